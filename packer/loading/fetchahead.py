"""Fetch ahead, release behind, for a dataset read a block at a time (a URL larger than the local cache).

While a loader's pass runs, a thread of the main process knows this rank's coming blocks (from the pass's
sample order, the same positions the batches come from) and keeps the next blocks that batches still need
fetched and held (pinned in the cache), as many as fit in ``ahead`` of the largest blocks' bytes (a file's
last block is often short: a WebDataset shard's tail), which the block size leaves room for: a batch needs its
blocks until the caller has received it, or only until its worker has mapped them (packer's worker pool:
:meth:`~packer.loading.workers.WorkerPool.mapped_batches`; torch's DataLoader workers: :class:`WorkerMaps`), and each
block goes once no batch needs it. Once every block of the pass is fetched or held, it fetches the blocks of the
next pass (``then``: the next epoch, as the sampler will make it from ``(seed, epoch)`` unless told otherwise), in
the order that pass reads them, as far as the same bytes allow, so that the next epoch starts on blocks already
fetched (its thread holds them first). It does not hold those: a block this pass's decoders (or another reader of
the cache) still need may take their room, and a pin that lasted to the pass's end could keep that block out for
good. Blocks are fetched several at once, in the
order they will be read, so that each request's latency overlaps the others' and the decoding, on threads the
process keeps for every pass: ``FETCHERS`` at first, then as many as a fetch's time at the rate the batches use
blocks needs (:class:`_Pace`), up to what the bytes held allow.
Correctness never depends on it: a decoder that needs a block not yet there fetches it itself (the cache makes
one process fetch, the others wait). When the cache has no room the thread waits. Once a reader of the cache (a
decoder of any process) has waited for room for ``STUCK_AFTER`` seconds (room normally comes within a batch or two,
as batches go by), the thread lets go of every block it holds for the pass and fetches none until that reader has
its room: readers sharing a small cache each hold up to most of it ahead, and with those pins kept, each could
wait for good on a block none had room for. The thread stops with the pass, when the caller drops the iterator,
or when the loader starts another pass.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import multiprocessing
import multiprocessing.context
import os
import queue
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

POLL = 0.01  # seconds between looks at the batches received
# seconds between looks at the first batch that still needs its blocks, while the bytes held are what keeps the
# next fetch from starting: a batch mapped frees its blocks' bytes, and the fetch that takes them is a request's
# latency ahead of the decoder that needs it only if it starts at once, not up to a POLL later
FRONTIER_POLL = 0.002
# seconds between looks for a reader stuck waiting for room (a scan of the cache's waiting/ folder each): the
# thread looks every POLL for the batches, but a reader is stuck only after STUCK_AFTER seconds, far longer
STUCK_POLL = 0.1
FETCHERS = 8  # blocks fetched at once: each request's latency overlaps the others'
_RUNNING: weakref.WeakSet = weakref.WeakSet()


class _ForkGate:
    """Fetches run at once; a thread that forks (a DataLoader starting its workers) waits until none runs and
    holds new ones off until the fork is done: a child is never forked in the middle of a fetch, holding locks
    it would wait on forever."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._fetching = 0

    @contextlib.contextmanager
    def fetching(self) -> Iterator[None]:
        with self._cond:
            self._fetching += 1
        try:
            yield
        finally:
            with self._cond:
                self._fetching -= 1
                self._cond.notify_all()

    def before_fork(self) -> None:
        self._cond.acquire()
        while self._fetching:
            self._cond.wait()

    def after_fork(self) -> None:
        self._cond.release()


_FORK_GATE = _ForkGate()
os.register_at_fork(before=_FORK_GATE.before_fork, after_in_parent=_FORK_GATE.after_fork,
                    after_in_child=_FORK_GATE.after_fork)


@atexit.register
def _stop_all() -> None:
    """At exit, stop every fetch-ahead thread (a daemon thread inside a fetch as the interpreter finalizes can
    abort the process)."""
    for fetching in list(_RUNNING):
        fetching.stop()


_SAID: set[str] = set()


def say_once(line: str) -> None:
    """Print ``line`` on stderr, once per process."""
    if line not in _SAID:
        _SAID.add(line)
        print(line, file=sys.stderr)


def blocked_reader(dataset: Any) -> Any | None:
    """The reader of a dataset read a block at a time (it has ``hold_block``), else None."""
    reader = getattr(dataset, "reader", None)
    return reader if callable(getattr(reader, "hold_block", None)) else None


