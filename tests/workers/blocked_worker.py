"""One rank of a torchrun test of a dataset read a block at a time: ``blocked_worker.py SOURCE CACHE LIMIT OUT_DIR
[WORKERS]``.

A URL SOURCE (test_blocked_remote.py) is opened with ``cache_limit=LIMIT`` and read with ``shuffle=True``
(block-aware, as it is larger than LIMIT); a local folder (test_page_budget.py) with ``page_budget=LIMIT`` and
``shuffle="blocks"``. Either is read for two epochs through WORKERS worker processes (default 1), and each batch's
images (by digest) and labels, the largest block and, for a URL, the most bytes the cache held (polled on a
thread) are written to ``OUT_DIR/rank<R>.json``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading

import torch.distributed as dist

import packer
from packer.remote.cache import Cache


def main() -> None:
    source, cache, limit, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    workers = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    local = os.path.isdir(source)
    budget = {"page_budget": limit} if local else {"cache_limit": limit}
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 0:  # the layout, computed once before the other rank opens it
        packer.open_dataset(source, cache_dir=cache, **budget)
    dist.barrier()
    ds = packer.open_dataset(source, cache_dir=cache, **budget)
    loader = packer.make_loader(ds, batch_size=16, num_workers=workers, shuffle="blocks" if local else True)
    most, stop = [0], threading.Event()

    def poll() -> None:
        used = Cache(cache)
        while not stop.wait(0.002):
            most[0] = max(most[0], min(used.used(), used.used()))  # two counts: see remote_support.CachePoll

    thread = threading.Thread(target=poll, daemon=True)
    if not local:  # a local dataset's pages are counted by the test (mincore), not in the cache folder
        thread.start()
    epochs = []
    for _ in range(2):
        epochs.append([[[hashlib.sha1(image.contiguous().numpy().tobytes()).hexdigest(), int(label)]
                        for image, label in zip(images, labels, strict=True)] for images, labels in loader])
        dist.barrier()
    stop.set()
    if not local:
        thread.join()
    spans = ds.reader.spans
    result = {"epochs": epochs, "most": most[0], "block": int((spans[:, 2] - spans[:, 1]).max())}
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
