"""The plan of a conversion: what every rank decides identically before converting (the source, the transform,
the record ``--resume`` compares, the output order), and the manifest that describes the result."""

from __future__ import annotations

import json
import os
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .. import __version__
from ..errors import ImageError, warn
from ..fields import is_pair_schema
from ..formats.base import Writer, get_format
from ..images.transforms import TransformSpec
from ..manifest import FIELDS_FORMAT_VERSION, PLAIN_FORMAT_VERSION
from ..sources.base import Source
from ..sources.detect import open_source
from .dest import SHOWN, name_some
from .options import PackOptions


@dataclass(frozen=True, eq=False)
class Plan:
    """Everything every rank decides identically before converting: the source, the transform, what the journal
    and the manifest record, and the output order (source indices). Replaced (``dataclasses.replace``), never
    changed."""

    source: Source
    options: PackOptions  # as given, with ``shuffle`` settled
    writer_cls: type[Writer]
    spec: TransformSpec
    record: dict[str, Any]  # the conversion's "options" in the journal and manifest: what --resume compares
    order: array  # array("q"): 8 bytes a sample, where a list of ints holds ~36
    sizes: np.ndarray  # bytes of each source sample, by source index
    shape: list[int] | None  # [H, W, C] when every sample has it

    def estimate(self, indices: Sequence[int]) -> int:
        """The bytes that converting these samples stores, roughly (LMDB map size, shard sizing)."""
        spec = self.spec
        if spec.store == "raw" and spec.fixed_shape:
            return len(indices) * int(np.prod(spec.fixed_shape)) * np.dtype(spec.dtype).itemsize
        total = int(self.sizes[np.asarray(indices, dtype=np.int64)].sum()) if len(indices) else 0
        return total * (8 if spec.store == "raw" and self.source.stored != "raw" else 1)


def build_plan(src: str | os.PathLike, options: PackOptions, quiet: bool = False) -> Plan:
    """Open the source, settle the transform and the order.

    Args:
        src: what to convert (see :func:`packer.sources.detect.open_source`).
        options: the conversion's options.
        quiet: leave the warnings about the source to another rank.

    Returns:
        The plan.

    Raises:
        PackerError: a bad source or options (a :class:`packer.errors.UsageError` for bad options).
    """
    writer_cls, _ = get_format(options.format)
    source = open_source(src, include_hidden=options.include_hidden, label_key=options.label_key,
                         table=options.table, hf=options.hf)
    spec = options.transform_spec(source.default_store, source.mode)
    source.check(spec)
    where = source.root if source.kind == "folder" else src
    named = where if isinstance(where, (str, os.PathLike)) else getattr(source, "name", source.kind)  # a Dataset
    writer_cls.check_schema(source.schema, {"caption": options.caption_column}, f"{named}: ")
    if source.hidden_skipped and not quiet:
        warn(f"skipped {source.hidden_skipped} hidden files and folders in {where} (names starting with '.'); "
             "pass --include-hidden to keep them")
    if not quiet:
        _warn_empty_classes(source)
    if source.loose_images and not quiet:
        loose = source.loose_images
        warn(f"{where} holds {len(loose):,} image{'s' if len(loose) > 1 else ''} beside its {len(source.classes):,} "
             f"class folder{'s' if len(source.classes) > 1 else ''} ({name_some(loose)}), in no class: not packed, "
             "as ImageFolder leaves them out; if SRC is one class's folder, pass the folder that holds every class")
    if options.strict and source.errors:
        rel, why = source.errors[0]
        raise ImageError(source.where(rel), why)
    if spec.normalize and not quiet:
        per = np.dtype(spec.dtype).itemsize
        warn(f"--normalize stores {spec.dtype} arrays: {per}x the bytes of raw uint8 and far more than JPEG")
    shuffle = options.shuffle
    if shuffle is None:  # WebDataset is read sequentially, so its order is the shuffle (unless it already is one)
        shuffle = writer_cls.READ_IN_ORDER and not source.shuffled
    options = replace(options, shuffle=bool(shuffle))
    record = {"format": options.format, "transform": spec.to_dict(), "shuffle": options.shuffle,
              "seed": options.seed, "shard_size": options.shard_size, "shard_samples": options.shard_samples,
              "include_hidden": options.include_hidden, "strict": options.strict, "source": source.key,
              "fingerprint": source.fingerprint()}
    if options.label_key is not None:
        record["label_key"] = options.label_key
    if options.caption_column is not None:
        record["caption_column"] = options.caption_column
    if source.kind == "table":
        record["table"] = options.table
    if source.kind == "hf":
        record["hf"] = options.hf
    record = json.loads(json.dumps(record))  # as the journal will hold them: lists, not tuples
    order = array("q", range(source.count))
    if options.shuffle:
        order = array("q", np.random.default_rng(options.seed).permutation(source.count).astype(np.int64).tobytes())
    if not quiet:
        for rel, why in source.errors:
            warn(f"skipped {source.where(rel)}: {why}")
    shape = list(spec.fixed_shape) if spec.fixed_shape else None
    geometry = spec.resize or spec.max_size or spec.center_crop or spec.normalize
    if shape is None and source.shape and not geometry and spec.mode == source.mode:
        shape = list(source.shape)  # a repack that keeps the pixels keeps the source's fixed shape
    return Plan(source, options, writer_cls, spec, record, order, source.sizes(), shape)


def _warn_empty_classes(source: Source) -> None:
    """One line per class without images, or one line for them all when there are more than a few (a table's
    class indices may leave thousands unused)."""
    empty = source.empty_classes
    if len(empty) <= SHOWN:
        for cls in empty:
            warn(f"class {cls!r} has no images; it keeps its index {source.class_to_idx[cls]}")
    else:
        warn(f"{len(empty):,} of the {len(source.classes):,} classes have no images ({name_some(empty)}); each "
             "keeps its index")


def make_manifest(plan: Plan, count: int, extras: dict[str, Any], skipped: list[dict], resumed: bool,
                  seconds: float) -> dict[str, Any]:
    """The manifest of a finished conversion (see :mod:`packer.manifest`).

    Args:
        plan: the conversion's plan.
        count: samples written.
        extras: what the writer (or the merged parts) adds: ``files``, ``shards``; a ``format_version`` of its own.
        skipped: images skipped while converting, ``{"path", "error"}`` each.
        resumed: whether the conversion was resumed.
        seconds: how long it took.

    Returns:
        The manifest, ready to write.
    """
    source, spec = plan.source, plan.spec
    return {
        "format": plan.options.format, "packer_version": __version__,
        "format_version": PLAIN_FORMAT_VERSION if is_pair_schema(source.schema) else FIELDS_FORMAT_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "source": {**source.describe(), "images": source.count,
                   "bytes": int(plan.sizes.sum()) if spec.store != "raw" else None},
        "count": count, "classes": source.classes, "class_to_idx": source.class_to_idx,
        **({} if is_pair_schema(source.schema) else {"fields": [f.to_dict() for f in source.schema]}),
        "store": spec.store, "transform": spec.to_dict(), "shape": plan.shape, "dtype": spec.dtype,
        "order": {"shuffle": plan.options.shuffle, "seed": plan.options.seed}, "checksum": "crc32",
        **extras,
        "skipped": [{"path": rel, "error": why} for rel, why in source.errors] + skipped,
        "hidden_skipped": source.hidden_skipped, "empty_classes": source.empty_classes,
        "conversion_seconds": round(seconds, 3), "resumed": resumed,
        "options": plan.record,  # what --resume compares, once the dataset is finished
    }
