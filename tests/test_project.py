"""Project metadata agrees with itself (environment.yml and pyproject.toml list the same dependencies), and the
package keeps its structure: no import cycle, no module over 600 lines, no format name compared, no format module
imported and no format's manifest key read outside formats/ (documented exceptions only), packer.remote imported
only by the public entry points (and importing nothing above the bytes it moves).

Lint is not run here: CI (.ci/run) runs ``ruff check .`` before the tests."""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml  # pyyaml, in the dev extra
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

import packer

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest itself depends on tomli before Python 3.11
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent
# conda-forge name -> PyPI name, where they differ
CONDA_TO_PYPI = {"pytorch": "torch", "python-lmdb": "lmdb"}
NOT_DEPENDENCIES = {"python", "pip"}


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def environment() -> dict:
    data = yaml.safe_load((REPO / "environment.yml").read_text(encoding="utf-8"))
    assert isinstance(data, dict)
    return data


def conda_spec(entry: str) -> tuple[str, SpecifierSet]:
    m = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)\s*(.*?)\s*", entry)
    assert m, entry
    name, spec = m.group(1).lower(), m.group(2).replace(" ", "")
    if spec.startswith("=") and not spec.startswith("=="):  # conda's "=3.11" is a prefix match
        spec = "==" + spec[1:] + ".*"
    return name, SpecifierSet(spec)


def environment_packages(environment: dict) -> dict[str, SpecifierSet]:
    out: dict[str, SpecifierSet] = {}
    for entry in environment["dependencies"]:
        if isinstance(entry, dict):  # the pip: section names PyPI packages
            assert set(entry) == {"pip"}, entry
            for req in entry["pip"]:
                if req.startswith("-e "):  # this checkout itself, installed editable
                    continue
                r = Requirement(req)
                assert r.name.lower() not in out, f"{r.name} listed twice"
                out[r.name.lower()] = r.specifier
            continue
        name, spec = conda_spec(entry)
        if name in NOT_DEPENDENCIES:
            continue
        name = CONDA_TO_PYPI.get(name, name)
        assert name not in out, f"{name} listed twice"
        out[name] = spec
    return out


def test_environment_yml_parses(environment):
    assert environment["name"] == "packer"
    assert "conda-forge" in environment["channels"]
    assert isinstance(environment["dependencies"], list) and environment["dependencies"]


def test_environment_matches_pyproject_dependencies(environment, pyproject):
    """environment.yml has every dependency with pyproject's specifier; anything more comes from the dev extra,
    with the same specifier."""
    def specs(requirements: list[str]) -> dict[str, SpecifierSet]:
        return {Requirement(r).name.lower(): Requirement(r).specifier for r in requirements}

    wanted = specs(pyproject["project"]["dependencies"])
    dev = specs(pyproject["project"]["optional-dependencies"]["dev"])
    listed = environment_packages(environment)
    assert {name: spec for name, spec in listed.items() if name in wanted} == wanted
    extra = {name: spec for name, spec in listed.items() if name not in wanted}
    assert extra == {name: dev.get(name) for name in extra}, "only dev-extra packages, with the same specifier"


def test_environment_python_satisfies_requires_python(environment, pyproject):
    pythons = [conda_spec(e)[1] for e in environment["dependencies"] if isinstance(e, str)
               and conda_spec(e)[0] == "python"]
    assert len(pythons) == 1
    requires = SpecifierSet(pyproject["project"]["requires-python"])
    pinned = re.search(r"(\d+\.\d+)", str(pythons[0])).group(1)
    assert requires.contains(pinned + ".0")


def test_dev_extra_has_what_the_tests_use(pyproject):
    dev = {Requirement(r).name.lower() for r in pyproject["project"]["optional-dependencies"]["dev"]}
    assert {"pytest", "pyyaml", "ruff"} <= dev


def test_version_and_entry_point(pyproject):
    assert pyproject["project"]["scripts"]["packer"] == "packer.cli:main"
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "packer.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+([.-]?\w+)?", packer.__version__)
    assert version(pyproject["project"]["name"]) == packer.__version__  # the installed metadata is this checkout's


def test_environment_installs_this_checkout_for_the_tests(environment):
    """`conda env create -f environment.yml` gives an environment where the test command passes: packer itself with
    its dev extra (pytest, pyyaml...) (matplotlib, for the bench chart, is a dependency)."""
    pip = next(entry["pip"] for entry in environment["dependencies"] if isinstance(entry, dict))
    assert "-e .[dev]" in pip


