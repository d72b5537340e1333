"""One rank of test_distributed.py, run under ``torchrun --nproc_per_node=2``: ``dist_worker.py OUT_DIR DATASET...``.

For each dataset: ``packer.make_loader(ds, batch_size=8, shuffle=True)`` over two epochs, without calling
``set_epoch``; records which samples (index and relpath, recognised by their pixels) this rank saw, in order,
and how many batches, to ``OUT_DIR/rank<R>.json``. Labels are checked here against ``ds[i]``. The same passes
over the dataset opened with ``random_resized_crop`` and ``flip`` record each image's digest.
"""

from __future__ import annotations

import hashlib
import json
import sys

import torch
import torch.distributed as dist

import packer

BATCH = 8
EPOCHS = 2


def digest(image: torch.Tensor) -> str:
    return hashlib.sha1(image.contiguous().numpy().tobytes()).hexdigest()


def main() -> None:
    out_dir, paths = sys.argv[1], sys.argv[2:]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {"rank": rank, "world": world, "datasets": {}}
    for path in paths:
        ds = packer.open_dataset(path)
        items = [ds[i] for i in range(len(ds))]
        index = {digest(image): i for i, (image, _) in enumerate(items)}
        if len(index) != len(ds):
            raise SystemExit(f"{path}: sample images are not distinct; the test cannot tell them apart")
        loader = packer.make_loader(ds, batch_size=BATCH, shuffle=True)
        epochs = []
        for _ in range(EPOCHS):
            seen, batches = [], 0
            for images, labels in loader:
                batches += 1
                for image, label in zip(images, labels, strict=True):
                    i = index[digest(image)]
                    if int(label) != items[i][1]:
                        raise SystemExit(f"{path}: sample {i} came with label {int(label)}, not {items[i][1]}")
                    seen.append(i)
            epochs.append({"indices": seen, "relpaths": [ds.relpath(i) for i in seen], "batches": batches})
        # the same passes with read-time augmentation: the test checks each image against one process's output
        # for (seed, epoch, index), so the ranks' batches are those of any rank count
        augmented = packer.open_dataset(path, random_resized_crop=12, flip=True, seed=0)
        aug_loader = packer.make_loader(augmented, batch_size=BATCH, shuffle=True)
        aug_epochs = [[digest(image) for images, _ in aug_loader for image in images] for _ in range(EPOCHS)]
        result["datasets"][path] = {"path": path, "len": len(ds), "epochs": epochs, "augmented": aug_epochs,
                                    "sampler": type(loader.sampler).__name__}
        dist.barrier()
    with open(f"{out_dir}/rank{rank}.json", "w", encoding="utf-8") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
