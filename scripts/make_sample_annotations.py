"""Build the small annotation table of the README's examples: ``sample_data/annotations.csv``, and a mask per
image in ``sample_masks/``, for the first images of each class of ``sample_data``.

Columns: ``image`` (path from the repository root), ``subject`` (the class, as text), ``caption`` (text),
``brightness`` (a float target), ``tags`` (a JSON list of integers, of varying length: a multi-label),
``meta`` (a JSON object) and ``mask`` (a PNG of class indices 0, 1, 2 from the image's brightness, 255 at the
border: values a smoothing resample would change). Deterministic: the same files on every run.

    python scripts/make_sample_annotations.py
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parent.parent
PER_CLASS = 4


def mask_of(image: Image.Image) -> np.ndarray:
    grey = np.asarray(image.convert("L"), dtype=np.int32)
    mask = np.digitize(grey, [85, 170]).astype(np.uint8)  # dark 0, middle 1, bright 2
    mask[:4], mask[-4:], mask[:, :4], mask[:, -4:] = 255, 255, 255, 255  # "ignore" border
    return mask


def main() -> None:
    data, masks = REPO / "sample_data", REPO / "sample_masks"
    masks.mkdir(exist_ok=True)
    rows = []
    for cls in sorted(p.name for p in data.iterdir() if p.is_dir()):
        for path in sorted((data / cls).iterdir())[:PER_CLASS]:
            with Image.open(path) as image:
                mask = mask_of(image)
                brightness = float(np.asarray(image.convert("L")).mean() / 255)
                width, height = image.size
            mask_path = masks / f"{path.stem}.png"
            Image.fromarray(mask).save(mask_path)
            rows.append({"image": path.relative_to(REPO).as_posix(), "subject": cls,
                         "caption": f"a photo of a {cls}, {width}x{height}",
                         "brightness": round(brightness, 4),
                         "tags": json.dumps(sorted({int(v) for v in np.unique(mask) if v != 255})),
                         "meta": json.dumps({"source": "scikit-image", "width": width, "height": height}),
                         "mask": mask_path.relative_to(REPO).as_posix()})
    with open(data / "annotations.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {len(rows)} rows to {data / 'annotations.csv'} and {len(rows)} masks to {masks}")


if __name__ == "__main__":
    main()
