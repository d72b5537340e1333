"""benchmarks/peers/remote_peers.py, packer's rows only (no peer venvs): it packs, serves the copy from a local
S3 server (s3_lite, or moto behind the latency proxy), reads it through packer from the URL and from local files,
and reports every row with its samples, cache, CPU and shuffle quality; and s3_lite answers the S3 calls the tools
make. No timing is asserted."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "peers" / "remote_peers.py"


def load_script():
    spec = importlib.util.spec_from_file_location("remote_peers", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_row_with_failed_reads_says_how_many_and_why_beside_the_medians_of_the_others():
    script = load_script()
    row = {"row": "streaming", "tool": "streaming", "format": "streaming", "url": "s3://b/s", "cache_limit": 2**20,
           "peak_cache": 2**20, "epoch1_samples": 300, "epoch1_sps": 20.0, "epoch1_sps_min": 18.0,
           "epoch1_sps_max": 22.0, "epoch2_sps": 50.0, "epoch2_sps_min": 40.0, "epoch2_sps_max": 60.0, "gets": 500,
           "mixing": 0.07, "runs": [{}, {}], "repeats": 3, "failures": ["ValueError: in a worker"],
           "reader_cpu": 12.34, "server_cpu": 0.56}
    refused = {"row": "packer wds", "tool": "packer", "url": "s3://b/p", "cache_limit": 2**20,
               "error": "RemoteError: over cache_limit"}
    results = {"cache_fraction": 0.125, "images": 300, "latency_ms": 20, "batch_size": 64, "workers": 2,
               "repeats": 3, "date": "today", "command": "python remote_peers.py", "publishable": False,
               "machine": {"cpu": "cpu", "cores": 2, "memory_gib": 8, "load_start": [3, 2, 1], "load_end": [3, 2, 1]},
               "first_format": "wds", "local_sps": {"wds": 100.0}, "rows": [row, refused], "reference": []}
    text = script.table(results)
    assert "| streaming (1 of 3 reads failed: ValueError: in a worker) | URL | 1.0 MB | 1.0 MB | 300 | 20 [18-22] | " \
           "50 [40-60] | 0.50 | 500 | 12.3, 0.6 | 0.070 |" in text
    assert "| packer wds | s3://b/p | 1.0 MB | | | failed: RemoteError: over cache_limit |" in text
    assert "Not publishable" in text


@pytest.mark.slow
@pytest.mark.remote
@pytest.mark.parametrize("server", ["lite", "moto"])
def test_packer_rows_read_the_url_through_the_server_and_report_shuffle_quality(sample_data, tmp_path, server):
    out = tmp_path / "remote"
    cmd = [sys.executable, str(SCRIPT), str(sample_data), "--tools", "packer", "--packer-formats", "wds",
           "--repeats", "1", "--blocks", "8", "--cache-fraction", "1", "--settle", "0", "--latency-ms", "5",
           "--server", server, "--out", str(out)]
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
    assert local["gets"] == 0 and remote["gets"] > 0  # the URL row went through the server, the local one not
    assert remote["reader_cpu"] > 0 and remote["server_cpu"] > 0 and results["server"] == server
    assert remote["url"].startswith("s3://") and 0 < remote["peak_cache"] <= remote["cache_limit"]
    assert [r["order"] for r in results["reference"]] == ["(stored class order)",
                                                          "(a full permutation, packer shuffle=True)"]
    table = (out / "results.md").read_text()
    assert "| packer wds | URL |" in table and "shuffle mixing" in table
    assert "load average at the start" in table
    assert results["publishable"] in (True, False) and results["machine"]["cores"] >= 1


@pytest.mark.remote
def test_s3_lite_answers_the_calls_boto3_and_s3fs_make(tmp_path, monkeypatch):
    """GetObject whole and ranged (the last bytes too), HeadObject, ListObjectsV2 folded at a delimiter and paged,
    NoSuchKey and an unsatisfiable range as S3 answers them; every GET counted."""
    import boto3
    import s3fs
    from botocore.exceptions import ClientError

    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import s3_lite

    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(key, "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    data = bytes(range(256)) * 400
    (tmp_path / "bucket" / "ds" / "sub").mkdir(parents=True)
    (tmp_path / "bucket" / "ds" / "a.bin").write_bytes(data)
    (tmp_path / "bucket" / "ds" / "sub" / "b.bin").write_bytes(b"hello")
    server = s3_lite.serve(tmp_path, latency=0.0)
    try:
        client = boto3.client("s3", endpoint_url=server.url)
        assert client.get_object(Bucket="bucket", Key="ds/a.bin")["Body"].read() == data
        assert client.get_object(Bucket="bucket", Key="ds/a.bin", Range="bytes=10-19")["Body"].read() == data[10:20]
        assert client.get_object(Bucket="bucket", Key="ds/a.bin", Range="bytes=-5")["Body"].read() == data[-5:]
        assert client.head_object(Bucket="bucket", Key="ds/a.bin")["ContentLength"] == len(data)
        listed = client.list_objects_v2(Bucket="bucket", Prefix="ds/", Delimiter="/")
        assert [o["Key"] for o in listed["Contents"]] == ["ds/a.bin"]
        assert [p["Prefix"] for p in listed["CommonPrefixes"]] == ["ds/sub/"]
        pages = client.get_paginator("list_objects_v2").paginate(Bucket="bucket", MaxKeys=1)
        assert [o["Key"] for page in pages for o in page["Contents"]] == ["ds/a.bin", "ds/sub/b.bin"]
        with pytest.raises(ClientError, match="NoSuchKey"):
            client.get_object(Bucket="bucket", Key="ds/none")
        with pytest.raises(ClientError, match="InvalidRange"):
            client.get_object(Bucket="bucket", Key="ds/a.bin", Range=f"bytes={len(data)}-")
        fs = s3fs.S3FileSystem(endpoint_url=server.url, skip_instance_cache=True)
        assert fs.cat_file("bucket/ds/a.bin", start=5, end=50) == data[5:50]
        assert fs.info("bucket/ds/a.bin")["size"] == len(data) and fs.info("bucket/ds")["type"] == "directory"
        assert sorted(fs.ls("bucket/ds")) == ["bucket/ds/a.bin", "bucket/ds/sub"]
        assert not fs.exists("bucket/ds/none")
        assert server.gets("a.bin") >= 5
    finally:
        server.stop()
