"""``packer.mix``: one dataset over several packed datasets, drawn in chosen proportions every epoch.

Each epoch reads ``samples_per_epoch`` positions (default: every dataset's size added up). How many come from each
dataset is fixed by the weights (:func:`apportion`: the nearest whole numbers to the shares, adding up exactly), and
which, and in what order, is a pure function of ``(seed, epoch)`` (:func:`epoch_draw`):

- the datasets' turns are the multiset of those counts in a random order (:func:`interleave`);
- a dataset's turns take its samples in a random order, and once all were used, in a fresh random order again
  (:func:`cycles`): a dataset drawn less than its size reads a different random part each epoch, one drawn more
  reads every sample once before any twice, and so on.

The mixture is a map-style dataset whose index is the position in its epoch (``ds[p]`` reads position ``p`` of
:attr:`MixedDataset.epoch`, or of the epoch an ``EpochIndex`` carries), so packer's sampler takes its positions in
turn and resumes it like any dataset: its state is ``{epoch, samples_seen}``, elastic across world sizes. The draw
of an epoch is numpy index arrays, computed once per epoch in each process that reads.
"""

from __future__ import annotations

import math
import operator
import os
import threading
from collections.abc import Sequence
from fractions import Fraction
from typing import Any, NamedTuple

import numpy as np
import torch

from .. import arguments
from ..errors import UsageError
from ..fields import Field, label_field
from .batches import BatchDataset, FieldBatch, collate_fields
from .buffers import BatchPool, empty_batch
from .dataset import PackedBatch, PackedDataset, open_dataset
from .decoding import Decoding
from .indices import EpochIndex

SOURCE = "source"  # the field that says which dataset a sample came from (its index in ``ds.names``)
SOURCE_FIELD = Field(SOURCE, "int64")
_INTERLEAVE, _CYCLE = 1, 2  # the two kinds of random streams an epoch's draw uses


def apportion(weights: Sequence[float], total: int) -> list[int]:
    """``total`` split in proportion to ``weights``: each share rounded down, then the units left over to the
    largest remainders (ties to the first dataset). Every count is within 1 of its exact share, and they add up to
    ``total``. Exact: the weights are taken as the fractions their floats are."""
    shares = [Fraction(w) for w in weights]
    whole = sum(shares)
    quotas = [total * share / whole for share in shares]
    counts = [math.floor(q) for q in quotas]
    by_remainder = sorted(range(len(quotas)), key=lambda k: (counts[k] - quotas[k], k))
    for k in by_remainder[:total - sum(counts)]:
        counts[k] += 1
    return counts


def random_stream(*values: int) -> np.random.Generator:
    """numpy's generator for a tuple of non-negative ints below 2**64, each taken as two 32-bit words, so that
    no two tuples share a stream."""
    words = [w for v in values for w in (v & 0xFFFFFFFF, v >> 32)]
    return np.random.default_rng(np.random.SeedSequence(words))


def interleave(counts: Sequence[int], seed: int, epoch: int) -> np.ndarray:
    """Which dataset each position of epoch ``epoch`` reads: ``counts[k]`` times ``k``, in a random order."""
    turns = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    random_stream(_INTERLEAVE, seed, epoch).shuffle(turns)
    return turns


