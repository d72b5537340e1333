"""Converting samples into a folder: worker processes read, transform and encode them, the format's writer writes
them in order, and the journal records each durable point.

Worker processes read, decode, transform and encode images in fixed chunks; the main process writes them in
order, so the output (samples, order, labels, bytes) does not depend on the number of workers. At most a few
chunks per worker are in flight, so memory stays flat however large the dataset. :func:`packer.pack` runs it in
one process; :mod:`packer.packing.ranks` runs it once per rank, on one part of the plan's order.
"""

from __future__ import annotations

import bisect
import contextlib
import signal
import sys
import threading
from array import array
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from ..errors import ImageError, NothingPackedError, PackerError, warn
from ..images.transforms import TransformSpec
from ..sources.base import SampleReader, Source
from ..system import close_fds, die_with_parent, process_context, usable_cores
from .journal import save, write_failed
from .plan import Plan

CHUNK = 16


def _convert_items(reader: SampleReader, items: list[tuple[int, int]], spec: TransformSpec) -> list[tuple]:
    """Convert ``(position, source index)`` items; returns ``(position, relpath, label, Encoded or error,
    extras)``."""
    out: list[tuple] = []
    for position, index in items:
        try:
            relpath, label, encoded, extras = reader.convert(index, spec)
            out.append((position, relpath, label, encoded, extras))
        # errors travel as plain tuples: anything the pool cannot unpickle would hang it instead of failing
        except ImageError as exc:
            out.append((position, exc.path, -1, ("skip", exc.reason), ()))
        except Exception as exc:  # a bug, not a bad image: the conversion stops and names the file
            out.append((position, reader.name(index), -1, ("fail", f"{type(exc).__name__}: {exc}"), ()))
    return out


_READER: SampleReader | None = None  # the source's reader, in each worker process


def _init_worker(reader: SampleReader, forked_from: list[ProcessPoolExecutor]) -> None:
    global _READER
    _ignore_sigint()
    # A worker left blocked on the pool's queue outlives a killed converter (seen after a full disk, with Python
    # 3.11's Pool) and keeps its stdout and stderr open, so whoever waits for the command's output waits forever:
    # it closes the converter's ends of the queues (so that it reads their end of file), and is killed with it.
    for pool in forked_from:
        close_fds(_parent_fds(pool))
    die_with_parent()
    _READER = reader  # given once per worker (inherited through fork): chunks then carry only indices


def _parent_fds(pool: ProcessPoolExecutor) -> list[int]:
    """The descriptors of ``pool`` that only its owner uses: the writing end of the task queue and the reading
    end of the results, and the pipes of the workers started before this one. A forked worker closes its copies
    (read through the executor's attributes; none where a Python version names them otherwise)."""
    fds = []
    for queue, end in ((getattr(pool, "_call_queue", None), "_writer"), (getattr(pool, "_result_queue", None),
                                                                         "_reader")):
        conn = getattr(queue, end, None)
        if conn is not None and not conn.closed:
            fds.append(conn.fileno())
    wakeup = getattr(getattr(pool, "_executor_manager_thread_wakeup", None), "_reader", None)
    if wakeup is not None and not wakeup.closed:
        fds.append(wakeup.fileno())
    for process in list(getattr(pool, "_processes", {}).values()):
        fds.append(process.sentinel)
    return fds


def _convert_chunk(args: tuple[list[tuple[int, int]], TransformSpec]) -> list[tuple]:
    items, spec = args
    assert _READER is not None  # set in each worker process before it takes a chunk
    return _convert_items(_READER, items, spec)


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process handles Ctrl-C and ends the pool


