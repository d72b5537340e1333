"""``make_loader``: a torch DataLoader with settings chosen for this machine, and ``to_device``.

Each default and why (every one can be overridden by keyword). Which engine reads (packer's worker pool, decode
threads in this process, or torch's workers), with how many workers and threads, pinning and prefetch, is decided
in one place, :func:`packer.loading.plan.plan_loader`: the loader keeps it as ``loader.plan`` (printable, with a
reason for each choice) and logs it at INFO on the ``packer.loading.loader`` logger.

- packer's datasets whose images have one shape (a packed size, or ``center_crop``/``random_resized_crop`` at read
  time) and no per-item ``transform``: one worker process per usable core (the affinity mask, which SLURM and taskset
  set, capped by a cgroup CPU quota and SLURM_CPUS_PER_TASK), each decoding whole batches into shared memory the main
  process owns (:mod:`packer.loading.workers`): only the labels cross between processes. Threads in the main process
  share one GIL, with each other and with the training loop, so they reach less of the decode ceiling than worker
  processes do, and torch's own workers, which allocate and send every batch, reach least (docs/benchmarks.md,
  "Loader"; ``packer bench`` measures it on your machine). Other packer datasets decode in the main process on one
  thread per core, in a background thread ``prefetch_batches`` ahead (``num_workers=0`` asks for that); so do all of
  them on one core, where processes do not fork (spawn and forkserver re-import a script's main module, which must then
  be guarded), and where /dev/shm has no room for the batches in flight (a container's default 64 MB). Other datasets
  use ``num_workers`` = usable cores, torch's workers. Under torchrun every count is the
  rank's share of the node's cores (``LOCAL_WORLD_SIZE``);
- ``pin_memory``: on when CUDA is available, so the copy to the GPU can be asynchronous;
- ``persistent_workers``: on, so workers (and their open maps and page-cache-warm handles) survive epochs;
- ``prefetch_factor``: 4 batches per worker, enough to ride out slow batches without holding much memory;
- ``worker_init_fn``: seeds ``random`` and numpy in each worker from torch's per-worker seed;
- ``collate_fn``: :func:`collate`, which takes the batch tensor a packed dataset's ``__getitems__`` already
  filled (in shared memory) instead of stacking it again;
- ``sampler``: a :class:`~packer.loading.sampler.ResumableSampler`: one global order per epoch (a permutation from
  ``(seed, epoch)``), a new one every epoch without ``set_epoch``, dealt to the ranks under ``torch.distributed``
  and padded as ``DistributedSampler`` does so that every rank gets the same number of batches. The loader's
  ``state_dict()``/``load_state_dict()`` resume mid-epoch, exactly, at any world size.

Loader settings tuned by ``packer bench --tune`` (``loader.json`` beside the manifest: ``num_workers``, ``threads``,
``prefetch_factor``, ``pin_memory``; never ``batch_size``, a training hyperparameter) are used when present and tuned
for the read-time view the dataset was opened with; an argument given explicitly always wins.
"""

from __future__ import annotations

import atexit
import logging
import queue
import random
import sys
import threading
from collections.abc import Sized
from typing import Any, cast

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate

from .. import arguments
from ..arguments import parse_bytes
from ..errors import Crossed, PackerError, UsageError, uncrossed
from ..manifest import TUNED
from ..reading.batches import BatchDataset, FieldBatch
from ..reading.dataset import PackedBatch
from ..state import CountingIterator, Progress
from ..system import die_with_parent
from .fetchahead import FetchAhead, WorkerMaps, blocked_reader, cache_short_of, say_once
from .plan import LoaderPlan, plan_loader, varying_sizes
from .sampler import BLOCKS, ResumableSampler
from .tuned import tuned_settings
from .workers import WorkerPool

BLOCK_BYTES = 64 << 20  # shuffle="blocks": an LMDB or HDF5 block
_log = logging.getLogger("packer.loading.loader")


