"""Count the imports of packer's modules that climb back up the import layers.

Layers: each module is placed one above the highest module it imports at load time (its module-level imports;
imports inside functions do not decide the layers, and imports under ``if TYPE_CHECKING:``, which never run, are
left out). An import, at load time or
deferred into a function, climbs back when it reaches a module on a layer above the importer's: a lower module
reaching up into the ones that use it (a deferred import is how such a call dodges the cycle the project test
forbids). An entry point that defers its imports for start-up time (``cli``) sits low and counts too: read the
list, not only the number. Cycles are the project test's business (tests/test_project.py), not
this script's; a module in a load-time cycle is placed on the highest layer of the cycle.

The traces follow calls at run time, between packages: each package (``packer.X``: a subpackage, or a
top-level module) is placed one above every package it imports, deferred imports included (the project test
forbids a cycle between packages, so this order exists). Within a package a base class calls its subclasses'
overrides and a reader hands a decoder its samples; between packages, a call into a package on a higher layer is
a lower package calling back up into one that uses it, through a function it was handed or found in a registry.
A generator resumed, or a protocol method (``__next__``, ``__len__``...; not ``__init__``) run on an object the
caller holds, is not counted as a call.

``--trace SRC`` runs ``packer.pack(SRC, a temporary folder, workers=1)`` (one process: the calls the conversion's
workers make are the source reader's and the transform's) and lists the modules the pack path enters, in order,
and each distinct call from one module into another that climbs back up the package layers.

``--trace-read TABLE`` packs TABLE (an annotation table with a ``subject`` label column and a mask) in each format,
untraced, then follows the calls while ``open_dataset`` with a training view, ``ds[0]`` and a batch of
``make_loader`` (threads, in this process) read it: a sample's fields from the table to a batch.

Usage::

    python scripts/count_climbs.py            # packer/ of this checkout: one line per climb, then the count
    python scripts/count_climbs.py --layers   # also each layer's modules, and the package layers
    python scripts/count_climbs.py --root DIR # another checkout (a git worktree of main, say)
    python scripts/count_climbs.py --trace sample_data   # and the calls of pack()'s path
    python scripts/count_climbs.py --trace-read sample_data/annotations.csv   # and a sample's fields to a batch
"""

from __future__ import annotations

import argparse
import ast
import inspect
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


def _typing_only(node: ast.AST) -> set[int]:
    """The ids of the import nodes inside ``if TYPE_CHECKING:`` blocks under ``node``: never run, so neither a
    dependency nor a climb (``packer/__init__`` names its lazy public API there for type checkers)."""
    out: set[int] = set()
    for inner in ast.walk(node):
        if isinstance(inner, ast.If) and "TYPE_CHECKING" in ast.unparse(inner.test):
            out |= {id(n) for n in ast.walk(inner) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return out


def _deferred(node: ast.AST) -> set[int]:
    """The ids of the import nodes inside functions under ``node``."""
    out: set[int] = set()
    for inner in ast.walk(node):
        if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
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
        deferred, typing_only = _deferred(tree), _typing_only(tree)
        found: dict[str, bool] = {}
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
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


_RESUMABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


def package_of(module: str) -> str:
    """The unit of the package layers: ``packer.X`` (a subpackage, or a top-level module)."""
    return ".".join(module.split(".")[:2])


def package_graph(graph: dict[str, dict[str, bool]]) -> dict[str, dict[str, bool]]:
    """The import graph between packages (:func:`package_of`), every import counted, deferred ones too (the
    project test forbids a cycle between packages, so each package sits above all it imports)."""
    units: dict[str, dict[str, bool]] = {}
    for name, found in graph.items():
        units.setdefault(package_of(name), {})
        for target in found:
            if package_of(target) != package_of(name):
                units[package_of(name)][package_of(target)] = True
                units.setdefault(package_of(target), {})
    return units


class _Calls:
    """Records each distinct call from one packer module into another while it is entered."""

    def __init__(self) -> None:
        self.seen: dict[tuple[str, str], None] = {}

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        # a generator resumed, or a protocol method (__next__, __len__, __getitem__...) run on an object the caller
        # holds, is the language calling an object it was handed, not a call naming that object's module
        name = frame.f_code.co_name
        protocol = name.startswith("__") and name.endswith("__") and name != "__init__"
        if event != "call" or frame.f_back is None or frame.f_code.co_flags & _RESUMABLE or protocol:
            return
        called = frame.f_globals.get("__name__", "")
        caller = frame.f_back.f_globals.get("__name__", "")
        if called != caller and called.startswith("packer.") and caller.startswith("packer."):
            self.seen.setdefault((caller, called), None)

    def __enter__(self) -> _Calls:
        sys.setprofile(self.profile)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)