def cache_short_of(reader: Any, batch_size: int, batches: int, window: int, ahead: int | None = None) -> str | None:
    """A one-line notice when what the fetch-ahead may hold (``ahead``, default ``reader.fetch_ahead``, of its
    largest blocks: a share of ``cache_limit``) is fewer samples than a loader's ``batches`` batches in flight
    (each decoder's prefetched batches and the next one) and the rest of the ``window`` of blocks the next of
    them may begin in (a batch needs its blocks whole; all of a window's blocks but one): the decoders would
    outrun it and wait on fetches of their own, a request's latency each. None where it holds them, and for a
    local folder (no latency to hide). Both terms grow with the limit (the blocks are cut from it), so the limit
    that holds them follows from this one."""
    sizes = np.asarray(reader.block_bytes(), dtype=np.int64)
    if reader.budget != "cache_limit" or not len(reader) or not sizes.sum():
        return None
    per_block = int(sizes.max()) * len(reader) / int(sizes.sum())  # samples of the mean size in the largest block
    ahead = reader.fetch_ahead if ahead is None else ahead
    held, flight, rest = int(ahead * per_block), batch_size * batches, int((window - 1) * per_block)
    if held >= flight + rest:
        return None
    need = f"about {reader.limit * flight / (held - rest) / 1e6:.3g} MB" if reader.limit and held > rest else ""
    return (f"packer: {reader.where}: cache_limit holds about {held:,} samples fetched ahead, fewer than the "
            f"{flight + rest:,} this loader needs there ({flight:,} in flight: {batches} batches of {batch_size}; "
            f"{rest:,} more for the rest of a window of {window} blocks): its decoders will wait on fetches; raise "
            f"cache_limit{' to ' + need if need else ''}, or lower batch_size, num_workers or the prefetch")


class WorkerMaps:
    """What the fetch-ahead knows of torch's DataLoader workers reading a dataset a block at a time (packer's
    pool has its own, :meth:`~packer.loading.workers.WorkerPool.mapped_batches`): before it decodes a batch, a worker
    maps every block the batch reads (:meth:`note`) and sets its slot, in memory shared with the main process,
    to the batch's first sample index; from then on the batch no longer needs its blocks in the cache. Without
    it the fetch-ahead held a batch's blocks until the caller received it, and in a cache near its bound a block
    a worker had fetched itself could be evicted before the fetch-ahead reached it, and fetched again.

    Args:
        workers: the DataLoader's ``num_workers``.
    """

    def __init__(self, workers: int):
        self.slots = multiprocessing.RawArray("q", [-1] * workers)

    @classmethod
    def of(cls, reader: Any | None, workers: int) -> WorkerMaps | None:
        """For ``workers`` of torch's reading ``reader`` (a :func:`blocked_reader`, or None): a URL's, or a local
        folder's within ``page_budget`` (whose hold returns once its block is read, so a release however soon
        after drops all of it)."""
        return cls(workers) if reader is not None and workers > 0 else None

    def __getstate__(self) -> dict:
        # shared memory travels to a worker as it is started (spawn, forkserver), never in another pickle
        spawning = multiprocessing.context.get_spawning_popen() is not None
        return {"slots": self.slots if spawning else None}

    def note(self, reader: Any, indices: list[int], worker: int) -> None:
        """In DataLoader worker ``worker``: map the blocks of the batch ``indices`` and say so."""
        if self.slots is not None and worker < len(self.slots) and len(indices):
            reader.map_blocks(indices)
            self.slots[worker] = int(indices[0])

    def counter(self, indices: list[int], batch_size: int) -> Callable[[], int]:
        """For the pass ``indices`` (its batches of ``batch_size``, in order): a call giving how many of its first
        batches no longer need their blocks. Each worker takes its batches in the order they were sent, and they
        are sent in order, so every batch before the least of the workers' latest is mapped too; a worker with
        none yet this pass keeps the count at 0 (the batches received then decide). The slots are cleared here,
        before the pass's batches are sent."""
        slots = self.slots
        slots[:] = [-1] * len(slots)
        batch_of: dict[int, int] = {}  # a batch's first sample -> its number in the pass, made on first use

        def mapped() -> int:
            if not batch_of:
                batch_of.update((int(first), number) for number, first in enumerate(indices[::batch_size]))
            return min(batch_of.get(int(first), -1) for first in slots[:]) + 1

        return mapped


