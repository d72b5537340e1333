"""The peer benchmark's report: each pipeline against its own baseline, and no README from a busy machine."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

PEERS = Path(__file__).resolve().parents[2] / "benchmarks" / "peers"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"peers_{name}", PEERS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    sys.path.insert(0, str(PEERS))  # run_peers imports report from beside itself
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(PEERS))
    return module


def row(tool: str, pipeline: str, sps: float, **extra) -> dict:
    return {"tool": tool, "variant": f"{tool}-{pipeline}", "pipeline": pipeline, "read_work": "w",
            "warm_epoch1_sps": sps, "warm_epoch2_sps": sps, **extra}


def results(load_start: float, load_end: float, rows: list[dict]) -> dict:
    return {"date": "2026-12-02T18:00:00+00:00", "command": "python run_peers.py", "src": "/data",
            "images": 50, "batch_size": 64, "workers": 2, "epochs": 2, "repeats": 3, "peers": [], "rows": rows,
            "machine": {"cpu": "cpu", "cores": 2, "memory_gib": 8, "os": "Linux", "python": "3.11",
                        "load_start": [load_start, 0, 0], "load_end": [load_end, 0, 0]}}


def test_each_pipeline_is_against_its_own_baseline():
    report = load("report")
    rows = [row("torchvision", "val", 100), row("packer", "val", 300),
            row("torchvision", "train", 50), row("packer", "train", 400, warm_epoch2_sps_min=350,
                                                 warm_epoch2_sps_max=420, repeats=3),
            {"tool": "packer", "variant": "packer-train-2", "pipeline": "train", "error": "NotImplementedError: x"}]
    text = report.pipeline_tables(rows)
    val, train = text.split("**Training pipeline")
    assert "| packer | packer-val | w |" in val and "| 3.00× |" in val and "packer-train" not in val
    assert "| 8.00× |" in train and "400 (350–420)" in train
    assert "failed: NotImplementedError: x" in train


@pytest.mark.parametrize(("load_start", "force", "code", "written"), [
    (5.0, False, 1, False),  # busy at the start: refused
    (5.0, True, 0, True),  # --force overrides
    (1.5, False, 0, True),  # idle: written
])
def test_update_readme_refuses_a_busy_run_unless_forced(tmp_path, capsys, load_start, force, code, written):
    run_peers = load("run_peers")
    old = tmp_path / "results.json"
    old.write_text(json.dumps(results(load_start, 1.0, [])))
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- peers:start -->\nold table\n<!-- peers:end -->\n")
    argv = ["--from-results", str(old), "--out", str(tmp_path / "out"), "--update-readme", "--readme", str(readme)]
    assert run_peers.main(argv + ["--force"] * force) == code
    assert ("old table" not in readme.read_text()) == written
    if not written:
        assert "not publishable" in capsys.readouterr().err
