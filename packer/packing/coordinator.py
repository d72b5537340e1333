"""Who does what in a conversion: one process, or the ranks of a torchrun launch.

:class:`Coordinator` is the one process that does everything; :class:`Context` is one rank of several, with the
same interface, so that the conversion sequence (:mod:`packer.packing.driver`) is written once. A coordinator says who
leads (locks and prepares DEST, writes the manifest), which folder this process writes (DEST itself, or its part
``DEST/part-NNNNN``) and which output positions; it holds DEST's lock where it should be held (in rank 0, for
every rank), and its barriers make the others wait for rank 0's DEST and rank 0 for every part. It calls nothing
back: the driver calls it between its steps.

Ranks coordinate through the process group's key-value store (``init_process_group("gloo")`` when torchrun
started the process and no group exists yet):

- a rank that fails publishes its error, and every other rank stops with it at its next check (within a few
  seconds, whatever the launcher; torchrun also ends the other ranks as soon as one exits non-zero);
- a rank that shows no sign of life for ``PACKER_DIST_TIMEOUT`` seconds (default 1800) while others wait for it
  fails the run, so nothing waits forever. Ranks report progress every few seconds while converting.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import PackerError, SourceError, UsageError
from ..system import usable_cores
from .dest import PART
from .lock import OutputLock

TIMEOUT_ENV = "PACKER_DIST_TIMEOUT"
DEFAULT_TIMEOUT = 1800.0
ALIVE_EVERY = 2.0  # seconds between a rank's liveness updates (and its checks for other ranks' failures)
SCAN_EVERY = 5.0  # seconds between rank 0's checks of the ranks it waits for

_calls = 0  # pack() calls in this process: every rank makes the same calls, so keys match across ranks


class Coordinator:
    """One process that converts everything into DEST itself: rank 0 of a world of one. :class:`Context` is
    the same interface for one torchrun rank of several."""

    rank: int
    world: int
    local_world: int  # ranks on this node

    def __init__(self) -> None:
        self.rank, self.world, self.local_world = 0, 1, 1

    @property
    def leads(self) -> bool:
        """Whether this process locks and prepares DEST and writes the manifest (rank 0)."""
        return self.rank == 0

    @property
    def part(self) -> str | None:
        """The part folder in DEST that this process writes, or None: DEST itself."""
        return None

    def workers(self, given: int | None) -> int | None:
        """The conversion workers this process runs: ``given`` (None: every usable core); a rank shares its
        node's cores with the other ranks on it."""
        return given

    def record(self, record: dict[str, Any]) -> dict[str, Any]:
        """What the journal and the manifest record of the conversion (ranks add their number)."""
        return record

    def share(self, order: Sequence[int], sizes: np.ndarray) -> tuple[int, int]:
        """The output positions ``[start, stop)`` this process converts, of ``order`` (source indices in output
        order; ``sizes``: each source sample's bytes)."""
        return 0, len(order)

    def lock(self, dest: Path) -> AbstractContextManager[Any]:
        """DEST's lock, held by rank 0 for every rank (:class:`packer.packing.lock.OutputLock`)."""
        return OutputLock(dest) if self.leads else nullcontext()

    def agree(self, resuming: bool, record: dict[str, Any]) -> bool:
        """Whether the conversion resumes: rank 0 prepared DEST (or resumed it) and tells the others, who wait
        for it and take its answer.

        Raises:
            SourceError: this rank sees other source files than rank 0 (``record``'s fingerprint).
        """
        return resuming

    def wait_shares(self) -> None:
        """Once this process has converted its share: rank 0 waits for every rank's, the others for rank 0's
        manifest (then they read it)."""

    def announce(self) -> None:
        """Rank 0, after DEST's lock is released: tell the others the manifest is written."""

    def alive(self, count: int | None = None, force: bool = False) -> None:
        """Tell the other ranks this one is alive, and stop if one of them failed."""

    def publish_failure(self, exc: BaseException) -> None:
        """Tell the other ranks this one failed with ``exc``."""

    def close(self) -> None:
        """Leave the process group, where this coordinator started it."""


class PeerFailed(PackerError):
    """Another rank failed; this one stops with its message."""


