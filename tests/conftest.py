"""Shared, generic fixtures: the independent references tests compare with (none of them calls packer), and
``pack_once``, the session's cache of packed datasets."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

REPO = Path(__file__).resolve().parent.parent
SAMPLE_DATA = REPO / "sample_data"
# torchvision.datasets.folder.IMG_EXTENSIONS, written out here on purpose (not imported from packer).
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


@pytest.fixture(scope="session")
def sample_data() -> Path:
    """The repository's 150-image ImageFolder (5 classes)."""
    assert SAMPLE_DATA.is_dir(), SAMPLE_DATA
    return SAMPLE_DATA


def synthetic_image(width: int, height: int, seed: int = 0) -> Image.Image:
    """A smooth, seed-dependent RGB image (smooth so that JPEG keeps it well above 30 dB)."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, size=(4, 4, 3), dtype=np.uint8)
    return Image.fromarray(coarse, "RGB").resize((width, height), Image.Resampling.BICUBIC)


def noise_folder(root: Path, count: int, side: int, ext: str, classes: int = 3) -> Path:
    """``count`` distinct side x side RGB noise images, ``root/class{i % classes}/img{i:02d}.{ext}`` (seed 0)."""
    rng = np.random.default_rng(0)
    for i in range(count):
        path = root / f"class{i % classes}" / f"img{i:02d}.{ext}"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(path)
    return root


def write_image(path: str | os.PathLike, width: int = 64, height: int = 48, seed: int = 0, mode: str = "RGB",
                fmt: str | None = None, **save_kwargs) -> Path:
    """Write a synthetic image at ``path`` (parents created) in ``mode``; the format follows the suffix
    unless ``fmt`` is given."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    img = synthetic_image(width, height, seed)
    if mode == "I;16":
        img = Image.fromarray(np.asarray(img.convert("L")).astype("<u2") * 257)  # a 16-bit grey image
    elif mode == "RGBA":
        img = img.copy()
        img.putalpha(Image.linear_gradient("L").resize(img.size))
    elif mode == "P":
        img = img.convert("P", palette=Image.Palette.ADAPTIVE, colors=128)
    elif mode != "RGB":
        img = img.convert(mode)
    img.save(path, fmt, **save_kwargs)
    return path


@pytest.fixture
def make_image():
    """``make_image(path, width=64, height=48, seed=0, mode="RGB", fmt=None, **save_kwargs) -> Path``."""
    return write_image


def imagefolder_reference(root: str | os.PathLike, include_hidden: bool = False):
    """torchvision ``ImageFolder``'s rules: sorted class folders, ``sorted(os.walk(followlinks=True))``, sorted
    file names, case-insensitive extensions. With ``include_hidden=False`` every path with a component that
    starts with '.' is dropped, as packer documents. Returns ``(classes, class_to_idx, [(relpath, label)])``."""
    root = str(root)
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    if not include_hidden:
        classes = [c for c in classes if not c.startswith(".")]
    class_to_idx = {c: i for i, c in enumerate(classes)}
    samples = []
    for cls in classes:
        for dirpath, _, fnames in sorted(os.walk(os.path.join(root, cls), followlinks=True)):
            for fname in sorted(fnames):
                if not fname.lower().endswith(IMG_EXTENSIONS):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, fname), root).replace(os.sep, "/")
                if include_hidden or not any(part.startswith(".") for part in rel.split("/")):
                    samples.append((rel, class_to_idx[cls]))
    return classes, class_to_idx, samples


@pytest.fixture(scope="session")
def reference_scan():
    """``reference_scan(root, include_hidden=False) -> (classes, class_to_idx, samples)``: ImageFolder's rules."""
    return imagefolder_reference


def stored_samples(dest: Path) -> list[tuple[str, int, bytes]]:
    """Every sample of a packed dataset as (relpath, label, stored bytes), read with checksums on."""
    import packer

    ds = packer.open_dataset(dest, decode=False, verify=True)
    out = []
    for i in range(len(ds)):
        data, label = ds.raw_sample(i)
        out.append((ds.relpath(i), label, data.tobytes() if isinstance(data, np.ndarray) else bytes(data)))
    return out


