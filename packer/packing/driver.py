"""The conversion sequence, written once: plan, lock DEST, prepare or resume it, convert, write the manifest.

One process converts everything into DEST; under torchrun every rank converts its part (:mod:`packer.packing.ranks`)
and rank 0 writes one manifest over all of them. Who does what is the coordinator's
(:mod:`packer.packing.coordinator`); the plan is :mod:`packer.packing.plan`'s, DEST's preparation
:mod:`packer.packing.prepare`'s, the work :mod:`packer.packing.convert`'s, the progress record the journal's
(:mod:`packer.packing.journal`). Each step calls down, into modules that do not call back. :func:`packer.pack`
(:mod:`packer.packing.pack`) and the upload to a URL (:mod:`packer.packing.upload`) both run :func:`pack_folder`.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..arguments import shown, spelled
from ..errors import DestinationError, NothingPackedError
from ..manifest import JOURNAL, MANIFEST, read_local_manifest
from ..system import is_regular_file
from .convert import Converted, convert_samples
from .coordinator import Coordinator, detect, early_rank
from .journal import differences, discard, finish
from .lock import OutputLock, check_free
from .options import PackOptions
from .plan import Plan, build_plan, make_manifest
from .prepare import open_dest
from .ranks import convert_part, merge


def pack_folder(src: str | os.PathLike | Any, dest: Path, options: PackOptions,
                coordinator: Coordinator | None = None) -> dict[str, Any]:
    """Convert ``src`` into the folder ``dest`` and return its manifest (see :func:`packer.pack`).

    Args:
        src: what to convert (see :func:`packer.sources.detect.open_source`).
        dest: the folder to write; under torchrun, a folder every rank sees.
        options: the conversion's options, the same on every rank.
        coordinator: this process's coordinator, where the caller has one already (an upload under torchrun);
            default: :func:`packer.packing.coordinator.detect`'s. It is closed on return.

    Returns:
        The manifest written to ``dest/manifest.json``.

    Raises:
        DestinationBusyError: another packer process is writing ``dest``.
        PackerError: any other failure, with a one-line message that names the file and what to do.
    """
    finished = fail_if_busy(dest, options, coordinator)
    coordinator = coordinator if coordinator is not None else detect(options.distributed)
    try:
        if finished:
            return _finished(dest, build_plan(src, options, quiet=not coordinator.leads), announce=coordinator.leads)
        try:
            return _convert(coordinator, src, options, dest)
        except BaseException as exc:
            coordinator.publish_failure(exc)
            raise
    finally:
        coordinator.close()


def fail_if_busy(dest: Path, options: PackOptions, coordinator: Coordinator | None = None) -> bool:
    """Fail at once when another process writes ``dest``: before the scan of a large source, or the fetch of a
    remote one. Rank 0 only: under torchrun it locks DEST for every rank, and in a process group that already
    exists (pack to a URL) it may hold the lock by the time another rank gets here. Nothing is checked for a
    finished ``dest`` that ``resume`` will return as it is.

    Returns:
        Whether ``dest`` is finished and ``resume`` asked for: then nothing is converted.

    Raises:
        DestinationBusyError: another packer process is writing ``dest``.
    """
    # a manifest beside a progress record is not finished: killed between the two steps of writing the manifest and
    # removing the record, or while --overwrite emptied DEST; --resume continues from the record
    finished = options.resume and is_regular_file(dest / MANIFEST) and not is_regular_file(dest / JOURNAL)
    rank = coordinator.rank if coordinator is not None else early_rank(options.distributed)
    if rank == 0 and not finished:
        check_free(dest)
    return finished


def _convert(coordinator: Coordinator, src: str | os.PathLike | Any, options: PackOptions,
             dest: Path) -> dict[str, Any]:
    """The sequence, in every process: plan; under DEST's lock (rank 0's) prepare or resume DEST, convert this
    process's share, write the manifest over every share (rank 0) or read it; then tell the others it is
    written."""
    coordinator.alive(force=True)
    plan = build_plan(src, options, quiet=not coordinator.leads)
    plan = replace(plan, options=replace(plan.options, workers=coordinator.workers(plan.options.workers)),
                   record=coordinator.record(plan.record))
    start, stop = coordinator.share(plan.order, plan.sizes)
    coordinator.alive(force=True)
    with coordinator.lock(dest):
        # ranks leave DEST in place when they packed nothing: it is their shared folder
        created = coordinator.part is None and not _exists(dest)
        journal, resuming = open_dest(dest, plan) if coordinator.leads else (None, False)
        resuming = coordinator.agree(resuming, plan.record)  # the other ranks take rank 0's answer
        started = time.time()
        try:
            written = _write_share(coordinator, plan, dest, journal, resuming, start, stop)
            coordinator.wait_shares()
            manifest = (_write_manifest(coordinator, plan, dest, written, started) if coordinator.leads
                        else read_local_manifest(dest))
        except NothingPackedError:
            if not resuming:  # leave nothing that blocks the same command
                discard(dest, created)
            raise
    coordinator.announce()
    return manifest


def _write_share(coordinator: Coordinator, plan: Plan, dest: Path, journal: dict | None, resuming: bool,
                 start: int, stop: int) -> Converted | dict[str, Any]:
    """Convert output positions ``[start, stop)``: one process into DEST itself, with DEST's journal; a rank into
    its part folder, under the part's own lock."""
    if coordinator.part is None:  # its share is the whole order
        assert journal is not None  # the one process prepared DEST
        return convert_samples(dest, plan, plan.order, journal, resuming)
    with OutputLock(dest, coordinator.part):
        return convert_part(coordinator, plan, dest, start, stop, resuming)


def _write_manifest(coordinator: Coordinator, plan: Plan, dest: Path, written: Converted | dict[str, Any],
                    started: float) -> dict[str, Any]:
    """The manifest over what was converted (one process's result, or every rank's part), written to DEST."""
    if isinstance(written, Converted):
        manifest = make_manifest(plan, written.count, written.extras, written.skipped, written.resumed,
                                 time.time() - started)
    else:
        manifest = merge(plan, dest, coordinator.world, started)
    finish(dest, MANIFEST, manifest)
    return manifest


def _exists(path: Path) -> bool:
    try:
        return os.path.lexists(path)
    except (OSError, ValueError):
        return False


def _finished(dest: Path, plan: Plan, announce: bool) -> dict[str, Any]:
    """``--resume`` on a finished DEST: its manifest, if it was packed from the same source with the same
    options; a :class:`DestinationError` otherwise, as for an unfinished one."""
    manifest = read_local_manifest(dest)
    recorded = manifest.get("options")
    wanted = {k: v for k, v in plan.record.items() if k != "world_size"}
    if isinstance(recorded, dict):
        recorded = {k: v for k, v in recorded.items() if k != "world_size"}
    else:  # packed before the manifest recorded its options: compare what it does record
        recorded = {"format": manifest.get("format"), "transform": manifest.get("transform"),
                    "source": (manifest.get("source") or {}).get("root")}
        wanted = {"format": plan.options.format, "transform": wanted["transform"],
                  "source": plan.source.describe()["root"]}
    changed = differences(recorded, wanted)
    if changed:
        raise DestinationError(f"{shown(dest)}: is a finished dataset packed with a different {', '.join(changed)}; "
                               f"run with the same source and options, or start again with {spelled('overwrite')}")
    if announce and shown(dest) == os.fspath(dest):  # a URL's staging folder: the upload says what it does
        print(f"packer: {dest} is already a finished dataset; nothing to resume", file=sys.stderr)
    return manifest
