"""Sample order for training: which sample each step reads, and in which epoch.

:class:`EpochIndex` is how the epoch reaches the dataset. A sampler yields indices that carry their epoch, and
the DataLoader hands them unchanged to ``__getitem__``/``__getitems__``, in the main process or pickled to a
worker process. A read-time augmentation (``random_resized_crop``, ``flip``) draws from ``(seed, epoch, index)``
and so gives the same pixels with threads, with worker processes (persistent ones too) and on any number of
ranks, with no ``set_epoch`` call to forward to workers.
"""

from __future__ import annotations


class EpochIndex(int):
    """An ``int`` sample index that also carries ``epoch``. Anything that treats it as an int still works; a
    dataset reads ``getattr(index, "epoch", default)``."""

    epoch: int

    def __new__(cls, index: int, epoch: int) -> EpochIndex:
        obj = super().__new__(cls, index)
        obj.epoch = int(epoch)
        return obj

    def __reduce__(self):  # crosses to worker processes through the index queue
        return EpochIndex, (int(self), self.epoch)

    def __repr__(self) -> str:
        return f"EpochIndex({int(self)}, epoch={self.epoch})"
