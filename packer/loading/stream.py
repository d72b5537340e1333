"""``packer.stream``: sequential reading of a packed dataset's WebDataset shards, resumable mid-epoch at any world
size and number of workers.

Each epoch has one global order of the samples, a pure function of ``(seed, epoch)``: the block-aware order of
:mod:`packer.loading.block_order` over the shards, which visits the shards in a random order and mixes the samples of
each ``window`` consecutive shards of it (without shuffle: the packed order). The ranks take it a step at a time
(:func:`packer.loading.block_order.deal_steps`: each step, ``batch_size * world`` positions grouped by shard, so each
rank reads its own shards, and every rank takes as many batches). A rank's batches go to its streams (one per worker
process) in turn; a stream reads the shards its batches need from start to end, once each, keeping only those
samples, and hands its batches out in order. The state is ``{epoch, samples_seen}``: the positions of the order
taken by every rank so far, the same at any world size and number of workers.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, NamedTuple, Protocol, cast, runtime_checkable

import numpy as np
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from .. import arguments
from ..errors import PackerError, UsageError, carried, uncrossed
from ..fields import Field
from ..formats import Reader, StreamSample, reader_class
from ..manifest import read_local_manifest
from ..reading.decoding import Sized
from ..reading.mix import SOURCE, mix_weights, mixture_counts
from ..state import CountingIterator, Progress, StateSchema, check_state
from ..system import die_with_parent, usable_cores
from .block_order import block_order, deal_steps, layout
from .mix_order import StreamMixture
from .sampler import EpochPass, distributed_rank_world
from .stream_decode import MixedStreamDecoder, StreamDecoder


# URLs are resolved at the entry point (one Fetchable per remote shard: packer.remote.resolve.RemoteFile); below it,
# a shard is read sequentially from the local path `fetched` gives, wherever its bytes came from.
@runtime_checkable
class Fetchable(Protocol):
    """A file whose local copy exists only while :meth:`local` is entered; ``str()`` is what messages name (a
    remote file's URL). It must be picklable: DataLoader workers fetch with their own."""

    def local(self) -> AbstractContextManager[Path]:
        """A context whose value is the local copy's path, held until the context is left."""
        ...


@contextlib.contextmanager
def fetched(file: Path | Fetchable) -> Iterator[Path]:
    """A local path for ``file``: itself, or a :class:`Fetchable`'s local copy, held while inside."""
    if isinstance(file, Fetchable):
        with file.local() as path:
            yield path
    else:
        yield file


# a stream state counts the samples of one global order; version 1 counted batches per rank and worker
STREAM_STATE_VERSION = 2
# settings a stream state must share with the stream that loads it: they fix the order and the batches
_MUST_MATCH = ("batch_size", "seed", "shuffle", "drop_last", "dataset_length", "window", "blocks")
Shard = tuple[Path | Fetchable, int]  # a shard and its sample count


def shard_samples(shard: Path | Fetchable, extras: Sequence[Field], reader: type[Reader],
                  wanted: Callable[[int], bool] | None = None,
                  stored: Sequence[Field] | None = None) -> Iterator[StreamSample | None]:
    """The samples of a shard, read sequentially by its format (:meth:`~packer.formats.Reader.stream_file`); a
    remote shard from its cached copy, held only while it is read. Those ``wanted`` declines are None;
    ``extras`` are the fields to give of ``stored``, the dataset's extra fields."""
    with fetched(shard) as local:
        yield from reader.stream_file(local, extras, shard, wanted, stored)


def shard_window(buffer: int, counts: Sequence[int]) -> int:
    """How many consecutive shards of an epoch's shard order are mixed together: as many as hold ``buffer``
    samples on average (at least one, at most all). ``counts``: the samples of each non-empty shard."""
    total = sum(counts)
    return max(1, min(len(counts), buffer * len(counts) // total)) if total else 1


def _die_with_parent(worker_id: int) -> None:
    """``worker_init_fn``: a streaming worker dies with the process that started it."""
    die_with_parent()


def rank_batches(plan: EpochPass) -> list[np.ndarray]:
    """The sample indices of each batch a rank takes in a pass (``plan.blocks``: the first sample of each
    shard). Shuffled: the block order of the shards with a window of ``plan.window``; else the packed order."""
    if plan.per_rank == 0:
        return []
    assert plan.blocks is not None and plan.window is not None  # a stream's pass carries its shards' starts and window
    if plan.shuffle:
        order, place = block_order(plan.blocks, plan.length, plan.window, plan.seed, plan.epoch)
    else:
        order = np.arange(plan.length, dtype=np.int64)
        place = np.repeat(np.arange(len(plan.blocks)), np.diff(np.append(plan.blocks, plan.length)))
    taken = order[deal_steps(place, plan.start, plan.per_rank, plan.batch_size, plan.world, plan.rank)]
    return [taken[k:k + plan.batch_size] for k in range(0, len(taken), plan.batch_size)]


class ShardStreams(IterableDataset):
    """This rank's batches for one pass; each worker process (or the main process) makes every ``workers``-th
    one, reading the shards they need from start to end, each once: their samples' members, and only the
    headers of the others'."""

    def __init__(self, shards: list[Shard], decoder: StreamDecoder | MixedStreamDecoder, *, reader: type[Reader]):
        self.shards = shards  # the non-empty shards, in the manifest's order: the blocks of the order
        self.decoder = decoder
        self.reader = reader  # the format's reader class, whose stream_file reads a shard
        self.extras = decoder.fields.extras  # the fields read from each sample's members beyond image and label
        self.plan: EpochPass | None = None
        self.view: tuple | None = None  # the pass's sizes under a resolution schedule, computed by the main process

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        batches = self._batches(self._rank_batches()[worker::workers])
        return batches if info is None else carried(batches)  # an error crosses to the caller as itself

    def _pass(self) -> EpochPass:
        """This pass's plan, with its shards' starts (set by the stream before each pass)."""
        assert self.plan is not None and self.plan.blocks is not None
        return self.plan

    def _rank_batches(self) -> list[np.ndarray]:
        return rank_batches(self._pass())

    def _shard(self, block: int) -> tuple[Path | Fetchable, int, type[Reader], int]:
        """Block ``block``'s shard, its samples, its format's reader, and the index of its first sample (which
        packer's member keys name)."""
        shard, count = self.shards[block]
        return shard, count, self.reader, int(cast(np.ndarray, self._pass().blocks)[block])

    def _stored(self, block: int) -> Sequence[Field]:
        """Every extra field of block ``block``'s dataset, in the order of a sample's members."""
        return cast(StreamDecoder, self.decoder).samples.extra_fields

    def _decode(self, batch: np.ndarray, samples: list[StreamSample]) -> Any:
        # a mixture has its own decoder, and decodes in its own _decode
        return cast(StreamDecoder, self.decoder).batch(samples, self._pass().epoch, self.view)

    def _batches(self, mine: list[np.ndarray]) -> Iterator[Any]:
        starts = cast(np.ndarray, self._pass().blocks)
        uses = Counter(int(i) for batch in mine for i in batch)
        held: dict[int, StreamSample] = {}
        for batch in mine:
            samples = []
            for i in batch.tolist():
                if i not in held:
                    self._read(int(np.searchsorted(starts, i, side="right")) - 1, uses, held)
                samples.append(held[i])
                uses[i] -= 1
                if not uses[i]:
                    del held[i]
            yield self._decode(batch, samples)

    def _read(self, block: int, uses: Counter, held: dict[int, StreamSample]) -> None:
        """Read shard ``block`` from start to end, keeping the samples this stream still uses."""
        shard, count, reader, named = self._shard(block)
        first, n = int(cast(np.ndarray, self._pass().blocks)[block]), 0
        for n, sample in enumerate(shard_samples(shard, self.extras, reader, lambda k: uses[first + k] > 0,
                                                  self._stored(block)), 1):
            if n > count or sample is None:  # the samples of other streams are skipped, not read
                continue
            key = sample.key  # packer's keys are the samples' indices: one elsewhere is a shard out of place
            if key.isascii() and key.isdigit() and int(key) != named + n - 1:
                raise PackerError(f"{shard}: holds sample {key} where the manifest's shard counts place sample "
                                  f"{named + n - 1}; the dataset is damaged, run `packer verify`")
            held[first + n - 1] = sample
        if n != count:
            raise PackerError(f"{shard}: holds {'more' if n > count else n} samples, the manifest says {count}; "
                              "run `packer verify`")


class StreamLoader:
    """What :func:`stream` returns. Each iteration is the next epoch; ``state_dict``/``load_state_dict`` resume
    at the batch, at any world size and number of workers. A mixture's (several roots) also says what its batches'
    ``sources`` and labels index: :attr:`names` and :attr:`classes`."""

    names: list[str] | None = None  # a mixture's datasets, as given: what a batch's sources index
    classes: list[str] | None = None  # a mixture's classes: its datasets' class names, joined

    def __init__(self, dataset: ShardStreams, settings: dict[str, Any], starts: np.ndarray, workers: int):
        self.starts = starts  # the blocks of the order: the first sample of each shard (a mixture's: of each round)
        self.rank, self.world = distributed_rank_world()
        self.workers = workers
        self.settings = settings  # what fixes the order and the batches: a state must agree on them
        self.dataset = dataset
        self.epoch, self.resume_at = 0, 0
        self._received: Progress | None = None  # the latest iteration's pass, its start, the batches handed out

    def _plan(self) -> EpochPass:
        s = self.settings
        window = s["window"] if isinstance(s["window"], int) else None  # a mixture has one per dataset
        return EpochPass(self.epoch, self.resume_at, self.world, self.rank, s["dataset_length"], s["batch_size"],
                         s["seed"], s["shuffle"], s["drop_last"], self.starts, window)

    def __len__(self) -> int:
        return self._plan().batches

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch ``epoch``; a loaded mid-epoch position is kept only for its own epoch."""
        if epoch != self.epoch:
            self.resume_at = 0
        self.epoch = epoch
        self._received = None

    def __iter__(self) -> Iterator[Any]:
        plan = self._plan()
        self.epoch, self.resume_at = plan.epoch + 1, 0
        self._received = Progress(plan, plan.batches, plan.start)
        self.dataset.plan = plan
        self.dataset.view = self.dataset.decoder.epoch_view(plan.epoch)
        return CountingIterator(self._handed_out(plan.batches), self._received)

    def _handed_out(self, batches: int) -> Iterator:
        workers = self.workers
        loader = DataLoader(self.dataset, batch_size=None, num_workers=workers,
                            prefetch_factor=4 if workers else None,
                            worker_init_fn=_die_with_parent if workers else None)
        for n, batch in enumerate(uncrossed(iter(loader))):
            if n >= batches:
                break
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """``{epoch, samples_seen (positions of the epoch's order every rank has taken together), world_size,
        settings}``, JSON-serialisable. After an epoch's last batch it is the start of the next epoch."""
        if self._received is None:
            epoch, seen = self.epoch, self.resume_at
        else:
            progress = self._received
            plan = progress.plan
            epoch, seen = plan.epoch, plan.start + progress.received * plan.batch_size * plan.world
            if progress.finished:
                epoch, seen = epoch + 1, 0
        return {"version": STREAM_STATE_VERSION, "kind": "stream", "epoch": epoch, "samples_seen": seen,
                "world_size": self.world, **self.settings}

    def _schema(self) -> StateSchema:
        keys = _MUST_MATCH + (("mixture",) if "mixture" in self.settings else ())
        settings = {"kind": "stream", **{key: self.settings[key] for key in keys}}
        return StateSchema("stream", "samples_seen", self.settings["dataset_length"], settings,
                           free=("world_size",), version=STREAM_STATE_VERSION)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next iteration the rest of ``state``'s epoch, at this world size and number of workers.

        Raises:
            ValueError: (one line) not a stream state, one of an older packer (its epoch must restart), a damaged
                one (a missing, unknown or mistyped key, each named), or one taken with other settings (it names
                which).
        """
        if isinstance(state, dict) and state.get("kind") == "stream" and state.get("version") == 1:
            raise ValueError(f"the stream state was saved by an older packer (version 1, counting batches per rank "
                             f"and worker) and cannot resume exactly; restart its epoch: "
                             f"loader.set_epoch({state.get('epoch')!r})")
        self.epoch, self.resume_at = check_state(state, self._schema())
        self._received = None


def _check_cache_limit(cache_limit: int | str | None, sizes: list[int], streams: int) -> None:
    """A URL's ``cache_limit`` must hold one shard per stream, the most ``stream`` holds at once: said at the call,
    with the figure to pass, rather than by the first worker that cannot fetch its shard."""
    from ..remote.cache import parse_limit

    limit = parse_limit(cache_limit if cache_limit is not None else os.environ.get("PACKER_CACHE_LIMIT"))
    need = streams * max(sizes, default=0)
    if limit is not None and limit < need:
        raise UsageError(f"cache_limit {limit:,} is below what packer.stream holds at once, one shard per worker "
                         f"({streams} x {max(sizes):,} bytes): pass cache_limit={need} or more, or fewer num_workers")


def stream(root: str | os.PathLike | Sequence[str | os.PathLike], batch_size: int, shuffle: bool = True,
           num_workers: int | None = None, seed: int = 0, mode: str = "RGB", drop_last: bool = False,
           buffer: int = 1000, storage_options: dict | None = None, cache_dir: str | os.PathLike | None = None,
           cache_limit: int | str | None = None, cache: bool = True,
           fields: Sequence[str] | str | None = None, resize: Sized | None = None,
           center_crop: Sized | None = None, interpolation: str = "bilinear", decoder: str = "auto",
           random_resized_crop: Sized | None = None, scale: tuple[float, float] = (0.08, 1.0),
           ratio: tuple[float, float] = (3 / 4, 4 / 3), flip: bool = False, weights: Sequence[float] | None = None,
           samples_per_epoch: int | None = None) -> StreamLoader:
    """Read a packed WebDataset's tar shards sequentially, as batches of ``(images, labels)`` (uint8 NCHW); a
    dataset with other fields gives dict batches as :func:`packer.make_loader` does (images and masks stacked,
    numbers stacked, text, JSON and variable-length vectors as lists), and ``fields=`` a tuple in that order.

    Every sample comes once per epoch, in one global order fixed by ``(seed, epoch)``: the shards in a random
    order, the samples of each window of consecutive shards (about ``buffer`` samples) mixed together. Under
    ``torch.distributed`` the ranks take that order a step of ``batch_size * world size`` samples at a time, each
    rank the samples of its own shards of the step, so that every rank takes as many batches (padded with the
    epoch's first samples, as ``DistributedSampler`` does, unless ``drop_last``). The state is ``{epoch,
    samples_seen}``: a stream saved at one world size and number of workers resumes exactly at any other.
    Shards are read sequentially, each whole; a stream (worker process) reads the shards its batches need and
    keeps only their samples, about ``buffer / (world size * workers)`` at a time.

    Images decode through :func:`packer.open_dataset`'s decode path, straight into the batch tensor, with the same
    read-time options: ``resize``/``center_crop`` (the same pixels as ``open_dataset``'s), or
    ``random_resized_crop``/``flip`` drawn from ``(seed, epoch, index)``, where a packer-written sample's index is
    its member key (``000000042`` is 42), so its window is ``open_dataset(..., seed=seed).augment_params(42,
    epoch)``; a key that is not a number (shards of other tools) stands for the crc32 of its UTF-8 bytes
    (:func:`packer.loading.stream_decode.key_index`). Mask and second-image fields get their image's geometry (masks by
    nearest neighbour). Without them, images stored at varying sizes cannot be batched (a one-line error).

    Several roots (a list) are a mixture, drawn as :func:`packer.mix` draws: each epoch ``samples_per_epoch``
    samples (default: all of them once), ``weights`` deciding each dataset's share (default: its size), each
    dataset's samples taken round after round, none twice before all came once, each round in its own block order
    of that dataset's shards (a small dataset drawn several times is read once a round), the datasets' turns
    shuffled together; all from ``(seed, epoch)``. Batches then carry each sample's dataset: ``(images, labels,
    sources)``, or a ``"source"`` entry (see :func:`packer.mix`); ``loader.names`` and ``loader.classes`` say
    what ``sources`` and labels index. It resumes as a single dataset does.

    Args:
        root: a dataset packed with ``--format wds``; or a list of them, mixed.
        batch_size: samples per batch; each rank's last batch may be smaller, unless ``drop_last``.
        shuffle: shuffle shards and samples, from ``(seed, epoch)``; else the packed order (under
            ``torch.distributed``, its batches dealt to the ranks in turn).
        num_workers: worker processes, each making every ``num_workers``-th batch (default: the usable cores;
            0: this process). A saved state resumes at any number.
        seed: the shuffles' and the augmentation's seed, the same on every rank.
        mode: the PIL mode images are decoded to.
        drop_last: drop each rank's last partial batch (and never pad with repeated samples).
        buffer: about how many samples are mixed together: the window is as many whole shards as hold that many
            on average (at least one shard).
        storage_options: for a URL ``root``, the fsspec filesystem's options (credentials, endpoint).
        cache_dir: for a URL ``root``, the cache folder (default ``PACKER_CACHE_DIR``, else ``~/.cache/packer``).
        cache_limit: for a URL ``root``, the most bytes the cache keeps (an int or ``"10GB"``): each shard is
            fetched into the cache when its stream reaches it, checked, and released once read, so it may be
            below the dataset's size (it must hold one shard per worker; room for a window's shards fetches
            each once an epoch, less may fetch again the shards the workers share).
        cache: False reads a URL's shards through temporary files deleted once read, leaving the cache alone.
        fields: the fields to give, by name, as a tuple in that order (as :func:`packer.open_dataset` takes it).
        resize: a read-time resize, as :func:`packer.open_dataset` takes it (N: the shorter side; ``"WxH"``), or a
            function of the epoch that gives it (a resolution schedule).
        center_crop: a read-time centre crop after the resize (N or ``"WxH"``), or a function of the epoch.
        interpolation: the resize's filter (``bilinear``, ``bicubic``, ``nearest``...).
        decoder: ``"auto"``, ``"fast"`` or ``"pil"``, as :func:`packer.open_dataset` takes it.
        random_resized_crop: an int or ``(height, width)``: torchvision's ``RandomResizedCrop`` fused into
            decoding, its window drawn from ``(seed, epoch, index)``; replaces ``resize``/``center_crop``. Or a
            function of the epoch that gives the size: every batch of an epoch has that epoch's size.
        scale: the crop's area as a fraction of the image's, ``(min, max)``.
        ratio: the crop's width / height, ``(min, max)``.
        flip: mirror left-right with probability 0.5.
        weights: a mixture's shares, one positive number per root (default: their sizes).
        samples_per_epoch: a mixture's samples per epoch (default: every sample of every root once).

    Raises:
        ValueError: (one line) an argument of the wrong type or range, naming it.

    Returns:
        A :class:`StreamLoader`, with ``state_dict``/``load_state_dict`` to resume mid-epoch (a state of an
        older packer's stream, version 1, is refused in one line: restart its epoch).
    """
    arguments.int_at_least("batch_size", batch_size, 1)
    arguments.flag("shuffle", shuffle)
    arguments.optional_int("num_workers", num_workers, 0)
    arguments.seed("seed", seed)
    arguments.flag("drop_last", drop_last)
    arguments.int_at_least("buffer", buffer, 1)
    if mode not in ("RGB", "L"):
        raise UsageError(f"mode must be 'RGB' or 'L', not {mode!r}")
    workers = usable_cores() if num_workers is None else num_workers
    decoding = {"resize": resize, "center_crop": center_crop, "interpolation": interpolation, "decoder": decoder,
                "random_resized_crop": random_resized_crop, "scale": scale, "ratio": ratio, "flip": flip,
                "seed": seed}
    opening: dict[str, Any] = {"storage_options": storage_options, "cache_dir": cache_dir,
                               "cache_limit": cache_limit, "cache": cache, "streams": max(workers, 1), "mode": mode,
                               "decoding": decoding}
    settings: dict[str, Any] = {"batch_size": batch_size, "seed": seed, "shuffle": shuffle, "drop_last": drop_last}
    if isinstance(root, (list, tuple)):
        return mixed_stream(root, weights, samples_per_epoch, fields, opening, settings, buffer, workers)
    if weights is not None or samples_per_epoch is not None:
        raise UsageError("weights= and samples_per_epoch= mix several datasets: give root as a list of them")
    source = open_stream(cast("str | os.PathLike", root), fields, **opening)
    counts = [count for _, count in source.shards]
    settings.update(dataset_length=sum(counts), window=shard_window(buffer, counts), blocks=layout(source.starts))
    return StreamLoader(ShardStreams(source.shards, source.decoder, reader=source.reader), settings, source.starts,
                        workers)


class StreamSource(NamedTuple):
    """One dataset a stream reads: its non-empty shards with their sample counts, the first sample of each, its
    format's reader class and its decoder."""

    name: str
    shards: list[Shard]
    starts: np.ndarray
    reader: type[Reader]
    decoder: StreamDecoder


def open_stream(root: str | os.PathLike, fields: Sequence[str] | str | None, *, storage_options: dict | None,
                cache_dir: str | os.PathLike | None, cache_limit: int | str | None, cache: bool, streams: int,
                mode: str, decoding: dict[str, Any]) -> StreamSource:
    """A dataset's shards for :func:`stream`: a local folder's, or a URL's, each a ``Fetchable`` fetched when its
    stream reaches it (with ``cache_limit`` checked to hold one shard per stream)."""
    from ..remote import parse_url  # a URL is resolved here, to its manifest and a Fetchable per shard
    from ..remote.resolve import remote_files

    files = None
    if parse_url(root) is not None:
        manifest, files = remote_files(os.fspath(root), storage_options, cache_dir, cache_limit, cache)
    else:
        root = Path(root)
        manifest = read_local_manifest(root)
    reader = reader_class(manifest, f"{root}/manifest.json")
    entries = reader.stream_files(manifest)
    if not entries:
        raise PackerError(f"{root}: packer.stream reads WebDataset shards, and this {manifest.get('format')} "
                          "dataset has none; read it with packer.open_dataset and packer.make_loader")
    shards: list[Shard] = [(files[path] if files is not None else Path(root) / path, count) for path, count in entries]
    if sum(count for _, count in shards) != int(manifest["count"]):
        raise PackerError(f"{root}/manifest.json: its shards hold {sum(count for _, count in shards)} samples, its "
                          f"count says {manifest['count']}; the dataset is damaged, re-pack")
    if files is not None and cache:
        _check_cache_limit(cache_limit, [files[path].entry["bytes"] for path, _ in entries], streams)
    shards = [(shard, count) for shard, count in shards if count > 0]  # an empty shard is no block
    counts = [count for _, count in shards]
    starts = np.cumsum([0, *counts[:-1]], dtype=np.int64) if counts else np.zeros(0, np.int64)
    return StreamSource(os.fspath(root), shards, starts, reader,
                        StreamDecoder(root, manifest, mode, fields, **decoding))


# -- mixtures ---------------------------------------------------------------------------------------------------
class MixedShardStreams(ShardStreams):
    """:class:`ShardStreams` over a mixture's virtual blocks (:class:`~packer.loading.mix_order.StreamMixture`):
    each round of each dataset's shards, read from that dataset with its reader and decoded by its decoder."""

    def __init__(self, sources: list[StreamSource], mixture: StreamMixture, decoder: MixedStreamDecoder):
        shards = [sources[k].shards[j] for k, j in zip(mixture.vsource.tolist(), mixture.vshard.tolist(),
                                                       strict=True)]
        super().__init__(shards, decoder, reader=sources[0].reader)
        self.sources, self.mixture, self.mixed = sources, mixture, decoder

    def _rank_batches(self) -> list[np.ndarray]:
        plan = cast(EpochPass, self.plan)  # set by the loader before each iteration
        if plan.per_rank == 0:
            return []
        order, place = self.mixture.epoch_order(plan.seed, plan.epoch)
        taken = order[deal_steps(place, plan.start, plan.per_rank, plan.batch_size, plan.world, plan.rank)]
        return [taken[k:k + plan.batch_size] for k in range(0, len(taken), plan.batch_size)]

    def _shard(self, block: int) -> tuple[Path | Fetchable, int, type[Reader], int]:
        k, j = int(self.mixture.vsource[block]), int(self.mixture.vshard[block])
        shard, count = self.shards[block]
        return shard, count, self.sources[k].reader, int(self.sources[k].starts[j])

    def _stored(self, block: int) -> Sequence[Field]:
        return self.mixed.decoders[int(self.mixture.vsource[block])].samples.extra_fields

    def _decode(self, batch: np.ndarray, samples: list[StreamSample]) -> Any:
        plan = cast(EpochPass, self.plan)
        blocks = np.searchsorted(self.mixture.vstarts, batch, side="right") - 1
        return self.mixed.batch(samples, plan.epoch, self.view, self.mixture.vsource[blocks])


def mixed_stream(roots: Sequence[str | os.PathLike], weights: Sequence[float] | None, samples_per_epoch: int | None,
                 fields: Sequence[str] | str | None, opening: dict[str, Any], settings: dict[str, Any], buffer: int,
                 workers: int) -> StreamLoader:
    """:func:`stream` over several datasets, mixed (see :func:`packer.mix` for the draw)."""
    if not roots:
        raise UsageError("root must be a dataset, or a list of at least one to mix")
    if not settings["shuffle"]:
        raise UsageError("shuffle=False: a mixture draws each epoch at random, from seed and the epoch; leave "
                         "shuffle=True")
    given = None if fields is None else [fields] if isinstance(fields, str) else list(fields)
    narrowed = None if given is None else [name for name in given if name != SOURCE]
    sources = [open_stream(root, narrowed, **opening) for root in roots]
    sizes = [sum(count for _, count in source.shards) for source in sources]
    names = [source.name for source in sources]
    for name, size in zip(names, sizes, strict=True):
        if size == 0:
            raise UsageError(f"{name} holds no samples; leave it out of the mixture")
    shares = sizes if weights is None else mix_weights(weights, len(sources))
    total = sum(sizes) if samples_per_epoch is None else arguments.int_at_least("samples_per_epoch",
                                                                               samples_per_epoch, 1)
    counts = mixture_counts(shares, total, names)
    windows = [shard_window(buffer, [count for _, count in source.shards]) for source in sources]
    mixture = StreamMixture([s.starts for s in sources], sizes, counts, windows)
    decoder = MixedStreamDecoder([s.decoder for s in sources], names, given)
    settings.update(dataset_length=total, window=windows, blocks=[layout(s.starts) for s in sources],
                    mixture={"sizes": sizes, "counts": counts})
    loader = StreamLoader(MixedShardStreams(sources, mixture, decoder), settings, mixture.vstarts, workers)
    loader.names, loader.classes = names, decoder.classes
    return loader
