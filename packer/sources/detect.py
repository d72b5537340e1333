"""Which kind of source SRC is: an image folder, an annotation table, a dataset packer already packed, WebDataset
shards or a Hugging Face dataset; :func:`open_source` tells them apart and opens it.

 Each :class:`Source` gives the classes, the samples in their natural order
(``len``, labels and relative paths), each sample's size in bytes (to estimate the output and to balance ranks),
a fingerprint (a resumed conversion must see the same source), and a picklable :class:`SampleReader` that a worker
process uses to read sample ``i`` and convert it.

- :class:`FolderSource`: ``SRC/<class>/**/<image>``, scanned with ImageFolder's rules (:func:`packer.scan_folder`).
- :class:`PackedSource`: a folder with a ``manifest.json`` (any format, also one converted by several ranks), read
  through its reader (:func:`packer.formats.open_reader`): the stored bytes, or the stored array for ``raw``.
- :class:`ShardsSource`: ``.tar`` shards written by any WebDataset tool (``webdataset.ShardWriter``, img2dataset),
  a folder of them, a single one, or a glob; read through the reader the registry gives for them
  (:func:`packer.formats.foreign_reader`) with a ``label_key``.

A repacked sample keeps the relative path it has in its source, so repacking keeps relpaths, and with
``store=original`` the exact stored bytes.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Any

from ..errors import SourceError, UsageError
from ..manifest import JOURNAL, MANIFEST
from .base import Source
from .folder import FolderSource
from .packed import PackedSource
from .shards import ShardsSource, _shards_in
from .table import TableSource, is_table


def open_source(src: str | os.PathLike | Any, include_hidden: bool = False, label_key: str | None = None,
                table: dict[str, Any] | None = None, hf: dict[str, Any] | None = None) -> Source:
    """The :class:`Source` that ``src`` names:

    - ``hf:PATH_OR_NAME``, a ``datasets.Dataset`` or ``DatasetDict``: a Hugging Face dataset (``hf``: the keyword
      arguments of :class:`packer.sources.hf.HfSource`: ``split``, ``image_column``, ``label_column``);
    - a ``.csv``, ``.tsv`` or ``.jsonl`` file: an annotation table (``table``: the keyword arguments of
      :class:`packer.sources.table.TableSource`: ``image_column``, ``root``, ``label_column``, ``field``);
    - a folder with ``manifest.json``: a packed dataset;
    - a ``.tar`` file, a glob such as ``'shards/*.tar'``, or a folder that holds ``.tar`` files and no
      sub-folders: WebDataset shards (labels from ``label_key``, default ``cls``);
    - any other folder: an image folder (``include_hidden`` keeps names starting with '.')."""
    from .hf import is_hf

    if is_hf(src):
        return _hf_source(src, label_key, table, hf)
    if (hf or {}).get("split") is not None:
        raise UsageError("--split is for a Hugging Face SRC (hf:PATH_OR_NAME)")
    text = os.fspath(src)  # a URL was resolved by pack(), the entry point: this is a local path or pattern
    path = Path(text)
    shards: list[Path] | None = None
    pattern = None
    if not path.exists() and glob.has_magic(text):
        shards = sorted(Path(p) for p in glob.glob(text) if os.path.isfile(p))
        pattern = os.path.abspath(text)
        if not shards:
            raise SourceError(f"{text}: no files match this pattern")
    elif path.is_file() and path.suffix.lower() == ".tar":
        shards = [path]
    elif is_table(path):
        if label_key is not None:
            raise UsageError("--label-key is for WebDataset shards; a table's label is --label-column")
        return TableSource(path, **(table or {}))
    elif path.is_dir():
        if (path / MANIFEST).exists():
            if label_key is not None:
                raise UsageError("--label-key is for WebDataset shards; a packed dataset keeps its labels")
            return PackedSource(path)
        if (path / JOURNAL).exists():
            raise SourceError(f"{path}: an unfinished packer conversion (no {MANIFEST}); finish it with `packer pack "
                              "... --resume` before packing from it")
        shards = _shards_in(path)
    if shards is not None:
        return ShardsSource(shards, label_key=label_key, pattern=pattern)
    if label_key is not None:
        raise UsageError("--label-key is for WebDataset shards; an image folder's labels are its class folders")
    return FolderSource(path, include_hidden=include_hidden)


def _hf_source(src: Any, label_key: str | None, table: dict[str, Any] | None, hf: dict[str, Any] | None) -> Source:
    from .hf import HfSource

    if label_key is not None:
        raise UsageError("--label-key is for WebDataset shards; a Hugging Face dataset's class is --label-column")
    if table and (table.get("root") is not None or table.get("field")):
        raise UsageError("--root and --field are for annotation tables; a Hugging Face dataset's columns are typed "
                         "from its features")
    return HfSource(src, **(hf or {}))
