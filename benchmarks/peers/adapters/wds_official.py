"""The ``webdataset`` library: ``ShardWriter`` tar shards, read by its own pipeline and ``WebLoader``.

Writer: ``wds.ShardWriter("shard-%06d.tar", maxcount=...)`` with ``{"__key__", "<ext>": original bytes,
"cls": label}``, where ``<ext>`` is the file's own extension (``jpg``, or ``png`` for the few PNGs, so nothing is
re-encoded). ``maxcount`` gives at least 8 shards (as packer's own default does): the library splits shards,
not samples, across workers, so one big shard would leave a worker idle on a small set.

Reader (the library's README): ``WebDataset(urls, shardshuffle=...)`` -> ``shuffle(1000)`` -> ``decode("pil")``
-> ``to_tuple("jpg;jpeg;png", "cls")`` -> ``map_tuple(shared Pillow resize+crop (val) or torchvision's
RandomResizedCrop + flip (train), int)`` -> ``batched(64)``, and
``WebLoader(batch_size=None, num_workers, persistent_workers=True)``.

Not ``webdataset.py``: that name would shadow the library.
"""

from __future__ import annotations

import math
import shutil
import sys
from pathlib import Path

from _common import Variant, main, package_versions, pipeline_transform

TOOL = "webdataset"
MIN_SHARDS = 8
VARIANTS = [Variant("ShardWriter+WebLoader", "shards", pipeline=pipeline) for pipeline in ("val", "train")]


def versions() -> dict[str, str]:
    return package_versions("webdataset", "torch", "pillow")


def prepare(variant: Variant, dest: Path) -> None:
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    import webdataset  # noqa: F401 - imported here so the import is not timed as conversion


def pack(variant: Variant, samples: list, classes: list, dest: Path) -> Path:
    import webdataset as wds

    per_shard = max(1, math.ceil(len(samples) / MIN_SHARDS))
    with wds.ShardWriter(str(dest / "shard-%06d.tar"), maxcount=per_shard, verbose=0) as sink:
        for i, (path, label) in enumerate(samples):
            ext = path.suffix.lower().lstrip(".")
            sink.write({"__key__": f"{i:09d}", ext: path.read_bytes(), "cls": label})
    return dest


def _label(value) -> int:
    return int(value)


def make_loader(variant: Variant, data: Path, batch_size: int, workers: int):
    import webdataset as wds

    urls = sorted(str(p) for p in data.glob("shard-*.tar"))
    pipeline = (wds.WebDataset(urls, shardshuffle=len(urls), empty_check=False)
                .shuffle(1000)
                .decode("pil")
                .to_tuple("jpg;jpeg;png", "cls")
                .map_tuple(pipeline_transform(variant), _label)
                .batched(batch_size, partial=True))
    return wds.WebLoader(pipeline, batch_size=None, num_workers=workers, persistent_workers=workers > 0)


if __name__ == "__main__":
    main(sys.modules[__name__])
