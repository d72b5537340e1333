"""How well a sample order mixes classes: what ``shuffle="blocks"`` trades for its sequential reads.

:func:`label_mixing` scores an order by the mean total-variation distance between each batch's label histogram
and the whole order's: 0 when every batch holds the classes in the dataset's proportions, ``1 - 1/classes`` when
every batch holds one class of equally many (a dataset packed in class order, read in order).
:func:`order_labels` gives the labels in the order ``make_loader`` reads them, without decoding an image, and
:func:`mixing_rows` compares ``shuffle=True`` with ``shuffle="blocks"`` at several windows on one dataset.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def label_mixing(labels: Sequence[int] | np.ndarray, batch_size: int) -> float:
    """Mean total-variation distance between each batch's label histogram and the whole sequence's.

    Batches are consecutive runs of ``batch_size`` labels; a last partial batch is left out unless it is the
    only one.

    Args:
        labels: class indices (non-negative) in the order a loader yields them.
        batch_size: samples per batch.

    Returns:
        A number in [0, 1): 0 is perfect mixing.

    Raises:
        ValueError: no labels, a negative label, or a batch size below 1.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, not {batch_size}")
    values = np.asarray(labels, dtype=np.int64).ravel()
    if values.size == 0 or values.min() < 0:
        raise ValueError("label_mixing needs at least one label, every one a non-negative class index")
    classes = int(values.max()) + 1
    batches = max(1, values.size // batch_size)
    rows = values[:batches * batch_size].reshape(batches, -1) if values.size >= batch_size else values[None, :]
    counts = np.stack([np.bincount(row, minlength=classes) for row in rows]) / rows.shape[1]
    overall = np.bincount(values, minlength=classes) / values.size
    return float(0.5 * np.abs(counts - overall).sum(axis=1).mean())


def order_labels(labels: Sequence[int] | np.ndarray, batch_size: int, shuffle: bool | str = True, seed: int = 0,
                 epoch: int = 0, blocks: np.ndarray | None = None, window: int = 4) -> np.ndarray:
    """The labels in the order ``make_loader(ds, batch_size, shuffle=..., seed=...)`` reads them in ``epoch`` on
    one rank (``labels``: the dataset's, by index; ``blocks``, ``window``: ``shuffle="blocks"``'s)."""
    from ..sampler import ResumableSampler

    sampler = ResumableSampler(len(labels), batch_size, shuffle=shuffle, seed=seed, num_replicas=1, rank=0,
                               blocks=blocks, window=window)
    sampler.set_epoch(epoch)
    return np.asarray(labels)[np.fromiter((int(i) for i in sampler), np.int64, len(labels))]


def mixing_rows(labels: Sequence[int] | np.ndarray, blocks: np.ndarray, batch_size: int,
                windows: Sequence[int] = (1, 4, 16), seed: int = 0) -> list[dict[str, Any]]:
    """``{"order", "mixing"}`` rows: the stored order, ``shuffle=True``, then ``shuffle="blocks"`` at each window
    over ``blocks`` (a dataset's ``blocks()``)."""
    rows = [{"order": "stored order (shuffle=False)", "mixing": label_mixing(labels, batch_size)},
            {"order": "shuffle=True", "mixing": label_mixing(order_labels(labels, batch_size, True, seed), batch_size)}]
    for window in windows:
        ordered = order_labels(labels, batch_size, "blocks", seed, blocks=blocks, window=window)
        rows.append({"order": f'shuffle="blocks", block_window={window}',
                     "mixing": label_mixing(ordered, batch_size)})
    return rows
