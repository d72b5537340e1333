"""The conversion driver's structure: one process is a coordinator like a torchrun rank (rank 0 of a world of one),
and the path of ``pack()`` calls down the import layers only, as ``scripts/count_climbs.py --trace`` counts them.
The behaviour of conversions is tested in test_pack, test_resume, test_lock and test_distributed_pack."""

from __future__ import annotations

import importlib.util
import json
from array import array
from pathlib import Path

import numpy as np
from conftest import write_image

from packer.packing.coordinator import Coordinator, detect
from packer.packing.driver import pack_folder
from packer.packing.options import pack_options

REPO = Path(__file__).resolve().parents[2]


def count_climbs():
    spec = importlib.util.spec_from_file_location("count_climbs", REPO / "scripts" / "count_climbs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def small_folder(root: Path) -> Path:
    for k, cls in enumerate(["a", "b"]):
        for i in range(2):
            write_image(root / cls / f"{i}.png", 32, 24, seed=10 * k + i)
    return root


def test_one_process_is_rank_0_of_a_world_of_one():
    coordinator = detect(distributed=False)
    assert type(coordinator) is Coordinator
    assert (coordinator.rank, coordinator.world, coordinator.leads, coordinator.part) == (0, 1, True, None)
    order = array("q", [2, 0, 1])
    assert coordinator.share(order, np.array([5, 6, 7])) == (0, 3)  # the whole order, into DEST itself
    assert coordinator.workers(None) is None and coordinator.workers(3) == 3
    record = {"format": "lmdb"}
    assert coordinator.record(record) == record  # no world_size: a one-process journal never had one
    assert coordinator.agree(True, record) is True


def test_pack_folder_is_what_pack_runs(tmp_path):
    src = small_folder(tmp_path / "src")
    manifest = pack_folder(src, tmp_path / "out", pack_options("lmdb", {"workers": 1, "progress": False}))
    assert json.loads(json.dumps(manifest)) == json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["count"] == 4 and "world_size" not in manifest["options"]
    assert not (tmp_path / "out" / ".packer-in-progress").exists()


def test_the_pack_path_calls_down_the_layers_only(tmp_path):
    """Every call from one packer module into another while pack() runs goes down the package layers: no package
    calls back up into one that called it (the driver calls the plan, DEST's preparation, the conversion, the
    journal, the lock and the coordinator; they call nothing back)."""
    script = count_climbs()
    package_layer = script.layers(script.package_graph(script.imports(REPO)))
    calls = script.trace_pack(REPO, str(small_folder(tmp_path / "src")))
    assert ("packer.packing.pack", "packer.packing.driver") in calls
    assert ("packer.packing.driver", "packer.packing.convert") in calls
    assert script.calls_up(calls, package_layer) == []
