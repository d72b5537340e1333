"""How the epoch reaches a dataset: :class:`EpochIndex`, a sample index that carries its epoch.

packer's sampler (:class:`packer.loading.sampler.ResumableSampler`) yields them, and the DataLoader hands them
unchanged to ``__getitem__``/``__getitems__``, in the main process or pickled to a worker process. A read-time
augmentation draws from ``(seed, epoch, index)``, a resolution schedule's size is the epoch's, and a mixture's
position is read from its epoch's draw: all the same with threads, worker processes (persistent ones too) and any
number of ranks, with no ``set_epoch`` call to forward to workers.
"""

from __future__ import annotations


class EpochIndex(int):
    """An ``int`` sample index that also carries ``epoch``, and ``view``: the sizes a resolution schedule gives
    that epoch (None without one), computed where the schedule's functions are (the loader's process) so that a
    lambda need not pickle to the processes that decode. Anything that treats it as an int still works; a
    dataset reads ``getattr(index, "epoch", default)``."""

    epoch: int
    view: tuple | None

    def __new__(cls, index: int, epoch: int, view: tuple | None = None) -> EpochIndex:
        obj = super().__new__(cls, index)
        obj.epoch = int(epoch)
        obj.view = view
        return obj

    def __reduce__(self):  # crosses to worker processes through the index queue
        return EpochIndex, (int(self), self.epoch, self.view)

    def __repr__(self) -> str:
        view = f", view={self.view}" if self.view is not None else ""
        return f"EpochIndex({int(self)}, epoch={self.epoch}{view})"