def trace_read(root: Path, table: str, table_root: str) -> list[tuple[str, str]]:
    """The calls between packer's modules while a sample's fields go from a packed table to a batch: ``table``
    (an annotation table with a mask column, relative to ``table_root``) is packed first, untraced, in each
    format; then ``open_dataset`` with a training view, ``ds[0]`` and one batch of ``make_loader`` with threads
    (in this process, so every call is seen) are traced."""
    sys.path.insert(0, str(root))
    import packer
    import packer.formats

    calls = _Calls()
    with open(table, encoding="utf-8") as f:  # sample_data's tags are lists of any length
        lists = ("tags:int64[]",) if "tags" in f.readline().strip().split(",") else ()
    with tempfile.TemporaryDirectory() as out:
        for fmt in packer.formats.format_names():
            dest = Path(out) / fmt
            packer.pack(table, dest, fmt, root=table_root, label_column="subject", max_size=64, workers=1,
                        progress=False, distributed=False, field=lists)
            with calls:
                ds = packer.open_dataset(dest, random_resized_crop=32, flip=True)
                ds[0]
                next(iter(packer.make_loader(ds, batch_size=4, num_workers=0)))
    return list(calls.seen)


def trace_pack(root: Path, src: str) -> list[tuple[str, str]]:
    """The calls from one packer module into another while ``pack(src, ...)`` runs in one process, in the order
    they first happen, each ``(caller, called)`` pair once."""
    sys.path.insert(0, str(root))
    import packer.packing.pack

    with tempfile.TemporaryDirectory() as out, _Calls() as calls:
        packer.packing.pack.pack(src, Path(out) / "dest", "lmdb", workers=1, progress=False, distributed=False)
    return list(calls.seen)


def calls_up(calls: list[tuple[str, str]], package_layer: dict[str, int]) -> list[tuple[str, str]]:
    """The calls into a package on a higher layer than the caller's package (a function a lower package was
    handed, or found in a registry, and calls back)."""
    return [(a, b) for a, b in calls if package_layer.get(package_of(b), -1) > package_layer.get(package_of(a), -1)]


def report_trace(name: str, start: str, calls: list[tuple[str, str]], package_layer: dict[str, int]) -> None:
    """Print the modules a path enters and its calls that climb back up the package layers."""
    entered = list(dict.fromkeys([start, *(called for _, called in calls)]))
    print(f"{name}: enters {len(entered)} modules: {' '.join(m.removeprefix('packer.') for m in entered)}")
    up = calls_up(calls, package_layer)
    for caller, called in up:
        print(f"call up: {caller} (package layer {package_layer[package_of(caller)]}) calls into {called} "
              f"(package layer {package_layer[package_of(called)]})")
    print(f"{name}: {len(up)} of its {len(calls)} distinct calls between modules climb back up the package layers")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=REPO, help="the checkout whose packer/ to count")
    parser.add_argument("--layers", action="store_true", help="print each layer's modules too")
    parser.add_argument("--trace", metavar="SRC", help="also follow the calls of pack(SRC) between modules")
    parser.add_argument("--trace-read", metavar="TABLE", help="also follow a sample's fields from TABLE (packed "
                        "first, paths relative to the current folder) to a batch")
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
    package_layer = layers(package_graph(graph))
    if args.layers:
        for level in range(max(package_layer.values()) + 1):
            print(f"package layer {level}: {' '.join(sorted(m for m, lv in package_layer.items() if lv == level))}")
    if args.trace:
        report_trace("pack path", "packer.packing.pack", trace_pack(args.root, args.trace), package_layer)
    if args.trace_read:
        report_trace("read path", "packer.reading.dataset", trace_read(args.root, args.trace_read, "."),
                     package_layer)


if __name__ == "__main__":
    main()
