"""``packer.stream``: sequential reading of a packed dataset's WebDataset shards, resumable mid-epoch.

Each epoch deals the shards (shuffled from ``(seed, epoch)``) to the ranks in turn, and each rank's shards to its
streams (one per worker process) in turn. A stream reads its shards in order, through a shuffle buffer seeded
from ``(seed, epoch, rank, stream)``, and makes batches. The DataLoader hands the streams' batches out in turn
(skipping a stream that has ended), so the k-th batch of an epoch is a pure function of the settings and k: the
state is ``{epoch, batches}``, and a resumed epoch replays, without decoding, what its shards gave before.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from . import arguments
from .errors import PackerError, UsageError, carried, uncrossed
from .fetchable import Fetchable, fetched
from .fields import Field
from .formats import Reader, StreamSample, reader_class
from .manifest import read_local_manifest
from .sampler import distributed_rank_world
from .state import STATE_VERSION, CountingIterator, Progress, StateSchema, check_state
from .streamdecode import StreamDecoder
from .system import die_with_parent, usable_cores

# settings a stream state must share with the stream that loads it: they fix which batch comes when
_MUST_MATCH = ("batch_size", "seed", "shuffle", "drop_last", "dataset_length", "world_size", "workers")


def shard_samples(shard: Path | Fetchable, extras: Sequence[Field], reader: type[Reader]
                  ) -> Iterator[StreamSample]:
    """The samples of a shard, read sequentially by its format (:meth:`~packer.formats.Reader.stream_file`); a
    remote shard from its cached copy, held only while it is read."""
    with fetched(shard) as local:
        yield from reader.stream_file(local, extras, shard)


def buffer_shuffled(items: Iterator, size: int, rng: np.random.Generator) -> Iterator:
    """``items`` through a shuffle buffer of ``size``: once it is full, a random one out for each one read."""
    buffer: list = []
    for item in items:
        if len(buffer) < size:
            buffer.append(item)
            continue
        k = int(rng.integers(len(buffer)))
        yield buffer[k]
        buffer[k] = item
    while buffer:
        k = int(rng.integers(len(buffer)))
        buffer[k], buffer[-1] = buffer[-1], buffer[k]
        yield buffer.pop()


def _die_with_parent(worker_id: int) -> None:
    """``worker_init_fn``: a streaming worker dies with the process that started it."""
    die_with_parent()


class StreamPlan:
    """One epoch of this rank: the shards each of its streams reads, and the batches each makes."""

    def __init__(self, shards: list[tuple[Path | Fetchable, int]], epoch: int, settings: dict[str, Any], rank: int,
                 world: int):
        order = list(range(len(shards)))
        if settings["shuffle"]:
            generator = torch.Generator().manual_seed(settings["seed"] + epoch)
            order = torch.randperm(len(shards), generator=generator).tolist()
        streams = max(settings["workers"], 1)
        size = settings["batch_size"]

        def batches(count: int) -> int:
            return count // size if settings["drop_last"] else math.ceil(count / size)

        every = [[shards[i] for i in order[r::world][s::streams]] for r in range(world) for s in range(streams)]
        per_stream = [batches(sum(n for _, n in stream)) for stream in every]
        self.epoch, self.rank = epoch, rank
        self.shards = every[rank * streams:(rank + 1) * streams]
        self.stream_batches = per_stream[rank * streams:(rank + 1) * streams]
        # every rank stops after the fewest batches any rank has, so that all ranks take as many steps
        self.batches = min(sum(per_stream[r * streams:(r + 1) * streams]) for r in range(world))

    def taken(self, batches: int) -> list[int]:
        """How many batches each stream has made when ``batches`` have been handed out (in turn, skipping the
        streams that have ended)."""
        taken = [0] * len(self.stream_batches)
        left = min(batches, sum(self.stream_batches))
        while left > 0:
            for s, total in enumerate(self.stream_batches):
                if left > 0 and taken[s] < total:
                    taken[s] += 1
                    left -= 1
        return taken


class ShardStreams(IterableDataset):
    """This rank's streams for one epoch; each worker process (or the main process) runs one. The first
    ``skip[s]`` batches of stream ``s`` are replayed without decoding. The first worker runs stream ``first``,
    so that a resumed epoch hands the streams' batches out in the uninterrupted epoch's turn."""

    def __init__(self, settings: dict[str, Any], decoder: StreamDecoder, buffer: int, *, reader: type[Reader]):
        self.settings, self.decoder, self.buffer = settings, decoder, buffer
        self.reader = reader  # the format's reader class, whose stream_file reads a shard
        self.extras = decoder.fields.extras  # the fields read from each sample's members beyond image and label
        self.plan: StreamPlan | None = None
        self.skip: list[int] = []
        self.first = 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        info = get_worker_info()
        stream = (self.first + (info.id if info is not None else 0)) % len(self.plan.shards)
        batches = self._batches(stream)
        return batches if info is None else carried(batches)  # an error crosses to the caller as itself

    def _batches(self, stream: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        plan, settings = self.plan, self.settings
        samples = (s for path, _ in plan.shards[stream] for s in shard_samples(path, self.extras, self.reader))
        if settings["shuffle"]:
            rng = np.random.default_rng([settings["seed"], plan.epoch, plan.rank, stream])
            samples = buffer_shuffled(samples, self.buffer, rng)
        size = settings["batch_size"]
        skip, batch = self.skip[stream] * size, []
        for n, sample in enumerate(samples):
            if n < skip:
                continue
            batch.append(sample)
            if len(batch) == size:
                yield self._decode(batch)
                batch = []
        if batch and not settings["drop_last"]:
            yield self._decode(batch)

    def _decode(self, batch: list) -> Any:
        """A batch through the decode path :func:`packer.open_dataset` uses, with this epoch's augmentation."""
        return self.decoder.batch(batch, self.plan.epoch if self.plan is not None else 0)


