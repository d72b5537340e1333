"""``make_loader``: a torch DataLoader with settings chosen for this machine, and ``to_device``.

Each default and why (every one can be overridden by keyword):

- packer's own datasets decode in the main process, one thread per usable core (the affinity mask, which SLURM
  and taskset set, capped by a cgroup CPU quota and SLURM_CPUS_PER_TASK), in a background thread that keeps
  ``prefetch_factor`` batches ready. Measured on this project's 2-core machine, handing a 224x224 uint8 batch of
  64 from a worker process to the main process costs about 9 ms, more than copying it from a packed raw dataset;
  threads avoid that, and start at once. Other datasets, or ``num_workers=N``, use N worker processes;
- ``pin_memory``: on when CUDA is available, so the copy to the GPU can be asynchronous;
- ``persistent_workers``: on, so workers (and their open maps and page-cache-warm handles) survive epochs;
- ``prefetch_factor``: 4 batches per worker, enough to ride out slow batches without holding much memory;
- ``worker_init_fn``: seeds ``random`` and numpy in each worker from torch's per-worker seed;
- ``collate_fn``: :func:`collate`, which takes the batch tensor a packed dataset's ``__getitems__`` already
  filled (in shared memory) instead of stacking it again;
- under ``torch.distributed`` a ``DistributedSampler`` that reshuffles every epoch by itself and pads so that
  every rank gets the same number of batches.

Settings tuned by ``packer bench --tune`` (``loader.json`` beside the manifest) are used when present.
"""

from __future__ import annotations

import json
import queue
import random
import sys
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, default_collate

from .formats.base import PackedBatch, PackedDataset
from .system import usable_cores

TUNED = "loader.json"


def default_workers() -> int:
    return usable_cores()


def collate(batch: list) -> Any:
    """Return a :class:`PackedBatch`'s tensors as they are; anything else goes to ``default_collate``."""
    if isinstance(batch, PackedBatch):
        return batch.images, batch.labels
    return default_collate(batch)


def seed_worker(worker_id: int) -> None:
    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    np.random.seed(seed)


