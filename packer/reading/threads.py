"""The decode threads of one process: a batch's rows decoded on the calling thread and a few kept threads.

Decoding (simplejpeg, OpenCV, memcpy) releases the GIL, so a batch's rows decode in parallel on threads. The
thread pools are this process's own: a forked child starts with none of its parent's threads, and a pickled
dataset takes none along.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any


class DecodeThreads:
    """The thread pools a dataset decodes batches on, one per thread count, made in the process that uses them."""

    def __init__(self) -> None:
        self._executors: dict[int, ThreadPoolExecutor] = {}  # by thread count, this process's
        self._pid: int | None = None

    def run(self, fn: Callable[[Any], object], items: list, threads: int) -> None:
        """Run ``fn`` over ``items`` on ``threads`` threads: this one and ``threads - 1`` of a pool this process
        keeps. Each thread takes the next item until none is left: one task per thread rather than a future per
        item, and the calling thread (the loader's prefetch thread) decodes instead of waiting."""
        if threads <= 1 or len(items) < 2:
            for item in items:
                fn(item)
            return
        if self._pid != os.getpid():  # a forked child has none of its parent's threads
            self._executors, self._pid = {}, os.getpid()
        executor = self._executors.get(threads)
        if executor is None:
            executor = self._executors[threads] = ThreadPoolExecutor(threads - 1, thread_name_prefix="packer-decode")
        taken = itertools.count()  # its next() is one C call under the GIL: every item goes to exactly one thread

        def drain() -> None:
            for k in taken:
                if k >= len(items):
                    return
                fn(items[k])

        helpers = [executor.submit(drain) for _ in range(min(threads, len(items)) - 1)]
        try:
            drain()
        finally:
            for helper in helpers:
                helper.result()  # waits for every thread; re-raises the first error a helper met

    def __reduce__(self):  # a dataset sent to another process takes no threads along
        return type(self), ()
