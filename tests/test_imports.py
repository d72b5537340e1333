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
