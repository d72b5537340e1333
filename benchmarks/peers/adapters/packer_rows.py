"""packer itself: every format x storage mode, read by ``make_loader`` on threads (``num_workers=0``) and on
2 worker processes (packer's pool).

Runs in the project's venv, where packer is importable. Validation rows, per storage mode:

- original: the source bytes as they are; resize 256 + centre-crop 224 at read time (``open_dataset(resize=256,
  center_crop=224)``, packer's fused resize+crop), with the default decoder and, in one more row, with the
  opt-in fast decode (``decoder=FAST_DECODER``: DCT-scaled JPEG decoding before the resize);
- jpeg / raw: resized and cropped once at conversion (``resize=256, center_crop=224``), stored as JPEG (q 90)
  or as uint8 arrays; read without any read-time geometry.

- jpeg-max256: stored with the long side capped at 256 (FFCV's geometry, ``store="jpeg", max_size=256``) and
  resized 256 + centre-cropped 224 at read time, read by ``make_loader``'s defaults (``.../default``: the worker
  pool on 2+ cores), with the default decoder (within one level of ``decoder="pil"``) and with ``FAST_DECODER``:
  the row to put beside FFCV's CenterCrop decoder on the same geometry.

Training rows read ``open_dataset(dest, random_resized_crop=224, flip=True, seed=0)`` through
``make_loader(ds, batch_size=..., seed=0, num_workers=0)`` (threads), from four stored geometries: jpeg and raw with
``max_size=256`` (the long side capped at 256, FFCV's geometry), jpeg with ``resize=256`` (short side 256, no
crop) and ``original``; ``original/default`` reads the originals with ``make_loader``'s defaults (the worker
pool on 2+ cores). A packer without these keywords (issue 10) reports each such row as not supported.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from _common import CROP, RESIZE, Variant, main, package_versions, source_root

TOOL = "packer"
FAST_DECODER = "fast"  # the opt-in DCT-scaled decode for the validation pipeline (issue 10)
FORMATS = [f for f in os.environ.get("PACKER_PEER_FORMATS", "lmdb,hdf5,wds").split(",") if f]
STORES = ["original", "jpeg", "raw"]
WORK = {"original": "decode+resize", "jpeg": "decode 224", "raw": "copy 224"}
# training: the stored geometry -> (store, conversion keywords, read-time work)
TRAIN_STORES = {
    "jpeg-max256": ("jpeg", {"max_size": RESIZE}, "decode <=256+RRC"),
    "jpeg-resize256": ("jpeg", {"resize": RESIZE}, "decode 256+RRC"),
    "raw-max256": ("raw", {"max_size": RESIZE}, "RRC <=256"),
    "original": ("original", {}, "decode+RRC"),
}
VAL_GEOMETRY = {"resize": RESIZE, "center_crop": CROP}


def _variants() -> list[Variant]:
    variants = []
    for fmt in FORMATS:
        for store in STORES:
            geometry = {} if store == "original" else VAL_GEOMETRY
            for loader in ("threads", "workers"):
                variants.append(Variant(f"{fmt}/{store}/{loader}", f"{fmt}-{store}",
                                        {"format": fmt, "store": store, "loader": loader, "work": WORK[store],
                                         "geometry": geometry}))
        variants.append(Variant(f"{fmt}/original/{FAST_DECODER}/threads", f"{fmt}-original",
                                {"format": fmt, "store": "original", "loader": "threads", "geometry": {},
                                 "work": "scaled decode+resize", "decoder": FAST_DECODER,
                                 "notes": f'decoder="{FAST_DECODER}": DCT-scaled JPEG decode before the resize'}))
        for decoder in ("auto", FAST_DECODER):
            suffix = "" if decoder == "auto" else f"/{decoder}"
            variants.append(Variant(f"{fmt}/jpeg-max256{suffix}/default", f"{fmt}-jpeg-max256",
                                    {"format": fmt, "store": "jpeg", "loader": "default", "decoder": decoder,
                                     "geometry": {"max_size": RESIZE}, "read": VAL_GEOMETRY,
                                     "work": "decode <=256+resize"}))
    for fmt in FORMATS:
        variants.append(Variant(f"{fmt}/original/default", f"{fmt}-original",
                                {"format": fmt, "store": "original", "loader": "default", "work": "decode+RRC",
                                 "geometry": {}}, "train"))
        for name, (store, geometry, work) in TRAIN_STORES.items():
            key = f"{fmt}-original" if store == "original" else f"{fmt}-{name}"
            variants.append(Variant(f"{fmt}/{name}/threads", key, {"format": fmt, "store": store, "loader": "threads",
                                                                  "work": work, "geometry": geometry}, "train"))
    return variants


VARIANTS = _variants()


def versions() -> dict[str, str]:
    return package_versions("packer", "torch", "pillow", "simplejpeg", "lmdb", "h5py")


def check(variant: Variant) -> None:
    """Training rows need packer's read-time RandomResizedCrop (issue 10); say so before packing anything."""
    from packer.reading.dataset import PackedDataset

    if variant.pipeline == "train" and not hasattr(PackedDataset, "augment_params"):
        raise NotImplementedError("not supported yet: this packer has no open_dataset(random_resized_crop=..., "
                                  "flip=..., seed=...) (issue 10)")


def pack(variant: Variant, samples: list, classes: list, dest: Path) -> Path:
    import packer

    packer.pack(source_root(samples, classes), dest, format=variant.options["format"], store=variant.options["store"],
                overwrite=True, progress=False, **variant.options["geometry"])
    return dest


def make_loader(variant: Variant, data: Path, batch_size: int, workers: int):
    import packer

    default = variant.options["loader"] == "default"  # make_loader's own choice: the worker pool on 2+ cores
    if variant.pipeline == "train":
        ds = packer.open_dataset(data, random_resized_crop=CROP, flip=True, seed=0)
        return packer.make_loader(ds, batch_size=batch_size, seed=0, **({} if default else {"num_workers": 0}))
    options = VAL_GEOMETRY if variant.options["store"] == "original" else variant.options.get("read", {})
    if "decoder" in variant.options:
        options = {**options, "decoder": variant.options["decoder"]}
    ds = packer.open_dataset(data, **options)
    if default:
        return packer.make_loader(ds, batch_size=batch_size)
    if variant.options["loader"] == "threads":
        return packer.make_loader(ds, batch_size=batch_size, num_workers=0)  # decode on threads in this process
    return packer.make_loader(ds, batch_size=batch_size, num_workers=workers)


if __name__ == "__main__":
    main(sys.modules[__name__])
