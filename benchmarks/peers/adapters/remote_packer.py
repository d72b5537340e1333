"""packer, read from a URL: ``open_dataset(URL, cache_limit=..., random_resized_crop=224, flip=True)`` through
``make_loader(ds, batch_size=64, shuffle="blocks", num_workers=2)``; or, given a local folder, the same dataset
read locally (the warm local row every remote row is compared with).

The driver (``remote_peers.py``) packs packer's copies itself (``store="jpeg", resize=256``, class order), since
it runs in packer's interpreter; this adapter only reads. The cache is ``cache_dir`` (fresh for every read),
the endpoint ``AWS_ENDPOINT_URL`` (packer's S3 filesystem reads it), here the latency proxy.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from _common import package_versions
from _remote import main

TOOL = "packer"
CROP = 224


def versions() -> dict[str, str]:
    import packer

    return {"packer": getattr(packer, "__version__", "?"), **package_versions("torch", "pillow", "s3fs")}


def make_loader(url: str, cache_dir: Path, cache_limit: int, batch_size: int, workers: int, block_bytes: int):
    import packer

    options = {"random_resized_crop": CROP, "flip": True, "seed": 0}
    if "://" in url:
        endpoint = os.environ.get("AWS_ENDPOINT_URL")
        ds = packer.open_dataset(url, cache_dir=cache_dir, cache_limit=cache_limit or None,
                                 storage_options={"endpoint_url": endpoint} if endpoint else None, **options)
    else:
        ds = packer.open_dataset(url, **options)
    extra = {"block_bytes": block_bytes} if block_bytes else {}
    return packer.make_loader(ds, batch_size=batch_size, shuffle="blocks", seed=0, num_workers=workers,
                              tuned=False, **extra)


if __name__ == "__main__":
    main(sys.modules[__name__])
