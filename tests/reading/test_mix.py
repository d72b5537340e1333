"""``packer.mix``: several packed datasets read as one, drawn by weight every epoch.

The datasets are real packs (LMDB, WebDataset, HDF5) of distinct noise images, so every sample a mixture gives is
recognised by its pixels in the dataset it came from; labels are checked by class name. The draw's guarantees are
checked on the draw itself and on what the loaders hand out (the pool, threads, ``num_workers=0``).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from support.fields import SCHEMA, write_dataset
from support.packed import noise_pack, pixel_digest
from support.processes import one_line_value_error

import packer
from packer.reading.indices import EpochIndex
from packer.reading.mix import apportion, epoch_draw

SIDE = 16
A_COUNT, B_COUNT, C_COUNT = 30, 7, 12
# B's classes overlap A's in one name ("beta") and add one ("zeta"): the mixture's labels are A's, then zeta
A_CLASSES, B_CLASSES, C_CLASSES = ["alpha", "beta", "gamma"], ["beta", "zeta"], ["alpha", "beta", "gamma"]


@pytest.fixture(scope="module")
def packs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mix")
    return {"a": noise_pack(root, "lmdb", A_COUNT, A_CLASSES, 1),
            "b": noise_pack(root, "wds", B_COUNT, B_CLASSES, 2, shard_samples=3),
            "c": noise_pack(root, "hdf5", C_COUNT, C_CLASSES, 3),
            "big": noise_pack(root, "lmdb", 4, A_CLASSES, 4, side=24)}


def opened(packs: dict[str, Path], *names: str, **options) -> list:
    return [packer.open_dataset(packs[n], **options) for n in names]


def recognise(datasets: list) -> dict[str, tuple[int, int, str]]:
    """Each sample of ``datasets`` by its pixels: ``(source, index, class name)``."""
    table = {}
    for k, ds in enumerate(datasets):
        for i in range(len(ds)):
            image, label = ds[i]
            table[pixel_digest(image)] = (k, i, ds.classes[label])
    assert len(table) == sum(len(ds) for ds in datasets), "the test images are distinct"
    return table


def by_source(sources: np.ndarray, samples: np.ndarray, k: int) -> list[int]:
    return samples[sources == k].tolist()


# -- the draw ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("weights, total", [([3, 1], 100), ([0.7, 0.2, 0.1], 1000), ([1, 1, 1], 10),
                                            ([1e-3, 1], 2000), ([5, 2, 2, 1], 7)])
def test_each_dataset_gets_its_share_rounded_and_the_counts_add_up(weights, total):
    counts = apportion(weights, total)
    assert sum(counts) == total
    for count, weight in zip(counts, weights, strict=True):
        assert abs(count - total * weight / sum(weights)) < 1


def test_every_epoch_holds_exactly_the_counts_and_each_prefix_is_within_the_sampling_tolerance():
    """The counts are exact every epoch. Within an epoch, the first m positions are m drawn without replacement
    from the epoch's turns, so dataset k's count among them is hypergeometric: mean m n_k / L, variance
    m (n_k / L) (1 - n_k / L) (L - m) / (L - 1). Every prefix (in steps of a batch of 64) is held within 4.5
    standard deviations, over 5 epochs and 3 datasets (a two-sided 4.5 sigma tail is below 1e-5 per prefix)."""
    sizes, weights, total = [1000, 50, 300], [0.6, 0.3, 0.1], 4000
    counts = apportion(weights, total)
    for epoch in range(5):
        sources, _ = epoch_draw(sizes, counts, seed=7, epoch=epoch)
        assert np.bincount(sources, minlength=3).tolist() == counts
        for m in range(64, total, 64):
            seen = np.bincount(sources[:m], minlength=3)
            for k, n in enumerate(counts):
                p = n / total
                sd = math.sqrt(m * p * (1 - p) * (total - m) / (total - 1))
                assert abs(seen[k] - m * p) <= 4.5 * sd + 1e-9, (epoch, m, k, seen[k], m * p, sd)


def test_no_sample_twice_before_all_came_and_each_round_is_freshly_shuffled():
    sizes, counts = [7, 30, 12], [50, 20, 12]  # 7 drawn 50 times, 30 drawn 20 times, 12 exactly once
    for epoch in range(3):
        sources, samples = epoch_draw(sizes, counts, seed=3, epoch=epoch)
        small = by_source(sources, samples, 0)
        rounds = [small[r:r + 7] for r in range(0, 50, 7)]
        assert all(sorted(r) == list(range(7)) for r in rounds[:-1]), "each full round is every sample once"
        assert len(set(rounds[-1])) == len(rounds[-1]) == 50 % 7
        assert len({tuple(r) for r in rounds[:-1]}) == len(rounds) - 1, "each round in a fresh order"
        part = by_source(sources, samples, 1)
        assert len(set(part)) == 20 and set(part) <= set(range(30)), "a part of the large one, none twice"
        assert sorted(by_source(sources, samples, 2)) == list(range(12))
    parts = [set(by_source(*epoch_draw(sizes, counts, seed=3, epoch=e), 1)) for e in range(3)]
    assert parts[0] != parts[1] != parts[2], "another part of the large one each epoch"


def test_the_draw_depends_only_on_seed_and_epoch():
    sizes, counts = [30, 7], [40, 20]

    def draw(seed, epoch):
        return [a.tolist() for a in epoch_draw(sizes, counts, seed, epoch)]

    assert draw(5, 2) == draw(5, 2)
    assert draw(5, 2) != draw(5, 3) and draw(5, 2) != draw(6, 2)
    assert draw(2**63 - 1, 0) != draw(2**63 - 2, 0)


# -- the dataset ---------------------------------------------------------------------------------------------------

def test_positions_read_the_drawn_samples_with_labels_by_class_name(packs):
    sets = opened(packs, "a", "b", "c")
    table = recognise(sets)
    ds = packer.mix(sets, [2, 1, 1], seed=11, samples_per_epoch=60)
    assert len(ds) == 60 and ds.counts == [30, 15, 15] and ds.names == [str(packs[n]) for n in "abc"]
    assert ds.classes == ["alpha", "beta", "gamma", "zeta"]
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        for p in range(len(ds)):
            image, label, source = ds[p]
            k, index, name = table[pixel_digest(image)]
            assert (k, index) == (source, ds.locate(p)[1]) == ds.locate(p, epoch)
            assert ds.classes[label] == name, "the label names the sample's class"
        assert ds[EpochIndex(5, 1 - epoch)][2] == ds.locate(5, 1 - epoch)[0], "an index's epoch wins"
    with pytest.raises(IndexError):
        ds[60]
    assert torch.equal(ds[-1][0], ds[59][0]) and ds[-1][1:] == ds[59][1:]
    assert ds[torch.tensor(7)][2] == ds[np.int64(7)][2] == ds.locate(7)[0]
    for bad in (1.5, "1", None, True):
        with pytest.raises(TypeError):
            ds[bad]


@pytest.mark.parametrize("engine", ["pool", "threads", "zero"])
def test_loaders_give_every_drawn_sample_of_every_epoch_with_its_source(packs, engine):
    sets = opened(packs, "a", "b", "c")
    table = recognise(sets)
    ds = packer.mix(sets, [1, 2, 1], seed=4, samples_per_epoch=50)
    kwargs = {"pool": {"num_workers": 2}, "threads": {"threads": 2}, "zero": {"num_workers": 0}}[engine]
    loader = packer.make_loader(ds, batch_size=8, **kwargs)
    assert loader.plan.engine == ("pool" if engine == "pool" else "threads")
    for epoch in range(2):
        seen = []
        for images, labels, sources in loader:
            assert images.shape[1:] == (3, SIDE, SIDE) and sources.dtype == torch.int64
            for image, label, source in zip(images, labels.tolist(), sources.tolist(), strict=True):
                k, index, name = table[pixel_digest(image)]
                assert k == source and ds.classes[label] == name
                seen.append((k, index))
        drawn = [ds.locate(p, epoch) for p in range(len(ds))]
        assert seen == drawn, "the epoch's draw, in order"
        assert np.bincount([k for k, _ in seen], minlength=3).tolist() == ds.counts


def test_datasets_read_at_two_sizes_make_batches_that_say_so_in_one_line(packs):
    ds = packer.mix([packer.open_dataset(packs["a"], random_resized_crop=8),
                     packer.open_dataset(packs["b"], random_resized_crop=12)])
    assert ds.output_shape() is None
    loader = packer.make_loader(ds, batch_size=37)
    assert loader.plan.engine == "threads", "the pool needs images of one size"
    with pytest.raises(packer.PackerError, match=r"^images in one batch differ in size .*random_resized_crop"):
        next(iter(loader))


def test_images_of_varying_size_and_per_item_transforms_come_with_their_source(packs):
    sets = [packer.open_dataset(packs["a"]), packer.open_dataset(packs["big"])]  # 16 and 24 px: no one size
    ds = packer.mix(sets, seed=1)
    items = ds.read_batch([EpochIndex(p, 0) for p in range(len(ds))], threads=2)
    assert sorted({tuple(image.shape) for image, _, _ in items}) == [(3, 16, 16), (3, 24, 24)]
    assert [s for _, _, s in items] == [ds.locate(p, 0)[0] for p in range(len(ds))]
    flipped = [packer.open_dataset(packs[n], transform=lambda t: t.flip(-1)) for n in "ac"]
    mixed = packer.mix(flipped, seed=2)
    loader = packer.make_loader(mixed, batch_size=7, num_workers=0)
    assert loader.plan.engine == "threads"
    plain = opened(packs, "a", "c")
    for images, labels, sources in loader:
        assert images.shape[0] == len(labels) == len(sources)
    p = 3
    k, index = mixed.locate(p)
    assert torch.equal(mixed[p][0], plain[k][index][0].flip(-1))


def test_datasets_with_fields_mix_as_dicts_or_as_the_fields_asked(tmp_path):
    values = {"lmdb": write_dataset(tmp_path / "l", "lmdb", SCHEMA), "wds": write_dataset(tmp_path / "w", "wds",
                                                                                          SCHEMA, count=5)}
    sets = [packer.open_dataset(tmp_path / "l"), packer.open_dataset(tmp_path / "w")]
    ds = packer.mix(sets, [1, 1], seed=3, samples_per_epoch=20)
    for kwargs in ({"num_workers": 2}, {"num_workers": 0}):
        loader = packer.make_loader(ds, batch_size=6, **kwargs)
        for batch in loader:
            assert list(batch) == [f.name for f in SCHEMA] + ["source"]
            assert batch["mask"].shape[1:] == (48, 64) and batch["image"].shape[1:] == (3, 48, 64)
            for j, k in enumerate(batch["source"].tolist()):
                expected = values["lmdb" if k == 0 else "wds"]
                caption = batch["caption"][j]
                i = int(caption.split()[4])
                assert caption == expected[i]["caption"] and batch["label"][j] == expected[i]["label"]
                assert np.array_equal(batch["mask"][j].numpy(), expected[i]["mask"])
    narrowed = packer.mix([tmp_path / "l", tmp_path / "w"], fields=("caption", "source", "image"))
    caption, source, image = narrowed[0]
    assert isinstance(caption, str) and source == narrowed.locate(0)[0] and image.shape == (3, 48, 64)
    loader = packer.make_loader(narrowed, batch_size=4, num_workers=2)
    captions, sources, images = next(iter(loader))
    assert len(captions) == 4 and sources.shape == (4,) and images.shape == (4, 3, 48, 64)


def test_a_mixture_is_one_dataset_for_the_sampler_and_its_state_names_the_mixture(packs):
    ds = packer.mix(opened(packs, "a", "b"), [1, 1], seed=9, samples_per_epoch=40)
    loader = packer.make_loader(ds, batch_size=8, num_workers=0)
    state = loader.state_dict()
    assert state["dataset_length"] == 40 and state["mixture"] == {"seed": 9, "sizes": [30, 7], "counts": [20, 20]}
    other = packer.make_loader(packer.mix(opened(packs, "a", "b"), [1, 1], seed=8, samples_per_epoch=40),
                               batch_size=8, num_workers=0)
    one_line_value_error(lambda: other.load_state_dict(state), "mixture=")
    plain = packer.make_loader(packer.open_dataset(packs["a"]), batch_size=8, num_workers=0)
    one_line_value_error(lambda: plain.load_state_dict(dict(state, dataset_length=30)), "mixture")


# -- bad input -----------------------------------------------------------------------------------------------------

def test_bad_arguments_are_one_line_errors_that_name_what_to_change(packs):
    sets = opened(packs, "a", "b")
    one_line_value_error(lambda: packer.mix([]), "datasets")
    one_line_value_error(lambda: packer.mix(str(packs["a"])), "datasets")
    one_line_value_error(lambda: packer.mix([42]), "int")
    one_line_value_error(lambda: packer.mix(sets, [1]), "weights", "2")
    one_line_value_error(lambda: packer.mix(sets, [1, 0]), "weights", "0")
    one_line_value_error(lambda: packer.mix(sets, [1, float("nan")]), "weights")
    one_line_value_error(lambda: packer.mix(sets, [1000, 1], samples_per_epoch=10), str(packs["b"]), "no sample")
    one_line_value_error(lambda: packer.mix(sets, samples_per_epoch=0), "samples_per_epoch")
    one_line_value_error(lambda: packer.mix(sets, seed=-1), "seed")
    one_line_value_error(lambda: packer.mix(sets, fields=("image", "nope")), str(packs["a"]), "nope")
    ds = packer.mix(sets)
    for shuffle in (False, "blocks"):
        one_line_value_error(lambda s=shuffle: packer.make_loader(ds, shuffle=s), "shuffle", "mix")


def test_datasets_that_give_other_fields_are_refused(packs, tmp_path):
    write_dataset(tmp_path / "f", "lmdb", SCHEMA)
    one_line_value_error(lambda: packer.mix([packs["a"], tmp_path / "f"]), str(tmp_path / "f"), "fields=")
    both = packer.mix([packs["a"], tmp_path / "f"], fields=("image", "label"))  # narrowed to what they share
    image, label, *rest = both[0]
    assert rest == [] and image.shape[0] == 3
