"""moto, the benchmark's S3 server, answers a ranged GET by reading the whole object and slicing it: a block of a
60 MB LMDB file cost the server a 60 MB copy, where S3 reads only the range. :func:`serve_ranges_at_their_cost`
makes the server in this process read only the bytes a ranged GET asks for, so the tools that fetch byte ranges
(packer's LMDB and HDF5 blocks) pay for their ranges, as on S3, and not for the emulator's copies. Whole-object
GETs (every peer's chunks and shards) are served as before."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

_RANGED = threading.local()  # whether this server thread is answering a ranged GET


class _RangeOf:
    """An object's bytes, read from moto's buffer only where sliced (moto slices the range it answers)."""

    def __init__(self, key: Any):
        self.key = key

    def __len__(self) -> int:
        return int(self.key.size)

    def __getitem__(self, part: slice) -> bytes:
        start, stop, _ = part.indices(len(self))
        with self.key.lock:
            self.key._value_buffer.seek(start)
            return self.key._value_buffer.read(max(0, stop - start))

    def __iter__(self) -> Iterator[bytes]:  # a range moto answers whole (200): the body, a chunk at a time
        for start in range(0, len(self), 1 << 20):
            yield self[start:start + (1 << 20)]


def serve_ranges_at_their_cost() -> None:
    """Patch moto (in this process) so that a ranged GET reads only its range of the stored object."""
    from moto.s3.models import FakeKey
    from moto.s3.responses import S3Response

    if getattr(S3Response, "_packer_ranges", False):
        return
    whole = FakeKey.value

    def value(key: Any) -> Any:
        return _RangeOf(key) if getattr(_RANGED, "on", False) else whole.fget(key)

    FakeKey.value = property(value, whole.fset)  # type: ignore[method-assign]
    key_response = S3Response._key_response

    def ranged_key_response(self: Any, request: Any, full_url: str) -> Any:
        _RANGED.on = request.method == "GET" and bool(request.headers.get("range"))
        try:
            return key_response(self, request, full_url)
        finally:
            _RANGED.on = False

    S3Response._key_response = ranged_key_response  # type: ignore[method-assign]
    S3Response._packer_ranges = True
