"""``manifest.json``: the one file every format shares, written last, which makes a folder a dataset.

It is plain JSON (nothing in it is evaluated). Top-level keys:

``format``, ``format_version``, ``packer_version``, ``created``, ``source`` (root, image count, bytes),
``count``, ``classes``, ``class_to_idx``, ``transform`` (store, resize, crop, normalize... see
:class:`packer.images.transforms.TransformSpec`), ``shape`` ([H, W, C] when fixed, else null), ``dtype``, ``order``
(shuffle, seed), ``checksum`` (the per-sample checksum algorithm), ``files`` (every data file with its size
and sha256), ``skipped`` (unreadable files with their error), ``hidden_skipped``, ``empty_classes``,
``scan_errors``, ``options`` (the source and options of the conversion, which ``--resume`` on a finished
dataset compares) and ``class_counts`` (the samples of each class, by label; what ``packer info`` shows without
reading the data: datasets packed before it have none, and their counts are read from the format's index). A
format adds keys of its own (WebDataset: ``shards``, per-shard sample counts): its module reads and checks them
(:meth:`packer.formats.Reader.check_manifest`, run here through :func:`add_key_check`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

from .errors import IncompleteDatasetError, ManifestError
from .install_hints import pip_hint

MANIFEST = "manifest.json"
JOURNAL = ".packer-in-progress"  # the progress record of an unfinished conversion
TUNED = "loader.json"  # a dataset's tuned loader settings, written by `packer bench --tune`
FORMAT_VERSION = 3  # the newest this packer reads
FIELDS_FORMAT_VERSION = 2  # a dataset with "fields"; a format may write a later one for its own layout (WebDataset
# writes 3: its fields' members renamed so that none can collide, packer.formats.wds.members.NAMED_FIELDS_VERSION)
PLAIN_FORMAT_VERSION = 1  # an image-and-class dataset is still written as 1, which older packers read
MAX_MANIFEST_BYTES = 64 << 20  # a manifest larger than this is refused before it is read (PACKER_MAX_MANIFEST_BYTES)
REQUIRED = {"format": str, "format_version": int, "count": int, "classes": list, "class_to_idx": dict,
            "transform": dict, "files": list}
# the checks of the keys each format owns, added as packer.formats registers them: a module that reads such a key
# imports packer.formats, so every manifest it reads was checked
_KEY_CHECKS: list[Callable[[dict, str], None]] = []


def add_key_check(check: Callable[[dict, str], None]) -> None:
    """Have :func:`parse_manifest` run ``check(data, where)`` on every manifest (a format's check of its own keys,
    raising :class:`ManifestError`)."""
    if check not in _KEY_CHECKS:
        _KEY_CHECKS.append(check)


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22, progress: Callable[[int], object] | None = None) -> str:
    """The file's sha256 (hex), read a chunk at a time; ``progress`` is given each chunk's length."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
            if progress is not None:
                progress(len(block))
    return h.hexdigest()


def file_entry(dest: Path, name: str) -> dict:
    path = dest / name
    return {"path": name, "bytes": path.stat().st_size, "sha256": sha256_file(path)}


def write_json_atomic(path: Path, data: dict) -> None:
    """Write to a temporary name, fsync, rename: a reader sees the old file or the whole new one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, ensure_ascii=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def parse_manifest(text: str | bytes, where: str = MANIFEST) -> dict:
    """Parse and check a manifest; anything malformed is a :class:`ManifestError` naming ``where``."""
    try:
        data = json.loads(text)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: absurdly deep nesting
        raise ManifestError(f"{where}: not valid JSON ({exc}); the dataset is damaged, re-pack it") from None
    if not isinstance(data, dict):
        raise ManifestError(f"{where}: not a packer manifest (expected a JSON object)")
    for key, kind in REQUIRED.items():
        if not isinstance(data.get(key), kind) or (kind is int and isinstance(data.get(key), bool)):
            raise ManifestError(f"{where}: missing or malformed {key!r}; the dataset is damaged, re-pack it")
    if data["format_version"] > FORMAT_VERSION:
        raise ManifestError(f"{where}: format version {data['format_version']} is newer than this packer reads "
                            f"({FORMAT_VERSION}); upgrade packer ({pip_hint()})")
    classes = data["classes"]
    if (data["count"] < 0 or not all(isinstance(c, str) for c in classes)
            or data["class_to_idx"] != {c: i for i, c in enumerate(classes)}):
        raise ManifestError(f"{where}: classes, class_to_idx or count are inconsistent; re-pack the dataset")
    counts = data.get("class_counts", [])
    if not (isinstance(counts, list) and len(counts) == len(classes) or "class_counts" not in data) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts):
        raise ManifestError(f"{where}: malformed 'class_counts' (one count a class); the dataset is damaged, "
                            "re-pack it")
    for entry in data["files"]:
        if not (isinstance(entry, dict) and isinstance(entry.get("path"), str) and isinstance(entry.get("bytes"), int)
                and is_safe_relpath(entry["path"])):
            raise ManifestError(f"{where}: malformed entry in 'files'; the dataset is damaged, re-pack it")
    for check in _KEY_CHECKS:
        check(data, where)
    from .images.transforms import TransformSpec  # here, not at the top: `packer info` need not load Pillow otherwise

    try:
        spec = TransformSpec.from_dict(data["transform"])
    except (TypeError, ValueError) as exc:
        raise ManifestError(f"{where}: malformed 'transform' ({exc}); the dataset is damaged, re-pack it") from None
    _check_geometry(data, spec, where)
    return data


def _check_geometry(data: dict, spec, where: str) -> None:
    """The manifest's ``shape`` and ``dtype`` as a reader may allocate from them: a shape is three positive
    ints, each side at most ``MAX_SIDE``, within ``max_pixels``, of the transform's channels."""
    from .images.transforms import MAX_SIDE

    shape = data.get("shape")
    if shape is not None:
        ok = (isinstance(shape, list) and len(shape) == 3
              and all(isinstance(v, int) and not isinstance(v, bool) for v in shape))
        if not ok or not (1 <= shape[0] <= MAX_SIDE and 1 <= shape[1] <= MAX_SIDE and shape[2] == spec.channels
                          and shape[0] * shape[1] <= spec.max_pixels):
            raise ManifestError(f"{where}: 'shape' {str(shape)[:60]} is not an image shape [H, W, {spec.channels}] "
                                f"with sides 1..{MAX_SIDE}; the dataset is damaged, re-pack it")
    if "dtype" in data and data["dtype"] != spec.dtype:
        raise ManifestError(f"{where}: 'dtype' {str(data['dtype'])[:30]!r} disagrees with the transform's "
                            f"{spec.dtype!r}; the dataset is damaged, re-pack it")


