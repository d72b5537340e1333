"""A mixture's epoch order over WebDataset shards, for ``packer.stream(roots, weights=)``.

The same draw as :func:`packer.mix` (:mod:`packer.reading.mix`): each epoch, dataset ``k`` fills ``counts[k]`` of
the positions, its turns shuffled among the others', and its turns take its samples round after round, none twice
before all came once. What differs is the order within a round: the block order of the dataset's shards
(:func:`packer.loading.block_order.block_order`: the shards in a random order, the samples of each ``window``
consecutive shards mixed), so that a stream reads each shard sequentially, once a round.

Every round of every dataset is a block range of its own, a *virtual* copy of the dataset's shards: position
``p`` reads virtual sample ``order[p]`` of virtual block ``place[p]``. A stream reads a virtual block's shard from
start to end and keeps the samples its batches take from that round only; a small dataset drawn many times is
read once a round, and nothing is held from one round to the next. No torch here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..reading.mix import interleave, random_stream
from .block_order import block_order

_ROUND = 3  # the random stream of a round's block order, apart from the interleave's and the map-style rounds'


@dataclass(frozen=True)
class StreamMixture:
    """The virtual blocks of a stream mixture: each dataset's shards, once per round an epoch takes of it.

    Args:
        starts: per dataset, the first sample of each of its (non-empty) shards.
        sizes: per dataset, its samples.
        counts: per dataset, its positions per epoch.
        windows: per dataset, how many consecutive shards of a round's shard order are mixed.
    """

    starts: Sequence[np.ndarray]
    sizes: Sequence[int]
    counts: Sequence[int]
    windows: Sequence[int]
    vstarts: np.ndarray = field(init=False, repr=False)  # the first virtual sample of each virtual block
    vsource: np.ndarray = field(init=False, repr=False)  # the dataset of each virtual block
    vshard: np.ndarray = field(init=False, repr=False)  # its shard in that dataset
    bases: tuple[tuple[int, int], ...] = field(init=False, repr=False)  # per dataset: first virtual sample, block

    def __post_init__(self) -> None:
        vstarts, vsource, vshard, bases = [], [], [], []
        sample = block = 0
        for k, (starts, size) in enumerate(zip(self.starts, self.sizes, strict=True)):
            bases.append((sample, block))
            for _ in range(self.rounds(k)):
                vstarts.append(starts + sample)
                vsource.append(np.full(len(starts), k, np.int64))
                vshard.append(np.arange(len(starts), dtype=np.int64))
                sample, block = sample + size, block + len(starts)
        object.__setattr__(self, "vstarts", np.concatenate(vstarts))
        object.__setattr__(self, "vsource", np.concatenate(vsource))
        object.__setattr__(self, "vshard", np.concatenate(vshard))
        object.__setattr__(self, "bases", tuple(bases))

    def rounds(self, k: int) -> int:
        """How many rounds an epoch takes of dataset ``k`` (the last one in part)."""
        return -(-self.counts[k] // self.sizes[k])

    def epoch_order(self, seed: int, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """Epoch ``epoch``'s ``(order, place)``: the virtual sample at each position, and the rank of its block
        (a virtual block per round: positions of one shard in one round share it, which
        :func:`~packer.loading.block_order.deal_steps` groups by)."""
        turns = interleave(self.counts, seed, epoch)
        order = np.empty(len(turns), np.int64)
        place = np.empty(len(turns), np.int64)
        for k, (starts, size, count) in enumerate(zip(self.starts, self.sizes, self.counts, strict=True)):
            sample, block = self.bases[k]
            orders, places = [], []
            for r in range(self.rounds(k)):
                round_seed = int(random_stream(_ROUND, seed, epoch, k, r).integers(2**63))
                found, ranks = block_order(starts, size, self.windows[k], round_seed, 0)
                orders.append(found + sample + r * size)  # the round's own copy of the samples
                places.append(ranks + block + r * len(starts))  # and of the block ranks: one group per block
            mine = turns == k
            order[mine] = np.concatenate(orders)[:count]
            place[mine] = np.concatenate(places)[:count]
        return order, place