def test_install_hints_name_the_distribution(pyproject):
    """Every `pip install 'NAME[extra]'` hint in the package and the README names this distribution, not `packer`
    (another project on PyPI), and the README says its name (tests/test_docs.py: no page installs it from PyPI)."""
    name = pyproject["project"]["name"]
    assert name != "packer"
    from packer.install_hints import DIST_NAME, pip_hint

    assert DIST_NAME == name
    assert pip_hint("s3") == f"pip install '{name}[s3]'"
    texts = {p: p.read_text(encoding="utf-8") for p in [*(REPO / "packer").rglob("*.py"), REPO / "README.md"]}
    hints = [(p.name, m.group(1)) for p, t in texts.items()
             for m in re.finditer(r"pip install (?:-U |--upgrade )?['\"]?([A-Za-z][\w.-]*)(?=[\[' \")]|$)", t, re.M)]
    wrong = [(f, n) for f, n in hints if n.lower() in {"packer", "packer_data"}]
    assert not wrong, f"install hints naming the wrong distribution: {wrong}"
    assert f"`{name}`" in texts[REPO / "README.md"], "the README names the distribution"


def test_ci_lints_with_ruff():
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    assert re.search(r"^\s*ruff check", ci, re.M)
    assert "pytest" in ci


# --------------------------------------------------------------------------------------------------------------
# No import cycles between packer's modules, counting imports inside functions
# --------------------------------------------------------------------------------------------------------------
def _count_climbs():
    """scripts/count_climbs.py (scripts/ is not a package): its import walk is the one these rules read."""
    spec = importlib.util.spec_from_file_location("count_climbs", REPO / "scripts" / "count_climbs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def module_imports() -> dict[str, set[str]]:
    """``{module: packer modules it imports}``, from every import statement (an AST walk, so imports inside
    functions count too); ``from . import x`` counts the submodule ``x``."""
    return {name: set(targets) for name, targets in _count_climbs().imports(REPO).items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_the_import_walk_sees_imports_inside_functions():
    graph = module_imports()
    assert "packer.formats.base" in graph["packer.packing.options"]  # imported inside functions only
    assert import_cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def test_no_import_cycle():
    assert import_cycles(module_imports()) == []


def test_no_module_over_600_lines():
    long = {str(p.relative_to(REPO)): n for p in (REPO / "packer").rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > 600}
    assert long == {}


# The package layers ARCHITECTURE.md draws, lowest first: a package (a subpackage, or a top-level module) imports
# only packages on lower layers, deferred imports included. The two paths are folders: packing/ (with sources/
# below it) and reading/ -> loading/, both over formats/ and the shared vocabulary.
PACKAGE_LAYERS = [
    ("errors", "system", "state", "install_hints"),  # what every part says and relies on
    ("arguments", "fields", "images"),  # public-argument checks, the sample schema, pixels and image bytes
    ("manifest",),  # the one file both paths share
    ("formats", "remote"),  # the formats' writers and readers; moving bytes to and from URLs
    ("sources",),  # what pack reads (a packed dataset and foreign shards through the formats)
    ("packing", "reading"),  # the pack path; the read path's datasets
    ("exports", "loading", "verify"),  # datasets written back out; the loader and stream; verify
    ("bench", "lightning"),  # measuring; Lightning's DataModule
    ("cli",),
    ("__main__",),
]


def test_packages_import_only_the_layers_below_them():
    layer = {f"packer.{name}": level for level, names in enumerate(PACKAGE_LAYERS) for name in names}
    graph = _count_climbs().package_graph(_count_climbs().imports(REPO))
    assert sorted(set(graph) - {"packer"}) == sorted(layer), "put each package of packer/ on one layer"
    upward = sorted(f"{a} imports {b}" for a, found in graph.items() if a != "packer" for b in found
                    if layer[b] >= layer[a])
    assert upward == []


# The only module imports that climb the load-time layers, each with its reason: the CLI imports each command's stack
# when the command runs, so that `packer --help` and a usage error answer without loading h5py, lmdb and the codecs.
ALLOWED_CLIMBS = {
    ("packer.cli", "packer.packing.pack"): "`packer pack`: the conversion",
    ("packer.cli", "packer.formats"): "`packer info`: the formats' manifest checks and readers",
    ("packer.cli", "packer.exports.folder"): "`packer export`",
    ("packer.cli", "packer.verify"): "`packer verify`",
    ("packer.cli", "packer.bench"): "`packer bench`: the whole benchmark and matplotlib",
}


def test_only_the_cli_s_commands_climb_the_import_layers():
    """scripts/count_climbs.py's list: a lower module that imports (in a function) one that uses it is a call
    climbing back up; the CLI's deferred command imports are the only ones, at most five."""
    script = _count_climbs()
    graph = script.imports(REPO)
    found = set(script.climbs(graph, script.layers(graph)))
    assert sorted(found - set(ALLOWED_CLIMBS)) == [], "import it at load time, or call down instead of up"
    assert sorted(set(ALLOWED_CLIMBS) - found) == [], "no longer climbs: take it off ALLOWED_CLIMBS"
    assert len(ALLOWED_CLIMBS) <= 5


# Modules outside packer/remote/ that may import it: the public entry points, which resolve a URL into local files
# (or one Fetchable per file, for stream) before they call down. Everything below them sees local paths.
REMOTE_IMPORTERS = {
    "packer.cli": "its commands take URLs: parse_url tells them from folders, info reads a URL's manifest",
    "packer.packing.pack": "pack(): a URL SRC is fetched into the cache, a URL DEST is converted then uploaded",
    "packer.packing.upload": "uploads a finished conversion to a URL, manifest last",
    "packer.reading.dataset": "open_dataset(): a URL is fetched into the cache",
    "packer.exports.folder": "export(): a URL is fetched into the cache",
    "packer.exports.hf": "to_hf(): a URL is fetched into the cache",
    "packer.verify": "verify(): a URL's objects are fetched afresh into a temporary cache and checked",
    "packer.loading.stream": "stream(): a URL becomes its manifest and one Fetchable per shard, fetched when read",
    "packer.bench.remote": "packer bench URL: counts the bytes and requests each epoch fetched",
}
# What packer/remote/ itself may import: it moves bytes, so nothing that converts, reads a format or checks one.
REMOTE_USES = {"packer.arguments", "packer.errors", "packer.manifest", "packer.system", "packer.install_hints"}


def is_remote(module: str) -> bool:
    return module == "packer.remote" or module.startswith("packer.remote.")


def test_remote_is_imported_only_by_the_entry_points():
    """A URL is resolved once, at the public entry points: formats, sources and the readers never see one."""
    graph = module_imports()
    found = sorted(m for m, imports in graph.items() if not is_remote(m) and m not in REMOTE_IMPORTERS
                   and any(is_remote(i) for i in imports))
    assert found == [], "resolve the URL at the entry point and pass a local folder (or a Fetchable) down"
    stale = sorted(m for m in REMOTE_IMPORTERS if m in graph and not any(is_remote(i) for i in graph[m]))
    assert stale == [], "no longer imports packer.remote: take it off REMOTE_IMPORTERS"


def test_remote_only_moves_bytes():
    graph = module_imports()
    climbs = {m: sorted(i for i in imports if not is_remote(i) and i not in REMOTE_USES)
              for m, imports in graph.items() if is_remote(m)}
    assert {m: i for m, i in climbs.items() if i} == {}


def test_no_import_cycle_between_packages():
    """With each sub-package (formats, remote, bench) taken as one module, still no cycle: ``formats`` importing
    ``remote`` while ``remote`` imported ``formats`` was one."""
    def unit(module: str) -> str:
        return ".".join(module.split(".")[:2])

    graph: dict[str, set[str]] = {}
    for module, imports in module_imports().items():
        graph.setdefault(unit(module), set()).update(unit(i) for i in imports if unit(i) != unit(module))
    assert import_cycles(graph) == []


def test_no_branching_on_a_format_name_outside_the_formats_package():
    """Comparisons with a format's name (``fmt == "wds"``, ``in ("lmdb", "hdf5")``) belong in that format's module:
    elsewhere a new format would need edits all over the code."""
    names = {"lmdb", "hdf5", "wds"}
    found = []
    for path in (REPO / "packer").rglob("*.py"):
        if "formats" in path.relative_to(REPO).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Compare):
                continue
            for operand in [node.left, *node.comparators]:
                values = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
                if any(isinstance(v, ast.Constant) and v.value in names for v in values):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert found == []


# --------------------------------------------------------------------------------------------------------------
# Each format owns its knowledge: its modules are imported inside formats/ only, its manifest keys read there
# --------------------------------------------------------------------------------------------------------------
# The registry's interface, importable from anywhere: packer.formats (open_reader, get_format, reader_class,
# foreign_reader, close_all...) and packer.formats.base (Reader, Writer, Sample).
FORMATS_INTERFACE = {"packer.formats", "packer.formats.base"}
# module outside formats/ -> the format modules it may import, each with its reason
FORMAT_IMPORTS_ALLOWED = {
    # LmdbDataset, Hdf5Dataset and WdsDataset are thin public subclasses that each name their reader class
    # (WdsDataset.from_shards calls WdsReader.from_shards); open_dataset itself goes through the registry
    "packer.reading.dataset": {"packer.formats.lmdb", "packer.formats.hdf5", "packer.formats.wds"},
}
# manifest keys a format adds, read only by its module (through the hooks: check_manifest, summary, merge_parts,
# stream_files)
FORMAT_MANIFEST_KEYS = {"shards", "caption"}  # caption: the field WebDataset writes as KEY.txt
# module -> how many times it may name such a key for something else, and why
KEY_MENTIONS_ALLOWED = {
    "packer/sources/shards.py": 1,  # ShardsSource.kind = "shards": the kind of source (sources.base.Source.kind)
}


def format_modules(graph: dict[str, set[str]]) -> set[str]:
    return {m for m in graph if m.startswith("packer.formats.") and m not in FORMATS_INTERFACE}


def test_format_modules_are_imported_inside_formats_only():
    """A module outside ``packer/formats/`` that imports ``packer.formats.<name>`` (``lmdb``, ``wds``,
    ``wds_members``...) holds that format's knowledge, which a new format could not extend: it goes through the
    registry's hooks instead. The allowed exceptions are listed above, each with its reason."""
    graph = module_imports()
    formats = format_modules(graph)
    assert {"packer.formats.lmdb", "packer.formats.wds", "packer.formats.wds.members"} <= formats
    found = {module: sorted(imported & (formats - FORMAT_IMPORTS_ALLOWED.get(module, set())))
             for module, imported in graph.items() if not module.startswith("packer.formats")}
    assert {module: names for module, names in found.items() if names} == {}
    unused = {module: sorted(allowed - graph.get(module, set())) for module, allowed in FORMAT_IMPORTS_ALLOWED.items()}
    assert {module: names for module, names in unused.items() if names} == {}, "an exception no longer needed"


def key_mentions(tree: ast.AST, keys: set[str]) -> list[int]:
    """Lines that name one of ``keys`` as a string: ``m["shards"]``, ``m.get("shards")``, ``for key in ("files",
    "shards")``; not a key of a dict display, which writes a mapping of its own (a source's description)."""
    written = {id(k) for node in ast.walk(tree) if isinstance(node, ast.Dict) for k in node.keys if k is not None}
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and node.value in keys and id(node) not in written]