def snapshot(root: str | os.PathLike) -> dict[str, bytes | None]:
    """Every path under ``root`` with its bytes (None for folders): compare two snapshots to prove nothing
    changed."""
    root = Path(root)
    out: dict[str, bytes | None] = {}
    for path in sorted(root.rglob("*")):
        out[str(path.relative_to(root))] = None if path.is_dir() else path.read_bytes()
    return out


@pytest.fixture(scope="session")
def tree_snapshot():
    """``tree_snapshot(root) -> {relpath: bytes or None}``."""
    return snapshot


@pytest.fixture(scope="session")
def run_packer():
    """``run_packer(*args, cwd=None) -> CompletedProcess``: the real CLI, ``python -m packer ARGS``, in a
    subprocess, text output captured."""

    def run(*args: str | os.PathLike, cwd: str | os.PathLike | None = None, timeout: float = 300):
        env = dict(os.environ, PYTHONIOENCODING="utf-8")
        return subprocess.run([sys.executable, "-m", "packer", *map(str, args)], capture_output=True, text=True,
                              encoding="utf-8", cwd=cwd, env=env, timeout=timeout)

    return run


# Markers for a quick local run (`pytest -m "not slow and not distributed and not remote"`); CI runs everything.
# Given by module here, so that a new test in one of these files is marked without anyone remembering to.
_MARKS_BY_MODULE = {
    "test_distributed": ("distributed",), "test_distributed_pack": ("distributed",),
    "test_parts_blocks": ("distributed", "remote"),  # packs by torchrun, then reads from a server
    "test_remote": ("remote",), "test_blocked_remote": ("remote",), "test_presigned": ("remote",),
    "test_bench": ("slow",), "test_orphans": ("slow",), "test_untrusted": ("slow", "remote"),
    "test_resume_loader": ("slow", "distributed"), "test_kill_resume": ("slow",),
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for mark in _MARKS_BY_MODULE.get(item.module.__name__.rpartition(".")[2], ()) if item.module else ():
            item.add_marker(mark)


# The quick run must start no torchrun and no server: a test (or the fixtures it asks for) that starts one without
# its marker fails, here and in tests/support/remote.py, instead of slowing the quick run down unseen.
RUNNING_MARKS: set[str] = set()
_popen_init = subprocess.Popen.__init__


def _checked_popen(self, args, *rest, **kwargs):
    shown = args if isinstance(args, str) else " ".join(map(str, args))
    if ("torch.distributed.run" in shown or "torchrun" in shown) and "distributed" not in RUNNING_MARKS:
        raise AssertionError(f"this test starts torchrun: mark it distributed ({shown[:120]})")
    _popen_init(self, args, *rest, **kwargs)


subprocess.Popen.__init__ = _checked_popen  # type: ignore[method-assign]


def pytest_runtest_setup(item: pytest.Item) -> None:
    RUNNING_MARKS.clear()
    RUNNING_MARKS.update(mark.name for mark in item.iter_markers())


@pytest.fixture(scope="module")
def quick_retries():
    """Retries 10 ms apart (not 0.2 s) for a module whose servers fail on purpose
    (``pytestmark = pytest.mark.usefixtures("quick_retries")``)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PACKER_RETRY_BACKOFF", "0.01")
        yield


@pytest.fixture(scope="session")
def pack_once(tmp_path_factory):
    """``pack_once(src, fmt, store, **extra) -> Path``: ``src`` packed as ``fmt`` with the options of
    ``packed_support.STORES[store]`` (and ``extra``), once per test session."""
    from support.packed import STORES

    import packer

    done: dict[tuple, Path] = {}

    def get(src: Path, fmt: str, store: str, **extra) -> Path:
        key = (str(src), fmt, store, tuple(sorted(extra.items())))
        if key not in done:
            dest = tmp_path_factory.mktemp(f"{fmt}-{store}") / "ds"
            packer.pack(src, dest, fmt, progress=False, workers=2, **STORES[store], **extra)
            done[key] = dest
        return done[key]

    return get
