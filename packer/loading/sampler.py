"""Sample order for training: which sample each step reads, and in which epoch.

:class:`~packer.reading.indices.EpochIndex` is how the epoch reaches the dataset: the sampler yields indices that
carry their epoch (and a resolution schedule's sizes for it), which the DataLoader hands unchanged to
``__getitem__``/``__getitems__``, in the main process or pickled to a worker process.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler

from ..reading.indices import EpochIndex
from ..state import STATE_VERSION, StateSchema, check_state
from .block_order import block_order, check_starts, deal_steps, layout

__all__ = ["BLOCKS", "EpochIndex", "EpochPass", "ResumableSampler", "distributed_rank_world", "make_state",
           "state_schema"]


BLOCKS = "blocks"  # shuffle="blocks": the block-aware order of packer.loading.block_order


def distributed_rank_world() -> tuple[int, int]:
    """This process's rank and the world size under ``torch.distributed``, else ``(0, 1)``."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


@dataclass(frozen=True)
class EpochPass:
    """One pass of a :class:`ResumableSampler`: the part of epoch ``epoch``'s global order that starts at
    position ``start`` (0 for a whole epoch, later after a resume), dealt to ``world`` ranks in turn.

    The global order is a permutation of the dataset from ``(seed, epoch)`` (``0..N-1`` without shuffle); past
    its end it wraps around, which pads the ranks as ``DistributedSampler`` does. Rank r reads positions
    ``start + r``, ``start + r + world``... so after every rank has taken k batches of B, the samples taken are
    exactly the positions before ``start + k * B * world``: one global number, valid at any world size.

    With ``shuffle="blocks"`` the global order is :func:`packer.loading.block_order.block_order` of ``blocks`` (the
    block start indices) and ``window``, and batch k of every rank comes from positions ``start + k * B * world``
    onwards, grouped by block (:func:`packer.loading.block_order.deal_steps`): the same rule for the samples taken."""

    epoch: int
    start: int
    world: int
    rank: int
    length: int
    batch_size: int
    seed: int
    shuffle: bool | str
    drop_last: bool
    blocks: np.ndarray | None = field(default=None, compare=False, repr=False)
    window: int | None = None
    mixture: dict | None = field(default=None, compare=False, repr=False)  # a dataset that orders its epochs

    @property
    def per_rank(self) -> int:
        """Samples each rank takes in this pass (the same on every rank)."""
        remaining = max(self.length - self.start, 0)
        if self.drop_last:  # whole batches only, and only real samples: as DistributedSampler + drop_last
            return remaining // self.world // self.batch_size * self.batch_size
        return -(-remaining // self.world)

    @property
    def batches(self) -> int:
        return -(-self.per_rank // self.batch_size)

    def _block_order(self) -> tuple[np.ndarray, np.ndarray]:
        assert self.blocks is not None and self.window is not None  # shuffle="blocks" always comes with both
        return block_order(self.blocks, self.length, self.window, self.seed, self.epoch)

    def order(self) -> torch.Tensor:
        if self.mixture is not None:  # a mixture (packer.mix) orders each epoch itself: its positions in turn
            return torch.arange(self.length)
        if self.shuffle == BLOCKS:
            return torch.from_numpy(self._block_order()[0])
        if not self.shuffle:
            return torch.arange(self.length)
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)  # DistributedSampler's permutation for this epoch
        return torch.randperm(self.length, generator=generator)

    def indices(self) -> list[int]:
        """This rank's sample indices for the pass, in order."""
        if self.per_rank == 0:
            return []
        if self.shuffle == BLOCKS:
            order, place = self._block_order()
            return order[deal_steps(place, self.start, self.per_rank, self.batch_size, self.world, self.rank)].tolist()
        positions = torch.arange(self.per_rank) * self.world + (self.start + self.rank)
        return self.order()[positions % self.length].tolist()

    def following(self) -> EpochPass:
        """The pass after this one when nothing sets another epoch or state: the next epoch, from its start."""
        return replace(self, epoch=self.epoch + 1, start=0)

    def state(self, taken: int) -> dict[str, Any]:
        """The state after each rank has taken ``taken`` samples of this pass. A finished pass is the start of the
        next epoch, so a state saved after the last batch never resumes into an empty or a repeated epoch."""
        if taken >= self.per_rank:
            epoch, position = self.epoch + 1, 0
        else:
            epoch, position = self.epoch, self.start + taken * self.world
        return make_state(epoch, position, self.world, self)


# what a state must agree on with the loader that loads it: anything else changes the order or the batches
_MUST_MATCH = ("batch_size", "seed", "shuffle", "drop_last", "dataset_length")


def make_state(epoch: int, position: int, world: int, settings: Any) -> dict[str, Any]:
    state = {"version": STATE_VERSION, "epoch": epoch, "samples_seen": position, "world_size": world,
             "batch_size": int(settings.batch_size), "seed": int(settings.seed),
             "shuffle": BLOCKS if settings.shuffle == BLOCKS else bool(settings.shuffle),
             "drop_last": bool(settings.drop_last), "dataset_length": int(settings.length)}
    if settings.shuffle == BLOCKS:  # the order depends on the blocks and the window too
        state.update(block_window=int(settings.window), blocks=layout(settings.blocks))
    if getattr(settings, "mixture", None) is not None:  # and a mixture's on its datasets, weights and seed
        state["mixture"] = settings.mixture
    return state


def state_schema(settings: Any) -> StateSchema:
    """What a loader state must hold to be loaded by a loader with ``settings`` (a sampler or an
    :class:`EpochPass`): anything that changes the order or the batches must match; ``world_size`` may differ."""
    mine = make_state(0, 0, 1, settings)
    keys = _MUST_MATCH + (("block_window", "blocks") if settings.shuffle == BLOCKS else ()) + (
        ("mixture",) if getattr(settings, "mixture", None) is not None else ())
    return StateSchema("loader", "samples_seen", settings.length, {key: mine[key] for key in keys},
                       free=("world_size",))


class ResumableSampler(Sampler[EpochIndex]):
    """A sampler whose whole state is ``{epoch, samples seen globally}``, for exact mid-epoch resumes.

    Each epoch has one global order (a permutation from ``(seed, epoch)``, or ``0..N-1`` without shuffle);
    ranks take its positions in turn, padded (or with ``drop_last``, cut to whole batches) so that every rank
    gets the same number of batches, as ``DistributedSampler`` + ``DataLoader(drop_last=...)`` do. Each
    iteration is the next epoch, without ``set_epoch`` (which still wins when called), and every index is an
    :class:`EpochIndex`, so the dataset knows the epoch also in persistent worker processes.

    ``state_dict``/``load_state_dict`` follow the protocol of ``torchdata``'s ``StatefulDataLoader``: the state
    counts the samples this sampler has yielded. A loaded state makes the next iteration the rest of that epoch,
    split over this world size; the iterations after it are whole epochs.

    Args:
        data_source: the dataset, or its length.
        batch_size: the loader's batch size: with ``drop_last`` each rank gets whole batches only.
        shuffle: a new permutation every epoch; ``"blocks"``, the block-aware order of :mod:`packer.loading.block_order`
            (with ``blocks`` and ``window``); else dataset order.
        seed: the permutations' seed; the same on every rank.
        drop_last: drop the last partial batch of every rank (no padding with repeated samples).
        num_replicas, rank: the world size and this rank; from ``torch.distributed`` when initialized, else 1, 0.
        blocks: with ``shuffle="blocks"``, the start index of every block (increasing from 0: a reader's
            ``blocks()``).
        window: with ``shuffle="blocks"``, how many consecutive blocks of the epoch's block order are mixed.

    A dataset with a resolution schedule (its ``epoch_view``) gets each epoch's sizes with every index of the
    epoch. A mixture (:func:`packer.mix`, its ``mixture``) orders each epoch itself: the sampler takes its
    positions in turn (``shuffle`` and ``seed`` do not reorder it), and the state records the mixture.
    """

    def __init__(self, data_source: Sized | int, batch_size: int = 1, shuffle: bool | str = True, seed: int = 0,
                 drop_last: bool = False, num_replicas: int | None = None, rank: int | None = None,
                 blocks: np.ndarray | list[int] | None = None, window: int = 4):
        self.length = data_source if isinstance(data_source, int) else len(data_source)
        self._view = getattr(data_source, "epoch_view", None)  # an epoch's sizes under a resolution schedule
        self.mixture = getattr(data_source, "mixture", None)
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, not {batch_size}")
        if isinstance(shuffle, str) and shuffle != BLOCKS:
            raise ValueError(f"shuffle must be True, False or {BLOCKS!r}, not {shuffle!r}")
        self.blocks, self.window = None, None
        if shuffle == BLOCKS:
            if blocks is None:
                raise ValueError("shuffle='blocks' needs the blocks' start indices (blocks=, a reader's blocks())")
            if window < 1:
                raise ValueError(f"block_window must be at least 1, not {window}")
            self.blocks, self.window = check_starts(blocks, self.length), int(window)
        dist_rank, dist_world = distributed_rank_world()
        self.world = dist_world if num_replicas is None else num_replicas
        self.rank = dist_rank if rank is None else rank
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is not in a world of {self.world}")
        self.batch_size, self.shuffle, self.seed, self.drop_last = batch_size, shuffle, seed, drop_last
        self._next_epoch = 0
        self._resume_at = 0  # where the next pass starts in the global order: not 0 after a load_state_dict
        self._current: EpochPass | None = None
        self._yielded = 0
        self._passes = 0

    @property
    def yielded(self) -> int:
        """Samples of the current pass yielded so far: handed to the batch sampler, so to whoever decodes them."""
        return self._yielded

    @property
    def passes(self) -> int:
        """How many passes have started (a pass starts at its first index)."""
        return self._passes

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch ``epoch``. A loaded mid-epoch position is kept only for its own epoch."""
        if epoch != self._next_epoch:
            self._resume_at = 0
        self._next_epoch = epoch

    def next_pass(self) -> EpochPass:
        """The pass the next iteration will make (nothing changes until it starts)."""
        return EpochPass(self._next_epoch, self._resume_at, self.world, self.rank, self.length, self.batch_size,
                         self.seed, self.shuffle, self.drop_last, self.blocks, self.window, self.mixture)

    def __len__(self) -> int:
        current = self._current
        if current is not None and self._yielded < current.per_rank:
            return current.per_rank
        return self.next_pass().per_rank

    def __iter__(self) -> Iterator[EpochIndex]:
        # a generator: torchdata makes (and drops) iterators while it restores a state, and only the one that
        # is iterated may start the pass
        epoch_pass = self.next_pass()
        self._next_epoch, self._resume_at = epoch_pass.epoch + 1, 0
        self._current, self._yielded = epoch_pass, 0
        self._passes += 1
        view = self._view(epoch_pass.epoch) if self._view is not None else None
        for index in epoch_pass.indices():
            self._yielded += 1
            yield EpochIndex(index, epoch_pass.epoch, view)

    def state_dict(self) -> dict[str, Any]:
        """The position after the samples this sampler has yielded (JSON-serialisable, a few hundred bytes)."""
        current = self._current
        if current is not None and self._yielded < current.per_rank:
            return current.state(self._yielded)
        return make_state(self._next_epoch, self._resume_at, self.world, self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next iteration the rest of ``state``'s epoch, dealt over this sampler's world size.

        Raises:
            ValueError: (one line) the state is damaged (a missing, unknown or mistyped key, each named), or was
                taken with another batch_size, seed, shuffle, drop_last or dataset length.
        """
        self._next_epoch, self._resume_at = check_state(state, state_schema(self))
        self._current = None
