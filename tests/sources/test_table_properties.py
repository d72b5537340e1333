"""A property test of annotation tables (issue 44): hypothesis writes random tables, with random column names,
values, image and mask files and paths inside and outside the root, and packs each; every pack either gives back
every value exactly (``ds[i]``, floats as float32) and every row that had nothing wrong, or fails in one line of
a usage error leaving no DEST that opens as a dataset. It runs in its own process under a 3 GiB address-space
limit (tests/workers/table_worker.py), so that a value sized from without a bound fails there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_random_tables_pack_exactly_or_fail_in_one_line(tmp_path):
    worker = TESTS / "workers" / "table_worker.py"
    r = subprocess.run([sys.executable, str(worker), str(tmp_path), "40", str(3 << 30)], capture_output=True,
                       text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)]),
                            "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (r.stdout + r.stderr)[-6000:]
    outcomes = json.loads(r.stdout.strip().splitlines()[-2])
    assert outcomes["packed"] >= 8 and outcomes["refused"] >= 8, outcomes  # both sides of the property ran