class StreamLoader:
    """What :func:`stream` returns. Each iteration is the next epoch; ``state_dict``/``load_state_dict`` resume
    at the batch, replaying (without decoding) what the interrupted epoch's shards gave before it."""

    def __init__(self, shards: list[tuple[Path | Fetchable, int]], settings: dict[str, Any], decoder: StreamDecoder,
                 buffer: int, *, reader: type[Reader]):
        self.shards = shards
        self.rank, self.world = distributed_rank_world()
        self.settings = dict(settings, world_size=self.world)
        self.dataset = ShardStreams(self.settings, decoder, buffer, reader=reader)
        self.epoch, self.resume_at = 0, 0
        self._received: Progress | None = None  # the latest iteration's pass, its start, the batches handed out

    def _plan(self) -> StreamPlan:
        return StreamPlan(self.shards, self.epoch, self.settings, self.rank, self.world)

    def __len__(self) -> int:
        return self._plan().batches - self.resume_at

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch ``epoch``; a loaded mid-epoch position is kept only for its own epoch."""
        if epoch != self.epoch:
            self.resume_at = 0
        self.epoch = epoch
        self._received = None

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        plan, start = self._plan(), self.resume_at
        self.epoch, self.resume_at = plan.epoch + 1, 0
        self._received = Progress(plan, max(plan.batches - start, 0), start)
        taken = plan.taken(start)
        going = [s for s, t in enumerate(taken) if t < plan.stream_batches[s]]
        rounds = min((taken[s] for s in going), default=0)
        self.dataset.plan, self.dataset.skip = plan, taken
        self.dataset.first = next((s for s in going if taken[s] == rounds), 0)  # whose turn it is
        return CountingIterator(self._handed_out(self._received.total), self._received)

    def _handed_out(self, batches: int) -> Iterator:
        workers = self.settings["workers"]
        loader = DataLoader(self.dataset, batch_size=None, num_workers=workers,
                            prefetch_factor=4 if workers else None,
                            worker_init_fn=_die_with_parent if workers else None)
        for n, batch in enumerate(uncrossed(iter(loader))):
            if n >= batches:
                break
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """``{epoch, batches (handed out in that epoch), settings}``, JSON-serialisable. After an epoch's last
        batch it is the start of the next epoch."""
        if self._received is None:
            epoch, batches = self.epoch, self.resume_at
        else:
            progress = self._received
            epoch, batches = progress.plan.epoch, progress.start + progress.received
            if progress.finished:
                epoch, batches = epoch + 1, 0
        return {"version": STATE_VERSION, "kind": "stream", "epoch": epoch, "batches": batches, **self.settings}

    def _schema(self) -> StateSchema:
        settings = {"kind": "stream", **{key: self.settings[key] for key in _MUST_MATCH}}
        return StateSchema("stream", "batches", self.settings["dataset_length"], settings)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next iteration the rest of ``state``'s epoch.

        Raises:
            ValueError: (one line) not a stream state, a damaged one (a missing, unknown or mistyped key, each
                named), or one taken with other settings (it names which).
        """
        self.epoch, self.resume_at = check_state(state, self._schema())
        self._received = None


def _check_cache_limit(cache_limit: int | str | None, sizes: list[int], streams: int) -> None:
    """A URL's ``cache_limit`` must hold one shard per stream, the most ``stream`` holds at once: said at the call,
    with the figure to pass, rather than by the first worker that cannot fetch its shard."""
    from .remote.cache import parse_limit

    limit = parse_limit(cache_limit if cache_limit is not None else os.environ.get("PACKER_CACHE_LIMIT"))
    need = streams * max(sizes, default=0)
    if limit is not None and limit < need:
        raise UsageError(f"cache_limit {limit:,} is below what packer.stream holds at once, one shard per worker "
                         f"({streams} x {max(sizes):,} bytes): pass cache_limit={need} or more, or fewer num_workers")


