"""``packer pack``, ``info``, ``verify`` and ``export`` start without importing torch: writers and readers need
none (about a second per call); only the Datasets and the loader do."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import write_image


def imported_modules(*args) -> set[str]:
    """The modules ``python -X importtime -m packer ARGS`` imported (it must succeed)."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "packer", *map(str, args)], capture_output=True,
                          text=True, env=dict(os.environ, PYTHONIOENCODING="utf-8"), timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = [line.split("|")[-1] for line in proc.stderr.splitlines() if line.startswith("import time:")]
    return {line.strip() for line in lines[1:]}  # the first line is the header


def test_pack_info_verify_export_import_no_torch(tmp_path):
    src, dest = tmp_path / "src", tmp_path / "ds"
    for i in range(4):
        write_image(src / ("ant", "bee")[i % 2] / f"{i}.jpg", width=20 + i, height=16, seed=i)
    commands = [("pack", src, dest, "--format", "wds"), ("info", dest), ("verify", dest, "--deep"),
                ("export", dest, tmp_path / "out")]
    for args in commands:
        modules = imported_modules(*args)
        assert "packer.cli" in modules  # the listing is real
        assert not {m for m in modules if m == "torch" or m.startswith("torch.")}, args[0]
    assert sorted(p.name for p in (tmp_path / "out" / "ant").iterdir()) == ["0.jpg", "2.jpg"]


WITHOUT_FCNTL = """
import runpy, sys
sys.modules["fcntl"] = None  # as on Windows: "import fcntl" raises ImportError
if sys.argv[1] == "cli":
    sys.argv = ["packer", *sys.argv[2:]]
    runpy.run_module("packer", run_name="__main__")
import packer
src, dest = sys.argv[2], sys.argv[3]
packer.pack(src, dest, "lmdb", workers=1, progress=False)
ds = packer.open_dataset(dest, resize=16, center_crop=16)
loader = packer.make_loader(ds, batch_size=2, num_workers=0, tuned=False)  # the threaded loader
print(len(ds), sum(len(labels) for _, labels in loader))
"""


def test_packer_works_without_fcntl(tmp_path):
    """Windows has no ``fcntl``: ``import packer``, pack, info, verify, open_dataset and the threaded loader
    work without it; the only sign is one warning line saying that DEST cannot be locked, and why."""
    src, dest = tmp_path / "src", tmp_path / "ds"
    for i in range(4):
        write_image(src / ("ant", "bee")[i % 2] / f"{i}.jpg", width=20, height=16, seed=i)

    def run(*args) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", WITHOUT_FCNTL, *map(str, args)], capture_output=True,
                              text=True, timeout=300)

    proc = run("python", src, dest)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["4", "4"]
    assert proc.stderr.splitlines() == [
        f"packer: warning: {dest}: cannot lock it ({tmp_path / '.ds.packer-lock'}: this Python has neither fcntl "
        "nor msvcrt, so packer cannot lock files), so packer cannot tell whether another process writes into it; "
        "make sure none does"]
    for args in (("info", dest), ("verify", dest, "--deep")):
        proc = run("cli", *args)
        assert proc.returncode == 0, proc.stderr
        assert proc.stderr == ""


def test_read_manifest_checks_format_keys_in_a_fresh_process(tmp_path):
    """``packer.read_manifest`` as the first call of a process still runs each format's checks of its own keys
    (they register when ``packer.formats`` loads): a wds manifest with a negative shard count is refused."""
    src, dest = tmp_path / "src", tmp_path / "ds"
    for i in range(4):
        write_image(src / ("ant", "bee")[i % 2] / f"{i}.jpg", width=20, height=16, seed=i)
    import json

    import packer

    packer.pack(src, dest, "wds", progress=False, workers=1)
    manifest = json.loads((dest / "manifest.json").read_text())
    manifest["shards"][0]["count"] = -3
    (dest / "manifest.json").write_text(json.dumps(manifest))
    code = (f"import packer\ntry:\n    packer.read_manifest({str(dest)!r})\n"
            "except packer.ManifestError as e:\n    print(e)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "manifest.json" in proc.stdout, (proc.stdout, proc.stderr)