def test_format_manifest_keys_are_read_inside_formats_only():
    """The manifest keys a format adds (WebDataset's ``shards``) are read by that format's module: ``info``'s
    lines, the merge of a distributed conversion's parts, the manifest's checks and ``stream`` ask its hooks."""
    sample = 'm["shards"]; m.get("shards", [])\nfor key in ("files", "shards"): pass\nd = {"shards": 1}'
    assert key_mentions(ast.parse(sample), {"shards"}) == [1, 1, 2]
    found = {}
    for path in (REPO / "packer").rglob("*.py"):
        name = path.relative_to(REPO).as_posix()
        lines = key_mentions(ast.parse(path.read_text(encoding="utf-8")), FORMAT_MANIFEST_KEYS)
        if "formats" not in path.relative_to(REPO).parts and len(lines) != KEY_MENTIONS_ALLOWED.get(name, 0):
            found[name] = lines
    assert found == {}


def test_one_resume_implementation():
    """The resume protocol lives in packer/state.py: nothing else defines a state check or a counting iterator,
    and every ``load_state_dict`` in packer checks the state with ``check_state`` or hands it to another
    ``load_state_dict`` (a loader to its sampler, Lightning's wrapper to its loader)."""
    owned = {"check_state", "CountingIterator", "Progress", "StateSchema", "Stateful"}
    loaders = []
    for path in sorted((REPO / "packer").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in owned:
                assert path.name == "state.py", f"{path}: defines {node.name}, which packer/state.py owns"
            if isinstance(node, ast.FunctionDef) and node.name == "load_state_dict" and path.name != "state.py":
                calls = {c.func.id if isinstance(c.func, ast.Name) else c.func.attr for c in ast.walk(node)
                         if isinstance(c, ast.Call) and isinstance(c.func, (ast.Name, ast.Attribute))}
                assert calls & {"check_state", "load_state_dict"}, f"{path}: load_state_dict checks states itself"
                loaders.append(path.name)
    assert {"sampler.py", "stream.py", "loader.py"} <= set(loaders)


# A measured figure in a comment or docstring goes stale silently: figures live in docs/benchmarks.md and the
# benchmarks, with their machine and command; the code says why in words and points there.
FIGURE = re.compile(r"\b\d[\d,.]*\s?(?:ms|us|µs|img/s|MB/s|GB/s)\b|\b\d+(?:\.\d+)?x (?:faster|slower|the|auto)\b")


def comments_and_docstrings(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring of a module."""
    import io
    import tokenize

    found = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                found.append((node.body[0].lineno, doc))
    return found


def test_no_measured_figure_in_code_comments_or_docstrings():
    assert FIGURE.search("about 9 ms a batch") and FIGURE.search("1.8x auto's speed") and not FIGURE.search("8 ranks")
    found = [f"{path.relative_to(REPO)}:{line}: {FIGURE.search(text).group(0)}"
             for path in sorted((REPO / "packer").rglob("*.py"))
             for line, text in comments_and_docstrings(path.read_text(encoding="utf-8")) if FIGURE.search(text)]
    assert found == [], "move the figure to docs/benchmarks.md (with its command) and say why in words"