def collate(batch: list) -> Any:
    """Return a :class:`PackedBatch`'s tensors (a :class:`FieldBatch`'s whole batch) as they are; anything else
    goes to ``default_collate``, with a sample's text, JSON, bytes and variable-length vectors kept as lists."""
    if isinstance(batch, PackedBatch):
        return (batch.images, batch.labels) if batch.sources is None else (batch.images, batch.labels, batch.sources)
    if isinstance(batch, Crossed):  # a worker's error, raised as itself by the loader
        return batch
    if isinstance(batch, FieldBatch):
        return batch.collate()
    first = batch[0] if batch else None
    if isinstance(first, (tuple, list)) and first and isinstance(first[0], torch.Tensor):
        sizes = sorted({tuple(item[0].shape) for item in batch})
        if len(sizes) > 1:  # torch would say "stack expects each tensor to be equal size", or worse in a worker
            raise PackerError(f"images in one batch differ in size ({', '.join(map(str, sizes[:3]))}); pass "
                              "resize= and center_crop= (or random_resized_crop=) to open_dataset so that every "
                              "image has one size")
    return default_collate(batch)


def seed_worker(worker_id: int) -> None:
    """``worker_init_fn`` of packer's DataLoaders: the worker dies with the process that started it, and seeds
    ``random`` and numpy from torch's per-worker seed."""
    die_with_parent()
    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    np.random.seed(seed)