def stream(root: str | os.PathLike, batch_size: int, shuffle: bool = True, num_workers: int | None = None,
           seed: int = 0, mode: str = "RGB", drop_last: bool = False, buffer: int = 1000,
           storage_options: dict | None = None, cache_dir: str | os.PathLike | None = None,
           cache_limit: int | str | None = None, cache: bool = True,
           fields: Sequence[str] | str | None = None, resize: int | str | None = None,
           center_crop: int | str | None = None, interpolation: str = "bilinear", decoder: str = "auto",
           random_resized_crop: int | tuple[int, int] | None = None, scale: tuple[float, float] = (0.08, 1.0),
           ratio: tuple[float, float] = (3 / 4, 4 / 3), flip: bool = False) -> StreamLoader:
    """Read a packed WebDataset's tar shards sequentially, as batches of ``(images, labels)`` (uint8 NCHW); a
    dataset with other fields gives dict batches as :func:`packer.make_loader` does (images and masks stacked,
    numbers stacked, text, JSON and variable-length vectors as lists), and ``fields=`` a tuple in that order.

    Every sample comes once per epoch on one rank; shards are reshuffled every epoch and samples mixed through a
    shuffle buffer. Under ``torch.distributed`` each rank reads its own shards, and every rank stops after the
    fewest batches any rank has, so that all take the same number of steps.

    Images decode through :func:`packer.open_dataset`'s decode path, straight into the batch tensor, with the same
    read-time options: ``resize``/``center_crop`` (the same pixels as ``open_dataset``'s), or
    ``random_resized_crop``/``flip`` drawn from ``(seed, epoch, index)``, where a packer-written sample's index is
    its member key (``000000042`` is 42), so its window is ``open_dataset(..., seed=seed).augment_params(42,
    epoch)``; a key that is not a number (shards of other tools) stands for the crc32 of its UTF-8 bytes
    (:func:`packer.streamdecode.key_index`). Mask and second-image fields get their image's geometry (masks by
    nearest neighbour). Without them, images stored at varying sizes cannot be batched (a one-line error).

    Args:
        root: a dataset packed with ``--format wds``.
        batch_size: samples per batch; each stream's last batch may be smaller, unless ``drop_last``.
        shuffle: shuffle shards and samples, from ``(seed, epoch)``; else the packed order (with one stream).
        num_workers: worker processes, each reading its own shards (default: the usable cores; 0: this process).
        seed: the shuffles' and the augmentation's seed, the same on every rank.
        mode: the PIL mode images are decoded to.
        drop_last: drop each stream's last partial batch.
        buffer: samples in each stream's shuffle buffer.
        storage_options, cache_dir, cache_limit: for a URL ``root``: each shard is fetched into the cache when
            its stream reaches it, checked, and released once read, so ``cache_limit`` (bytes or ``"10GB"``)
            may be below the dataset's size (it must hold one shard per worker).
        cache: False reads a URL's shards through temporary files deleted once read, leaving the cache alone.
        fields: the fields to give, by name, as a tuple in that order (as :func:`packer.open_dataset` takes it).
        resize, center_crop, interpolation, decoder, random_resized_crop, scale, ratio, flip: as
            :func:`packer.open_dataset` takes them.

    Raises:
        ValueError: (one line) an argument of the wrong type or range, naming it.

    Returns:
        A :class:`StreamLoader`, with ``state_dict``/``load_state_dict`` to resume mid-epoch.
    """
    arguments.int_at_least("batch_size", batch_size, 1)
    arguments.flag("shuffle", shuffle)
    arguments.optional_int("num_workers", num_workers, 0)
    arguments.seed("seed", seed)
    arguments.flag("drop_last", drop_last)
    arguments.int_at_least("buffer", buffer, 1)
    if mode not in ("RGB", "L"):
        raise UsageError(f"mode must be 'RGB' or 'L', not {mode!r}")
    from .remote import parse_url  # a URL is resolved here, to its manifest and a Fetchable per shard
    from .remote.resolve import remote_files

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
    shards = [(files[path] if files is not None else root / path, count) for path, count in entries]
    workers = usable_cores() if num_workers is None else num_workers
    if files is not None and cache:
        _check_cache_limit(cache_limit, [files[path].entry["bytes"] for path, _ in entries], max(workers, 1))
    settings = {"batch_size": batch_size, "seed": seed, "shuffle": shuffle, "drop_last": drop_last,
                "dataset_length": int(manifest["count"]), "workers": workers}
    decoding = {"resize": resize, "center_crop": center_crop, "interpolation": interpolation, "decoder": decoder,
                "random_resized_crop": random_resized_crop, "scale": scale, "ratio": ratio, "flip": flip,
                "seed": seed}
    return StreamLoader(shards, settings, StreamDecoder(root, manifest, mode, fields, **decoding), buffer,
                        reader=reader)