@contextlib.contextmanager
def _ctrl_c_between_steps() -> Iterator[Callable[[], None]]:
    """Ctrl-C noted while the pool is fed and read, and raised where the caller checks (the call it yields): a
    KeyboardInterrupt raised inside the executor's ``submit`` can leave its work queue's lock held (CPython may
    raise it between taking a lock and the ``with`` that releases it), and the shutdown that follows then waits
    on that lock forever. Only in the main thread with Python's own handler in place; elsewhere Ctrl-C is left
    as it is."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield lambda: None
        return
    noted: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: noted.append(signum))

    def check() -> None:
        if noted:
            raise KeyboardInterrupt

    try:
        yield check
    finally:
        signal.signal(signal.SIGINT, previous)
    check()  # a Ctrl-C after the last check


@dataclass
class Converted:
    """What :func:`convert_samples` wrote."""

    count: int
    extras: dict[str, Any]  # what the writer adds to the manifest: files, shards
    skipped: list[dict]
    resumed: bool


def convert_samples(dest: Path, plan: Plan, indices: Sequence[int], journal: dict, resuming: bool, *,
                    allow_empty: bool = False, key_offset: int = 0, progress: bool | None = None,
                    desc: str | None = None, on_progress=None) -> Converted:
    """Convert source samples ``indices``, in that order, into ``dest``, recording progress in its journal.

    Args:
        dest: the prepared folder (DEST, or a rank's part folder).
        plan: the conversion's plan.
        indices: source indices, in output order.
        journal: the folder's journal (:func:`packer.packing.journal.resumable` or
        :func:`packer.packing.journal.start`).
        resuming: continue from the journal's last durable point.
        allow_empty: keep a conversion where every image was skipped (one rank's part).
        key_offset: number WebDataset keys from there (a rank's first output position).
        progress: show a progress bar (default: the plan's option).
        desc: the progress bar's label.
        on_progress: called with the samples written after each chunk (a rank's liveness).

    Returns:
        What was written: the count, the writer's files, and the skipped images.

    Raises:
        NothingPackedError: no image could be read (unless ``allow_empty``).
        PackerError: a write failed, a worker died, or an image failed with ``strict``.
    """
    writer_options = {"estimated_bytes": plan.estimate(indices), "shard_bytes": plan.options.shard_size,
                      "shard_samples": plan.options.shard_samples, "classes": plan.source.classes,
                      "key_offset": key_offset, "schema": plan.source.schema, "caption": plan.options.caption_column}
    writer = plan.writer_cls(dest, plan.spec, len(indices), writer_options)
    conversion = _Conversion(plan.source, dest, indices, plan.spec, writer, journal, plan.options.strict,
                             plan.options.progress if progress is None else progress, desc, on_progress)
    try:
        conversion.restore(resuming)
        conversion.run(plan.options.workers)
        if writer.count == 0 and not allow_empty:
            where = plan.source.root if plan.source.kind == "folder" else plan.record["source"]
            raise NothingPackedError(f"{where}: none of the {len(indices)} images could be read; nothing was "
                                     "packed")
        extras = writer.close()
        counts = conversion.class_counts()
        if counts is not None:
            extras["class_counts"] = counts
    except BaseException as exc:
        try:
            writer.abort()
        except OSError:
            pass  # a full disk fails the final flush too; the journal still marks the last durable point
        if isinstance(exc, OSError):  # from close(): finishing the data files
            raise write_failed(dest, exc) from None
        raise
    skipped = [{"path": e["path"], "error": e["error"]} for e in conversion.skipped]
    return Converted(writer.count, extras, skipped, conversion.resumed)


class _Conversion:
    """Runs the workers and the writer, and keeps the journal that makes the conversion resumable.

    The journal (``.packer-in-progress``) records, each time the writer makes its output durable, how many
    samples it holds, the source position to continue from, the images skipped so far, and how many of the
    durable samples each class has (the manifest's ``class_counts``: ``packer info`` answers from it)."""

    def __init__(self, source: Source, dest: Path, indices: Sequence[int], spec: TransformSpec, writer,
                 journal: dict, strict: bool, progress: bool, desc: str | None = None, on_progress=None):
        self.source, self.dest, self.indices, self.spec = source, dest, indices, spec
        self.writer, self.journal, self.strict, self.progress = writer, journal, strict, progress
        self.desc = desc or f"packing {writer.format}"
        self.on_progress = on_progress  # called with the samples written after each chunk (distributed liveness)
        self.skipped: list[dict] = []
        self.start = 0
        self.resumed = False
        # the samples not yet durable: their count after writing and source position, 16 bytes each (tuples of
        # ints were ~150 and, for a writer that is durable only at the end, held for every sample of the run)
        self.pending_counts, self.pending_positions = array("q"), array("q")
        self.pending_labels = array("q")
        self.classes = len(source.classes)
        # the durable samples per class; None where they are not known (a journal an earlier packer wrote)
        self.durable_counts: np.ndarray | None = np.zeros(self.classes, np.int64)

    def restore(self, resuming: bool) -> None:
        state = self.journal.get("writer")
        kept = self.writer.restore(state) if state is not None else 0
        self.resumed = resuming
        if kept == 0:
            if resuming:
                warn(f"{self.dest}: no finished part to keep ({self.writer.format} keeps "
                     f"{self.writer.RESUMES_FROM}); converting again from the first image")
            return
        self.start = self.journal["position"]
        self.skipped = list(self.journal["skipped"])
        kept_counts = self.journal.get("class_counts")
        self.durable_counts = (np.asarray(kept_counts, np.int64) if isinstance(kept_counts, list)
                               and len(kept_counts) == self.classes else None)
        print(f"packer: resuming {self.dest} after {kept} samples", file=sys.stderr)

    def _checkpoint(self, durable: int) -> None:
        done = bisect.bisect_right(self.pending_counts, durable)  # counts only grow
        if done == 0:
            return
        position = self.pending_positions[done - 1] + 1
        del self.pending_counts[:done], self.pending_positions[:done]
        self._count_labels(done)
        self.journal.update(position=position, writer=self.writer.state(),
                            skipped=[e for e in self.skipped if e["position"] < position],
                            class_counts=None if self.durable_counts is None else self.durable_counts.tolist())
        save(self.dest, self.journal)

    def _count_labels(self, done: int) -> None:
        """Add the first ``done`` pending samples' labels to the durable counts (-1, no class, is not counted)."""
        labels = np.frombuffer(self.pending_labels, np.int64)[:done].copy()
        del self.pending_labels[:done]
        if self.durable_counts is not None:
            counted = np.bincount(labels[labels >= 0], minlength=self.classes)
            self.durable_counts = self.durable_counts + counted if len(counted) == self.classes else None

    def class_counts(self) -> list[int] | None:
        """Every written sample per class, once the writer closed (all of them durable); None for a dataset
        without classes, or where the counts before a resume are not known."""
        self._count_labels(len(self.pending_labels))
        if not self.classes or self.durable_counts is None:
            return None
        return self.durable_counts.tolist()

    def consume(self, results: list[tuple]) -> None:
        for position, relpath, label, item, extras in results:
            if isinstance(item, tuple):
                kind, reason = item
                if kind == "fail":
                    raise PackerError(f"{self.source.where(relpath)}: unexpected error while converting ({reason}); "
                                      "please report it")
                if self.strict:
                    raise ImageError(self.source.where(relpath), reason)
                warn(f"skipped {self.source.where(relpath)}: {reason}")
                self.skipped.append({"path": relpath, "error": reason, "position": position})
                continue
            durable = self.writer.write(label, relpath, item, extras)
            self.pending_counts.append(self.writer.count)
            self.pending_positions.append(position)
            self.pending_labels.append(label)
            if durable is not None:
                self._checkpoint(durable)
        self.bar.update(len(results))
        if self.on_progress is not None:
            self.on_progress(self.writer.count)

    def run(self, workers: int | None) -> None:
        workers = usable_cores() if workers is None else max(1, workers)
        reader = self.source.reader()
        chunks = (list(enumerate(self.indices[i:i + CHUNK], start=i))  # made as submitted: memory stays flat
                  for i in range(self.start, len(self.indices), CHUNK))
        self.bar = tqdm(total=len(self.indices), initial=self.start, unit="img", disable=not self.progress,
                        file=sys.stderr, dynamic_ncols=True, desc=self.desc)
        try:
            if workers == 1:
                for chunk in chunks:
                    self.consume(_convert_items(reader, chunk, self.spec))
                return
            ctx = process_context()
            forked_from: list[ProcessPoolExecutor] = []  # the pool, in each forked worker's copy of memory
            pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                                       initargs=(reader, forked_from))
            if ctx.get_start_method() == "fork":
                forked_from.append(pool)  # before the first worker forks (at the first submit)
            try:
                pending: deque = deque()
                window = 4 * workers  # chunks in flight: bounds memory whatever the dataset size
                with _ctrl_c_between_steps() as check:
                    for chunk in chunks:
                        check()
                        pending.append(pool.submit(_convert_chunk, (chunk, self.spec)))
                        if len(pending) >= window:
                            self.consume(pending.popleft().result())
                    while pending:
                        check()
                        self.consume(pending.popleft().result())
            except BaseException:
                # Cancel what has not started and let each worker finish its chunk (a fraction of a second).
                # Killing workers instead can leave one dead in the middle of writing its result, and then
                # multiprocessing.Pool's terminate(), or the executor's exit hook, waits on that pipe forever.
                pool.shutdown(wait=True, cancel_futures=True)
                raise
            pool.shutdown()
        except BrokenProcessPool:
            raise PackerError(f"{self.dest}: a conversion worker process died (killed, out of memory?); run the same "
                              "command with --resume to continue, with fewer --workers if memory is short") from None
        except OSError as exc:
            raise write_failed(self.dest, exc) from None
        finally:
            self.bar.close()