class PrefetchLoader(DataLoader):
    """A ``DataLoader`` that, with ``num_workers=0``, makes its batches in a background thread of the main
    process, ``prefetch_batches`` ahead (packed datasets decode each batch on several threads; decoding and
    copying release the GIL). With ``worker_pool`` settings, ``num_workers`` are packer's
    :class:`~packer.loading.workers.WorkerPool` instead of torch's workers, started at the first iteration.

    With a :class:`~packer.loading.sampler.ResumableSampler` (``make_loader``'s) it also resumes mid-epoch:
    :meth:`state_dict` is the position after the batches the caller has received (the sampler and the workers
    run ahead of it), and :meth:`load_state_dict` makes the next iteration the rest of that epoch."""

    def __init__(self, *args, prefetch_batches: int = 4, threads: int = 1, pin_batches: bool = False,
                 worker_pool: dict[str, Any] | None = None, plan: LoaderPlan | None = None,
                 fetch_ahead: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.fetch_ahead = fetch_ahead  # blocks' worth of bytes fetched ahead (a dataset read a block at a time)
        self._fetching: FetchAhead | None = None  # the latest pass's fetch-ahead thread
        self.plan = plan  # how make_loader chose to read (engine, workers, threads...) and why; None otherwise
        self.prefetch_batches = prefetch_batches
        self.threads = threads  # decode threads per batch, in each process that reads
        self.pin_batches = pin_batches  # batches are made in pinned memory (then pin_memory itself is off)
        self.worker_pool_settings = worker_pool  # num_workers are packer's WorkerPool, started at the first pass
        self._worker_pool: WorkerPool | None = None
        self._received: Progress | None = None  # the latest iteration's pass and the batches handed out of it
        self._prefetching: tuple[threading.Event, threading.Thread] | None = None  # the latest prefetch thread

    def __iter__(self):
        if self._fetching is not None:
            self._fetching.stop()
        sampler = self._resumable_sampler()
        if sampler is not None:
            self._restart_untouched(sampler)
        epoch_pass = sampler.next_pass() if sampler is not None else None
        reader = blocked_reader(self.dataset)
        fetching = reader is not None and epoch_pass is not None and epoch_pass.per_rank > 0
        indices = epoch_pass.indices() if fetching else []
        maps = self.dataset.maps if isinstance(self.dataset, BatchReads) else None  # torch's workers' mapped batches
        mapped = maps.counter(indices, self.batch_size) if maps is not None and fetching else None
        if self.worker_pool_settings is not None:
            if self._worker_pool is None:
                self._worker_pool = WorkerPool(**self.worker_pool_settings)
            iterator = self._worker_pool.iterate(iter(self.batch_sampler))
        else:
            iterator = uncrossed(super().__iter__())
        if self.num_workers == 0 and self.prefetch_batches > 0:
            iterator = _BackgroundIterator(iterator, self.prefetch_batches)
            self._prefetching = iterator.stop, iterator.thread
        if epoch_pass is None:
            return iterator
        self._received = Progress(epoch_pass, epoch_pass.batches)
        counting = CountingIterator(iterator, self._received)
        if fetching:  # started after any worker forked: they hold none of it
            ahead = reader.fetch_ahead if self.fetch_ahead is None else self.fetch_ahead
            pool, following = self._worker_pool, epoch_pass.following()
            self._fetching = FetchAhead(reader, indices, self.batch_size, self._received, counting, ahead,
                                        pool.mapped_batches if pool is not None else mapped, following.indices)
        return counting

    def _restart_untouched(self, sampler: ResumableSampler) -> None:
        """When the latest iteration handed out no batch, the next one makes its pass again: for the caller it
        never started (``iter(loader)`` twice), though a prefetch thread may have started it in the sampler. That
        thread is stopped first, so that it takes nothing more from the sampler."""
        received = self._received
        if received is None or received.received or received.finished:
            return
        if self._prefetching is not None:
            stop, thread = self._prefetching
            stop.set()
            thread.join()
        sampler.load_state_dict(received.plan.state(0))

    @property
    def worker_pool(self) -> WorkerPool | None:
        """packer's :class:`~packer.loading.workers.WorkerPool` when it makes this loader's batches and has started
        (at the first iteration), else None. ``loader.worker_pool.close()`` stops its processes now; they also
        stop when the loader is garbage-collected, and at exit."""
        return self._worker_pool

    def __len__(self) -> int:
        received = self._received  # during a pass: its batches (the prefetching sampler may be done with it)
        if received is not None and not received.finished:
            return received.total
        return super().__len__()

    def _resumable_sampler(self) -> ResumableSampler | None:
        sampler = self.sampler
        if isinstance(sampler, ResumableSampler) and self.batch_size == sampler.batch_size:
            return sampler
        return None

    def _require_resumable(self) -> ResumableSampler:
        sampler = self._resumable_sampler()
        if sampler is None:
            raise ValueError(f"this loader's sampler ({type(self.sampler).__name__}, batch_size={self.batch_size})"
                             " keeps no position; use make_loader without sampler= or batch_sampler= to resume")
        return sampler

    def state_dict(self) -> dict[str, Any]:
        """The loader's position: ``{epoch, samples_seen (globally, over all ranks), world_size, ...}``, the same
        on every rank. JSON-serialisable, under 1 KB, and cheap enough to take every step.

        Returns:
            A dict for :meth:`load_state_dict`, in this process or a new one, at this or another world size.
        """
        sampler = self._require_resumable()
        received = self._received
        if received is None:
            return sampler.state_dict()
        return received.plan.state(received.received * sampler.batch_size)  # the loader's, as it resumes

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next iteration the rest of the epoch ``state`` was taken in (the samples no rank has received
        yet, dealt over this world size); the iterations after it are whole epochs.

        Args:
            state: what :meth:`state_dict` returned.

        Raises:
            ValueError: (one line) ``state`` was taken with another batch_size, seed, shuffle, drop_last or
                dataset length.
        """
        self._require_resumable().load_state_dict(state)
        self._received = None

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch ``epoch`` (each iteration moves to the next epoch by itself)."""
        self._require_resumable().set_epoch(epoch)
        self._received = None


_PREFETCHING: set[tuple[threading.Event, threading.Thread]] = set()


@atexit.register
def _stop_prefetching(timeout: float = 10.0) -> None:
    """At exit, stop every prefetch thread and wait for its batch in progress. A daemon thread still inside torch
    when the interpreter finalizes aborts the whole process ("terminate called without an active exception",
    seen after a loop that breaks out mid-epoch and then returns)."""
    for stop, _ in list(_PREFETCHING):
        stop.set()
    for _, thread in list(_PREFETCHING):
        thread.join(timeout)


class _BackgroundIterator:
    _END = object()

    def __init__(self, iterator, depth: int):
        self.queue: queue.Queue = queue.Queue(depth)
        self.stop = threading.Event()
        # the thread holds the queue and the event, not self: a consumer that stops early (``next(iter(loader))``,
        # ``break``) drops this object, __del__ sets ``stop`` and the thread ends instead of living on
        self.thread = threading.Thread(target=self._fill, args=(iterator, self.queue, self.stop), daemon=True,
                                       name="packer-prefetch")
        _PREFETCHING.add((self.stop, self.thread))
        self.thread.start()

    @classmethod
    def _fill(cls, iterator, q: queue.Queue, stop: threading.Event) -> None:
        try:
            for batch in iterator:
                if not cls._put(q, stop, batch):
                    return
            cls._put(q, stop, cls._END)
        except BaseException as exc:  # handed to the consumer, raised there
            cls._put(q, stop, exc)
        finally:
            _PREFETCHING.discard((stop, threading.current_thread()))

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


class BatchReads(Dataset):
    """What :func:`make_loader` hands the DataLoader for a packed dataset: a view whose batch reads carry the
    loader's decode threads and pinning, so the dataset is never changed and one dataset can back several
    loaders with different settings. Other attributes are the dataset's."""

    def __init__(self, dataset: BatchDataset, threads: int, pin_memory: bool, crossing: bool = False,
                 maps: WorkerMaps | None = None):
        self.dataset = dataset
        self.threads = threads
        self.pin_memory = pin_memory
        self.crossing = crossing  # torch's workers hand a PackerError on as a Crossed batch (collate passes it)
        self.maps = maps  # a dataset read a block at a time by torch's workers: what they have mapped

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, indices: list[int]) -> list | Crossed:
        try:
            if self.maps is not None:
                worker = torch.utils.data.get_worker_info()
                if worker is not None:
                    # maps are made only for a dataset read a block at a time, which has a reader
                    self.maps.note(cast(Any, self.dataset).reader, indices, worker.id)
            return self.dataset.read_batch(indices, threads=self.threads, pin_memory=self.pin_memory)
        except PackerError as exc:
            if torch.utils.data.get_worker_info() is None or not self.crossing:
                raise
            return Crossed(exc)  # collate passes it on and the loader raises it, as itself, in one line

    def __getattr__(self, name: str) -> Any:
        if name == "dataset":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.dataset, name)


