"""Shuffle quality: the batch-mixing score of an order, and its measurement on a dataset packed in class order."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import write_image

import packer
from packer.bench.shuffle_quality import batch_mixing, quality_lines, sampler_labels, shuffle_quality


def test_hand_cases_have_exact_values():
    assert batch_mixing([0, 1, 0, 1], 2) == 0.0  # every batch is the global half and half
    assert batch_mixing([0, 0, 1, 1], 2) == 0.5  # each batch one class of two: |1 - 1/2| / 2 * 2
    assert batch_mixing([0, 0, 0, 1, 1, 1], 3) == 0.5
    # batches (0,0,1) and (1,2,2); global 1/3 each: TV of each is (1/3 + 1/3 + 0... ) -> 1/3
    assert batch_mixing([0, 0, 1, 1, 2, 2], 3) == pytest.approx(1 / 3)
    assert batch_mixing([2, 2, 2, 2], 4) == 0.0  # one batch is the whole sequence
    assert batch_mixing([0, 1, 0, 1, 1], 2) == pytest.approx(0.1)  # the partial last batch is left out


def test_sorted_order_scores_high_and_a_uniform_shuffle_low():
    classes, per_class, batch = 10, 500, 64
    ordered = np.repeat(np.arange(classes), per_class)
    shuffled = np.random.default_rng(0).permutation(ordered)
    assert batch_mixing(ordered, batch) > 0.85  # nearly every batch is one class: 1 - 1/10 = 0.9
    # a uniform shuffle: each batch a sample of 64, distance of the order of sqrt(classes / batch) / 2
    assert batch_mixing(shuffled, batch) < 0.2
    assert batch_mixing(sampler_labels(ordered, batch, seed=3), batch) < 0.2


@pytest.mark.parametrize("labels, batch, message", [([], 4, "no labels"), ([0, -1], 2, "non-negative"),
                                                    ([0, 1], 0, "at least 1")])
def test_bad_input_is_a_value_error(labels, batch, message):
    with pytest.raises(ValueError, match=message):
        batch_mixing(labels, batch)


def test_shuffle_quality_on_a_wds_packed_in_class_order(tmp_path):
    src = tmp_path / "src"
    for c in range(4):
        for i in range(60):
            write_image(src / f"c{c}" / f"{i:03d}.png", 8, 8, seed=i)
    dest = tmp_path / "wds"
    packer.pack(src, dest, "wds", shuffle=False, store="png", workers=1, progress=False, shard_samples=40)
    rows = shuffle_quality(dest, batch_size=15, buffers=(8, 240))
    mixing = {row["order"]: row["mixing"] for row in rows}
    assert mixing["packed order (no shuffle)"] == pytest.approx(0.75)  # one class of four in every batch
    assert mixing["make_loader(shuffle=True)"] < 0.35
    assert mixing["stream(buffer=240)"] < mixing["stream(buffer=8)"] <= 0.75
    assert "| make_loader(shuffle=True) |" in "\n".join(quality_lines(rows, 15))
