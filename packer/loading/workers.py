"""Worker processes that decode whole batches into shared memory: ``make_loader(ds, num_workers=N)`` over
packer's datasets.

torch's DataLoader workers allocate every batch afresh in shared memory and send it through a queue, a hand-off that
held two workers far below the decode ceiling (docs/benchmarks.md, "Loader"). Here the main process owns the batch
memory: slots in shared memory, each sent to a worker once. A worker decodes a batch into the slot it is given and
answers with the labels, and the loader hands out a view of the slot. A slot is written again only once no tensor in
the main process refers to it (the rule of :class:`~packer.reading.buffers.BatchPool`), so batches a training loop
keeps stay intact; with pinned memory each batch is copied into a pinned batch instead and its slot is free at once.

Messages, over one duplex pipe per worker:

- main to worker: ``("batch", key, slot_id, shared_tensor or None, indices, sequence)``, the tensor the first
  time this worker gets that slot; ``("forget", slot_id)``; ``None`` to stop;
- worker to main: ``(key, result, None)``, or ``(key, None, exception)`` when the batch failed; the result is
  the labels (and, for a dataset with fields, the values of those that are not dense:
  :meth:`~packer.reading.dataset.PackedDataset.decode_slot`).

For a dataset read a block at a time, a worker first maps every block of the batch, then writes the batch's
sequence number into its entry of a shared array (``mapped``) before it decodes: from then on the batch no longer
needs its blocks in the cache, and :meth:`WorkerPool.mapped_batches` tells the loader's fetch-ahead so, which
lets them go and fetches further ahead in their place (holding them until the batch came back left it only a
block or two ahead of the decoders, since the batches in flight span whole windows of blocks).
"""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import itertools
import multiprocessing
import multiprocessing.connection
import os
import pickle
import random
import shutil
import signal
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from ..errors import PackerError
from ..reading.buffers import shared_tensor, tensor_bytes
from ..system import close_fds, die_with_parent
from .fetchahead import blocked_reader

Layout = tuple[tuple[tuple[int, ...], torch.dtype], ...]  # a slot's arrays: (row shape, dtype) each
STACKS_SIGNAL: int | None = getattr(signal, "SIGUSR1", None)  # makes a worker write its threads' stacks to stderr


