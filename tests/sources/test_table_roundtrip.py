"""Tables from strangers round-trip or fail in one line (issue 44's "Done when"): hypothesis writes random annotation
tables (names and values unicode, huge, negative, NaN, nested, empty, repeated; images and masks of random modes
and sizes) and, for every format, a pack either fails with one ``packer: error:`` line or gives a dataset that
opens, reads alike through ``ds[i]``, ``stream``, the plain library and ``export``, verifies deep, and packs back
from its export to the same samples and fields. It runs in its own process under an address-space limit
(tests/workers/roundtrip_worker.py), so that unbounded memory is a failure, not a slow machine.

Its sibling, test_table_properties.py, holds the pack side (each value read back as the table says, refusals in
one line, no DEST left); this one holds the read side: every reader and the export agree on what was packed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
LIMIT = 3 << 30  # address space: torch, numpy and the loader's threads fit; a runaway allocation does not
EXAMPLES = int(os.environ.get("PACKER_ROUNDTRIP_EXAMPLES", "12"))


@pytest.mark.slow
def test_random_tables_round_trip_through_every_format_or_fail_in_one_line(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), *sys.path]), OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, str(TESTS / "workers" / "roundtrip_worker.py"), str(tmp_path),
                             str(EXAMPLES), str(LIMIT)], capture_output=True, text=True, env=env, timeout=1200)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), \
        (result.stdout[-6000:] + result.stderr[-6000:])
