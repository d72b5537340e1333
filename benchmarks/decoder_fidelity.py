"""How close each decoder's validation pixels are to ``decoder="pil"`` (torchvision's ``Resize`` + ``CenterCrop``
on PIL images), per stored geometry: PSNR (worst and median over the images), the largest difference in levels,
and the share of pixel channels that are identical (:func:`packer.reading.fidelity.compare`).

    python benchmarks/decoder_fidelity.py [FOLDER] [--resize 256] [--crop 224] [--out bench-out/fidelity]

FOLDER (default: sample_data, 150 photographs) is packed once per store into ``--out`` (lmdb): ``jpeg-max256``
(``store="jpeg", max_size=256``: the long side capped at 256, FFCV's geometry; the read-time resize enlarges
them) and ``original`` (the files' own bytes; the resize shrinks them). No timing: run it anywhere.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import packer
from packer.reading.fidelity import compare

REPO = Path(__file__).resolve().parent.parent
STORES = {"jpeg-max256": {"store": "jpeg", "max_size": 256}, "original": {}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", nargs="?", type=Path, default=REPO / "sample_data")
    parser.add_argument("--resize", type=int, default=256)
    parser.add_argument("--crop", type=int, default=224)
    parser.add_argument("--out", type=Path, default=REPO / "bench-out" / "fidelity")
    args = parser.parse_args(argv)
    view = {"resize": args.resize, "center_crop": args.crop}
    print(f"packer {packer.__version__}, {args.folder}, resize {args.resize} + centre crop {args.crop}")
    print("| store | decoder | against | PSNR worst | PSNR median | max diff | identical |")
    print("|---|---|---|---:|---:|---:|---:|")
    for store, options in STORES.items():
        dest = args.out / f"{args.folder.name}-{store}"
        if not (dest / "manifest.json").exists():
            packer.pack(args.folder, dest, "lmdb", progress=False, overwrite=True, **options)
        decodings = {name: packer.open_dataset(dest, decoder=name, **view).decoding for name in ("auto", "fast", "pil")}
        for reader in {id(d.reader): d.reader for d in decodings.values()}.values():
            reader.open()
        indices = range(len(decodings["auto"].reader))
        for name, reference in (("auto", "pil"), ("fast", "pil"), ("fast", "auto")):
            f = compare(decodings[name], decodings[reference], indices)
            print(f"| {store} | {name} | {reference} | {f.worst_psnr:.1f} dB | {f.median_psnr:.1f} dB | "
                  f"{f.max_diff} | {f.identical:.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
