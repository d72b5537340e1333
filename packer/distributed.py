"""Distributed conversion: ``torchrun --nnodes=N --nproc_per_node=K -m packer pack SRC DEST --format F``.

Every rank scans SRC the same way and computes the same output order (with ``--shuffle``, the same permutation).
The order is cut into ``world_size`` contiguous ranges of about equal source bytes, so concatenating them in rank
order gives exactly the single-process order. Rank r converts its range into ``DEST/part-{r:05d}/`` with the
format's usual writer and its own journal (so ``--resume`` resumes every part), then writes
``part-{r:05d}/part.json`` (its count, files, shards, skipped images). Rank 0 prepares DEST first, waits for every
part, and writes the one ``DEST/manifest.json`` over all of them: paths in ``files`` and ``shards`` are relative
to DEST (``part-00000/data.mdb``), and ``parts`` lists each part's folder, count and range.
:func:`packer.open_dataset` reads it as one dataset (:class:`packer.dataset.PartedDataset`).

DEST must be a folder every node sees (a shared filesystem). Ranks coordinate through the process group's
key-value store (``init_process_group("gloo")`` when torchrun started the process and no group exists yet):

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
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np

from .dest import PART_INFO, part_problems, prepare_output
from .engine import Plan, build_plan, convert_samples, make_manifest, prepare_dest
from .errors import DestinationError, NothingPackedError, PackerError, SourceError, UsageError
from .journal import discard, finish, open_journal
from .lock import OutputLock
from .manifest import MANIFEST, read_local_manifest
from .options import PackOptions
from .system import usable_cores

PART = "part-{:05d}"
TIMEOUT_ENV = "PACKER_DIST_TIMEOUT"
DEFAULT_TIMEOUT = 1800.0
ALIVE_EVERY = 2.0  # seconds between a rank's liveness updates (and its checks for other ranks' failures)
SCAN_EVERY = 5.0  # seconds between rank 0's checks of the ranks it waits for

_calls = 0  # pack() calls in this process: every rank makes the same calls, so keys match across ranks


class PeerFailed(PackerError):
    """Another rank failed; this one stops with its message."""


@dataclass
class Context:
    """This rank's view of the distributed conversion, and the store the ranks talk through."""

    rank: int
    world: int
    local_world: int
    store: Any
    prefix: str
    timeout: float
    owns_group: bool
    _last_alive: float = 0.0

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
            last = {r: (None, time.monotonic()) for r in pending}
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


def detect(distributed: bool | None = None) -> Context | None:
    """The distributed context when this process is one rank of several (torchrun's ``WORLD_SIZE`` > 1, or an
    initialised process group of more than one rank), initialising a gloo group if none exists; else None.
    ``distributed=False`` always converts in this process only; ``True`` requires a distributed launch."""
    if distributed is False:
        return None
    try:
        env_world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    except ValueError:
        env_world = 1
    if env_world <= 1 and "torch.distributed" not in sys.modules and not distributed:
        return None  # no launcher and no process group (that needs torch.distributed imported): skip torch
    import torch.distributed as dist

    initialised = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if initialised else env_world
    if world <= 1:
        if distributed:
            raise UsageError("distributed=True needs a distributed launch: run under torchrun with more than one "
                             "process, or initialise a process group first")
        return None
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


def pack_distributed(context: Context, src: str | os.PathLike, options: PackOptions, dest: Path) -> dict[str, Any]:
    """This rank's share of a distributed ``pack()``: see the module docstring.

    Args:
        context: this rank (:func:`detect`).
        src: what to convert.
        options: the conversion's options, the same on every rank.
        dest: the folder every rank writes, on a filesystem they share.

    Returns:
        The manifest over every part.
    """
    try:
        return _run(context, src, options, dest)
    except BaseException as exc:
        context.publish_failure(exc)
        raise
    finally:
        context.close()


