"""``pack()``: convert an image folder (or a packed dataset, or WebDataset shards) into a packed dataset.

Here are the public signature and the checks of what the caller gave; a folder DEST goes to the conversion
sequence (:mod:`packer.packing.driver`: one process, or every torchrun rank), a URL to the upload
(:mod:`packer.packing.upload`), which runs the same sequence into a staging folder.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..remote.url import parse_url
from .driver import fail_if_busy, pack_folder
from .options import args_doc, pack_options, signature_parameters


def pack(src: str | os.PathLike | Any, dest: str | os.PathLike, format: str = "lmdb", *,
         storage_options: dict | None = None, cache_dir: str | os.PathLike | None = None,
         **options: Any) -> dict[str, Any]:
    """Convert ``src`` into a ``format`` dataset in ``dest`` and return its manifest.

    ``src`` is an image folder, a dataset packed by packer (any format: repacking keeps relpaths, and with
    ``store="original"`` the stored bytes), or WebDataset shards written by any tool (a folder of ``.tar`` files,
    one ``.tar``, or a glob; the label comes from ``label_key``: ``cls``, ``txt``, ``json:FIELD``...), or a Hugging
    Face dataset: a ``datasets.Dataset`` (or ``DatasetDict``, with ``split``), or ``"hf:PATH_OR_NAME"`` naming a
    ``save_to_disk`` folder or a Hub dataset already downloaded (see :mod:`packer.sources.hf`).

    ``resume=True`` continues an interrupted conversion of the same source with the same options, and returns
    the existing manifest if ``dest`` is already finished. Under torchrun (``WORLD_SIZE`` > 1) or in an
    initialised process group, every rank converts one part and rank 0 writes one manifest over all of them
    (see :mod:`packer.packing.ranks`). One process at a time writes ``dest``: a second fails at once. The CLI's
    ``packer pack`` calls this with the same names (:class:`packer.packing.options.PackOptions` declares them).

    Args:
        src: the image folder, packed dataset, WebDataset shards or Hugging Face dataset to convert.
        dest: the folder to write; new, empty, or (with ``overwrite``) a packer dataset. Or a URL (``s3://``,
            ``gs://``): converted into a staging folder in the cache, then uploaded, manifest last
            (:mod:`packer.packing.upload`).
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
    to_url = parse_url(dest) is not None
    if not to_url and (storage_options is not None or cache_dir is not None):
        raise UsageError(f"{dest}: storage_options and cache_dir are for a URL destination (s3://, gs://); "
                         "a folder needs neither")
    if not to_url:
        fail_if_busy(Path(dest), opts)  # before a remote SRC is fetched
    src = _local_source(src)
    if to_url:
        from .upload import pack_to_url

        return pack_to_url(src, os.fspath(dest), format, storage_options=storage_options, cache_dir=cache_dir,
                           **options)
    return pack_folder(src, Path(dest), opts)


pack.__doc__ = (pack.__doc__ or "").replace("{options}", args_doc())  # None: docstrings stripped (python -OO)
# inspect.signature reads a function's __signature__, which typeshed does not declare on functions
pack.__signature__ = inspect.signature(pack).replace(parameters=[  # type: ignore[attr-defined]
    *list(inspect.signature(pack).parameters.values())[:5], *signature_parameters()])


def _local_source(src: str | os.PathLike | Any) -> str | os.PathLike | Any:
    """``src``, or for a packed dataset's URL the local folder it is fetched into: below ``pack`` every source is
    local (a Hugging Face name, ``hf:...``, is not a URL: :mod:`packer.sources.hf` reads it)."""
    from ..remote.entry import local_dataset
    from ..sources.hf import is_hf

    return src if is_hf(src) else local_dataset(src)
