"""benchmarks/fields_pipeline.py (issue 24's benchmark) in its ``--quick`` mode, on a few images of sample_data:
every row is measured and reported, each loader gives the batches its pipeline promises. No timing is checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
IMAGES = 6
SEG_ROWS = ["Pillow + DataLoader, original files (baseline)", "Pillow + DataLoader, files at long side <= 256",
            "packer lmdb", "packer hdf5", "packer wds"]
CAPTION_ROWS = ["webdataset + WebLoader, the same shards (baseline)", "packer wds"]


@pytest.mark.slow
def test_quick_run_reports_every_row_with_the_promised_batches(tmp_path):
    out = tmp_path / "fields"
    cmd = [sys.executable, str(REPO / "benchmarks" / "fields_pipeline.py"), "--quick", "--images", str(IMAGES),
           "--batch-size", "2", "--out", str(out)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / "fields_pipeline.json").read_text())
    rows = result["rows"]
    assert [(r["pipeline"], r["name"]) for r in rows] == ([("image + mask", n) for n in SEG_ROWS]
                                                          + [("image + caption", n) for n in CAPTION_ROWS])
    for row in rows:
        assert row["images"] == IMAGES  # the measured epoch read every sample once
        assert len(row["runs"]) == 1 and row["images_per_s"] > 0
        assert row["ratio"] == row["images_per_s"] / next(
            r["images_per_s"] for r in rows if r["pipeline"] == row["pipeline"] and r.get("baseline"))
        if row["name"].startswith("packer"):
            assert row["target_met"] == (row["ratio"] >= row["target"])
        second = "uint8 (2, 224, 224)" if row["pipeline"] == "image + mask" else "list of 2 str"
        assert row["batch"] == ["uint8 (2, 3, 224, 224)", second], row["name"]
    assert result["settings"]["images"] == IMAGES and result["machine"]["usable_cores"] >= 1
    text = (out / "fields_pipeline.md").read_text()
    assert text in done.stdout  # printed, ready to paste
    assert "--quick --images 6 --batch-size 2" in text and "usable cores" in text
    table_lines = [line for line in text.splitlines() if line.startswith("| ") and "img/s" not in line]
    assert [line.split(" | ")[0][2:] for line in table_lines] == SEG_ROWS + CAPTION_ROWS
    assert all(line.endswith("x |") for line in table_lines)
    assert text.count("Target (issue 24): packer at least") == 2
    for fmt in ("lmdb", "hdf5", "wds"):
        manifest = json.loads((Path(result["work"]) / "packed" / f"seg-{fmt}" / "manifest.json").read_text())
        assert manifest["count"] == IMAGES
