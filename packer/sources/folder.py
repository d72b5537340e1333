"""An image folder as a source: scanned with torchvision ``ImageFolder`` semantics (:func:`scan_folder`), each
image read and converted by a worker (:class:`FolderSource`, :class:`FolderSampleReader`).

The rules, as in ``torchvision.datasets.folder`` (``ImageFolder(root, allow_empty=True)``):

- classes are the sorted names of the sub-folders of ``root`` (links followed); ``class_to_idx`` numbers them
  from 0 in that order;
- each class folder is walked recursively with ``os.walk(followlinks=True)``, the walk sorted by folder path and
  the files of each folder sorted by name;
- a file is an image when its name ends, case-insensitively, in one of
  :data:`packer.images.transforms.IMG_EXTENSIONS`.

One deliberate difference: hidden entries (a name that starts with ``.``, such as ``.ipynb_checkpoints`` or
``.DS_Store``) are skipped and counted, unless ``include_hidden=True``. ImageFolder would make
``.ipynb_checkpoints`` a class.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import SourceError
from ..images.transforms import IMG_EXTENSIONS, Encoded, TransformSpec, convert_file, is_image_file
from .base import SampleReader, Source


@dataclass
class ScanResult:
    """What :func:`scan_folder` found. ``samples`` holds ``(relative path with '/' separators, label)``."""

    root: Path
    classes: list[str]
    class_to_idx: dict[str, int]
    samples: list[tuple[str, int]]
    hidden_skipped: int = 0
    empty_classes: list[str] = field(default_factory=list)
    errors: list[tuple[str, str]] = field(default_factory=list)
    loose_images: list[str] = field(default_factory=list)  # images directly in root, beside the class folders


def _is_hidden(name: str) -> bool:
    return name.startswith(".")


def _check_name(relpath: str) -> str | None:
    """Return why ``relpath`` cannot be stored, or None. Names must be valid UTF-8 to go in a manifest or a tar."""
    try:
        relpath.encode("utf-8")
    except UnicodeEncodeError:
        return "file name is not valid UTF-8; rename the file"
    return None


def find_classes(root: Path, include_hidden: bool = False,
                 loose: list[str] | None = None) -> tuple[list[str], int]:
    """Sorted class folder names under ``root``, and how many hidden folders were skipped; ``loose`` gets the
    images directly in ``root`` (which ImageFolder leaves out: they are in no class)."""
    names, hidden = [], 0
    with os.scandir(root) as entries:
        for entry in entries:
            if not entry.is_dir():
                if loose is not None and is_image_file(entry.name) and (include_hidden or not _is_hidden(entry.name)):
                    loose.append(entry.name.encode("utf-8", "backslashreplace").decode())
                continue
            if _is_hidden(entry.name) and not include_hidden:
                hidden += 1
                continue
            names.append(entry.name)
    return sorted(names), hidden


def scan_folder(root: str | os.PathLike, include_hidden: bool = False) -> ScanResult:
    """Scan ``root`` as torchvision's ``ImageFolder(root, allow_empty=True)`` does: the same classes,
    ``class_to_idx`` and (file, label) pairs, in the same order.

    Args:
        root: the image folder, ``root/<class>/**/<image>``.
        include_hidden: keep files and folders whose names start with ``.`` (skipped and counted by default).

    Returns:
        A ``ScanResult``: ``root``, ``classes``, ``class_to_idx``, ``samples`` (relative path with ``/``
        separators, label), ``hidden_skipped``, ``empty_classes`` and ``errors`` (unreadable entries).

    Raises:
        SourceError: ``root`` is missing, is not a folder, or holds no class folder or no image.
    """
    root = Path(root)
    if not root.exists():
        raise SourceError(f"{root}: source folder does not exist; pass the folder that holds one sub-folder per class")
    if not root.is_dir():
        raise SourceError(f"{root}: not a folder; pass the folder that holds one sub-folder per class")
    loose: list[str] = []
    try:
        classes, hidden = find_classes(root, include_hidden, loose)
    except PermissionError:
        raise SourceError(f"{root}: permission denied; make the folder readable") from None
    if not classes:
        raise SourceError(
            f"{root}: no class folders found; an image folder holds one sub-folder per class (root/<class>/<image>)"
        )
    for cls in classes:  # a class name goes in the manifest: it must be UTF-8 (skipping it would renumber classes)
        if _check_name(cls):
            shown = os.fsencode(cls).decode("utf-8", "backslashreplace")
            raise SourceError(f"{root / shown}: class folder name is not valid UTF-8; rename the folder")
    result = ScanResult(root=root, classes=classes, class_to_idx={c: i for i, c in enumerate(classes)}, samples=[])
    result.hidden_skipped = hidden
    result.loose_images = sorted(loose)
    for label, cls in enumerate(classes):
        count = _scan_class(root, cls, label, include_hidden, result)
        if count == 0:
            result.empty_classes.append(cls)
    if not result.samples:
        raise SourceError(f"{root}: no images found (extensions: {' '.join(IMG_EXTENSIONS)})")
    return result


def _links_back(dirpath: str, key: tuple[int, int], folder_ids: dict[str, tuple[int, int]]) -> bool:
    parent = os.path.dirname(dirpath)
    while parent in folder_ids:
        if folder_ids[parent] == key:
            return True
        if os.path.dirname(parent) == parent:  # "" or "/": the top
            break
        parent = os.path.dirname(parent)
    return False


def _scan_class(root: Path, cls: str, label: int, include_hidden: bool, result: ScanResult) -> int:
    count = 0
    folder_ids: dict[str, tuple[int, int]] = {}
    st = os.stat(root)  # a link back to the source root is a loop too (it would repeat every class)
    folder_ids[os.path.dirname(os.fspath(root / cls))] = (st.st_dev, st.st_ino)  # as os.walk spells it

    def onerror(err: OSError) -> None:
        rel = os.path.relpath(err.filename, root).replace(os.sep, "/")
        result.errors.append((rel, f"cannot list folder: {err.strerror}; make it readable"))

    walk = []
    for dirpath, dirnames, filenames in os.walk(root / cls, followlinks=True, onerror=onerror):
        # os.walk(followlinks=True) never stops on a link that points to one of its own parents; stop it here.
        try:
            st = os.stat(dirpath)
        except OSError:
            continue
        key = folder_ids[dirpath] = (st.st_dev, st.st_ino)
        if _links_back(dirpath, key, folder_ids):
            rel = os.path.relpath(dirpath, root).replace(os.sep, "/")
            result.errors.append((rel, "symlink loop: links back to one of its parent folders; remove the link"))
            dirnames[:] = []
            continue
        if not include_hidden:
            result.hidden_skipped += sum(_is_hidden(d) for d in dirnames)
            dirnames[:] = [d for d in dirnames if not _is_hidden(d)]
        walk.append((dirpath, filenames))
    for dirpath, filenames in sorted(walk):
        for name in sorted(filenames):
            if _is_hidden(name) and not include_hidden:
                result.hidden_skipped += 1
                continue
            if not is_image_file(name):
                continue
            rel = os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/")
            problem = _check_name(rel)
            if problem is None and not os.path.exists(os.path.join(dirpath, name)):
                problem = "broken symlink: its target does not exist; fix or remove the link"
            if problem:
                result.errors.append((rel.encode("utf-8", "backslashreplace").decode(), problem))
                continue
            result.samples.append((rel, label))
            count += 1
    return count


# -- image folders -----------------------------------------------------------------------------------------------
class FolderSampleReader(SampleReader):
    """The source images of an image folder, read and converted one by one for a conversion."""

    def __init__(self, root: str, samples: list[tuple[str, int]]):
        self.root = root
        self.samples = samples

    def convert(self, index: int, spec: TransformSpec) -> tuple[str, int, Encoded, tuple[bytes, ...]]:
        relpath, label = self.samples[index]
        return relpath, label, convert_file(os.path.join(self.root, relpath), relpath, spec), ()

    def name(self, index: int) -> str:
        return self.samples[index][0]


class FolderSource(Source):
    """An ImageFolder, scanned with :func:`packer.scan_folder`."""

    kind = "folder"

    def __init__(self, root: str | os.PathLike, include_hidden: bool = False):
        scan = scan_folder(root, include_hidden=include_hidden)
        super().__init__(Path(root), scan.classes, len(scan.samples))
        self.samples = scan.samples
        self.hidden_skipped = scan.hidden_skipped
        self.empty_classes = scan.empty_classes
        self.errors = scan.errors
        self.loose_images = scan.loose_images
        self._stats: tuple[np.ndarray, str] | None = None

    def _stat(self) -> tuple[np.ndarray, str]:
        """One pass over the files: their sizes, and a digest of what the scan found (paths, labels, sizes,
        mtimes)."""
        if self._stats is None:
            sizes = np.zeros(len(self.samples), np.int64)
            h = hashlib.sha256(json.dumps([self.classes, self.errors]).encode())
            for i, (rel, label) in enumerate(self.samples):
                try:
                    st = os.stat(self.root / rel)
                    sizes[i] = st.st_size
                    h.update(f"{rel}\0{label}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
                except OSError:
                    h.update(f"{rel}\0{label}\0missing\n".encode())
            self._stats = sizes, h.hexdigest()
        return self._stats

    def sizes(self) -> np.ndarray:
        return self._stat()[0]

    def fingerprint(self) -> str:
        return self._stat()[1]

    def reader(self) -> SampleReader:
        return FolderSampleReader(str(self.root), self.samples)

    def where(self, relpath: str) -> str:
        return str(self.root / relpath)