def block_plan(blocks: np.ndarray, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """From the block of each of a rank's samples in order: the blocks in the order they are first read, and
    the last batch that reads each (aligned with that order)."""
    if len(blocks) == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    batch = np.arange(len(blocks), dtype=np.int64) // batch_size
    unique, first = np.unique(blocks, return_index=True)
    last = np.full(len(unique), -1, np.int64)
    np.maximum.at(last, np.searchsorted(unique, blocks), batch)
    by_first = np.argsort(first, kind="stable")
    return unique[by_first], last[by_first]


class FetchAhead:
    """The thread that keeps the next blocks that batches still need fetched (``ahead`` of the largest blocks'
    bytes), and releases each once none does (``progress.received``, or ``mapped()``), for one pass
    (``indices``: this rank's samples, in order).

    Args:
        reader: the blocked reader (``block_of``, ``block_bytes``, ``hold_block``, ``reader_stuck``).
        indices: the pass's sample indices on this rank, in order.
        batch_size: samples per batch.
        progress: the pass's :class:`~packer.state.Progress` (batches received so far).
        owner: the iterator the caller holds: when it is garbage-collected, the thread stops.
        ahead: how many of the largest blocks' bytes to hold at most.
        mapped: the first batches that no longer need their blocks in the cache (received, or their decoder has
            mapped every block they read: :meth:`packer.loading.workers.WorkerPool.mapped_batches`,
            :meth:`WorkerMaps.counter`; default: those received).
        then: the next pass's sample indices, in order (called on the thread, once this pass's blocks are all
            fetched or held); None: nothing beyond this pass.
    """

    def __init__(self, reader: Any, indices: list[int], batch_size: int, progress: Any, owner: Any, ahead: int,
                 mapped: Callable[[], int] | None = None, then: Callable[[], list[int]] | None = None):
        self.order, self.last = block_plan(reader.block_of(indices), batch_size)
        sizes = np.asarray(reader.block_bytes(), dtype=np.int64)
        budget = max(0, ahead) * int(sizes.max(initial=0))
        self.stop_event = threading.Event()
        self.fetchers = _Fetchers(reader.hold_block, max(1, ahead), self.stop_event)
        self.thread = threading.Thread(target=self._run, daemon=True, name="packer-fetch-ahead",
                                       args=(self.fetchers, self.order, self.last, progress,
                                             mapped or (lambda: progress.received), weakref.ref(owner),
                                             (sizes, budget), self.stop_event, _next_blocks(reader, then),
                                             _at_most_every(STUCK_POLL, reader.reader_stuck)))
        _RUNNING.add(self)
        self.thread.start()

    def stop(self) -> None:
        """Stop the thread and release what it holds (waits for the fetches in progress)."""
        self.stop_event.set()
        self.fetchers.wake()
        if self.thread is not threading.current_thread():
            self.thread.join()

    @staticmethod
    def _run(fetchers: _Fetchers, order: np.ndarray, last: np.ndarray, progress: Any, mapped: Callable[[], int],
             owner: weakref.ref, limits: tuple[np.ndarray, int], stop: threading.Event,
             then: Callable[[], np.ndarray] | None, reader_stuck: Callable[[], bool]) -> None:
        sizes, budget = limits  # each block's bytes; the bytes held and fetched at most
        held: dict[int, Callable[[], None]] = {}  # position in ``order`` -> its release (a no-op: the next pass's)
        pace = _Pace(fetchers.count, fetchers.most)
        this_pass = len(order)  # positions from here on are the next pass's
        passed = 0  # no batch needs the blocks of ``order`` before this one
        try:
            while not stop.is_set() and owner() is not None and not progress.finished:
                room = True
                for k, release in fetchers.done(pace):
                    if release is None:  # no room in the cache now: try again later
                        room = False
                    elif k >= this_pass:  # fetched, left evictable; its bytes still count, so it is not fetched again
                        release()
                        held[k] = _fetched
                    else:
                        held[k] = release
                frontier = _frontier(progress, mapped)
                for k in [k for k in held if last[k] < frontier]:  # no batch needs it
                    held.pop(k)()
                while passed < len(order) and last[passed] < frontier:
                    passed += 1
                if reader_stuck():  # a reader of the cache has waited for room a while: what is held makes way
                    for k in [k for k in held if k < this_pass]:
                        held.pop(k)()
                    stop.wait(POLL)  # and nothing is fetched ahead until it has its room
                    continue
                fetchers.count = pace.target(passed)
                k = passed
                pinned = int(sum(sizes[order[j]] for j in (*held, *fetchers.running)))
                full = False  # the next block waits for bytes held to be let go
                while room and fetchers.idle() and k < len(order):
                    if last[k] >= frontier and k not in held and not fetchers.has(k):
                        if pinned + sizes[order[k]] > budget:
                            full = True
                            break
                        pinned += int(sizes[order[k]])
                        fetchers.start(k, int(order[k]))
                    k += 1
                if then is not None and k >= len(order):  # the pass's blocks are all fetched or held
                    try:
                        following = then()
                    except Exception:  # noqa: BLE001 - the next pass fetches its own blocks; this one goes on
                        following = np.zeros(0, np.int64)
                    order = np.concatenate([order, following])
                    last = np.concatenate([last, np.full(len(following), np.iinfo(np.int64).max)])  # to the end
                    then = None
                if not room:
                    stop.wait(POLL)
                elif full:  # woken by a fetch done, or by a batch that no longer needs its blocks
                    fetchers.wait(POLL, _moved_past(frontier, progress, mapped))
                else:
                    fetchers.wait(POLL)  # woken by a fetch done: the next starts at once
        except Exception:  # noqa: BLE001 - fetching ahead is an optimisation: the reader fetches what it needs
            pass
        finally:
            # no pin outlives the pass (another loader on the same cache, a validation pass, needs the room)
            stop.set()
            for _, release in fetchers.finish():
                if release is not None:
                    release()
            for release in held.values():
                release()


def _frontier(progress: Any, mapped: Callable[[], int]) -> int:
    """The first batch of the pass that still needs its blocks: neither received nor mapped by its decoder."""
    return max(progress.received, mapped())


def _moved_past(frontier: int, progress: Any, mapped: Callable[[], int]) -> Callable[[], bool]:
    """A call saying whether the frontier (:func:`_frontier`) has moved past ``frontier``."""
    return lambda: _frontier(progress, mapped) > frontier


def _at_most_every(seconds: float, ask: Callable[[], bool]) -> Callable[[], bool]:
    """``ask``, called at most once every ``seconds``: in between, its last answer."""
    last = [-math.inf, False]  # when it was last asked, and what it said

    def answer() -> bool:
        now = time.monotonic()
        if now - last[0] >= seconds:
            last[:] = [now, ask()]
        return bool(last[1])

    return answer


def _fetched() -> None:
    """The release of a next pass's block, which the fetch-ahead does not hold."""


class _Pace:
    """How many fetches to keep in flight: enough to cover a fetch's time at the rate the pass's batches use
    up blocks (Little's law: in flight = time a fetch takes x blocks used a second, and one more), never fewer
    than ``start`` (a pass begins needing a window of blocks at once, before any rate shows) and at most
    ``most`` (the blocks the fetch-ahead may hold: what the cache bound allows). Where fetches are the
    bottleneck the rate follows them and the count grows by one at a time to ``most``; where the decoders
    are, it settles at what hides the latency."""

    def __init__(self, start: int, most: int):
        self.start, self.most = start, most
        self.seconds: float | None = None  # a fetch's time, averaged
        self.began = time.monotonic()

    def fetched(self, seconds: float) -> None:
        self.seconds = seconds if self.seconds is None else 0.8 * self.seconds + 0.2 * seconds

    def target(self, passed: int) -> int:
        elapsed = time.monotonic() - self.began
        if self.seconds is None or passed < 4 or elapsed <= 0:
            return self.start
        return min(self.most, max(self.start, math.ceil(self.seconds * passed / elapsed) + 1))


def _next_blocks(reader: Any, then: Callable[[], list[int]] | None) -> Callable[[], np.ndarray] | None:
    """The blocks of the next pass's samples, in the order they are first read, as a call for the thread."""
    if then is None:
        return None
    return lambda: block_plan(reader.block_of(then()), 1)[0]


class _FetchThreads:
    """This process's fetch threads, kept across passes (daemon threads, started as passes need them): a pass
    that started threads of its own, on cores the decoders keep busy, began its first fetches after its first
    batches had been decoded. A forked child starts its own (the parent's are not in it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = -1
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = 0
        self._wanted = 0  # threads the passes running now asked for

    def want(self, count: int) -> queue.SimpleQueue:
        """Make sure ``count`` more threads than the running passes asked for serve this process's jobs
        (``(fetchers, k, block)``), and return their queue; :meth:`done_with` gives the ``count`` back."""
        with self._lock:
            if self._pid != os.getpid():
                self._pid, self._jobs, self._threads, self._wanted = os.getpid(), queue.SimpleQueue(), 0, 0
            self._wanted += count
            while self._threads < self._wanted:
                threading.Thread(target=self._work, args=(self._jobs,), daemon=True, name="packer-fetch-block").start()
                self._threads += 1
            return self._jobs

    def done_with(self, count: int) -> None:
        with self._lock:
            if self._pid == os.getpid():
                self._wanted -= count

    @staticmethod
    def _work(jobs: queue.SimpleQueue) -> None:
        while True:
            fetchers, k, block = jobs.get()
            fetchers.run(k, block)


_FETCH_THREADS = _FetchThreads()


class _Fetchers:
    """One :class:`FetchAhead` pass's fetches: up to ``count`` blocks at once (set as the pass goes, at most
    ``most``), on this process's fetch threads."""

    def __init__(self, hold: Callable[..., Callable[[], None] | None], most: int, stop: threading.Event):
        self.hold, self.stop, self.most = hold, stop, max(1, most)
        self.count = min(FETCHERS, self.most)
        self.jobs = _FETCH_THREADS.want(self.most)
        # (position, release or None, seconds), or None: wake()
        self.results: queue.SimpleQueue = queue.SimpleQueue()
        self.running: set[int] = set()  # positions being fetched, or fetched and not yet taken by done()
        self._ready: list[tuple[int, Callable[[], None] | None, float]] = []  # results wait() took

    def run(self, k: int, block: int) -> None:
        """Fetch and hold block ``block`` (position ``k``), on a fetch thread: its release, or None, to done()."""
        release, began = None, time.monotonic()
        if not self.stop.is_set():
            try:
                with _FORK_GATE.fetching():
                    release = self.hold(block, wait=False)
            except Exception:  # noqa: BLE001 - the reader fetches it itself when it needs it
                release = None
        self.results.put((k, release, time.monotonic() - began))

    def start(self, k: int, block: int) -> None:
        self.running.add(k)
        self.jobs.put((self, k, block))

    def has(self, k: int) -> bool:
        return k in self.running

    def idle(self) -> bool:
        return len(self.running) < self.count

    def wait(self, timeout: float, moved: Callable[[], bool] | None = None) -> None:
        """Until a fetch finishes, :meth:`wake` is called, ``moved()`` (asked every ``FRONTIER_POLL`` seconds)
        is true or ``timeout`` seconds pass."""
        deadline = time.monotonic() + timeout
        while True:
            left = max(0.0, deadline - time.monotonic())
            try:
                result = self.results.get(timeout=left if moved is None else min(left, FRONTIER_POLL))
            except queue.Empty:
                if moved is None or left <= FRONTIER_POLL or moved():
                    return
                continue
            if result is not None:
                self._ready.append(result)
            return

    def wake(self) -> None:
        """End a :meth:`wait` now."""
        self.results.put(None)

    def done(self, pace: _Pace | None = None) -> list[tuple[int, Callable[[], None] | None]]:
        """The fetches finished since the last call: (position, release or None when there was no room); each
        held block's time goes to ``pace``."""
        finished, self._ready = self._ready, []
        while True:
            try:
                result = self.results.get_nowait()
            except queue.Empty:
                break
            if result is not None:
                finished.append(result)
        self.running.difference_update(k for k, _, _ in finished)
        if pace is not None:
            for _, release, seconds in finished:
                if release is not None:
                    pace.fetched(seconds)
        return [(k, release) for k, release, _ in finished]

    def finish(self) -> list[tuple[int, Callable[[], None] | None]]:
        """Wait for the fetches started (those not begun yet give None once ``stop`` is set) and return what
        they gave; the threads go back to the process's."""
        finished = self.done()
        while self.running:
            result = self.results.get()
            if result is not None:
                self.running.discard(result[0])
                finished.append(result[:2])
        _FETCH_THREADS.done_with(self.most)
        return finished
