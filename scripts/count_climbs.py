"""Count the imports of packer's modules that climb back up the import layers.

Layers: each module is placed one above the highest module it imports at load time (its module-level imports;
imports inside functions and ``if TYPE_CHECKING:`` blocks do not decide the layers). An import, at load time or
deferred into a function, climbs back when it reaches a module on a layer above the importer's: a lower module
reaching up into the ones that use it (a deferred import is how such a call dodges the cycle the project test
forbids). An entry point that defers its imports for start-up time (``cli``) sits low and counts too: read the
list, not only the number. Cycles are the project test's business (tests/test_project.py), not
this script's; a module in a load-time cycle is placed on the highest layer of the cycle.

``--trace SRC`` also runs ``packer.pack(SRC, a temporary folder, workers=1)`` (one process: the calls the
conversion's workers make are the source reader's and the transform's) and follows the calls between packer's
modules while it runs: the modules the pack path enters, in order, and each distinct call from one module into
another (a function, a method or a function passed down, counted once per calling and called module), with the
ones that go to a higher layer: a module calling back up into one that called it, directly or through a
function it was given.

Usage::

    python scripts/count_climbs.py            # packer/ of this checkout: one line per climb, then the count
    python scripts/count_climbs.py --layers   # also each layer's modules
    python scripts/count_climbs.py --root DIR # another checkout (a git worktree of main, say)
    python scripts/count_climbs.py --trace sample_data   # and the calls of pack()'s path
"""

from __future__ import annotations

import argparse
import ast
import sys
import tempfile
from pathlib import Path
from types import FrameType
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def modules(root: Path) -> dict[str, Path]:
    """``{dotted module name: file}`` of every module under ``root/packer``."""
    found = {}
    for path in (root / "packer").rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _deferred(node: ast.AST) -> set[int]:
    """The ids of the import nodes inside functions or ``if TYPE_CHECKING:`` blocks under ``node``."""
    out: set[int] = set()
    for inner in ast.walk(node):
        typing_only = isinstance(inner, ast.If) and "TYPE_CHECKING" in ast.unparse(inner.test)
        if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) or typing_only:
            out |= {id(n) for n in ast.walk(inner) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return out


def imports(root: Path) -> dict[str, dict[str, bool]]:
    """``{module: {packer module it imports: whether at load time}}``; ``from . import x`` counts the submodule
    ``x``, and ``packer`` itself (its ``__init__`` imports lazily, by name) is left out."""
    known = modules(root)
    graph: dict[str, dict[str, bool]] = {}
    for name, path in known.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        tree = ast.parse(path.read_text(encoding="utf-8"))
        deferred = _deferred(tree)
        found: dict[str, bool] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base_parts = here[:len(here) - node.level + 1] if node.level else []
                base = ".".join([*base_parts, node.module] if node.module else base_parts)
                targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            else:
                continue
            for target in targets:
                while target and target not in known:  # an attribute of a module, or not packer's
                    target = target.rpartition(".")[0]
                if target and target not in (name, "packer"):
                    found[target] = found.get(target, False) or id(node) not in deferred
        graph[name] = found
    return graph


def layers(graph: dict[str, dict[str, bool]]) -> dict[str, int]:
    """Each module's layer: 0 for a module that imports no packer module at load time, else one above the highest
    it imports at load time."""
    layer: dict[str, int] = {}
    visiting: set[str] = set()

    def place(name: str) -> int:
        if name in layer:
            return layer[name]
        if name in visiting:  # a load-time cycle: not this script's business
            return 0
        visiting.add(name)
        below = [place(t) for t, loaded in graph[name].items() if loaded]
        visiting.discard(name)
        layer[name] = 1 + max(below) if below else 0
        return layer[name]

    for name in sorted(graph):
        place(name)
    return layer


def climbs(graph: dict[str, dict[str, bool]], layer: dict[str, int]) -> list[tuple[str, str]]:
    """The imports ``(importer, imported)`` that reach a layer above the importer's, sorted."""
    return sorted((name, target) for name, found in graph.items() for target in found
                  if layer[target] > layer[name])


def trace_pack(root: Path, src: str) -> list[tuple[str, str]]:
    """The calls from one packer module into another while ``pack(src, ...)`` runs in one process, in the order
    they first happen, each ``(caller, called)`` pair once."""
    sys.path.insert(0, str(root))
    import packer.packing.pack

    seen: dict[tuple[str, str], None] = {}

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or frame.f_back is None:
            return
        called = frame.f_globals.get("__name__", "")
        caller = frame.f_back.f_globals.get("__name__", "")
        if called != caller and called.startswith("packer.") and caller.startswith("packer."):
            seen.setdefault((caller, called), None)

    with tempfile.TemporaryDirectory() as out:
        sys.setprofile(profile)
        try:
            packer.packing.pack.pack(src, Path(out) / "dest", "lmdb", workers=1, progress=False, distributed=False)
        finally:
            sys.setprofile(None)
    return list(seen)


def report_trace(calls: list[tuple[str, str]], layer: dict[str, int]) -> None:
    """Print the modules the pack path enters and its calls that climb back up."""
    entered = list(dict.fromkeys(["packer.packing.pack", *(called for _, called in calls)]))
    print(f"pack path: enters {len(entered)} modules: {' '.join(m.removeprefix('packer.') for m in entered)}")
    up = [(a, b) for a, b in calls if layer.get(b, -1) > layer.get(a, -1)]
    for caller, called in up:
        print(f"call up: {caller} (layer {layer[caller]}) calls into {called} (layer {layer[called]})")
    print(f"pack path: {len(up)} of its {len(calls)} distinct calls between modules climb back up")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=REPO, help="the checkout whose packer/ to count")
    parser.add_argument("--layers", action="store_true", help="print each layer's modules too")
    parser.add_argument("--trace", metavar="SRC", help="also follow the calls of pack(SRC) between modules")
    args = parser.parse_args()
    graph = imports(args.root)
    layer = layers(graph)
    if args.layers:
        for level in range(max(layer.values()) + 1):
            print(f"layer {level}: {' '.join(sorted(m for m, lv in layer.items() if lv == level))}")
    found = climbs(graph, layer)
    for name, target in found:
        print(f"climb: {name} (layer {layer[name]}) imports {target} (layer {layer[target]})")
    print(f"{len(found)} imports climb back up, of {sum(len(f) for f in graph.values())} between "
          f"{len(graph)} modules in {max(layer.values()) + 1} layers")
    if args.trace:
        report_trace(trace_pack(args.root, args.trace), layer)


if __name__ == "__main__":
    main()