class SharedSlots:
    """Batch memory in shared memory, each slot reused once no tensor refers to it (as in BatchPool: a tensor
    from ``torch.from_numpy`` holds its array for as long as its storage lives), each with the id workers know
    it by. A slot is one array per entry of its layout (``(row shape, dtype)``: the images, and each mask or
    second image of a dataset with fields), free once none of them is referred to. At most ``keep``
    unreferenced slots are kept; a free slot of another layout than the one asked for (the previous epoch's
    size under a resolution schedule) is dropped."""

    # the slot's tuple, the loop variable and getrefcount's own argument: an array no tensor holds
    _UNREFERENCED = 3

    def __init__(self, layout: list[tuple[tuple[int, ...], torch.dtype]], rows: int, keep: int):
        self.layout: Layout = tuple((tuple(shape), dtype) for shape, dtype in layout)
        self.rows = rows
        self.keep = keep
        self._arrays: dict[int, tuple[np.ndarray, ...]] = {}
        self._shared: dict[int, tuple[torch.Tensor, ...]] = {}  # the tensors each slot is sent to a worker as
        self._rows_of: dict[int, int] = {}
        self._layout_of: dict[int, Layout] = {}
        self._ids = itertools.count()

    def _free(self, slot_id: int) -> bool:
        """Whether nothing refers to the slot: not its tuple (a batch in flight holds it), nor any array."""
        if sys.getrefcount(self._arrays[slot_id]) != 2:  # the dict's reference and getrefcount's argument
            return False
        for array in self._arrays[slot_id]:
            if sys.getrefcount(array) != self._UNREFERENCED:
                return False
        return True

    def take(self, rows: int, layout: Layout | None = None) -> tuple[int, tuple[np.ndarray, ...], list[int]]:
        """A slot of at least ``rows`` rows of ``layout`` (default: the first one) that nothing refers to, a new
        one if none is free.

        Returns:
            The slot's id, its arrays, and the ids of slots dropped meanwhile (free ones beyond ``keep``, and free
            ones of another layout).
        """
        layout = self.layout if layout is None else layout
        found = None
        free, stale = [], []
        for slot_id in self._arrays:
            if self._free(slot_id):
                if self._layout_of[slot_id] != layout:
                    stale.append(slot_id)
                    continue
                free.append(slot_id)
                if found is None and self._rows(slot_id) >= rows:
                    found = slot_id
        dropped = stale + [s for s in free if s != found][: max(0, len(self._arrays) - len(stale) - self.keep)]
        for slot_id in dropped:
            del self._arrays[slot_id], self._shared[slot_id], self._rows_of[slot_id], self._layout_of[slot_id]
        if found is None:
            found = next(self._ids)
            shared = []
            for row_shape, dtype in layout:
                shape = (max(rows, self.rows), *row_shape)
                try:
                    shared.append(shared_tensor(shape, dtype))
                except RuntimeError:  # torch reserves the pages up front: a full /dev/shm fails here, not by SIGBUS
                    free_bytes, size = shared_memory_free(), tensor_bytes(shape, dtype)
                    raise PackerError(f"no room in /dev/shm for a batch of {size / 2**20:.1f} MiB "
                                      f"({'?' if free_bytes is None else f'{free_bytes / 2**20:.1f}'} MiB free): give "
                                      "the container more (docker run --shm-size=2g), or pass num_workers=0") from None
            self._shared[found] = tuple(shared)
            self._arrays[found] = tuple(t.numpy() for t in shared)
            self._rows_of[found] = max(rows, self.rows)
            self._layout_of[found] = layout
        return found, self._arrays[found], dropped

    def _rows(self, slot_id: int) -> int:
        return self._rows_of[slot_id]

    def shared(self, slot_id: int) -> tuple[torch.Tensor, ...]:
        """The shared tensors of a slot, to send to a worker."""
        return self._shared[slot_id]

    def __len__(self) -> int:
        return len(self._arrays)


def shared_memory_free() -> int | None:
    """Bytes free in ``/dev/shm``, where torch makes shared memory on Linux (a container's is 64 MB unless
    ``--shm-size`` says otherwise); None where there is none to ask."""
    try:
        return shutil.disk_usage("/dev/shm").free
    except OSError:
        return None


def default_start_method() -> str:
    """The start method a DataLoader would use here, without fixing it (``get_start_method()`` would)."""
    return multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]


def slot_bytes(dataset: Any, batch_size: int) -> int:
    """Bytes of one batch of ``dataset``'s images (and its masks and second images)."""
    return sum(tensor_bytes((batch_size, *shape), dtype) for _, shape, dtype in dataset.batch_layout())


def _sendable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling, else a PackerError with its message."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # an exception type that does not pickle (extra required arguments...)
        return PackerError(f"{type(exc).__name__}: {exc}")