def label_bounds(manifest: dict) -> tuple[int, int]:
    """``(low, high)``: the labels a dataset's samples may have, ``low <= label < high``. A dataset whose
    ``fields`` list holds no field of kind ``class`` stores -1 ("no label") and nothing else: a class index there
    means the manifest lost its class field."""
    fields = manifest.get("fields")
    unlabelled = isinstance(fields, list) and not any(isinstance(f, dict) and f.get("kind") == "class"
                                                       for f in fields)
    return (-1, 0) if unlabelled else (0, len(manifest.get("classes", [])))


def max_manifest_bytes() -> int:
    """The most bytes a manifest may have: ``PACKER_MAX_MANIFEST_BYTES``, else 64 MiB."""
    try:
        return max(1, int(os.environ.get("PACKER_MAX_MANIFEST_BYTES", MAX_MANIFEST_BYTES)))
    except ValueError:
        return MAX_MANIFEST_BYTES


def is_safe_name(name: object) -> bool:
    """Whether ``name`` is one plain file or folder name: not empty, ``.`` or ``..``, no separator or NUL."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and "\0" not in name)


def is_safe_relpath(name: object, normalized: bool = False) -> bool:
    """Whether ``name`` is a relative path that stays inside its folder: a non-empty string, '/'-separated, not
    absolute, with no ``..`` component, backslash or NUL. ``normalized`` also refuses empty and ``.``
    components (``a//b``, ``./a``, ``a/``): every component a plain name, as a file to write must be."""
    if not isinstance(name, str) or not name or name.startswith("/") or "\\" in name or "\0" in name:
        return False
    parts = name.split("/")
    if normalized:
        return all(is_safe_name(part) for part in parts)
    return ".." not in parts


def _is_image_folder(folder: Path) -> bool:
    """Whether ``folder`` looks like an image folder (``<class>/**/<image>``): no visible file beside its class
    folders, and an image in one of them."""
    from .images.transforms import is_image_file

    entries = [entry for entry in os.scandir(folder) if not entry.name.startswith(".")]
    if not entries or any(not entry.is_dir() for entry in entries):
        return False
    for dirpath, _, filenames in os.walk(folder):
        if dirpath != str(folder) and any(is_image_file(name) for name in filenames):
            return True
    return False


def _not_a_dataset(dest: Path) -> IncompleteDatasetError:
    """Why the folder ``dest``, which has no manifest, is not a dataset: an interrupted conversion (a progress
    record, or nothing yet), an image folder, or a folder that says neither."""
    if (dest / JOURNAL).exists() or not any(os.scandir(dest)):
        return IncompleteDatasetError(
            f"{dest}: no {MANIFEST}, so its conversion did not finish; run the same `packer pack` command with "
            "--resume to finish it, or with --overwrite to start again")
    if _is_image_folder(dest):
        return IncompleteDatasetError(f"{dest}: is an image folder, not a packed dataset (no {MANIFEST}); pack it "
                                      f"with `packer pack {dest} DEST --format lmdb`")
    return IncompleteDatasetError(f"{dest}: has no {MANIFEST}: not a packed dataset, or one whose conversion did not "
                                  "finish (then run the same `packer pack` command with --resume, or with "
                                  "--overwrite to start again)")


def read_local_manifest(dest: str | os.PathLike) -> dict:
    """Read ``DEST/manifest.json`` of a local folder; a folder without one is a conversion that did not finish.
    For a folder or a URL, :func:`packer.read_manifest` (:func:`packer.remote.entry.read_manifest`)."""
    dest = Path(dest)
    path = dest / MANIFEST
    if not dest.is_dir():
        if dest.exists():
            raise IncompleteDatasetError(f"{dest}: is a file, not a packed dataset folder; give the folder "
                                         "`packer pack` wrote")
        raise IncompleteDatasetError(f"{dest}: no such dataset folder; pack one with `packer pack SRC {dest}`")
    if not path.exists():
        raise _not_a_dataset(dest)
    try:
        size, cap = path.stat().st_size, max_manifest_bytes()
        if size > cap:
            raise ManifestError(f"{path}: {size:,} bytes, over the {cap:,}-byte limit on manifests; the dataset is "
                                "damaged (or raise PACKER_MAX_MANIFEST_BYTES)")
        text = path.read_bytes()
    except OSError as exc:
        raise ManifestError(f"{path}: cannot read ({exc.strerror})") from None
    return parse_manifest(text, str(path))
