"""Where decoded pixels go: buffers that start where libjpeg-turbo writes fastest, and each decode thread's
scratch buffer for a whole image it crops or resamples from (a fresh array for every image would pay the kernel's
page faults and zeroing each time: docs/benchmarks.md, "Decoding"). No torch, as :mod:`packer.reading.decoding`.
"""

from __future__ import annotations

import threading

import numpy as np

# Where decoded pixels should start: simplejpeg decodes fastest into rows a few bytes past a 64-byte boundary,
# not on one (docs/benchmarks.md, "Decoding"). torch's CPU and pinned memory start on 64-byte boundaries and
# shared memory on a page; numpy's arrays start wherever glibc puts them. Batches and scratch buffers start here.
DECODE_OFFSET = 16
DECODE_SLACK = 64  # bytes allocated beyond a buffer's size to move its start there


def decode_start(address: int) -> int:
    """Bytes to skip from ``address`` to the next address ``DECODE_OFFSET`` past a 64-byte boundary."""
    return (DECODE_OFFSET - address) % DECODE_SLACK


def decode_buffer(nbytes: int) -> np.ndarray:
    """An uninitialised flat uint8 array of ``nbytes`` at a :func:`decode_start`. From numpy, which asks the
    kernel for transparent huge pages for large arrays; torch's allocator does not, and decoding into torch's
    memory was measurably slower (docs/benchmarks.md, "Decoding")."""
    flat = np.empty(nbytes + DECODE_SLACK, np.uint8)
    start = decode_start(flat.ctypes.data)
    return flat[start:start + nbytes]


_scratch = threading.local()  # each decode thread's buffer for a whole image it crops from


def decode_scratch(nbytes: int) -> np.ndarray:
    """This thread's scratch :func:`decode_buffer` of ``nbytes``, reused by the thread's next call: what is in
    it must be copied out before then."""
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or len(buffer) < nbytes:
        _scratch.buffer = buffer = decode_buffer(nbytes)
    return buffer[:nbytes]