@dataclass
class Context(Coordinator):
    """This rank's view of the distributed conversion, and the store the ranks talk through."""

    rank: int
    world: int
    local_world: int
    store: Any
    prefix: str
    timeout: float
    owns_group: bool
    _last_alive: float = 0.0

    # -- the conversion sequence's steps ----------------------------------------------------------------------------
    @property
    def part(self) -> str | None:
        return PART.format(self.rank)

    def workers(self, given: int | None) -> int | None:
        return given if given is not None else max(1, usable_cores() // self.local_world)

    def record(self, record: dict[str, Any]) -> dict[str, Any]:
        return {**record, "world_size": self.world}

    def share(self, order: Sequence[int], sizes: np.ndarray) -> tuple[int, int]:
        return partition(sizes[np.asarray(order, dtype=np.int64)], self.world)[self.rank]

    def agree(self, resuming: bool, record: dict[str, Any]) -> bool:
        if self.rank == 0:
            self.set("prep", json.dumps({"resuming": resuming, "fingerprint": record["fingerprint"]}))
            return resuming
        prep = json.loads(self.wait_key("prep", 0, "rank 0 to prepare the destination"))
        if prep["fingerprint"] != record["fingerprint"]:
            raise SourceError(f"{record['source']}: rank {self.rank} sees different source files than "
                              "rank 0 (files changed during the scan, or SRC differs between nodes); every rank "
                              "must see the same SRC")
        return prep["resuming"]

    def wait_shares(self) -> None:
        self.set(f"done/{self.rank}", "1")
        if self.rank != 0:
            self.wait_key("manifest", 0, "rank 0 to write the manifest")
            self.mark_exit()
            return
        self.wait_ranks("done", "every rank to finish its part")

    def announce(self) -> None:
        if self.rank == 0:
            self.set("manifest", "1")
            _wait_exits(self)

    # -- store helpers -------------------------------------------------------------------------------------------
    def _key(self, name: str) -> str:
        return self.prefix + name

    def set(self, name: str, value: str) -> None:
        self.store.set(self._key(name), value)

    def has(self, name: str) -> bool:
        return self.store.check([self._key(name)])

    def get(self, name: str) -> str:
        return self.store.get(self._key(name)).decode("utf-8")

    def _store_call(self, fn: Callable, what: str):
        try:
            return fn()
        except PackerError:
            raise
        except Exception as exc:  # the store is gone: the launcher or rank 0 ended
            raise PeerFailed(f"lost contact with the other ranks while {what} ({exc}); another rank probably "
                             "failed, see its error") from None

    # -- failures and liveness ------------------------------------------------------------------------------------
    def publish_failure(self, exc: BaseException) -> None:
        if isinstance(exc, PeerFailed):
            return
        if isinstance(exc, KeyboardInterrupt):
            code, message = 130, "interrupted"
        elif isinstance(exc, PackerError):
            code, message = exc.exit_code, str(exc)
        else:
            code, message = 1, f"{type(exc).__name__}: {exc}"
        try:
            self.set("failed", json.dumps({"rank": self.rank, "code": code, "message": message}))
        except Exception:  # noqa: BLE001 - the store may be gone already; the exit code still tells
            pass

    def check_failures(self) -> None:
        if not self.has("failed"):
            return
        failure = json.loads(self.get("failed"))
        error = PeerFailed(f"rank {failure['rank']} failed: {failure['message']}")
        error.exit_code = int(failure.get("code", 1))
        raise error

    def alive(self, count: int | None = None, force: bool = False) -> None:
        """Tell the others this rank is alive (at most every ALIVE_EVERY s), and stop if one of them failed."""
        now = time.monotonic()
        if not force and now - self._last_alive < ALIVE_EVERY:
            return
        self._last_alive = now

        def beat() -> None:
            self.set(f"alive/{self.rank}", f"{time.time():.3f} {count if count is not None else ''}")
            self.check_failures()

        self._store_call(beat, "converting")

    # -- waiting --------------------------------------------------------------------------------------------------
    def wait_key(self, name: str, owner: int, what: str) -> str:
        """Wait for ``name`` (set by rank ``owner``); fail if a rank fails or ``owner`` shows no life."""

        def poll() -> str:
            started = last_change = time.monotonic()
            last_seen = None
            delay = 0.02
            while True:
                if self.has(name):
                    return self.get(name)
                self.check_failures()
                now = time.monotonic()
                seen = self.get(f"alive/{owner}") if self.has(f"alive/{owner}") else None
                if seen != last_seen:
                    last_seen, last_change = seen, now
                if now - last_change > self.timeout:
                    raise PackerError(f"rank {owner} showed no sign of life for {now - last_change:.0f} s while rank "
                                      f"{self.rank} waited for {what} (waited {now - started:.0f} s in all); "
                                      f"raise {TIMEOUT_ENV} if it is only slow")
                self.alive(force=False)
                time.sleep(delay)
                delay = min(1.0, delay * 1.5)

        return self._store_call(poll, f"waiting for {what}")

    def wait_ranks(self, name: str, what: str) -> None:
        """Rank 0: wait until every rank has set ``name/<rank>``."""

        def poll() -> None:
            pending = set(range(self.world))
            last: dict[int, tuple[str | None, float]] = {r: (None, time.monotonic()) for r in pending}
            next_scan = 0.0
            delay = 0.02
            while True:
                pending = {r for r in pending if not self.has(f"{name}/{r}")}
                if not pending:
                    return
                now = time.monotonic()
                if now >= next_scan:  # liveness of the ranks still converting
                    for r in sorted(pending):
                        seen = self.get(f"alive/{r}") if self.has(f"alive/{r}") else None
                        if seen != last[r][0]:
                            last[r] = (seen, now)
                        elif now - last[r][1] > self.timeout:
                            raise PackerError(f"rank {r} showed no sign of life for {now - last[r][1]:.0f} s while "
                                              f"rank {self.rank} waited for {what}; raise {TIMEOUT_ENV} if it is "
                                              "only slow")
                    next_scan = now + SCAN_EVERY
                self.check_failures()
                self.alive(force=False)
                time.sleep(delay)
                delay = min(1.0, delay * 1.5)

        self._store_call(poll, f"waiting for {what}")

    def mark_exit(self) -> None:
        """Tell rank 0 this rank has read that the manifest is written (see :func:`_wait_exits`)."""
        self._store_call(lambda: self.set(f"exit/{self.rank}", "1"), "finishing")

    def close(self) -> None:
        if self.owns_group:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
            self.owns_group = False


def early_rank(distributed: bool | None = None) -> int:
    """This process's rank as far as it is known before any rendezvous: an initialised process group's, else
    torchrun's ``RANK``, else 0 (also with ``distributed=False``)."""
    if distributed is False:
        return 0
    if "torch.distributed" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0") or 0)
    except ValueError:
        return 0


def detect(distributed: bool | None = None) -> Coordinator:
    """This process's coordinator: a :class:`Context` when it is one rank of several (torchrun's ``WORLD_SIZE``
    > 1, or an initialised process group of more than one rank), initialising a gloo group if none exists; else
    the one-process :class:`Coordinator`. ``distributed=False`` always converts in this process only; ``True``
    requires a distributed launch."""
    if distributed is False:
        return Coordinator()
    try:
        env_world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    except ValueError:
        env_world = 1
    if env_world <= 1 and "torch.distributed" not in sys.modules and not distributed:
        return Coordinator()  # no launcher and no process group (that needs torch.distributed imported): skip torch
    import torch.distributed as dist

    initialised = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if initialised else env_world
    if world <= 1:
        if distributed:
            raise UsageError("distributed=True needs a distributed launch: run under torchrun with more than one "
                             "process, or initialise a process group first")
        return Coordinator()
    if not dist.is_available():
        raise PackerError("WORLD_SIZE > 1 but this PyTorch has no torch.distributed; convert in one process")
    try:
        timeout = float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT))
    except ValueError:
        raise UsageError(f"{TIMEOUT_ENV} must be a number of seconds") from None
    owns = False
    if not initialised:
        missing = [v for v in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v)]
        if missing:
            raise PackerError(f"WORLD_SIZE is {env_world} but {', '.join(missing)} not set; launch with torchrun "
                              "(or set RANK, MASTER_ADDR and MASTER_PORT on every process)")
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
        owns = True
    global _calls
    _calls += 1
    store = dist.distributed_c10d._get_default_store()
    try:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or 1
    except ValueError:
        local_world = 1
    return Context(rank=dist.get_rank(), world=dist.get_world_size(), local_world=local_world, store=store,
                   prefix=f"packer/pack{_calls}/", timeout=timeout, owns_group=owns)


def partition(sizes: np.ndarray, world: int) -> list[tuple[int, int]]:
    """Cut samples (in output order, with these sizes) into ``world`` contiguous ranges of about equal bytes: a
    sample goes to the rank whose share ``[k, k+1) * total / world`` holds its middle byte."""
    n = len(sizes)
    if n == 0:
        return [(0, 0)] * world
    sizes = np.maximum(np.asarray(sizes, dtype=np.float64), 1.0)
    ends = np.cumsum(sizes)
    middles = ends - sizes / 2
    total = ends[-1]
    bounds = [0] + [int(np.searchsorted(middles, k * total / world, side="left")) for k in range(1, world)] + [n]
    return [(bounds[k], bounds[k + 1]) for k in range(world)]


def _wait_exits(ctx: Context, limit: float = 30.0) -> None:
    """Rank 0 may host the store (outside torchrun): give the others a moment to read that the manifest is
    written before this process, and the store with it, ends."""
    deadline = time.monotonic() + limit
    try:
        for r in range(1, ctx.world):
            while not ctx.has(f"exit/{r}") and time.monotonic() < deadline:
                time.sleep(0.05)
    except Exception:  # noqa: BLE001 - the manifest is written; nothing else to do
        pass
