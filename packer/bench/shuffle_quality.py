"""How well an order mixes: the distance between each batch's label histogram and the dataset's.

A loader's order is good for SGD when every batch looks like the whole dataset. :func:`batch_mixing` scores an
order (the labels in the order a loader yields them) by the mean total-variation distance between each batch's
label histogram and the global one: 0 when every batch holds the classes in the dataset's proportions, near 1
when every batch holds one class of many (a dataset read in class order). Any order can be scored: the map-style
sampler's, :func:`packer.stream`'s shuffle buffer, or a block-wise order.

:func:`shuffle_quality` measures it for ``make_loader(shuffle=True)`` and for ``packer.stream``'s buffer on a
WebDataset packed in class order (``--no-shuffle``); ``packer bench`` reports it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..loading.sampler import ResumableSampler
from ..loading.stream import stream
from ..packing.pack import pack
from ..reading.dataset import open_dataset


def batch_mixing(labels: Sequence[int] | np.ndarray, batch_size: int) -> float:
    """Mean total-variation distance between each batch's label histogram and the whole sequence's.

    Batches are consecutive runs of ``batch_size`` labels; a last partial batch is left out (as with
    ``drop_last``) unless it is the only one. The distance of a batch is half the sum, over classes, of the
    absolute difference between the class's fraction in the batch and in the whole sequence.

    Args:
        labels: class labels (non-negative integers) in the order a loader yields them.
        batch_size: samples per batch.

    Returns:
        A number in [0, 1): 0 when every batch has the global class proportions; close to 1 - 1/classes when
        each batch holds one class of equally many.

    Raises:
        ValueError: no labels, a negative label, or a batch size below 1.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, not {batch_size}")
    values = np.asarray(labels, dtype=np.int64).ravel()
    if values.size == 0:
        raise ValueError("no labels to score: give the labels of at least one batch")
    if values.min() < 0:
        raise ValueError("labels must be non-negative class indices")
    classes = int(values.max()) + 1
    batches = max(1, values.size // batch_size)
    used = values[:batches * batch_size] if values.size >= batch_size else values
    global_fraction = np.bincount(values, minlength=classes) / values.size
    rows = used.reshape(batches, -1)
    counts = np.zeros((batches, classes), dtype=np.int64)
    np.add.at(counts, (np.repeat(np.arange(batches), rows.shape[1]), rows.ravel()), 1)
    fractions = counts / rows.shape[1]
    return float(0.5 * np.abs(fractions - global_fraction).sum(axis=1).mean())


def loader_labels(loader: Iterable[Any]) -> np.ndarray:
    """The labels of one pass over a loader that yields ``(images, labels)`` batches, in order."""
    parts = [np.asarray(labels).ravel() for _, labels in loader]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def sampler_labels(labels: Sequence[int] | np.ndarray, batch_size: int, shuffle: bool | str = True, seed: int = 0,
                   epoch: int = 0, blocks: np.ndarray | None = None, window: int = 4) -> np.ndarray:
    """The labels in the order ``make_loader(ds, batch_size, shuffle=..., seed=...)`` yields them in ``epoch``
    on one rank, without decoding an image (``labels``: the dataset's labels by index; ``blocks``, ``window``:
    ``shuffle="blocks"``'s)."""
    sampler = ResumableSampler(len(labels), batch_size, shuffle=shuffle, seed=seed, num_replicas=1, rank=0,
                               blocks=blocks, window=window)
    sampler.set_epoch(epoch)
    return np.asarray(labels)[np.fromiter((int(i) for i in sampler), np.int64)]


def shuffle_quality(wds_root: str | os.PathLike, batch_size: int, buffers: Sequence[int] = (100, 1000),
                    seed: int = 0) -> list[dict[str, Any]]:
    """Batch mixing of the ways packer can shuffle one WebDataset packed in class order (``--no-shuffle``).

    Args:
        wds_root: the dataset (wds, packed without shuffling, so that the file order is class order).
        batch_size: samples per batch.
        buffers: ``packer.stream`` ``buffer=`` values to measure (each a window of whole shards holding about
            that many samples; each streams the dataset once, in this process, decoding every image).
        seed: the shuffles' seed.

    Returns:
        One row per order: ``{"order", "mixing"}``, the packed order first (the worst case), then
        ``shuffle=True`` (a full permutation, the best an order can do), then each stream buffer.
    """
    ds = open_dataset(wds_root)
    labels = np.asarray([ds.raw_sample(i)[1] for i in range(len(ds))], dtype=np.int64)
    rows = [{"order": "packed order (no shuffle)", "mixing": batch_mixing(labels, batch_size)},
            {"order": "make_loader(shuffle=True)", "mixing": batch_mixing(sampler_labels(labels, batch_size, seed=seed),
                                                                          batch_size)}]
    for buffer in buffers:
        streamed = loader_labels(stream(wds_root, batch_size, shuffle=True, num_workers=0, seed=seed,
                                        buffer=buffer))
        rows.append({"order": f"stream(buffer={buffer})", "mixing": batch_mixing(streamed, batch_size)})
    return rows


def measure_shuffle_quality(src: str | os.PathLike, work: str | os.PathLike, batch_size: int,
                            progress: bool = False) -> dict[str, Any]:
    """Pack ``src`` into ``work`` as a small WebDataset in class order (jpeg, 32 px: only labels matter), then
    :func:`shuffle_quality` on it; ``packer bench``'s shuffle-quality section."""
    dest = Path(work) / "shuffle-quality-wds"
    pack(src, dest, "wds", shuffle=False, store="jpeg", resize=32, center_crop=32, progress=progress)
    return {"batch_size": batch_size, "rows": shuffle_quality(dest, batch_size)}


def quality_lines(rows: Sequence[dict[str, Any]], batch_size: int) -> list[str]:
    """A Markdown table of :func:`shuffle_quality`'s rows."""
    lines = [f"Shuffle quality (mean total-variation distance between each batch's label histogram and the "
             f"dataset's, batch {batch_size}; 0 is perfect mixing):", "", "| order | mixing distance |",
             "|---|---:|"]
    lines += [f"| {row['order']} | {row['mixing']:.3f} |" for row in rows]
    return lines