def _work(dataset: Any, conn: multiprocessing.connection.Connection, worker_id: int, seed: int,
          not_mine: list[int], mapped: Any) -> None:
    """A worker's loop: decode each batch asked for into its slot, answer with the labels or the error.
    ``not_mine``: the descriptors a forked worker closes (the main process's pipe ends and earlier workers'
    process pipes), so that it reads its pipe's end of file when the main process dies; the parent-death signal
    backs that up. ``mapped``: the shared array whose entry ``worker_id`` this worker sets to the sequence number
    of the batch whose blocks it has mapped (a dataset read a block at a time)."""
    close_fds(not_mine)
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle; it stops the workers
    if STACKS_SIGNAL is not None:  # where it is stuck, when the loader times out (not on Windows)
        with contextlib.suppress(AttributeError, OSError, RuntimeError, ValueError):  # no usable stderr
            faulthandler.register(STACKS_SIGNAL, all_threads=True)
    torch.set_num_threads(1)
    torch.manual_seed(seed + worker_id)
    random.seed(seed + worker_id)
    np.random.seed((seed + worker_id) % 2**32)
    slots: dict[int, tuple[np.ndarray, ...]] = {}
    reader = blocked_reader(dataset)
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the main process is gone
            return
        if message is None:
            return
        if message[0] == "forget":
            slots.pop(message[1], None)
            continue
        _, key, slot_id, shared, indices, sequence = message
        if shared is not None:
            slots[slot_id] = tuple(t.numpy() for t in shared)
        try:
            if reader is not None:
                reader.map_blocks(indices)
                mapped[worker_id] = sequence
            result = dataset.decode_slot(indices, [array[: len(indices)] for array in slots[slot_id]])
            reply: tuple[Any, Any, BaseException | None] = (key, result, None)
        except Exception as exc:  # sent to the main process, raised there for this batch
            reply = (key, None, _sendable(exc))
        conn.send(reply)


def _stop(conns: list, processes: list, owner: int) -> None:
    """Stop the workers of the pool made in process ``owner``. In any other process (a child forked while the pool
    lived, which may collect its inherited copy) nothing: its workers are not that process's to stop, and joining
    them raised there, as an unraisable exception in the middle of whatever the child was running."""
    if os.getpid() != owner:
        return
    for conn in conns:
        try:
            conn.send(None)
        except (OSError, ValueError):
            pass
    for process in processes:
        process.join(5)
        if process.is_alive():
            process.terminate()
            process.join(5)
    for conn in conns:
        conn.close()


def start_context(context: Any) -> Any:
    """The multiprocessing context for ``multiprocessing_context`` as DataLoader takes it (None, a name or a
    context)."""
    if context is None:
        return torch.multiprocessing.get_context()
    if isinstance(context, str):
        return torch.multiprocessing.get_context(context)
    return context


