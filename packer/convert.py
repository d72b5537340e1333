"""``pack()``: convert an image folder (or a packed dataset, or WebDataset shards) into a packed dataset.

The work is the engine's (:mod:`packer.engine`), the progress record the journal's (:mod:`packer.journal`); here
is the order of a conversion in one process: plan, lock DEST, prepare or resume it, convert, write the manifest.
Under torchrun each rank converts one contiguous part instead (:mod:`packer.distributed`).
"""

from __future__ import annotations

import inspect
import os
import sys
import time
from pathlib import Path
from typing import Any

from .arguments import shown, spelled
from .dest import is_regular_file
from .distributed import detect, early_rank, pack_distributed
from .engine import Plan, build_plan, convert_samples, make_manifest, prepare_dest
from .errors import DestinationError, NothingPackedError, UsageError
from .journal import differences, discard, finish, open_journal
from .lock import OutputLock, check_free
from .manifest import MANIFEST, read_local_manifest
from .options import args_doc, pack_options, signature_parameters
from .remote.url import parse_url


def pack(src: str | os.PathLike | Any, dest: str | os.PathLike, format: str = "lmdb", *,
         storage_options: dict | None = None, cache_dir: str | os.PathLike | None = None,
         **options: Any) -> dict[str, Any]:
    """Convert ``src`` into a ``format`` dataset in ``dest`` and return its manifest.

    ``src`` is an image folder, a dataset packed by packer (any format: repacking keeps relpaths, and with
    ``store="original"`` the stored bytes), or WebDataset shards written by any tool (a folder of ``.tar`` files,
    one ``.tar``, or a glob; the label comes from ``label_key``: ``cls``, ``txt``, ``json:FIELD``...), or a Hugging
    Face dataset: a ``datasets.Dataset`` (or ``DatasetDict``, with ``split``), or ``"hf:PATH_OR_NAME"`` naming a
    ``save_to_disk`` folder or a Hub dataset already downloaded (see :mod:`packer.hf`).

    ``resume=True`` continues an interrupted conversion of the same source with the same options, and returns
    the existing manifest if ``dest`` is already finished. Under torchrun (``WORLD_SIZE`` > 1) or in an
    initialised process group, every rank converts one part and rank 0 writes one manifest over all of them
    (see :mod:`packer.distributed`). One process at a time writes ``dest``: a second fails at once. The CLI's
    ``packer pack`` calls this with the same names (:class:`packer.options.PackOptions` declares them).

    Args:
        src: the image folder, packed dataset, WebDataset shards or Hugging Face dataset to convert.
        dest: the folder to write; new, empty, or (with ``overwrite``) a packer dataset. Or a URL (``s3://``,
            ``gs://``): converted into a staging folder in the cache, then uploaded, manifest last
            (:mod:`packer.remote.upload`).
        format: the output format: a name of the format registry (lmdb, hdf5, wds).
        storage_options: for a URL ``dest``, the fsspec filesystem's options (credentials, endpoint).
        cache_dir: for a URL ``dest``, the cache folder that holds the staging folder.
{options}

    Returns:
        The manifest written to ``dest/manifest.json``.

    Raises:
        UsageError: a bad option value or combination (also a ValueError).
        DestinationBusyError: another packer process is writing ``dest``.
        PackerError: any other failure, with a one-line message that names the file and what to do.
    """
    opts = pack_options(format, options)  # bad options fail before anything is read or sent
    if parse_url(dest) is not None:
        from .remote.upload import pack_to_url

        return pack_to_url(pack, src, os.fspath(dest), format, storage_options=storage_options, cache_dir=cache_dir,
                           **options)
    if storage_options is not None or cache_dir is not None:
        raise UsageError(f"{dest}: storage_options and cache_dir are for a URL destination (s3://, gs://); "
                         "a folder needs neither")
    dest = Path(dest)
    if early_rank(opts.distributed) == 0 and not (opts.resume and is_regular_file(dest / MANIFEST)):
        # before the scan of a large source: a second writer fails at once. Rank 0 only: under torchrun it locks
        # DEST for every rank, and in a process group that already exists (pack to a URL) it may hold the lock
        # by the time another rank gets here.
        check_free(dest)
    context = detect(opts.distributed)
    if opts.resume and is_regular_file(dest / MANIFEST):
        try:
            return _finished(dest, build_plan(src, opts, quiet=context is not None and context.rank != 0),
                             announce=context is None or context.rank == 0)
        finally:
            if context is not None:
                context.close()
    if context is not None:
        return pack_distributed(context, src, opts, dest)
    plan = build_plan(src, opts)
    with OutputLock(dest):
        created = not _exists(dest)
        journal, resuming = open_journal(dest, plan.record, opts.resume, lambda: prepare_dest(dest, plan))
        started = time.time()
        try:
            result = convert_samples(dest, plan, plan.order, journal, resuming)
        except NothingPackedError:
            if not resuming:
                discard(dest, created)
            raise
        manifest = make_manifest(plan, result.count, result.extras, result.skipped, result.resumed,
                                 time.time() - started)
        finish(dest, MANIFEST, manifest)
    return manifest


pack.__doc__ = pack.__doc__.replace("{options}", args_doc())
pack.__signature__ = inspect.signature(pack).replace(parameters=[
    *list(inspect.signature(pack).parameters.values())[:5], *signature_parameters()])


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
