"""benchmarks/peers/remote_peers.py, packer's rows only (no peer venvs): it packs, serves the copy from the local
S3 server behind the latency proxy, reads it through packer from the URL and from local files, and reports
every row with its samples, cache and shuffle quality. No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.remote]

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "peers" / "remote_peers.py"


def test_packer_rows_read_the_url_through_the_proxy_and_report_shuffle_quality(sample_data, tmp_path):
    out = tmp_path / "remote"
    cmd = [sys.executable, str(SCRIPT), str(sample_data), "--tools", "packer", "--packer-formats", "wds",
           "--repeats", "1", "--blocks", "8", "--cache-fraction", "1", "--settle", "0", "--latency-ms", "5",
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    rows = {row["row"]: row for row in results["rows"]}
    assert list(rows) == ["packer wds local", "packer wds"]
    for row in rows.values():
        assert "error" not in row, row["error"]
        assert row["epoch1_samples"] == row["epoch2_samples"] == 150  # every sample, each epoch
        assert 0 <= row["mixing"] < 1
    local, remote = rows["packer wds local"], rows["packer wds"]
    assert local["gets"] == 0 and remote["gets"] > 0  # the URL row went through the proxy, the local one not
    assert remote["url"].startswith("s3://") and 0 < remote["peak_cache"] <= remote["cache_limit"]
    assert [r["order"] for r in results["reference"]] == ["(stored class order)",
                                                          "(a full permutation, packer shuffle=True)"]
    table = (out / "results.md").read_text()
    assert "| packer wds | URL |" in table and "shuffle mixing" in table
    assert "load average at the start" in table
    assert results["publishable"] in (True, False) and results["machine"]["cores"] >= 1
