"""LitData, read from a URL: ``optimize`` chunks of about ``--block-bytes`` (``chunk_bytes``), read by
``StreamingDataset("s3://...", shuffle=True, max_cache_size=..., cache_dir=CACHE, storage_options=...)`` with
torchvision's RandomResizedCrop + flip on LitData's decoded tensor (``lit_data.py``'s ``_Train``) and
``StreamingDataLoader``.

LitData's S3 client (boto3) takes its endpoint from ``storage_options={"endpoint_url": ...}``, here
``AWS_ENDPOINT_URL`` (the driver sets it to the latency proxy), and its credentials from the usual ``AWS_*``
variables. LitData fetches chunks with obstore, which needs ``allow_http`` for the local server's http://
endpoint: the adapter sets it in LitData's client options (a private dict; real S3 is https and needs nothing).
Given a local folder, it reads the chunks in place.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from _common import scan
from _remote import main
from lit_data import _item, _Train, versions  # noqa: F401 - versions is this adapter's too

TOOL = "litdata"


def pack(src: Path, dest: Path, block_bytes: int) -> None:
    import litdata

    samples, _ = scan(src)
    litdata.optimize(fn=_item, inputs=[(str(p), label) for p, label in samples], output_dir=str(dest),
                     num_workers=2, chunk_bytes=block_bytes, verbose=False)


def make_loader(url: str, cache_dir: Path, cache_limit: int, batch_size: int, workers: int, block_bytes: int):
    import litdata

    options = {}
    if "://" in url:
        from litdata.streaming import downloader

        # LitData GETs chunks with obstore, which refuses an http:// endpoint (reqwest "BadScheme") unless told
        # allow_http; the local server speaks http. Set before the workers fork, so they inherit it.
        downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = True
        options = {"cache_dir": str(cache_dir), "max_cache_size": cache_limit or "100GB",
                   "storage_options": {"endpoint_url": os.environ["AWS_ENDPOINT_URL"]}}
    ds = litdata.StreamingDataset(url, shuffle=True, seed=0, transform=_Train(), **options)
    return litdata.StreamingDataLoader(ds, batch_size=batch_size, num_workers=workers,
                                       persistent_workers=workers > 0)


if __name__ == "__main__":
    main(sys.modules[__name__])