class WorkerPool:
    """``workers`` processes that decode batches of ``dataset`` into shared memory, kept across epochs.

    Args:
        dataset: a :class:`~packer.reading.dataset.PackedDataset` whose images have one shape.
        workers: processes.
        batch_size: rows of a slot (a larger batch gets a larger slot).
        prefetch_factor: batches in flight per worker.
        context: the multiprocessing context (None, a start method's name, or a context).
        pin_memory: copy each batch into pinned memory (then its slot is free at once).
        copy_out: copy each batch out of its slot even without pinning.
        timeout: seconds to wait for a batch before raising (0: no limit).
        seed: the workers' random seeds are ``seed + worker_id``.
    """

    def __init__(self, dataset: Any, workers: int, batch_size: int, prefetch_factor: int = 4,
                 context: Any = None, pin_memory: bool = False, copy_out: bool = False, timeout: float = 0,
                 seed: int | None = None):
        layout = dataset.batch_layout()
        if layout is None:
            raise ValueError("packer's worker pool needs images of one shape")
        self.dataset = dataset
        self.where = getattr(dataset, "where", None) or dataset.root  # what messages name the dataset by
        self.depth = workers * max(1, prefetch_factor)
        self.slots = SharedSlots([(shape, dtype) for _, shape, dtype in layout], batch_size, keep=self.depth + 4)
        self._layouts: tuple[Any, Layout] = (None, self.slots.layout)  # (epoch, its layout): the latest asked
        self.pin_memory = pin_memory
        self.copy_out = copy_out or pin_memory
        self.timeout = timeout or None
        needed, free = (self.depth + 2) * slot_bytes(dataset, batch_size), shared_memory_free()
        if free is not None and free < needed:
            warnings.warn(f"packer: /dev/shm has {free / 2**20:.0f} MiB free and the loader keeps about "
                          f"{needed / 2**20:.0f} MiB of batches there, and stops with an error when it is full: "
                          "give the container more (docker run --shm-size=2g), or pass num_workers=0",
                          stacklevel=3)
        ctx = start_context(context)
        seed = int(torch.empty((), dtype=torch.int64).random_().item()) if seed is None else seed
        self.conns: list = []
        self.processes: list = []
        # registered first: workers started before a later one fails to start are stopped too
        self._finalizer = weakref.finalize(self, _stop, self.conns, self.processes, os.getpid())
        forked = ctx.get_start_method() == "fork"
        self.mapped = ctx.RawArray("q", workers)  # per worker: the sequence number of the batch it has mapped
        for worker_id in range(workers):
            parent, child = ctx.Pipe()
            self.conns.append(parent)
            not_mine = [c.fileno() for c in self.conns] + [p.sentinel for p in self.processes] if forked else []
            process = ctx.Process(target=_work, args=(dataset, child, worker_id, seed, not_mine, self.mapped),
                                  daemon=True, name=f"packer-worker-{worker_id}")
            process.start()
            child.close()
            self.processes.append(process)
        self.in_flight = [0] * workers  # batches sent to each worker and not answered
        self.has_slot: list[set[int]] = [set() for _ in range(workers)]
        # key -> worker, slot, the slot's arrays, rows
        self.pending: dict[tuple[int, int], tuple[int, int, tuple[np.ndarray, ...], int]] = {}
        self.done: dict[tuple[int, int], tuple[Any, BaseException | None]] = {}
        self.passes = itertools.count()
        self.current = -1  # the pass being iterated
        self.sequence = itertools.count(1)  # every batch sent, across passes
        self.queued: list[collections.deque] = [collections.deque() for _ in range(workers)]  # (sequence, key)
        self.sent = 0  # batches of the current pass sent
        self.lock = threading.Lock()  # queued and sent, read by the fetch-ahead thread

    def close(self) -> None:
        """Stop the workers (also done when the pool is garbage-collected, and at exit)."""
        self._finalizer()

    def iterate(self, batches: Iterator[list[int]]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The ``(images, labels)`` batches for these index lists, in order: NCHW views of shared memory (or
        pinned copies) and int64 labels. The pass starts now (:meth:`mapped_batches` counts its batches), its
        batches when iterated."""
        with self.lock:
            pass_id = self.current = next(self.passes)
            self.sent = 0
        self.done.clear()  # an abandoned pass's batches: their slots are free again
        return self._iterate(pass_id, batches)

    def mapped_batches(self) -> int:
        """How many of the current pass's first batches no longer need their blocks in the cache: each is
        decoded, or its worker has mapped every block it reads (a dataset read a block at a time; for any other
        dataset, only those decoded count)."""
        with self.lock:
            frontier = self.sent
            for worker, queued in enumerate(self.queued):
                for sequence, (pass_id, batch) in queued:
                    if pass_id == self.current and sequence > self.mapped[worker]:
                        frontier = min(frontier, batch)
                        break
            return frontier

    def _iterate(self, pass_id: int, batches: Iterator[list[int]]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        sent = received = 0
        exhausted = False
        while True:
            while not exhausted and sent - received < self.depth:
                indices = next(batches, None)
                if indices is None:
                    exhausted = True
                else:
                    self._send((pass_id, sent), list(indices))
                    sent += 1
            if received == sent:
                return
            key = (pass_id, received)
            while key not in self.done:
                if self.current != pass_id:
                    raise RuntimeError("this loader iterator was replaced by a newer iter(loader)")
                self._receive()
            labels, error = self.done.pop(key)
            received += 1
            if error is not None:
                raise error
            yield labels

    def _layout(self, indices: list[int]) -> Layout:
        """The slot layout of a batch: its epoch's (a resolution schedule changes the size between epochs, and
        the slots with it, without restarting the workers)."""
        epoch = getattr(indices[0], "epoch", None) if indices else None
        if epoch is None or epoch == self._layouts[0]:
            return self._layouts[1]
        layout = self.dataset.batch_layout(epoch)
        if layout is None:
            raise PackerError(f"{self.where}: epoch {epoch}'s images have no one shape; the worker pool needs one")
        self._layouts = (epoch, tuple((tuple(shape), dtype) for _, shape, dtype in layout))
        return self._layouts[1]

    def _send(self, key: tuple[int, int], indices: list[int]) -> None:
        worker = min(range(len(self.conns)), key=self.in_flight.__getitem__)
        slot_id, array, dropped = self.slots.take(len(indices), self._layout(indices))
        for forgotten in dropped:
            for w, known in enumerate(self.has_slot):
                if forgotten in known:
                    known.discard(forgotten)
                    self.conns[w].send(("forget", forgotten))
        shared = None if slot_id in self.has_slot[worker] else self.slots.shared(slot_id)
        self.has_slot[worker].add(slot_id)
        sequence = next(self.sequence)
        with self.lock:
            self.queued[worker].append((sequence, key))
            if key[0] == self.current:
                self.sent = max(self.sent, key[1] + 1)
        try:
            self.conns[worker].send(("batch", key, slot_id, shared, indices, sequence))
        except OSError:  # its end of the pipe closed: the worker is gone
            self._ended(worker)
        self.in_flight[worker] += 1
        self.pending[key] = (worker, slot_id, array, len(indices))

    def _receive(self) -> None:
        sentinels = {p.sentinel: w for w, p in enumerate(self.processes)}
        ready = multiprocessing.connection.wait([*self.conns, *sentinels], self.timeout)
        if not ready:
            told = self._tell_stacks()
            raise PackerError(f"no batch from the loader's {len(self.processes)} worker processes in "
                              f"{self.timeout:g} s (timeout=); a worker may be stuck reading {self.where}"
                              f"{' (each worker wrote where it is to stderr)' if told else ''}")
        for worker in [self.conns.index(c) for c in ready if c in self.conns]:
            conn = self.conns[worker]
            try:
                key, labels, error = conn.recv()
            except (EOFError, OSError):
                continue  # the process's sentinel reports it
            self.in_flight[worker] -= 1
            with self.lock:
                self.queued[worker] = collections.deque(q for q in self.queued[worker] if q[1] != key)
            _, _, array, rows = self.pending.pop(key)
            if key[0] != self.current:
                continue  # an abandoned pass's batch: its slot is free again
            self.done[key] = (None, error) if error is not None else (self._batch(array, rows, labels), None)
        for w in [sentinels[r] for r in ready if r in sentinels]:  # a worker ended: only close() ends one
            self._ended(w)

    def _tell_stacks(self) -> bool:
        """Have each worker write every thread's stack to stderr (:func:`faulthandler.register` in :func:`_work`,
        which runs even in a worker stuck inside C code), for the message of a loader that timed out."""
        if STACKS_SIGNAL is None:
            return False
        told = False
        for process in self.processes:
            with contextlib.suppress(OSError, TypeError):  # gone already, or never started (no pid)
                os.kill(process.pid, STACKS_SIGNAL)
                told = True
        if told:
            time.sleep(0.5)  # the dumps are written by the workers' own signal handlers
        return told

    def _ended(self, worker: int) -> None:
        """Raise the one-line error for a worker process that ended."""
        process = self.processes[worker]
        process.join(1)  # its exit code
        why = ("/dev/shm is full: give the container more (docker run --shm-size=2g), or pass num_workers=0"
               if process.exitcode == -signal.SIGBUS else
               "out of memory, or killed? make the loader again, or pass num_workers=0")
        raise PackerError(f"loader worker {worker} (pid {process.pid}) exited with code {process.exitcode} while "
                          f"reading {self.where}: {why}")

    def _batch(self, arrays: tuple[np.ndarray, ...], rows: int, result: Any) -> Any:
        """The batch a worker's ``result`` and the slot's ``arrays`` make (:meth:`PackedDataset.slot_batch`)."""
        tensors = []
        for array in arrays:
            tensor = torch.from_numpy(array[:rows])
            if self.copy_out:
                copy = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self.pin_memory)
                tensor = copy.copy_(tensor)
            tensors.append(tensor)
        return self.dataset.slot_batch(tensors, result)
