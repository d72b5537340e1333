"""The loader settings ``packer bench --tune`` saved beside a dataset (``loader.json``): read for the read-time
view they were tuned for (:func:`read_view`), and applied where no explicit argument overrides them."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from typing import Any

from ..manifest import TUNED
from ..reading.dataset import PackedDataset


def applied_tuned(tuned: Mapping[str, Any], threads: int | None, prefetch_batches: int | None,
                  overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The tuned settings an explicit argument does not override (an explicit argument always wins)."""
    given = set(overrides) | {k for k, v in (("threads", threads), ("prefetch_batches", prefetch_batches))
                              if v is not None}
    if "prefetch_batches" in given or "prefetch_factor" in given:
        given.add("prefetch_factor")
    if "threads" in given or "prefetch_batches" in given:  # the in-process loader was asked for
        given.add("num_workers")
    if overrides.get("num_workers"):  # worker processes: tuned threads belong to the tuned in-process loader
        given.add("threads")
    return {k: v for k, v in tuned.items() if k not in given}


TUNABLE = ("num_workers", "threads", "prefetch_factor", "pin_memory")  # loader settings only, never batch_size
VIEW_KEYS = ("resize", "center_crop", "random_resized_crop", "flip", "decoder", "interpolation", "decode")


def read_view(dataset: Any) -> dict[str, Any] | None:
    """The read-time options a packed dataset was opened with (what each batch costs to make), as JSON values;
    ``transform`` is recorded as whether there is one. None for datasets that are not packer's."""
    if not isinstance(dataset, PackedDataset):
        return None
    view = {key: getattr(dataset, key, None) for key in VIEW_KEYS}
    view["transform"] = dataset.transform is not None
    return json.loads(json.dumps(view, default=str))


def _describe_view(view: dict[str, Any]) -> str:
    shown = [f"{k} {v}" for k, v in view.items() if v not in (None, False) and k not in ("decode", "interpolation")]
    return ", ".join(shown) or "no read-time options"


def tuned_settings(dataset: Any) -> dict[str, Any]:
    """The loader settings ``packer bench --tune`` saved beside the dataset (``loader.json``): num_workers,
    threads, prefetch_factor and pin_memory, never batch_size; {} if none, or (said in one line on stderr) if
    they were tuned for another read-time view than the one ``dataset`` was opened with."""
    root = getattr(dataset, "root", None)
    path = root / TUNED if root is not None else None
    if path is None or not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except ValueError:
        return {}
    tuned_view = data.get("view")
    view = read_view(dataset)
    if tuned_view is not None and view is not None and tuned_view != view:
        print(f"packer: not using the tuned loader settings in {path}: they were tuned for another view "
              f"({_describe_view(tuned_view)}; this dataset: {_describe_view(view)}); run `packer bench --tune "
              f"{root}` with this view to tune for it", file=sys.stderr)
        return {}
    loader = data.get("loader", {})
    return {k: loader[k] for k in TUNABLE if isinstance(loader.get(k), (bool, int))
            and (k == "pin_memory") == isinstance(loader.get(k), bool)}
