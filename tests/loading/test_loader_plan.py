"""``plan_loader``: the loader ``make_loader`` builds, decided in one place and printable, for the typical cases."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.utils.data import TensorDataset

import packer
from packer.loading.plan import LoaderPlan, plan_loader
from packer.loading.workers import default_start_method

FORKS = default_start_method() == "fork"


@pytest.fixture(scope="module")
def fixed(pack_once, sample_data):
    """A packed dataset whose images all have one shape (56x56 raw)."""
    return packer.open_dataset(pack_once(sample_data, "lmdb", "raw"))


@pytest.fixture(scope="module")
def varying(pack_once, sample_data):
    """A packed dataset whose images differ in shape (short side 50)."""
    return packer.open_dataset(pack_once(sample_data, "lmdb", "raw_var"))


def test_images_of_one_shape_get_packers_worker_pool(fixed):
    plan = plan_loader(fixed, 16, cores=4, cuda=False)
    if not FORKS:  # spawn or forkserver would re-import the user's script: a user who did not ask keeps threads
        assert plan.engine == "threads" and "re-imports the main module" in plan.reason("engine")
        return
    assert (plan.engine, plan.workers, plan.threads, plan.prefetch, plan.pin_memory) == ("pool", 4, 1, 4, False)
    assert plan.reason("workers") == "one per usable core" and plan.reason("pin_memory") == "no CUDA"
    line = str(plan)
    assert "\n" not in line and line.startswith("pool: 4 worker processes (packer's pool), 1 decode thread each")


def test_cuda_pins(fixed):
    plan = plan_loader(fixed, 16, cores=4, cuda=True)
    assert plan.pin_memory and plan.reason("pin_memory") == "CUDA is available"
    assert not plan_loader(fixed, 16, cores=4, cuda=True, overrides={"pin_memory": False}).pin_memory


@pytest.mark.parametrize("asked, reason", [({"overrides": {"num_workers": 0}}, "num_workers=0 given"),
                                           ({"threads": 3}, "threads= given"),
                                           ({"prefetch_batches": 2}, "prefetch_batches= given")])
def test_num_workers_0_or_threads_ask_for_the_threads_engine_and_say_so(fixed, asked, reason):
    plan = plan_loader(fixed, 16, cores=4, cuda=False, **asked)
    assert (plan.engine, plan.workers) == ("threads", 0)
    assert plan.reason("engine") == reason
    assert plan.threads == asked.get("threads", 4)  # one decode thread per usable core unless given
    assert plan.prefetch == asked.get("prefetch_batches", 4)
    assert str(plan).startswith(f"threads: {plan.threads} decode threads in this process, prefetch {plan.prefetch},")


def test_one_core_keeps_threads(fixed):
    plan = plan_loader(fixed, 16, cores=1, cuda=False)
    assert (plan.engine, plan.threads, plan.reason("engine")) == ("threads", 1, "one usable core")


def test_variable_shapes_take_torchs_workers(varying):
    plan = plan_loader(varying, 16, cores=4, cuda=False, overrides={"num_workers": 2})
    assert (plan.engine, plan.workers, plan.threads) == ("torch", 2, 1)
    assert "varying size" in plan.reason("engine")
    default = plan_loader(varying, 16, cores=4, cuda=False)  # no processes asked for: threads in this process
    assert default.engine == "threads" and "varying size" in default.reason("engine")


@pytest.mark.parametrize("overrides, reason", [({"collate_fn": lambda batch: batch}, "collate_fn"),
                                               ({"generator": torch.Generator()}, "generator given"),
                                               ({"persistent_workers": False}, "persistent_workers=False")])
def test_settings_the_pool_does_not_carry_out_take_torchs_workers(fixed, overrides, reason):
    plan = plan_loader(fixed, 16, cores=4, cuda=False, overrides={"num_workers": 2, **overrides})
    assert plan.engine == "torch" and reason in plan.reason("engine")


def test_other_datasets_take_torchs_workers():
    plan = plan_loader(TensorDataset(torch.arange(10)), 4, cores=3, cuda=False)
    assert (plan.engine, plan.workers, plan.threads) == ("torch", 3, 1)
    assert plan.reason("engine") == "TensorDataset is not a packer dataset"


def test_an_explicit_argument_always_wins_over_tuned_settings(fixed):
    tuned = {"num_workers": 2, "threads": 5, "prefetch_factor": 3, "pin_memory": True}
    plan = plan_loader(fixed, 16, cores=4, cuda=False, tuned=tuned)
    assert (plan.engine, plan.workers, plan.threads, plan.prefetch, plan.pin_memory) == ("pool", 2, 1, 3, True)
    assert plan.reason("workers") == "tuned (loader.json)" == plan.reason("prefetch") == plan.reason("pin_memory")
    mine = plan_loader(fixed, 16, cores=4, cuda=False, tuned=tuned, prefetch_batches=1,
                       overrides={"num_workers": 0, "pin_memory": False})
    assert (mine.engine, mine.workers, mine.prefetch, mine.pin_memory) == ("threads", 0, 1, False)
    assert mine.reason("workers") == "num_workers= given" and mine.reason("prefetch") == "prefetch_batches= given"
    assert dict(mine.tuned) == {"threads": 5} == {"threads": mine.threads}  # the in-process loader's, not given
    in_process = plan_loader(fixed, 16, cores=4, cuda=False, tuned={"num_workers": 0, "threads": 5})
    assert (in_process.engine, in_process.threads, in_process.reason("threads")) == ("threads", 5,
                                                                                     "tuned (loader.json)")
    assert plan_loader(fixed, 16, cores=4, cuda=False, threads=2, tuned={"threads": 5}).threads == 2


def test_make_loader_builds_what_the_plan_says_and_logs_it(fixed, caplog):
    with caplog.at_level(logging.INFO, logger="packer.loading.loader"):
        loader = packer.make_loader(fixed, batch_size=8, num_workers=2)
    plan = loader.plan
    assert isinstance(plan, LoaderPlan) and plan == plan_loader(fixed, 8, overrides={"num_workers": 2})
    assert hash(plan) == hash(plan_loader(fixed, 8, overrides={"num_workers": 2}))  # a frozen, hashable value
    assert f"packer: loader plan: {plan}" in caplog.text
    assert (loader.num_workers, loader.threads) == (plan.workers, plan.threads)
    assert (loader.worker_pool_settings is not None) == (plan.engine == "pool")
    threaded = packer.make_loader(fixed, batch_size=8, threads=2)
    assert (threaded.plan.engine, threaded.num_workers, threaded.threads) == ("threads", 0, 2)
    assert threaded.prefetch_batches == threaded.plan.prefetch
    torchs = packer.make_loader(fixed, batch_size=8, num_workers=1, collate_fn=lambda batch: batch)
    assert torchs.plan.engine == "torch" and torchs.worker_pool_settings is None


def test_the_plan_names_the_faster_decoder_for_a_read_time_resize(pack_once, sample_data):
    """A read-time resize with the default decoder: the plan says decoder="fast" is the faster one and what it
    gives up, in words for shrinking (Pillow's filter, against DCT scaling) or enlarging (the float32 kernel,
    against warpAffine). Where the default is already the fast one (a random resized crop, fast asked for, a
    crop without a resize, a raw store), it says nothing."""
    original = pack_once(sample_data, "lmdb", "original")
    plan = plan_loader(packer.open_dataset(original, resize=64, center_crop=56), 16, cores=4, cuda=False)
    assert 'decoder="fast"' in plan.decoder and "30 dB" in plan.decoder and plan.decoder in str(plan)
    assert "shrinks with Pillow" in plan.decoder
    jpeg_112 = pack_once(sample_data, "lmdb", "jpeg_fixed")  # 112 px: read at 128, every image is enlarged
    enlarged = plan_loader(packer.open_dataset(jpeg_112, resize=128, center_crop=112), 16, cores=4, cuda=False)
    assert "enlarges with OpenCV" in enlarged.decoder and 'decoder="fast"' in enlarged.decoder
    assert "shrinks" in plan_loader(packer.open_dataset(jpeg_112, resize=100, center_crop=96), 16, cores=4,
                                    cuda=False).decoder
    quiet = [packer.open_dataset(original, resize=64, center_crop=56, decoder="fast"),
             packer.open_dataset(original, random_resized_crop=56),
             packer.open_dataset(original, center_crop=56),
             packer.open_dataset(pack_once(sample_data, "lmdb", "raw"), resize=64, center_crop=56)]
    for ds in quiet:
        plan = plan_loader(ds, 16, cores=4, cuda=False)
        assert plan.decoder == "" and "decoder" not in str(plan)
