"""Datasets with every kind of field, written through each format's writer, and what reading them must give."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image

from packer.fields import Field, encode, extra_fields
from packer.formats import get_format
from packer.images.transforms import TransformSpec, convert_bytes
from packer.manifest import FORMAT_VERSION, MANIFEST, write_json_atomic

CLASSES = ["cat", "dog", "emu"]
COUNT = 12
WIDTH, HEIGHT = 64, 48
BLOCK = 16  # the masks' class blocks, in pixels
STEP = 60  # the image of a "lined up" dataset is STEP * class in every channel

SCHEMA = [
    Field("image", "image"),
    Field("label", "class"),
    Field("caption", "text"),
    Field("target", "float32", ()),
    Field("count", "int64", ()),
    Field("tags", "int64", None),
    Field("box", "float32", (4,)),
    Field("meta", "json"),
    Field("mask", "mask", (), "uint8"),
    Field("depth", "mask", (), "uint16"),
    Field("blob", "bytes"),
]


def png(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    return buf.getvalue()


def class_mask(seed: int, height: int = HEIGHT, width: int = WIDTH) -> np.ndarray:
    """A mask of BLOCK x BLOCK blocks of classes 0..3 (uint8)."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 4, size=(-(-height // BLOCK), -(-width // BLOCK)), dtype=np.uint8)
    return np.kron(blocks, np.ones((BLOCK, BLOCK), np.uint8))[:height, :width]


def sample_values(i: int) -> dict:
    """The values sample ``i`` is written with: what reading it must give back."""
    rng = np.random.default_rng(100 + i)
    mask = class_mask(i)
    image = np.repeat((mask * STEP)[:, :, None], 3, axis=2).astype(np.uint8)  # pixels say the class
    image[..., 1] = np.clip(image[..., 1].astype(int) + rng.integers(0, 3, image.shape[:2]), 0, 255)
    return {
        "image": image,
        "label": i % len(CLASSES),
        "caption": f"a photo of sample {i} ü",
        "target": np.float32(0.25 * i - 1),
        "count": int(10 ** (i % 12)) * (-1) ** i,
        "tags": np.arange(i % 4, dtype=np.int64) * 7,
        "box": np.array([i, i / 2, 3.5, -1], np.float32),
        "meta": {"id": i, "src": ["a", i], "nested": {"x": i / 4}},
        "mask": mask,
        "depth": (mask.astype(np.uint16) * 16000 + i),
        "blob": bytes([i, 0, 255, i]),
    }


def write_dataset(dest: Path, fmt: str, schema: list[Field], count: int = COUNT,
                  stored: dict[tuple[int, str], bytes] | None = None) -> list[dict]:
    """A packed dataset of ``schema`` written through ``fmt``'s Writer with extras, images stored PNG (lossless,
    so pixels compare exactly); returns each sample's values. ``stored`` replaces the stored bytes of (sample,
    field): what another writer, or a hostile one, might have stored."""
    dest.mkdir(parents=True)
    spec = TransformSpec(store="png")
    writer_class, _ = get_format(fmt)
    has_label = any(f.kind == "class" for f in schema)
    classes = CLASSES if has_label else []
    writer = writer_class(dest, spec, count, {"schema": schema, "classes": classes, "shard_samples": 5})
    samples = []
    for i in range(count):
        values = sample_values(i)
        samples.append(values)
        item = convert_bytes(png(values["image"]), f"s{i}.png", spec)
        extras = []
        for field in extra_fields(schema):
            value = values[field.name]
            extras.append(png(value) if field.kind in ("mask", "image") else encode(field, value))
            extras[-1] = (stored or {}).get((i, field.name), extras[-1])
        label = values["label"] if has_label else -1
        writer.write(label, f"{classes[label] if has_label else 'all'}/s{i}.png", item, tuple(extras))
    entries = writer.close()
    manifest = {"format": fmt, "format_version": FORMAT_VERSION, "count": count, "classes": classes,
                "class_to_idx": {c: k for k, c in enumerate(classes)}, "store": spec.store,
                "transform": spec.to_dict(), "shape": [HEIGHT, WIDTH, 3], "dtype": "uint8", "checksum": "crc32",
                "fields": [f.to_dict() for f in schema], **entries}
    write_json_atomic(dest / MANIFEST, manifest)
    return samples


# -- dense targets get the image's augmentation --------------------------------------------------------------------

def nearest_expected(stored: np.ndarray, top: float, left: float, height: float, width: float,
                     size: tuple[int, int], flipped: bool) -> np.ndarray:
    """numpy's nearest-neighbour resample of ``stored``'s window: each output pixel takes the stored pixel under
    its centre."""
    rows = np.floor(top + (np.arange(size[0]) + 0.5) * height / size[0]).astype(int)
    cols = np.floor(left + (np.arange(size[1]) + 0.5) * width / size[1]).astype(int)
    out = stored[np.clip(rows, 0, stored.shape[0] - 1)][:, np.clip(cols, 0, stored.shape[1] - 1)]
    return out[:, ::-1] if flipped else out
