"""The memory a batch is decoded into.

A 64 x 224 x 224 x 3 batch is 9.6 MB. Allocated afresh for every batch, glibc maps it from the kernel and gives
it back on free, so each batch pays about 2,400 page faults and the kernel zeroes every page before the decode
threads write it: a visible part of a 224 px JPEG's decode (docs/benchmarks.md, "Decoding"). :class:`BatchPool` keeps
the arrays and hands one out again only once nothing refers to it any more, so reuse never changes a batch
that a caller still holds: a training loop that keeps batches (a list of them, a tensor saved for later) keeps
them intact, and the pool makes new ones meanwhile.
"""

from __future__ import annotations

import sys
import threading

import numpy as np
import torch
from torch.utils.data import get_worker_info

from .scratch import DECODE_SLACK, decode_buffer, decode_start

_NUMPY_DTYPES = {torch.uint8: np.uint8, torch.float16: np.float16, torch.float32: np.float32}


def empty_batch(shape: tuple[int, ...], dtype: torch.dtype, pin_memory: bool = False,
                pool: BatchPool | None = None) -> torch.Tensor:
    """A tensor for a whole batch. In a DataLoader worker it is allocated in shared memory, so sending it to the
    main process copies nothing (as ``default_collate`` does); in the main process it can be pinned, so the
    copy to the GPU needs no staging copy (torch's pinned-memory allocator reuses its own blocks), or else
    comes from ``pool``."""
    if get_worker_info() is not None:
        return shared_tensor(shape, dtype)
    if pin_memory or pool is None or dtype not in _NUMPY_DTYPES:
        return placed_empty(shape, dtype, pin_memory)
    return pool.take(shape, dtype)


def placed_empty(shape: tuple[int, ...], dtype: torch.dtype, pin_memory: bool = False) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype, pin_memory=pin_memory)``, starting where a JPEG decodes into memory
    fastest (:data:`packer.reading.scratch.DECODE_OFFSET`, whose comment has the measurements) rather than on the
    allocator's 64-byte boundary; unpinned, in numpy's memory (:func:`~packer.reading.scratch.decode_buffer`)."""
    if not pin_memory and dtype in _NUMPY_DTYPES:
        memory = decode_buffer(tensor_bytes(shape, dtype))
        return torch.from_numpy(memory.view(_NUMPY_DTYPES[dtype]).reshape(shape))
    flat = torch.empty(tensor_bytes(shape, dtype) + DECODE_SLACK, dtype=torch.uint8, pin_memory=pin_memory)
    return _placed(flat, shape, dtype)


def shared_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor in shared memory, made there directly: ``torch.empty(...).share_memory_()``
    allocates it on the heap first and copies it over, and a forked worker's allocations then reuse the freed
    heap chunks it inherited, copying them page by page: the workers' memory grows epoch after epoch
    (docs/benchmarks.md)."""
    storage = torch.UntypedStorage._new_shared(tensor_bytes(shape, dtype) + DECODE_SLACK)
    return _placed(torch.empty(0, dtype=torch.uint8).set_(storage), shape, dtype)


def tensor_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of a tensor of ``shape`` and ``dtype``."""
    return int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()


def _placed(flat: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The tensor of ``shape`` and ``dtype`` in ``flat`` (uint8, ``DECODE_SLACK`` bytes longer than it needs)
    at the first :func:`~packer.reading.scratch.decode_start`; a 224 x 224 x 3 image is 150,528 bytes, a multiple of
    64, so every image of the batch starts there too."""
    start = decode_start(flat.data_ptr())
    return flat[start:start + tensor_bytes(shape, dtype)].view(dtype).view(shape)


class BatchPool:
    """Batch arrays of one process, reused once unreferenced.

    A tensor made by ``torch.from_numpy(array)`` holds one reference to ``array`` for as long as its storage
    lives, and every view of it (the CHW permute, each image of the batch, a slice) shares that storage. So an
    array whose reference count is back to the pool's own is referred to by no tensor anywhere, and can be
    written again. At most ``keep`` arrays are kept; past that, batches are allocated and freed as before.

    Args:
        keep: arrays kept for reuse: enough for the batches a loader holds at once (those prefetched, the one
            being filled and the caller's).
    """

    # the pool's list, the loop variable and getrefcount's own argument: the count of an array no tensor holds
    _UNREFERENCED = 3

    def __init__(self, keep: int = 12):
        self.keep = keep
        self._arrays: list[np.ndarray] = []
        self._lock = threading.Lock()  # two loaders over one dataset take batches from two threads

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor of ``shape`` and ``dtype`` (uint8, float16 or float32) that no one else holds.

        Args:
            shape: the batch's shape.
            dtype: the torch dtype.

        Returns:
            A CPU tensor over a reused array, or over a new one.
        """
        np_dtype = np.dtype(_NUMPY_DTYPES[dtype])
        shape = tuple(shape)
        with self._lock:
            for array in self._arrays:
                if sys.getrefcount(array) == self._UNREFERENCED and array.shape == shape and array.dtype == np_dtype:
                    return torch.from_numpy(array)
            array = decode_buffer(tensor_bytes(shape, dtype)).view(np_dtype).reshape(shape)
            if len(self._arrays) >= self.keep:
                self._drop_one_free()
            if len(self._arrays) < self.keep:
                self._arrays.append(array)
            return torch.from_numpy(array)

    def _drop_one_free(self) -> None:
        """Forget one unreferenced array (one of another shape: the last batch of an epoch, a new batch size)."""
        for k in range(len(self._arrays)):
            if sys.getrefcount(self._arrays[k]) == self._UNREFERENCED - 1:  # no loop variable holds it here
                del self._arrays[k]
                return

    def __len__(self) -> int:
        return len(self._arrays)

    def __reduce__(self):  # a dataset sent to a worker process takes an empty pool, not this process's arrays
        return type(self), (self.keep,)