class EpochDistributedSampler(DistributedSampler):
    """A ``DistributedSampler`` that moves to the next epoch each time it is iterated, so the order changes
    every epoch without the user calling ``set_epoch`` (an explicit ``set_epoch`` still wins)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._next_epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self._next_epoch = epoch

    def __iter__(self) -> Iterator[int]:
        super().set_epoch(self._next_epoch)
        self._next_epoch += 1
        return super().__iter__()


def tuned_settings(dataset: Dataset) -> dict[str, Any]:
    root = getattr(dataset, "root", None)
    path = root / TUNED if root is not None else None
    if path is None or not path.exists():
        return {}
    try:
        settings = json.loads(path.read_text())
    except ValueError:
        return {}
    allowed = {"num_workers", "batch_size", "prefetch_factor"}
    settings = {k: v for k, v in settings.get("loader", {}).items() if k in allowed and isinstance(v, int)}
    if settings:
        print(f"packer: using tuned loader settings from {path}: {settings}", file=sys.stderr)
    return settings


class PrefetchLoader(DataLoader):
    """A ``DataLoader`` that, with ``num_workers=0``, makes its batches in a background thread of the main
    process, ``prefetch_batches`` ahead. Packed datasets decode each batch on several threads (decoding and
    copying release the GIL), so this runs as parallel as worker processes without their cost: no process
    start, and no trip through shared memory for every batch."""

    def __init__(self, *args, prefetch_batches: int = 4, **kwargs):
        super().__init__(*args, **kwargs)
        self.prefetch_batches = prefetch_batches

    def __iter__(self):
        iterator = super().__iter__()
        if self.num_workers > 0 or self.prefetch_batches <= 0:
            return iterator
        return _BackgroundIterator(iterator, self.prefetch_batches)


class _BackgroundIterator:
    _END = object()

    def __init__(self, iterator, depth: int):
        self.queue: queue.Queue = queue.Queue(depth)
        self.stop = threading.Event()
        # the thread holds the queue and the event, not self: a consumer that stops early (``next(iter(loader))``,
        # ``break``) drops this object, __del__ sets ``stop`` and the thread ends instead of living on
        self.thread = threading.Thread(target=self._fill, args=(iterator, self.queue, self.stop), daemon=True,
                                       name="packer-prefetch")
        self.thread.start()

    @classmethod
    def _fill(cls, iterator, q: queue.Queue, stop: threading.Event) -> None:
        try:
            for batch in iterator:
                if not cls._put(q, stop, batch):
                    return
        except BaseException as exc:  # handed to the consumer, raised there
            cls._put(q, stop, exc)
            return
        cls._put(q, stop, cls._END)

    @staticmethod
    def _put(q: queue.Queue, stop: threading.Event, item) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self):
        return self

    def __next__(self):
        item = self.queue.get()
        if item is self._END:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def __del__(self):
        self.stop.set()


def make_loader(dataset: Dataset, batch_size: int | None = None, shuffle: bool = True, *, seed: int = 0,
                drop_last: bool = False, **overrides: Any) -> DataLoader:
    """A ``torch.utils.data.DataLoader`` over ``dataset`` with the defaults above; ``overrides`` win.

    For packer's datasets, unless ``num_workers`` is given, batches are decoded in the main process on one
    thread per usable core and prefetched in the background (:class:`PrefetchLoader`); batches are allocated
    in pinned memory when CUDA is available. Pass ``num_workers=N`` for N worker processes instead (each
    decoding on one thread), as for any other dataset."""
    tuned = tuned_settings(dataset)
    if batch_size is None:
        batch_size = tuned.get("batch_size", 64)
    cuda = torch.cuda.is_available()
    threaded = isinstance(dataset, PackedDataset) and "num_workers" not in overrides and "num_workers" not in tuned
    workers = 0 if threaded else overrides.get("num_workers", tuned.get("num_workers", default_workers()))
    settings: dict[str, Any] = {"batch_size": batch_size, "num_workers": workers, "pin_memory": cuda,
                                "collate_fn": collate, "drop_last": drop_last}
    if workers > 0:
        settings.update(persistent_workers=True, prefetch_factor=tuned.get("prefetch_factor", 4),
                        worker_init_fn=seed_worker)
    if isinstance(dataset, PackedDataset):
        dataset.threads = overrides.pop("threads", default_workers() if workers == 0 else 1)
        if workers == 0 and cuda and overrides.get("pin_memory", True):
            dataset.pin_memory = True  # the batch is made in pinned memory: no second copy to pin it
            settings["pin_memory"] = False
    if "sampler" not in overrides and "batch_sampler" not in overrides:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            settings["sampler"] = EpochDistributedSampler(dataset, shuffle=shuffle, seed=seed, drop_last=drop_last)
        elif shuffle:
            settings["sampler"] = torch.utils.data.RandomSampler(dataset, generator=torch.Generator().manual_seed(seed))
    settings.update(overrides)
    if settings.get("batch_sampler") is not None:
        for key in ("batch_size", "drop_last", "sampler"):
            settings.pop(key, None)
    if settings["num_workers"] == 0:
        return PrefetchLoader(dataset, prefetch_batches=tuned.get("prefetch_factor", 4), **settings)
    return DataLoader(dataset, **settings)


class DeviceLoader:
    """Iterates a loader and moves each ``(images, labels)`` batch to ``device``.

    On CUDA the copy of batch n+1 (pinned memory, ``non_blocking=True``) and its conversion run on a side stream
    while batch n is used; on the CPU it converts in place of the copy. With ``normalize=(mean, std)`` images
    become ``dtype`` floats ``(x / 255 - mean) / std``; without it they keep their dtype."""

    def __init__(self, loader, device: str | torch.device, normalize: tuple | None = None,
                 dtype: torch.dtype = torch.float32):
        self.loader = loader
        self.device = torch.device(device)
        self.dtype = dtype
        self.normalize = normalize
        self._stats: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(self.loader)

    def _convert(self, images: torch.Tensor) -> torch.Tensor:
        if self.normalize is None:
            return images
        if self.device not in self._stats:
            mean, std = (torch.tensor(v, dtype=self.dtype, device=self.device).view(1, -1, 1, 1) * 255
                         for v in self.normalize)
            self._stats[self.device] = (mean, std)
        mean, std = self._stats[self.device]
        return images.to(self.dtype).sub_(mean).div_(std)

    def _move(self, batch):
        images, labels = batch
        images = images.to(self.device, non_blocking=True)
        labels = labels.to(self.device, non_blocking=True)
        return self._convert(images), labels

    def __iter__(self):
        if self.device.type != "cuda":
            for batch in self.loader:
                yield self._move(batch)
            return
        stream = torch.cuda.Stream(self.device)
        current = torch.cuda.current_stream(self.device)
        ready = None
        for batch in self.loader:
            with torch.cuda.stream(stream):
                nxt = self._move(batch)
            if ready is not None:
                yield ready
            current.wait_stream(stream)
            for t in nxt:
                t.record_stream(current)
            ready = nxt
        if ready is not None:
            yield ready


def to_device(loader, device: str | torch.device, normalize: tuple | None = None,
              dtype: torch.dtype = torch.float32) -> DeviceLoader:
    """Wrap ``loader`` so that batches arrive on ``device``, converted and normalized there (see DeviceLoader)."""
    return DeviceLoader(loader, device, normalize, dtype)