def cycles(size: int, count: int, seed: int, epoch: int, source: int) -> np.ndarray:
    """``count`` sample indices of a dataset of ``size``: all of them in a random order, then all of them in a
    fresh random order again, as often as it takes; each round from ``(seed, epoch, source, round)``."""
    rounds = [random_stream(_CYCLE, seed, epoch, source, c).permutation(size) for c in range(-(-count // size))]
    return np.concatenate(rounds)[:count] if rounds else np.zeros(0, np.int64)


def epoch_draw(sizes: Sequence[int], counts: Sequence[int], seed: int, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """The dataset each position of epoch ``epoch`` reads, and which of its samples: two int64 arrays of
    ``sum(counts)``. A dataset's positions take :func:`cycles` in order, so none of its samples comes twice before
    all of them came once."""
    sources = interleave(counts, seed, epoch)
    samples = np.empty(len(sources), np.int64)
    for k, (size, count) in enumerate(zip(sizes, counts, strict=True)):
        samples[sources == k] = cycles(size, count, seed, epoch, k)
    return sources, samples


class Drawn(NamedTuple):
    """A batch of a mixture's positions: the dataset of each (``sources``); per dataset, the rows of the batch it
    has and their samples, as indices of that dataset carrying the epoch and its sizes (``groups``); the
    epoch's decoding of the first dataset, and the (H, W, C) of every image of the epoch (None when they vary)."""

    sources: np.ndarray
    groups: list[tuple[int, np.ndarray, list[EpochIndex]]]
    decoding: Decoding
    shape: tuple[int, int, int] | None


class MixedDataset(BatchDataset):
    """Several packed datasets read as one, in proportions fixed per epoch: what :func:`mix` returns.

    ``ds[p]`` is position ``p`` of the epoch (:attr:`epoch`, or the one an ``EpochIndex`` carries): ``(image,
    label, source)`` for datasets of images and classes, else the datasets' dict with ``"source"`` added (or the
    ``fields=`` tuple, where ``"source"`` may be named). ``source`` is the index of the dataset in :attr:`names`.
    Labels are indices into :attr:`classes`: the first dataset's classes, then each class of the others not
    already there, in order (the same index for the same class name).

    Attributes:
        datasets: the datasets mixed.
        names: what each dataset was given as (its path or URL): ``names[source]``.
        sizes: each dataset's number of samples.
        counts: how many positions of every epoch read each dataset.
        seed: the seed of the draw.
        classes: the class names the labels index.
    """

    def __init__(self, datasets: list[PackedDataset], names: list[str], counts: list[int], seed: int,
                 output: list[str]):
        self.datasets, self.names, self.counts, self.seed = datasets, names, counts, seed
        self.sizes = [len(d) for d in datasets]
        self.length = sum(counts)
        self.epoch = 0
        self.threads = 1
        first = datasets[0]
        form, self._selected = first.gives
        self.output, self._as_dict, self._pair = output, form == "dict", form == "pair"  # the fields, in order
        label = label_field(self._selected)
        self._label_name = label.name if label is not None else None
        self.classes, self._relabels = (joined_classes([d.classes for d in datasets]) if label is not None
                                        else ([], [None] * len(datasets)))
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        layout = first.batch_layout(0)
        self._slot_names = [name for name, _, _ in layout] if layout is not None else []
        self._draws: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # the latest epochs' draws, this process's
        self._lock = threading.Lock()
        self._batches = BatchPool()

    # -- what the loader asks -------------------------------------------------------------------------------------
    @property
    def mixture(self) -> dict[str, Any]:
        """What fixes the draw (recorded in the loader's state, which another mixture refuses)."""
        return {"seed": self.seed, "sizes": list(self.sizes), "counts": list(self.counts)}

    @property
    def where(self) -> str:
        return f"the mixture of {', '.join(self.names)}"

    @property
    def transform(self) -> Any:  # type: ignore[override]
        """The datasets' per-item transforms, or None when none has one."""
        found = [d.transform for d in self.datasets]
        return found if any(t is not None for t in found) else None

    @property
    def target_transform(self) -> Any:  # type: ignore[override]
        found = [d.target_transform for d in self.datasets]
        return found if any(t is not None for t in found) else None

    def __len__(self) -> int:
        return self.length

    def set_epoch(self, epoch: int) -> None:
        """The epoch ``ds[p]`` reads when ``p`` carries none."""
        self.epoch = int(epoch)

    def epoch_view(self, epoch: int) -> tuple | None:
        """Each dataset's sizes under its resolution schedule in ``epoch`` (None when none has one); datasets with
        a schedule must give images of one size every epoch."""
        views = tuple(d.epoch_view(epoch) for d in self.datasets)
        if all(v is None for v in views):
            return None
        shapes = [d.output_shape(epoch) for d in self.datasets]
        if any(shape != shapes[0] for shape in shapes):
            raise UsageError(f"the datasets of a mixture with a resolution schedule read images of one size every "
                             f"epoch; in epoch {epoch} "
                             + ", ".join(f"{n} gives {s}" for n, s in zip(self.names, shapes, strict=True)))
        return views

    def output_shape(self, epoch: int | None = None) -> tuple[int, int, int] | None:
        """(H, W, C) of every image of ``epoch`` (default :attr:`epoch`) when it is fixed and the same in every
        dataset, else None."""
        epoch = self.epoch if epoch is None else epoch
        return _one_shape([d.output_shape(epoch) for d in self.datasets])

    def output_dtype(self) -> torch.dtype:
        return self.datasets[0].output_dtype()

    def batch_layout(self, epoch: int | None = None) -> list[tuple[str, tuple[int, ...], torch.dtype]] | None:
        if self.output_shape(epoch) is None:
            return None
        return self.datasets[0].batch_layout(self.epoch if epoch is None else epoch)

    # -- positions ------------------------------------------------------------------------------------------------
    def draw(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """Epoch ``epoch``'s draw: the dataset and the sample each position reads (:func:`epoch_draw`)."""
        with self._lock:
            found = self._draws.get(epoch)
            if found is None:
                found = epoch_draw(self.sizes, self.counts, self.seed, epoch)
                if len(self._draws) >= 2:  # the epoch being read, and the next one a prefetch may start
                    self._draws.pop(min(self._draws))
                self._draws[epoch] = found
            return found

    def locate(self, position: int, epoch: int | None = None) -> tuple[int, int]:
        """``(source, index)``: the dataset (its index in :attr:`names`) and the sample that position
        ``position`` of ``epoch`` (default: the one it carries, else :attr:`epoch`) reads."""
        epoch = getattr(position, "epoch", self.epoch) if epoch is None else epoch
        sources, samples = self.draw(epoch)
        p = self._position(position)
        return int(sources[p]), int(samples[p])

    def _position(self, position: Any) -> int:
        if isinstance(position, bool):
            raise TypeError("a mixture's index is a position (an int), not a bool")
        try:
            given = operator.index(position)  # an int, a numpy integer, an integer tensor of one element
        except TypeError:
            raise TypeError(f"a mixture's index is a position (an int), not {type(position).__name__}") from None
        p = given + (self.length if given < 0 else 0)
        if not 0 <= p < self.length:
            raise IndexError(f"position {given} is out of range for a mixture of {self.length} per epoch")
        return p

    def _batch(self, indices: list) -> Drawn:
        """Where the positions of a batch (of one epoch) are: see :class:`Drawn`."""
        first = indices[0]
        epoch = getattr(first, "epoch", self.epoch)
        if any(getattr(i, "epoch", self.epoch) != epoch for i in indices):
            raise UsageError("a batch of a mixture holds positions of one epoch; this one holds several")
        view = first.view if isinstance(first, EpochIndex) else None
        if view is None:
            view = self.epoch_view(epoch)
        positions = np.fromiter((self._position(i) for i in indices), np.int64, len(indices))
        drawn, samples = self.draw(epoch)
        sources, samples = drawn[positions], samples[positions]
        groups = []
        for k in np.unique(sources).tolist():
            rows = np.flatnonzero(sources == k)
            at = view[k] if view is not None else None
            groups.append((k, rows, [EpochIndex(i, epoch, at) for i in samples[rows].tolist()]))
        decodings = [d.decoding.for_epoch(epoch, None if view is None else view[k])
                     for k, d in enumerate(self.datasets)]
        return Drawn(sources, groups, decodings[0], _one_shape([d.output_shape() for d in decodings]))

    def _relabel(self, source: int, labels: Any) -> Any:
        """A dataset's labels (an int, or an array) as indices into :attr:`classes`."""
        return relabeled(self._relabels[source], labels)

    # -- reading --------------------------------------------------------------------------------------------------
    def __getitem__(self, position: int) -> Any:
        [(k, _, [index])] = self._batch([position]).groups
        return self._with_source(self.datasets[k][index], k)

    def __getitems__(self, indices: list[int]) -> list:
        return self.read_batch(indices)

    def read_batch(self, indices: list[int], threads: int | None = None, pin_memory: bool = False) -> list:
        """A whole batch: each dataset's rows decoded by it (its reader, decoding and options) straight into one
        batch tensor when images have one size; see :meth:`PackedDataset.read_batch`."""
        threads = self.threads if threads is None else threads
        if not indices:
            return []
        drawn = self._batch(indices)
        sources, groups = drawn.sources, drawn.groups
        shape = drawn.shape
        if shape is None or self.transform is not None or self.target_transform is not None:
            return self._items(sources, groups, threads)
        if not self._pair:
            return self._field_batch(drawn, threads, pin_memory)
        batch = empty_batch((len(indices), *shape), self.output_dtype(), pin_memory, self._batches)
        labels = self._decode_pairs(groups, batch.numpy(), threads)
        images = batch.permute(0, 3, 1, 2)
        result = PackedBatch(zip(images.unbind(0), labels.tolist(), sources.tolist(), strict=True))
        result.images, result.labels, result.sources = images, torch.from_numpy(labels), torch.from_numpy(sources)
        return result

    def _decode_pairs(self, groups: list, out: np.ndarray, threads: int) -> np.ndarray:
        labels = np.empty(len(out), np.int64)
        for k, rows, local in groups:
            labels[rows] = self._relabel(k, self.datasets[k].decode_into(local, out, threads, rows=rows))
        return labels

    def _decode_fields(self, groups: list, outs: dict[str, np.ndarray], n: int, threads: int
                       ) -> tuple[np.ndarray, dict[str, list]]:
        labels = np.full(n, -1, np.int64)
        values: dict[str, list] = {}
        for k, rows, local in groups:
            got, columns = self.datasets[k].decode_rows(local, outs, threads, rows=rows)
            labels[rows] = self._relabel(k, got)
            for name, column in columns.items():
                placed = values.setdefault(name, [None] * n)
                for row, value in zip(rows.tolist(), column, strict=True):
                    placed[row] = value
        return labels, values

    def _field_batch(self, drawn: Drawn, threads: int, pin_memory: bool) -> list:
        layout = self.datasets[0].batch_layout(decoding=drawn.decoding) or []
        n = len(drawn.sources)
        tensors = {name: empty_batch((n, *row), dtype, pin_memory, self._batches) for name, row, dtype in layout}
        labels, values = self._decode_fields(drawn.groups, {k: t.numpy() for k, t in tensors.items()}, n, threads)
        named = {**collate_fields(self._selected, self._label_name, tensors, labels, values),
                 SOURCE: torch.from_numpy(drawn.sources)}
        collated = self._package(named)
        result = FieldBatch(self._package({name: column[j] for name, column in named.items()}) for j in range(n))
        result.collated = collated
        return result

    def _items(self, sources: np.ndarray, groups: list, threads: int) -> list:
        """Each sample on its own (images of varying size, or a per-item transform): each dataset's batch read,
        its items put back in the batch's order with their source."""
        items: list = [None] * len(sources)
        for k, rows, local in groups:
            for row, item in zip(rows.tolist(), self.datasets[k].read_batch(local, threads), strict=True):
                items[row] = item
        out = [self._with_source(item, int(k)) for item, k in zip(items, sources.tolist(), strict=True)]
        if self._pair:
            return out
        result = FieldBatch(out)
        by_name = {f.name: f for f in [*self._selected, SOURCE_FIELD]}
        result.fields = [by_name[name] for name in self.output]
        return result

    def _with_source(self, item: Any, k: int) -> Any:
        """A dataset's item with its label as an index into :attr:`classes`, and its source."""
        if self._pair:
            image, label = item
            return image, self._relabel(k, label), k
        values = dict(item) if isinstance(item, dict) else dict(zip([f.name for f in self._selected], item,
                                                                    strict=True))
        if self._label_name in values:
            values[self._label_name] = self._relabel(k, values[self._label_name])
        return self._package({**values, SOURCE: k})

    def _package(self, values: dict[str, Any]) -> Any:
        """The values in the mixture's order of fields: a dict, or a tuple."""
        if self._as_dict:
            return {name: values[name] for name in self.output}
        return tuple(values[name] for name in self.output)

    # -- the worker pool ------------------------------------------------------------------------------------------
    def decode_slot(self, indices: list[int], arrays: list[np.ndarray]) -> Any:
        drawn = self._batch(indices)
        if self._pair:
            return self._decode_pairs(drawn.groups, arrays[0], 1), drawn.sources
        labels, values = self._decode_fields(drawn.groups, dict(zip(self._slot_names, arrays, strict=True)),
                                             len(indices), 1)
        return labels, values, drawn.sources

    def slot_batch(self, tensors: list[torch.Tensor], result: Any) -> Any:
        if self._pair:
            labels, sources = result
            return tensors[0].permute(0, 3, 1, 2), torch.from_numpy(labels), torch.from_numpy(sources)
        labels, values, sources = result
        named = collate_fields(self._selected, self._label_name, dict(zip(self._slot_names, tensors, strict=True)),
                               labels, values)
        return self._package({**named, SOURCE: torch.from_numpy(sources)})

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_draws"], state["_lock"], state["_batches"] = {}, None, BatchPool()
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


def joined_classes(class_lists: Sequence[Sequence[str]]) -> tuple[list[str], list[np.ndarray | None]]:
    """The class names of a mixture (the first dataset's, then each new one of the others, in order), and per
    dataset the table from its labels to those (None where they are the same)."""
    found: dict[str, int] = {}
    tables: list[np.ndarray | None] = []
    for names in class_lists:
        table = np.array([found.setdefault(name, len(found)) for name in names], np.int64)
        tables.append(None if np.array_equal(table, np.arange(len(table))) else table)
    return list(found), tables


def relabeled(table: np.ndarray | None, labels: Any) -> Any:
    """Labels (an int or an array) through a :func:`joined_classes` table (negative ones, no class, kept)."""
    if table is None:
        return labels
    found = np.asarray(labels, np.int64)
    found = np.where(found >= 0, table[np.clip(found, 0, len(table) - 1)], found)
    return int(found) if found.ndim == 0 else found


def _opened(item: Any, fields: list[str] | None) -> tuple[PackedDataset, str]:
    """A dataset of the mixture and its name: a packed dataset as it is, a path or URL opened with
    :func:`packer.open_dataset`; narrowed to ``fields`` when given."""
    if isinstance(item, PackedDataset):
        dataset, name = item, item.where
    elif isinstance(item, (str, os.PathLike)):
        dataset, name = open_dataset(item), os.fspath(item)
    else:
        raise UsageError(f"mix() takes packed datasets (packer.open_dataset's) or their paths or URLs, not "
                         f"{type(item).__name__}")
    if fields is not None:
        try:
            dataset = dataset.with_fields(fields)
        except ValueError as exc:
            raise UsageError(f"{name}: {exc}") from None
    if not dataset.decode:
        raise UsageError(f"{name}: a mixture decodes its images; open the dataset without decode=False")
    if callable(getattr(dataset.reader, "hold_block", None)):
        raise UsageError(f"{name} is read a block at a time (larger than its cache_limit), which a mixture's "
                         "random draw would fetch a block per sample: give open_dataset a cache_limit that holds "
                         "it, or read WebDataset shards with packer.stream(..., weights=)")
    if len(dataset) == 0:
        raise UsageError(f"{name} holds no samples; leave it out of the mixture")
    return dataset, name


def _fields_given(fields: Sequence[str] | str | None) -> tuple[list[str] | None, list[str] | None]:
    """``fields=`` as names (None for none given), and the names the datasets give (without ``source``)."""
    if fields is None:
        return None, None
    names = [fields] if isinstance(fields, str) else list(fields)
    return names, [name for name in names if name != SOURCE]


def _check_alike(datasets: list[PackedDataset], names: list[str]) -> None:
    """The datasets give the same fields, and images of one size and type: a one-line error naming two that do
    not."""
    first = datasets[0]
    for dataset, name in zip(datasets[1:], names[1:], strict=True):
        if dataset.gives != first.gives:
            raise UsageError(f"{name} gives {_described(dataset)}, {names[0]} gives {_described(first)}; a mixture "
                             "reads one kind of sample: pass fields= the names they share")
        if dataset.output_dtype() != first.output_dtype():
            raise UsageError(f"{name} gives images of type {dataset.output_dtype()}, {names[0]} "
                             f"{first.output_dtype()}; a mixture's images are of one type: repack one of them")
    if any(f.name == SOURCE for f in first.gives[1]):
        raise UsageError(f"{names[0]} has a field named {SOURCE!r}, which a mixture gives itself (the dataset of "
                         "each sample): pass fields= without it")


def _one_shape(shapes: list[tuple[int, int, int] | None]) -> tuple[int, int, int] | None:
    """The shape all of ``shapes`` are, else None (images of varying size)."""
    return shapes[0] if all(shape == shapes[0] for shape in shapes) else None


def _described(dataset: PackedDataset) -> str:
    form, fields = dataset.gives
    return f"{form}s of {', '.join(f'{f.name} ({f.kind})' for f in fields)}"


def mix(datasets: Sequence[PackedDataset | str | os.PathLike], weights: Sequence[float] | None = None, *,
        seed: int = 0, samples_per_epoch: int | None = None,
        fields: Sequence[str] | str | None = None) -> MixedDataset:
    """One dataset over several packed datasets, each epoch drawing from each in the given proportions.

    Each epoch has ``samples_per_epoch`` positions. Dataset ``k`` fills ``weights[k] / sum(weights)`` of them (the
    nearest whole number; the counts add up exactly, and are the same every epoch). Within an epoch a dataset's
    samples come in a random order, none twice before all of them came once: a dataset drawn more than its size
    cycles through itself, freshly shuffled each time round; one drawn less reads a new random part of itself each
    epoch. The datasets' turns are shuffled together. Which sample comes at which position depends only on
    ``(seed, epoch)``.

    ``packer.make_loader`` reads a mixture like any packed dataset (packer's worker pool when its images have one
    size, threads, ``num_workers=0``, under DDP), and resumes it exactly mid-epoch from ``loader.state_dict()``,
    at any world size. Its batches are ``(images, labels, sources)`` for datasets of images and classes: ``sources``
    (int64, one per sample) is each sample's dataset, an index into ``ds.names``, for per-dataset losses; a dict
    batch has a ``"source"`` entry. Labels index ``ds.classes`` (the first dataset's classes, then the new ones of
    the others: one index per class name).

    Args:
        datasets: the datasets: packed datasets (``packer.open_dataset``'s, opened with the read-time options
            to use) or their paths or URLs (opened with the defaults); any formats. Batches need one image size:
            open them with one ``random_resized_crop`` (or ``resize`` and ``center_crop``).
        weights: each dataset's share of an epoch: positive numbers, in any unit (default: the datasets' sizes).
        seed: the draw's seed (an int from 0 to 2**63-1). ``make_loader``'s ``shuffle`` and ``seed`` do not
            reorder a mixture.
        samples_per_epoch: positions per epoch, ``len(ds)`` (default: the datasets' sizes added up).
        fields: the fields to give, by name, as a tuple in that order (as ``open_dataset``'s ``fields=``), each
            dataset narrowed to them; ``"source"`` names the dataset index. Default: what the datasets give, which
            must be the same fields, with the source added.

    Returns:
        A :class:`MixedDataset`: ``len(ds)`` is ``samples_per_epoch``; ``ds.names``, ``ds.counts`` (positions per
        epoch of each dataset), ``ds.classes``, ``ds.locate(position, epoch)``.

    Raises:
        ValueError: (one line) an argument of the wrong type or range, naming it; datasets that give other fields
            or image sizes; a weight that gives a dataset no position in an epoch.
    """
    if isinstance(datasets, (str, os.PathLike)) or not isinstance(datasets, Sequence) or not datasets:
        raise UsageError("datasets must be a list of packed datasets (or their paths or URLs), at least one")
    given, narrowed = _fields_given(fields)
    opened = [_opened(item, narrowed) for item in datasets]
    sets, names = [d for d, _ in opened], [n for _, n in opened]
    _check_alike(sets, names)
    sizes = [len(d) for d in sets]
    shares = sizes if weights is None else mix_weights(weights, len(sets))
    total = sum(sizes) if samples_per_epoch is None else arguments.int_at_least("samples_per_epoch",
                                                                               samples_per_epoch, 1)
    seed = arguments.seed("seed", seed)
    counts = mixture_counts(shares, total, names)
    output = given if given is not None else [f.name for f in sets[0].gives[1]] + [SOURCE]
    mixed = MixedDataset(sets, names, counts, seed, output)
    if any(t is not None for t in mixed._relabels) and mixed.target_transform is not None:
        raise UsageError("the datasets have different classes, so a mixture relabels them to ds.classes, which a "
                         "dataset's target_transform would not see: open them without target_transform")
    return mixed


def mixture_counts(shares: Sequence[float], total: int, names: Sequence[str]) -> list[int]:
    """Each dataset's positions in an epoch of ``total`` (:func:`apportion`); a one-line error for a dataset whose
    share gives it none."""
    counts = apportion(shares, total)
    for name, count, share in zip(names, counts, shares, strict=True):
        if count == 0:
            raise UsageError(f"weight {share} gives {name} no sample in an epoch of {total}; raise its weight or "
                             "samples_per_epoch")
    return counts


def mix_weights(weights: Any, count: int) -> list[float]:
    """``weights`` checked: ``count`` finite positive numbers (a one-line error naming the first that is not)."""
    if isinstance(weights, (str, bytes)) or not isinstance(weights, Sequence) or len(weights) != count:
        raise UsageError(f"weights must be a list of {count} numbers, one per dataset, not {weights!r}")
    for w in weights:
        if isinstance(w, bool) or not isinstance(w, (int, float, np.number)) or not math.isfinite(w) or w <= 0:
            raise UsageError(f"weights must be finite positive numbers; {w!r} is not")
    return [float(w) for w in weights]
