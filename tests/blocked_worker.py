"""One rank of test_blocked_remote.py's torchrun test: ``blocked_worker.py URL CACHE LIMIT OUT_DIR``.

Opens the URL (larger than LIMIT, so read a block at a time), reads two epochs with ``make_loader(shuffle=True)``
(block-aware) through one worker process, and writes each batch's images (by digest) and labels, the most bytes
the cache held (polled on a thread) and the largest block, to ``OUT_DIR/rank<R>.json``.
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading

import torch.distributed as dist

import packer
from packer.remote.cache import Cache


def main() -> None:
    url, cache, limit, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 0:  # the layout, computed once before the other rank opens it
        packer.open_dataset(url, cache_dir=cache, cache_limit=limit)
    dist.barrier()
    ds = packer.open_dataset(url, cache_dir=cache, cache_limit=limit)
    loader = packer.make_loader(ds, batch_size=16, num_workers=1, shuffle=True)
    most, stop = [0], threading.Event()

    def poll() -> None:
        used = Cache(cache)
        while not stop.wait(0.002):
            most[0] = max(most[0], min(used.used(), used.used()))  # two counts: see test_blocked_remote's CachePoll

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    epochs = []
    for _ in range(2):
        epochs.append([[[hashlib.sha1(image.contiguous().numpy().tobytes()).hexdigest(), int(label)]
                        for image, label in zip(images, labels, strict=True)] for images, labels in loader])
        dist.barrier()
    stop.set()
    thread.join()
    spans = ds.reader.spans
    result = {"epochs": epochs, "most": most[0], "block": int((spans[:, 2] - spans[:, 1]).max())}
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
