"""``packer bench --compare A B``: the differences between two runs' results.json, row by row.

Rows are matched by what they read and how (dataset, store, pipeline, cache, workers), a --full run's by the epoch
that stands for its cache (:func:`~packer.bench.chart.steady`), so a quick run compares with a --full one. A change
is "within noise" where it is no larger than twice the two rates' noise combined (:func:`~packer.bench.measure.change`;
a rate without a noise figure counts :data:`~packer.bench.measure.DEFAULT_NOISE`); each rate's noise includes how much
its run's machine moved between figures (:func:`~packer.bench.measure.add_drift`). What differs between the two
machines and package versions is said first, with each run's command and load average.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..errors import UsageError
from .chart import steady
from .machine import load_text
from .measure import add_drift, change

Key = tuple[str, str, str, str, int]


def load_results(path: str | os.PathLike) -> dict[str, Any]:
    """A run's results.json, given as the file or as the --out folder holding it."""
    p = Path(path)
    p = p / "results.json" if p.is_dir() else p
    try:
        results = json.loads(p.read_text())
    except FileNotFoundError:
        raise UsageError(f"{p}: no such file; give a results.json packer bench wrote, or its --out folder") from None
    except (OSError, ValueError) as exc:
        raise UsageError(f"{p}: not a packer bench results.json ({exc})") from None
    if not isinstance(results, dict) or not isinstance(results.get("rows"), list):
        raise UsageError(f"{p}: not a packer bench results.json (it has no rows)")
    add_drift(results)  # a run written before the machine's drift was part of each row's noise
    return results


def keyed(results: dict[str, Any]) -> dict[Key, dict[str, Any]]:
    """The rows that stand for each (dataset, store, pipeline, cache, workers)."""
    rows = results["rows"]
    found: dict[Key, dict[str, Any]] = {}
    for cache in dict.fromkeys(r["cache"] for r in rows):
        for r in steady(rows, cache):
            found[(r["dataset"], r["store"], r["pipeline"], r["cache"], r["workers"])] = r
    return found


def _machine_lines(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    ma, mb = a.get("machine", {}), b.get("machine", {})
    lines = [f"{name}: {ma.get(name)} | {mb.get(name)}" for name in ("cpu_model", "usable_cores", "memory_gib",
                                                                        "platform", "python", "packer")
             if ma.get(name) != mb.get(name)]
    va, vb = ma.get("versions", {}), mb.get("versions", {})
    lines += [f"{name}: {va.get(name)} | {vb.get(name)}" for name in sorted(set(va) | set(vb))
              if va.get(name) != vb.get(name)]
    return lines or ["machine and package versions: the same"]


def compare_lines(a: dict[str, Any], b: dict[str, Any], names: tuple[str, str] = ("A", "B")) -> list[str]:
    """The comparison as printed: the two runs, what differs about their machines, then a line per row."""
    lines = []
    for name, r in zip(names, (a, b), strict=True):
        load = (r.get("load_average") or {}).get("start")
        lines.append(f"{name}: {r.get('command', '?')} ({r.get('mode', 'full')}, {r.get('created', '?')}, load "
                     f"average {load_text(load)} at the start)")
    lines += _machine_lines(a, b)
    ka, kb = keyed(a), keyed(b)
    both = [k for k in ka if k in kb]
    width = max((len(" ".join(map(str, k))) for k in both), default=10)
    lines += ["", f"{'row':<{width}}  {'A img/s':>10}  {'B img/s':>10}  {'change':>7}  {'noise':>6}"]
    for k in both:
        c = change(ka[k], kb[k])
        verdict = "within noise" if c["within"] else ("faster" if c["change"] > 0 else "slower") + ", beyond noise"
        lines.append(f"{' '.join(map(str, k)):<{width}}  {c['a']:>10,.0f}  {c['b']:>10,.0f}  {c['change']:>+7.1%}  "
                     f"±{c['noise']:>5.0%}  {verdict}")
    within = sum(change(ka[k], kb[k])["within"] for k in both)
    lines.append(f"{within} of {len(both)} rows within noise")
    for name, mine, other in ((names[0], ka, kb), (names[1], kb, ka)):
        only = [" ".join(map(str, k)) for k in mine if k not in other]
        if only:
            lines.append(f"only in {name}: {'; '.join(only)}")
    return lines