def _check_loader_arguments(dataset: Any, batch_size: Any, shuffle: Any, seed: Any, tuned: Any, threads: Any,
                            prefetch_batches: Any, drop_last: Any) -> None:
    """make_loader's own arguments, each checked at the call (a one-line ValueError naming it)."""
    if not isinstance(dataset, Dataset) and not hasattr(dataset, "__getitem__"):
        raise UsageError(f"dataset must be a torch Dataset (packer.open_dataset gives one), not "
                         f"{type(dataset).__name__}")
    arguments.optional_int("batch_size", batch_size, 1)
    if shuffle != BLOCKS and not isinstance(shuffle, bool):
        raise UsageError(f"shuffle must be True, False or 'blocks', not {shuffle!r}")
    for name, value in (("tuned", tuned), ("drop_last", drop_last)):
        arguments.flag(name, value)
    arguments.seed("seed", seed)
    arguments.optional_int("threads", threads, 1)
    arguments.optional_int("prefetch_batches", prefetch_batches, 0)


def _block_starts(dataset: Dataset, block_bytes: int | str) -> np.ndarray:
    """The dataset's blocks for ``shuffle="blocks"``; a one-line error for a dataset that has none."""
    blocks = getattr(dataset, "blocks", None)
    if not callable(blocks):
        raise PackerError(f"shuffle='blocks' needs a dataset that knows its blocks (packer.open_dataset's); "
                          f"{type(dataset).__name__} has none: use shuffle=True")
    return blocks(parse_bytes(block_bytes))