def _run(ctx: Context, src: str | os.PathLike, options: PackOptions, dest: Path) -> dict[str, Any]:
    ctx.alive(force=True)
    plan = build_plan(src, options, quiet=ctx.rank != 0)
    if plan.options.workers is None:  # the node's cores, shared between the ranks on it
        plan = replace(plan, options=replace(plan.options, workers=max(1, usable_cores() // ctx.local_world)))
    plan = replace(plan, record={**plan.record, "world_size": ctx.world})
    ranges = partition(plan.sizes[np.asarray(plan.order, dtype=np.int64)], ctx.world)
    ctx.alive(force=True)
    with OutputLock(dest) if ctx.rank == 0 else nullcontext():  # rank 0 locks DEST for every rank
        if ctx.rank == 0:
            _, resuming = open_journal(dest, plan.record, options.resume,
                                       lambda: prepare_dest(dest, plan))
            ctx.set("prep", json.dumps({"resuming": resuming, "fingerprint": plan.record["fingerprint"]}))
        else:
            prep = json.loads(ctx.wait_key("prep", 0, "rank 0 to prepare the destination"))
            if prep["fingerprint"] != plan.record["fingerprint"]:
                raise SourceError(f"{plan.record['source']}: rank {ctx.rank} sees different source files than "
                                  "rank 0 (files changed during the scan, or SRC differs between nodes); every rank "
                                  "must see the same SRC")
            resuming = prep["resuming"]
        started = time.time()
        a, b = ranges[ctx.rank]
        with OutputLock(dest, PART.format(ctx.rank)):
            _convert_part(ctx, plan, dest, a, b, resuming)
        ctx.set(f"done/{ctx.rank}", "1")
        if ctx.rank != 0:
            ctx.wait_key("manifest", 0, "rank 0 to write the manifest")
            ctx.mark_exit()
            return read_local_manifest(dest)
        ctx.wait_ranks("done", "every rank to finish its part")
        try:
            manifest = _merge(plan, dest, ranges, started)
        except NothingPackedError:
            if not resuming:  # every rank is done with DEST: leave nothing that blocks the same command
                discard(dest, created=False)
            raise
        finish(dest, MANIFEST, manifest)
    ctx.set("manifest", "1")
    _wait_exits(ctx)
    return manifest


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


def _convert_part(ctx: Context, plan: Plan, dest: Path, a: int, b: int, resuming: bool) -> dict[str, Any]:
    """Convert output positions ``[a, b)`` into ``DEST/part-{rank}`` and write its ``part.json``."""
    part = dest / PART.format(ctx.rank)
    info_path = part / PART_INFO
    if resuming and info_path.exists():
        info = json.loads(info_path.read_text())
        if info.get("range") != [a, b]:
            raise DestinationError(f"{info_path}: this part covers {info.get('range')}, not [{a}, {b}]; start "
                                   "again with --overwrite")
        print(f"packer: {part} is already finished", file=sys.stderr)
        return info
    # a part that never recorded progress: nothing in it to keep, but only packer's files are deleted
    journal, part_resuming = open_journal(
        part, {**plan.record, "part": ctx.rank, "range": [a, b]}, resuming,
        lambda: prepare_output(part, True, part_problems, "packer part folder"),
        same="source, options and number of ranks")
    started = time.time()
    result = convert_samples(
        part, plan, plan.order[a:b], journal, part_resuming, allow_empty=True, key_offset=a,
        progress=plan.options.progress and ctx.rank == 0, desc=f"packing {plan.options.format} (rank 0 of {ctx.world})",
        on_progress=ctx.alive)
    info = {"part": ctx.rank, "range": [a, b], "count": result.count, **result.extras, "skipped": result.skipped,
            "resumed": result.resumed, "conversion_seconds": round(time.time() - started, 3)}
    finish(part, PART_INFO, info)
    return info


def _merge(plan: Plan, dest: Path, ranges: list[tuple[int, int]], started: float) -> dict[str, Any]:
    """Rank 0: the manifest over every part's ``part.json``."""
    infos = []
    for r in range(len(ranges)):
        path = dest / PART.format(r) / PART_INFO
        try:
            infos.append(json.loads(path.read_text()))
        except FileNotFoundError:
            raise PackerError(f"{path}: missing although rank {r} reported its part finished; DEST must be a folder "
                              "shared by every node (a network filesystem), not a node's local disk") from None
        except (OSError, ValueError) as exc:
            raise PackerError(f"{path}: unreadable ({exc}); run the same command with --resume") from None
    extras: dict[str, Any] = {}
    for r, info in enumerate(infos):
        prefix = PART.format(r)
        for key in ("files", "shards"):
            if key in info:
                extras.setdefault(key, []).extend({**e, "path": f"{prefix}/{e['path']}"} for e in info[key])
    count = sum(int(info["count"]) for info in infos)
    if count == 0:
        raise NothingPackedError(f"{plan.record['source']}: none of the {len(plan.order)} images could be read; "
                                 "nothing was packed")
    skipped = [e for info in infos for e in info["skipped"]]
    manifest = make_manifest(plan, count, extras, skipped, any(i["resumed"] for i in infos),
                                     time.time() - started)
    manifest["parts"] = [{"path": PART.format(r), "count": int(info["count"]), "range": info["range"]}
                         for r, info in enumerate(infos)]
    return manifest

