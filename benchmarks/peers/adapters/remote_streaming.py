"""MosaicML Streaming, read from a URL: ``MDSWriter`` shards of about ``--block-bytes`` (``size_limit``), read by
``StreamingDataset(remote="s3://...", local=CACHE, cache_limit=..., shuffle=True, shuffle_algo="py1e")`` (the
``mosaic_streaming.py`` subclass applying torchvision's RandomResizedCrop + flip) in a torch ``DataLoader``.

Streaming's S3 client takes its endpoint from ``S3_ENDPOINT_URL`` (the driver sets it to the latency proxy) and
its credentials from the usual ``AWS_*`` variables. Stale shared memory from an earlier crashed run is cleaned
first, as Streaming advises. Given a local folder, it reads the shards in place (``remote=None``). The
``streaming-tuned`` row sets ``predownload`` from ``REMOTE_STREAMING_PREDOWNLOAD`` (see ``remote_peers.py``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from _common import Variant, pipeline_transform, scan
from _remote import main
from mosaic_streaming import _dataset_class, versions  # noqa: F401 - versions is this adapter's too

TOOL = "streaming"


def pack(src: Path, dest: Path, block_bytes: int) -> None:
    from PIL import Image
    from streaming import MDSWriter

    samples, _ = scan(src)
    with MDSWriter(out=str(dest), columns={"image": "jpeg", "label": "int"}, size_limit=block_bytes) as writer:
        for path, label in samples:
            with Image.open(path) as img:
                writer.write({"image": img, "label": label})


def make_loader(url: str, cache_dir: Path, cache_limit: int, batch_size: int, workers: int, block_bytes: int):
    import torch
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    remote, local = (url, str(cache_dir)) if "://" in url else (None, url)
    predownload = os.environ.get("REMOTE_STREAMING_PREDOWNLOAD")  # the streaming-tuned row's; else the default
    ds = _dataset_class()(remote=remote, local=local, cache_limit=cache_limit or None, shuffle=True,
                          predownload=int(predownload) if predownload else None,
                          shuffle_algo="py1e", shuffle_seed=0, batch_size=batch_size,
                          image_transform=pipeline_transform(Variant("remote", "mds", pipeline="train")))
    return torch.utils.data.DataLoader(ds, batch_size=batch_size, num_workers=workers,
                                       persistent_workers=workers > 0)


if __name__ == "__main__":
    main(sys.modules[__name__])
