"""Distributed conversion: ``torchrun --nnodes=N --nproc_per_node=K -m packer pack SRC DEST --format F``.

Every rank scans SRC the same way and computes the same output order (with ``--shuffle``, the same permutation).
The order is cut into ``world_size`` contiguous ranges of about equal source bytes, so concatenating them in rank
order gives exactly the single-process order. Rank r converts its range into ``DEST/part-{r:05d}/`` with the
format's usual writer and its own journal (so ``--resume`` resumes every part), then writes
``part-{r:05d}/part.json`` (its count, files, shards, skipped images). Rank 0 prepares DEST first, waits for every
part, and writes the one ``DEST/manifest.json`` over all of them: paths in ``files`` and ``shards`` are relative
to DEST (``part-00000/data.mdb``), and ``parts`` lists each part's folder, count and range.
:func:`packer.open_dataset` reads it as one dataset (:class:`packer.reading.dataset.PartedDataset`).

DEST must be a folder every node sees (a shared filesystem). The sequence is :mod:`packer.packing.driver`'s, the same as
in one process; who does what, and how the ranks wait for each other, is :mod:`packer.packing.coordinator`'s. Here are a
rank's part and the merge of the parts.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from ..errors import DestinationError, NothingPackedError, PackerError
from .convert import convert_samples
from .coordinator import Coordinator
from .dest import PART, PART_INFO, part_problems, prepare_output
from .journal import finish, resumable, start
from .plan import Plan, make_manifest


def convert_part(ctx: Coordinator, plan: Plan, dest: Path, a: int, b: int, resuming: bool) -> dict[str, Any]:
    """Convert output positions ``[a, b)`` into ``DEST/part-{rank}`` and write its ``part.json``; return it."""
    part = dest / PART.format(ctx.rank)
    info_path = part / PART_INFO
    if resuming and info_path.exists():
        info = json.loads(info_path.read_text())
        if info.get("range") != [a, b]:
            raise DestinationError(f"{info_path}: this part covers {info.get('range')}, not [{a}, {b}]; start "
                                   "again with --overwrite")
        print(f"packer: {part} is already finished", file=sys.stderr)
        return info
    record = {**plan.record, "part": ctx.rank, "range": [a, b]}
    journal = resumable(part, record, resuming, same="source, options and number of ranks")
    part_resuming = journal is not None
    if journal is None:
        # a part that never recorded progress: nothing in it to keep, but only packer's files are deleted
        prepare_output(part, True, part_problems, "packer part folder")
        journal = start(part, record)
    started = time.time()
    result = convert_samples(
        part, plan, plan.order[a:b], journal, part_resuming, allow_empty=True, key_offset=a,
        progress=plan.options.progress and ctx.rank == 0, desc=f"packing {plan.options.format} (rank 0 of {ctx.world})",
        on_progress=ctx.alive)
    info = {"part": ctx.rank, "range": [a, b], "count": result.count, **result.extras, "skipped": result.skipped,
            "resumed": result.resumed, "conversion_seconds": round(time.time() - started, 3)}
    finish(part, PART_INFO, info)
    return info


def merge(plan: Plan, dest: Path, world: int, started: float) -> dict[str, Any]:
    """Rank 0: the manifest over every part's ``part.json``."""
    infos = []
    for r in range(world):
        path = dest / PART.format(r) / PART_INFO
        try:
            infos.append(json.loads(path.read_text()))
        except FileNotFoundError:
            raise PackerError(f"{path}: missing although rank {r} reported its part finished; DEST must be a folder "
                              "shared by every node (a network filesystem), not a node's local disk") from None
        except (OSError, ValueError) as exc:
            raise PackerError(f"{path}: unreadable ({exc}); run the same command with --resume") from None
    extras = plan.writer_cls.merge_parts({PART.format(r): info for r, info in enumerate(infos)})
    count = sum(int(info["count"]) for info in infos)
    if count == 0:
        raise NothingPackedError(f"{plan.record['source']}: none of the {len(plan.order)} images could be read; "
                                 "nothing was packed")
    skipped = [e for info in infos for e in info["skipped"]]
    manifest = make_manifest(plan, count, extras, skipped, any(i["resumed"] for i in infos),
                                     time.time() - started)
    counts = [info.get("class_counts") for info in infos]
    if plan.source.classes and all(isinstance(c, list) for c in counts):  # else unknown: info reads the parts
        manifest["class_counts"] = [sum(per_class) for per_class in zip(*counts, strict=True)]
    manifest["parts"] = [{"path": PART.format(r), "count": int(info["count"]), "range": info["range"]}
                         for r, info in enumerate(infos)]
    return manifest