def make_loader(dataset: Dataset, batch_size: int | None = None, shuffle: bool | str = True, *, seed: int = 0,
                tuned: bool = True, threads: int | None = None, prefetch_batches: int | None = None,
                drop_last: bool = False, block_window: int = 4, block_bytes: int | str = BLOCK_BYTES,
                fetch_ahead: int | None = None, **overrides: Any) -> PrefetchLoader:
    """A ``torch.utils.data.DataLoader`` over ``dataset`` with packer's tuned defaults; ``overrides`` win.

    The loader resumes mid-epoch: save ``loader.state_dict()`` with the model, and after a restart make the same
    loader and call ``loader.load_state_dict(state)``; the next iteration is the rest of the interrupted epoch.

    For packer's datasets of one image shape and no per-item transform, batches are decoded by worker
    processes (one per usable core, or ``num_workers``) into shared memory the main process hands out
    (:class:`~packer.loading.workers.WorkerPool`; copied into pinned memory when CUDA is available). ``num_workers=0``,
    ``threads=`` or ``prefetch_batches=``, and the datasets the pool cannot serve, decode in the main process
    on one thread per usable core, prefetched in the background (:class:`PrefetchLoader`), in pinned memory when
    CUDA is available. The dataset itself is not changed.

    Args:
        dataset: any map-style or iterable Dataset; packer's get the settings above.
        batch_size: samples per batch (default 64; never tuned).
        shuffle: a new random order every epoch (from ``seed`` and the epoch). ``"blocks"``: a block-aware
            order (:mod:`packer.loading.block_order`) for datasets larger than memory: blocks the reader reads
            sequentially (a WebDataset shard, ``block_bytes`` of an LMDB or HDF5 file) in a random order, the samples of
            each ``block_window`` consecutive blocks shuffled together; under ``torch.distributed`` each rank takes
            whole blocks where it can. Resumes exactly at any world size, like ``True``. A mixture
            (:func:`packer.mix`) orders its epochs itself, from its own seed: it takes True only.
        seed: the sample order's seed (not a mixture's: that is ``mix()``'s).
        tuned: use ``DEST/loader.json`` from ``packer bench --tune`` when present and tuned for this dataset's
            read-time view (and say on stderr which settings apply: those no argument given here overrides);
            False ignores it and prints nothing.
        threads: decode threads per batch in the main process (default: the usable cores; 1 in workers).
            Giving it asks for the in-process loader.
        prefetch_batches: batches the in-process loader keeps ready (default: the tuned prefetch_factor, else
            4; 0 with worker processes, which prefetch ``prefetch_factor`` batches each). Giving it asks for the
            in-process loader.
        drop_last: drop the last, smaller batch of each epoch.
        block_window: with ``shuffle="blocks"``, how many blocks are mixed together (and read at a time).
        block_bytes: with ``shuffle="blocks"``, the size of an LMDB or HDF5 block (an int, or "64MB"). A URL
            larger than its cache_limit is read in the blocks ``open_dataset`` sized for the cache instead, and
            ``shuffle=True`` reads it as ``"blocks"`` (said once on stderr).
        fetch_ahead: for a URL larger than its cache_limit, how many blocks' worth of bytes (of its largest
            block) a thread keeps fetched ahead of the batches: more blocks where they are short, such as a
            shard's last one (default: what the cache budget allows, see ``open_dataset``). Where that holds
            fewer samples than the batches in flight (and the rest of their window), it says so once on stderr,
            with the ``cache_limit`` that would hold them: below it the decoders wait on fetches of their own.
        **overrides: any ``DataLoader`` argument (``num_workers``, ``pin_memory``, ``sampler``...).

    Raises:
        ValueError: (one line) an argument of the wrong type or range, naming it.

    Returns:
        A :class:`PrefetchLoader`; ``loader.plan`` (:class:`~packer.loading.plan.LoaderPlan`) says which engine
        reads, with how many workers and threads, pinning and prefetch, and why each.
    """
    _check_loader_arguments(dataset, batch_size, shuffle, seed, tuned, threads, prefetch_batches, drop_last)
    if getattr(dataset, "mixture", None) is not None and shuffle is not True:
        raise UsageError(f"shuffle={shuffle!r}: a mixture (packer.mix) orders each epoch itself, from mix()'s "
                         "seed and the epoch; leave shuffle=True")
    arguments.optional_int("fetch_ahead", fetch_ahead, 0)
    reader = blocked_reader(dataset)
    if reader is not None and fetch_ahead is not None and fetch_ahead > reader.fetch_ahead:
        # more pins than the blocks were sized for would starve the workers' own fetches of room in the cache
        raise ValueError(f"fetch_ahead={fetch_ahead}: {reader.where}'s blocks were cut for at most "
                         f"{reader.fetch_ahead} blocks fetched ahead within its cache; give at most that")
    if shuffle is True and reader is not None:
        say_once(f"packer: {reader.where} is read a block at a time: shuffle=True shuffles blocks "
                 f"(shuffle='blocks', {block_window} blocks mixed at a time)")
        shuffle = BLOCKS
    batch_size = 64 if batch_size is None else batch_size
    ours = {"collate_fn": (collate,), "worker_init_fn": (None, seed_worker)}  # packer's own: not the caller's
    given = {k: v for k, v in overrides.items() if not any(v is own for own in ours.get(k, ()))}
    refusal = varying_sizes(dataset, batch_size, given)
    if refusal is not None:
        raise UsageError(refusal)
    plan = plan_loader(dataset, batch_size, threads=threads, prefetch_batches=prefetch_batches, overrides=given,
                       tuned=tuned_settings(dataset) if tuned else None)
    if plan.tuned:
        print(f"packer: using tuned loader settings from {getattr(dataset, 'root', '')}/{TUNED}: {dict(plan.tuned)}",
              file=sys.stderr)
    _log.info("packer: loader plan: %s", plan)
    packed = isinstance(dataset, BatchDataset)
    pin_batches = packed and plan.engine == "threads" and plan.pin_memory and torch.cuda.is_available()
    settings: dict[str, Any] = {"batch_size": batch_size, "num_workers": plan.workers,
                                "pin_memory": plan.pin_memory,
                                "collate_fn": collate, "drop_last": drop_last}
    if plan.workers > 0:
        settings.update(persistent_workers=True, prefetch_factor=plan.prefetch, worker_init_fn=seed_worker)
    if "sampler" not in overrides and "batch_sampler" not in overrides and not isinstance(dataset, IterableDataset):
        starts = _block_starts(dataset, block_bytes) if shuffle == BLOCKS else None
        # a map-style dataset has a length (DataLoader's own samplers take it too); Dataset does not declare it
        settings["sampler"] = ResumableSampler(cast(Sized, dataset), batch_size=batch_size, shuffle=shuffle, seed=seed,
                                               drop_last=drop_last, blocks=starts, window=block_window)
    settings.update(overrides)
    if settings.get("batch_sampler") is not None:
        for key in ("batch_size", "drop_last", "sampler"):
            settings.pop(key, None)
    if pin_batches:
        settings["pin_memory"] = False  # the batch is made in pinned memory: no second copy to pin it
    if reader is not None and settings.get("batch_sampler") is None:
        in_flight = max(1, settings["num_workers"]) * (settings.get("prefetch_factor") or plan.prefetch) + 1
        short = cache_short_of(reader, batch_size, in_flight, block_window, fetch_ahead)
        if short:
            say_once(short)
    maps = WorkerMaps.of(reader, settings["num_workers"] if plan.engine == "torch" else 0)
    data = BatchReads(dataset, plan.threads, pin_batches, settings.get("collate_fn") is collate, maps) \
        if isinstance(dataset, BatchDataset) else dataset
    return PrefetchLoader(data, prefetch_batches=plan.prefetch if plan.workers == 0 else 0, threads=plan.threads,
                          pin_batches=pin_batches, worker_pool=_pool_arguments(plan, dataset, settings), plan=plan,
                          fetch_ahead=fetch_ahead, **settings)


