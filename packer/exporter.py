"""``export()``: write a packed dataset back out as an image folder, ``OUT/<class>/.../<image>``.

Each sample is written at its relative path (``OUT/<relpath>``), prefixed with its class folder where the path
does not already start with it (samples repacked from WebDataset shards), so that ImageFolder and ``packer pack``
read the same labels back. What is written is the stored bytes: the original files when the dataset stores
``original`` (so export then pack gives byte-identical samples), the JPEG or PNG re-encodings otherwise (the
extension changed to match where it did not), and for ``raw`` datasets a lossless PNG of the stored pixels
(extension ``.png``). Every class gets its folder, even an empty one, so class indices survive the round trip.

(The module is ``packer.exporter``, not ``packer.export``: a submodule of that name would shadow the
``packer.export`` function once imported.)
"""

from __future__ import annotations

import os
import shutil
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
from tqdm import tqdm

from .errors import CorruptDataError, DestinationError, PackerError
from .scan import is_image_file
from .system import usable_cores
from .transforms import to_pil

SUFFIXES = {"jpeg": (".jpg", ".jpeg"), "png": (".png",), "raw": (".png",)}


def _safe_component(name: str) -> bool:
    return bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name and "\0" not in name


def _safe_relpath(rel: str) -> bool:
    parts = rel.split("/")
    return bool(rel) and not rel.startswith("/") and all(_safe_component(p) for p in parts)


def _prepare_out(out: Path, dest: Path, overwrite: bool) -> None:
    out_r, dest_r = out.resolve(), dest.resolve()
    if out_r == dest_r or out_r.is_relative_to(dest_r) or dest_r.is_relative_to(out_r):
        raise DestinationError(f"{out}: must not contain, or be inside, the dataset {dest}; choose another folder")
    if out.exists() and not out.is_dir():
        raise DestinationError(f"{out}: exists and is not a folder; choose another destination")
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise DestinationError(f"{out}: already exists and is not empty; pass --overwrite to replace it")
        for dirpath, _, filenames in os.walk(out):
            top = Path(dirpath) == out
            if any(top or not is_image_file(name) for name in filenames):
                raise DestinationError(f"{out}: is not an image folder (it holds other files), so --overwrite will "
                                       "not delete it; choose an empty or new folder")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)


def _write(path: Path, data: bytes | np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, np.ndarray):
        to_pil(data).save(path, "PNG")
    else:
        with open(path, "wb") as f:
            f.write(data)


def export(dest: str | os.PathLike, out: str | os.PathLike, *, overwrite: bool = False, workers: int | None = None,
           progress: bool = True) -> dict[str, Any]:
    """Write the packed dataset ``dest`` (any format) to the image folder ``out``; see the module docstring.
    ``out`` must be new or empty, or an image folder (a previous export) with ``overwrite=True``. Returns
    ``{"out", "count", "classes", "renamed"}`` (renamed: samples whose extension changed)."""
    from .formats import open_dataset

    dest, out = Path(dest), Path(out)
    ds = open_dataset(dest, decode=False, verify=True)
    store = ds.spec.store
    if ds.spec.normalize:
        raise PackerError(f"{dest}: stores normalized {ds.spec.dtype} arrays, which are not images; export needs "
                          "a dataset of pixels or encoded images")
    classes = ds.classes
    for name in classes:
        if not _safe_component(name):
            raise CorruptDataError(f"{dest}: class name {name!r} cannot be a folder name; refusing to export")
    _prepare_out(out, dest, overwrite)
    for name in classes:
        (out / name).mkdir(exist_ok=True)
    workers = workers or usable_cores()
    written: set[str] = set()
    renamed = 0
    bar = tqdm(total=len(ds), unit="img", disable=not progress, desc=f"exporting {ds.format}", dynamic_ncols=True)
    try:
        with ThreadPoolExecutor(workers, thread_name_prefix="packer-export") as pool:
            pending: deque = deque()
            for i in range(len(ds)):
                rel = ds.relpath(i)
                data, label = ds.raw_sample(i)  # read in this thread: format handles are not shared across threads
                if not 0 <= label < len(classes):
                    raise CorruptDataError(f"{ds._describe(i)}: label {label} is not a class index; "
                                           "run `packer verify`")
                if not _safe_relpath(rel):
                    raise CorruptDataError(f"{ds._describe(i)}: relative path {rel!r} is absolute or has '..'; "
                                           "refusing to export it")
                target = rel if rel.split("/", 1)[0] == classes[label] and "/" in rel else f"{classes[label]}/{rel}"
                allowed = SUFFIXES.get(store)
                if allowed and PurePosixPath(target).suffix.lower() not in allowed:
                    changed = str(PurePosixPath(target).with_suffix(allowed[0]))
                    target = changed if changed not in written else target + allowed[0]
                    renamed += 1
                if target in written:
                    raise PackerError(f"{ds._describe(i)}: two samples would be written to {out / target}; the "
                                      "dataset holds the same relative path twice")
                written.add(target)
                pending.append(pool.submit(_write, out / target, data))
                if len(pending) >= 4 * workers:
                    pending.popleft().result()
                    bar.update()
            while pending:
                pending.popleft().result()
                bar.update()
    except OSError as exc:
        raise PackerError(f"{out}: write failed ({exc.strerror or exc}); free space or fix permissions, then export "
                          "again with --overwrite") from None
    finally:
        bar.close()
    return {"out": str(out), "count": len(ds), "classes": len(classes), "renamed": renamed}
