"""The block-aware order (``make_loader(ds, shuffle="blocks")``): random across blocks, local within a window.

A dataset is cut into blocks that are cheap to read sequentially (a WebDataset shard, a byte range of an LMDB or
HDF5 file: each format's ``Reader.blocks``). Each epoch visits the blocks in a random order from ``(seed,
epoch)`` and shuffles the samples of each ``window`` consecutive blocks of that order together: while one window
is read, only its blocks are needed, so reads stay sequential within a few blocks at a time, and a batch mixes
samples of ``window`` blocks (where ``shuffle=True`` mixes the whole dataset).

The order depends on ``(seed, epoch)``, the block starts and the window only: not on the number of ranks or
workers, so a loader's position is still one global count of samples, valid at any world size. No torch here.
"""

from __future__ import annotations

import zlib

import numpy as np

_STREAM = 0x626C6B73  # "blks": the block order's random stream, apart from shuffle=True's permutation


def check_starts(starts: np.ndarray | list[int], length: int) -> np.ndarray:
    """Block start indices as a sorted int64 array that begins at 0 (an empty dataset has none).

    Raises:
        ValueError: the starts do not begin at 0, are not increasing, or reach past ``length``."""
    starts = np.asarray(starts, dtype=np.int64).ravel()
    if length == 0:
        return starts[:0]
    if starts.size == 0 or starts[0] != 0 or np.any(np.diff(starts) <= 0) or starts[-1] >= length:
        raise ValueError(f"block starts must increase from 0 and stay below the {length} samples, not "
                         f"{starts[:5].tolist()}...")
    return starts


def layout(starts: np.ndarray) -> str:
    """A short fingerprint of a block layout, kept in a loader state: ``"COUNT:CRC32"``."""
    return f"{len(starts)}:{zlib.crc32(np.ascontiguousarray(starts, dtype='<i8').tobytes()):08x}"


def block_order(starts: np.ndarray, length: int, window: int, seed: int, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """Epoch ``epoch``'s order of the ``length`` samples, and the place of each position's block.

    The blocks (``starts``, see :func:`check_starts`) are permuted from ``(seed, epoch)``; the samples of blocks
    ``k * window .. (k + 1) * window - 1`` of that permutation fill window ``k`` in a random order.

    Returns:
        ``(order, place)``: ``order[p]`` is the sample at position ``p``; ``place[p]`` the rank of its block in
        the epoch's block permutation (non-decreasing from one window to the next).
    """
    if window < 1:
        raise ValueError(f"block_window must be at least 1, not {window}")
    if length == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    rng = np.random.default_rng((int(seed) % 2**63, int(epoch), _STREAM))
    ends = np.append(starts[1:], length)
    perm = rng.permutation(len(starts))
    sizes = (ends - starts)[perm]
    before = np.cumsum(sizes) - sizes  # where each permuted block begins in the block-by-block sequence
    sequence = np.arange(length, dtype=np.int64) + np.repeat(starts[perm] - before, sizes)
    place = np.repeat(np.arange(len(starts), dtype=np.int64), sizes)
    mixed = np.lexsort((rng.random(length), place // window))  # by window, then at random within it
    return sequence[mixed], place[mixed]


def deal_steps(place: np.ndarray, start: int, per_rank: int, batch_size: int, world: int,
               rank: int) -> np.ndarray:
    """The positions of the global order that rank ``rank`` takes, batch by batch.

    Batch ``k`` of every rank comes from one step of the global order: positions ``start + k * batch_size *
    world`` onwards, ``world`` batches' worth (the last step: ``world`` times the last batch's size). After
    every rank has taken ``k`` batches, exactly the positions before ``start + k * batch_size * world`` are taken,
    whatever the world size, so a position resumes at any world size. Within a step the samples are grouped by
    block (stably, by their place in the block order) and rank ``r`` takes the ``r``-th group: each rank reads
    about ``window / world`` of a window's blocks, whole, rather than a part of every one. Past the end of the
    order, positions wrap around (the padding of ``DistributedSampler``).
    """
    length = len(place)
    if per_rank == 0 or length == 0:
        return np.zeros(0, np.int64)
    full, last = divmod(per_rank, batch_size)
    steps = start + np.arange(full * batch_size * world, dtype=np.int64).reshape(full, batch_size * world)
    parts = [_take(steps, batch_size, place, world, rank)]
    if last:
        tail = start + full * batch_size * world + np.arange(last * world, dtype=np.int64)
        parts.append(_take(tail.reshape(1, -1), last, place, world, rank))
    return np.concatenate(parts) % len(place)


def _take(steps: np.ndarray, size: int, place: np.ndarray, world: int, rank: int) -> np.ndarray:
    """Rank ``rank``'s ``size`` positions of each step (a row of ``steps``), the step grouped by block."""
    if world > 1:
        steps = np.take_along_axis(steps, np.argsort(place[steps % len(place)], axis=1, kind="stable"), axis=1)
    return steps[:, rank * size:(rank + 1) * size].ravel()