def _pool_arguments(plan: LoaderPlan, dataset: Dataset, settings: dict[str, Any]) -> dict[str, Any] | None:
    """WorkerPool's arguments when the plan's engine is packer's pool, else None."""
    if plan.engine != "pool":
        return None
    return {"dataset": dataset, "workers": plan.workers, "batch_size": settings.get("batch_size") or 1,
            "prefetch_factor": settings.get("prefetch_factor") or 2,
            "pin_memory": plan.pin_memory and torch.cuda.is_available(),
            "context": settings.get("multiprocessing_context"), "timeout": settings.get("timeout", 0)}


class DeviceLoader:
    """Iterates a loader and moves each ``(images, labels)`` batch to ``device``; a dataset with fields' batch
    too (a dict, or a ``fields=`` tuple): every tensor moves, text, JSON and bytes stay as they are, and
    ``normalize`` applies to the dict's ``"image"``, or a tuple's first entry.

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

    def _to(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.to(self.device, non_blocking=True)
        if isinstance(value, list) and value and isinstance(value[0], torch.Tensor):  # variable-length vectors
            return [v.to(self.device, non_blocking=True) for v in value]
        return value  # text, JSON, bytes stay on the host

    def _move(self, batch):
        if isinstance(batch, dict):  # a dataset with fields: the "image" entry is converted
            moved = {key: self._to(value) for key, value in batch.items()}
            if isinstance(moved.get("image"), torch.Tensor):
                moved["image"] = self._convert(moved["image"])
            return moved
        moved = [self._to(value) for value in batch]  # (images, labels), or the fields= tuple: the first entry
        if moved and isinstance(moved[0], torch.Tensor):
            moved[0] = self._convert(moved[0])
        return tuple(moved)

    @staticmethod
    def _tensors(batch) -> list[torch.Tensor]:
        values = batch.values() if isinstance(batch, dict) else batch
        found = []
        for value in values:
            if isinstance(value, torch.Tensor):
                found.append(value)
            elif isinstance(value, list):
                found.extend(v for v in value if isinstance(v, torch.Tensor))
        return found

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
            for t in self._tensors(nxt):
                t.record_stream(current)
            ready = nxt
        if ready is not None:
            yield ready


def to_device(loader, device: str | torch.device, normalize: tuple | None = None,
              dtype: torch.dtype = torch.float32) -> DeviceLoader:
    """Wrap ``loader`` so that batches arrive on ``device``, converted and normalized there (see DeviceLoader).

    On CUDA the copy of the next batch (from pinned memory, ``non_blocking=True``) and its conversion run on a
    side stream while the current batch is used. Every tensor of a batch moves (a dict's or tuple's too); text,
    JSON and bytes stay on the host.

    Args:
        loader (Iterable): any iterable of batches: ``(images, labels)``, a dict, or a tuple (``make_loader``'s, or
            ``stream``'s).
        device: where the batches go: ``"cuda"``, ``"cuda:1"``, ``"cpu"`` or a ``torch.device``.
        normalize: ``(mean, std)``, one value per channel on the 0-1 scale (ImageNet's is ``((0.485, 0.456,
            0.406), (0.229, 0.224, 0.225))``): images become ``dtype`` floats ``(x / 255 - mean) / std``, of the
            dict's ``"image"`` or the tuple's first entry. None leaves the images as they are (uint8).
        dtype: the float type of normalized images.

    Returns:
        A ``DeviceLoader``: iterate it as the loader (``len`` is the loader's).

    Raises:
        ValueError: (one line) ``device`` is not a device torch knows, or one this machine does not have (CUDA
            without a GPU or a CUDA build of torch).
    """
    try:
        where = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise UsageError(f"device {device!r} is not a torch device ({' '.join(str(exc).split())[:120]}); "
                         "give 'cpu' or 'cuda'") from None
    if where.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"device {device!r}: this machine has no CUDA GPU (or torch was built without CUDA); "
                         "use 'cpu', or \"cuda\" if torch.cuda.is_available() else \"cpu\"")
    if where.type == "cuda" and where.index is not None and where.index >= torch.cuda.device_count():
        raise UsageError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return DeviceLoader(loader, where, normalize, dtype)
