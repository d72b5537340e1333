"""packer itself: every format x storage mode, read by ``make_loader`` on threads (its default) and on workers.

Runs in the project's venv (/work/venv), where packer is installed. Storage modes:

- original: the source bytes as they are; resize 256 + centre-crop 224 at read time (``open_dataset(resize=256,
  center_crop=224)``, packer's fused resize+crop);
- jpeg / raw: resized and cropped once at conversion (``resize=256, center_crop=224``), stored as JPEG (q 90)
  or as uint8 arrays; read without any read-time geometry.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from _common import RESIZE, Variant, main, package_versions, source_root

TOOL = "packer"
FORMATS = [f for f in os.environ.get("PACKER_PEER_FORMATS", "lmdb,hdf5,wds").split(",") if f]
STORES = ["original", "jpeg", "raw"]
WORK = {"original": "decode+resize", "jpeg": "decode 224", "raw": "copy 224"}
VARIANTS = [Variant(f"{fmt}/{store}/{loader}", f"{fmt}-{store}",
                    {"format": fmt, "store": store, "loader": loader, "work": WORK[store]})
            for fmt in FORMATS for store in STORES for loader in ("threads", "workers")]


def versions() -> dict[str, str]:
    return package_versions("packer", "torch", "pillow", "simplejpeg", "lmdb", "h5py")


def pack(variant: Variant, samples: list, classes: list, dest: Path) -> Path:
    import packer

    store = variant.options["store"]
    geometry = {} if store == "original" else {"resize": RESIZE, "center_crop": 224}
    packer.pack(source_root(samples, classes), dest, format=variant.options["format"], store=store,
                overwrite=True, progress=False, **geometry)
    return dest


def make_loader(variant: Variant, data: Path, batch_size: int, workers: int):
    import packer

    geometry = {"resize": RESIZE, "center_crop": 224} if variant.options["store"] == "original" else {}
    ds = packer.open_dataset(data, **geometry)
    if variant.options["loader"] == "threads":
        return packer.make_loader(ds, batch_size=batch_size)  # default: decode on threads in this process
    return packer.make_loader(ds, batch_size=batch_size, num_workers=workers)


if __name__ == "__main__":
    main(sys.modules[__name__])
