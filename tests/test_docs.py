"""Every example of the README and of the documentation site runs as a new user would run it, and the site says
what the code does.

Each page's ``bash`` and ``python`` blocks run in one Python interpreter, in order (a ``bash`` block as a
subprocess at its place), in a fresh folder holding ``sample_data`` and ``sample_masks``, on CPU. A block preceded
by ``<!-- no-test: why -->`` is not run (it needs a bucket or a cluster, or installs packages: the remote and
distributed tests, and the fresh-venv test below, cover those). What a page's blocks write must be git-ignored
(as it would be in a checkout), and the checkout is left as it was. The README's two install commands work in a
fresh venv with that venv's own pip."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.packed import libjpeg_turbo_headers

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = REPO / "docs"
PAGES = [README, *sorted(DOCS.rglob("*.md"))]
# Shrinks a block for the test, the only edits made to what a page says: two epochs instead of 90, a checkpoint
# every step instead of every 500 (so that its second run resumes from one).
SMALLER = {"epochs, start_epoch, step = 90, 0, 0": "epochs, start_epoch, step = 2, 0, 0",
           "if step % 500 == 0:": "if step % 1 == 0:"}
INSTALL_STEP = re.compile(r"^(python3 -m venv |\. \.venv/bin/activate$|python -m pip install |pip install )")
RUNS = ("bash", "python")
# Runs a page's blocks (a JSON list on argv[1]) in this one interpreter, each block's start marked on stdout.
DRIVER = r'''
import json, subprocess, sys, traceback
namespace = {"__name__": "__main__"}
for block in json.load(open(sys.argv[1])):
    for run in range(block["runs"]):
        print(f"@@ {block['where']} run {run + 1}", flush=True)
        if block["lang"] == "python":
            try:
                exec(compile(block["code"], block["where"], "exec"), namespace)
            except BaseException:
                traceback.print_exc()
                sys.exit(f"{block['where']} failed")
            sys.stdout.flush()
        elif subprocess.run(["bash", "-euo", "pipefail", "-c", block["code"]]).returncode:
            sys.exit(f"{block['where']} failed")
'''


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the block's first line of code, 1-based
    lang: str
    code: str
    skip: str | None  # why it is not run, from <!-- no-test: why -->

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def page_blocks(page: Path) -> list[Block]:
    """The fenced blocks of ``page``, in order."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = re.fullmatch(r"```(\w*)\s*", lines[i])
        if not m:
            i += 1
            continue
        start = i + 1
        end = next(j for j in range(start, len(lines)) if lines[j].startswith("```"))
        marker = re.fullmatch(r"<!-- no-test: (.+) -->", lines[i - 1].strip()) if i > 0 else None
        blocks.append(Block(page, start + 1, m.group(1), "\n".join(lines[start:end]) + "\n",
                            marker.group(1) if marker else None))
        i = end + 1
    return blocks


def install_and_rest(command: str) -> tuple[list[str], str]:
    """Split a one-line install command into its install steps and what it runs after them."""
    steps = [s.strip() for s in command.strip().split(" && ")]
    n = next((k for k, s in enumerate(steps) if not INSTALL_STEP.match(s)), len(steps))
    return steps[:n], " && ".join(steps[n:])


def to_run(page: Path) -> list[dict]:
    """What the driver runs for ``page``: install steps left to the fresh-venv test (and the test command to CI),
    the blocks shrunk, the
    README's first Python block twice (packing again must not fail) and a checkpointing loop twice (it resumes)."""
    out, pythons = [], 0
    for block in page_blocks(page):
        if block.lang not in RUNS or block.skip:
            continue
        code = block.code
        if block.lang == "bash" and code.startswith("python3 -m venv"):
            _, code = install_and_rest(code)
            if code.startswith("python -m pytest"):
                continue  # the test command: this suite itself
        for a, b in SMALLER.items():
            code = code.replace(a, b)
        pythons += block.lang == "python"
        runs = 2 if "checkpoint.pt" in code or (page == README and block.lang == "python" and pythons == 1) else 1
        out.append({"where": block.where, "lang": block.lang, "code": code, "runs": runs})
    return out


def git_status() -> str:
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=REPO, capture_output=True,
                          text=True, check=True).stdout


def not_ignored(names: list[str]) -> list[str]:
    """The names among ``names`` (files or folders at the checkout's root) that git would show as untracked."""
    return [n for n in names if subprocess.run(["git", "check-ignore", "-q", "--no-index", n], cwd=REPO).returncode]


RUNNABLE = [p for p in PAGES if to_run(p)]


@pytest.mark.slow
@pytest.mark.parametrize("page", RUNNABLE, ids=[str(p.relative_to(REPO)) for p in RUNNABLE])
def test_every_example_of_the_page_runs(page, tmp_path_factory, capsys):
    work, home = tmp_path_factory.mktemp("page"), tmp_path_factory.mktemp("hf-home")
    for name in ("sample_data", "sample_masks"):  # the examples read both; copied, not linked: a table's paths
        shutil.copytree(REPO / name, work / name)  # must lead inside --root (.) with links followed
    blocks = to_run(page)
    script = tmp_path_factory.mktemp("driver")
    (script / "blocks.json").write_text(json.dumps(blocks))
    env = dict(os.environ, PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="", HF_HOME=str(home),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env.pop("PACKER_DEBUG", None)
    before = git_status()
    r = subprocess.run([sys.executable, "-c", DRIVER, str(script / "blocks.json")], cwd=work, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"{r.stdout[-6000:]}\n{r.stderr[-6000:]}"
    runs = dict(re.findall(r"^@@ (\S+ run \d)\n(.*?)(?=^@@ |\Z)", r.stdout, re.M | re.S))
    for block in blocks:
        if "checkpoint.pt" in block["code"]:  # the training loop says how it goes, and resumes where it stopped
            first, second = runs[f"{block['where']} run 1"], runs[f"{block['where']} run 2"]
            assert "epoch 1 done" in first and "resumed at epoch" not in first, first
            assert "resumed at epoch" in second, second
    made = sorted(p.name + "/" * p.is_dir() for p in work.iterdir() if p.name not in ("sample_data", "sample_masks"))
    assert not_ignored(made) == [], "examples leave files git would show: write them under out/ (or .gitignore)"
    assert git_status() == before
    with capsys.disabled():
        skipped = sum(b.skip is not None for b in page_blocks(page) if b.lang in RUNS)
        print(f"\n{page.relative_to(REPO)}: ran {len(blocks)} blocks, skipped {skipped} marked no-test")


def test_every_block_is_run_or_says_why():
    """A shell or Python block is run, or marked no-test with a reason; a page's other blocks are text."""
    for page in PAGES:
        for block in page_blocks(page):
            assert block.lang in (*RUNS, ""), f"{block.where}: a {block.lang!r} block; mark it bash, python or none"
            assert block.skip is None or block.lang in RUNS, f"{block.where}: no-test on a block that never runs"
    assert sum(len(to_run(p)) for p in PAGES) >= 30


def test_no_page_installs_a_distribution_pypi_does_not_have():
    """packer-data is not on PyPI: pages install it from a checkout (``pip install -e ".[s3]"``) or a wheel."""
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        assert not re.search(r"pip install (?:-U |--upgrade )?['\"]?packer[-_]data\b", text), page
        assert "'packer-data[" not in text and '"packer-data[' not in text, page


def test_the_api_reference_documents_every_public_name():
    import packer

    directives = {m for p in (DOCS / "reference").glob("*.md")
                  for m in re.findall(r"^::: (packer\S*)", p.read_text(encoding="utf-8"), re.M)}
    public = {f"packer.{name}" for name in packer.__all__ if not name.startswith("_")}
    assert public | {"packer.lightning.PackedDataModule"} <= directives


def test_the_type_checking_imports_are_the_lazy_exports():
    """``packer/__init__.py`` gives each public name twice, in ``_EXPORTS`` (imported on first use) and in its
    ``if TYPE_CHECKING:`` imports (which type checkers and the API reference read): the same names, the same
    modules."""
    import packer

    tree = ast.parse((REPO / "packer" / "__init__.py").read_text(encoding="utf-8"))
    block = next(n for n in tree.body if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test))
    named = {alias.name: f"packer.{node.module}" for node in block.body if isinstance(node, ast.ImportFrom)
             for alias in node.names}
    assert named == packer._EXPORTS


def test_every_public_function_documents_every_argument():
    """Google-style Args for every parameter of the public API, read as the API reference reads them (griffe,
    with the site's extensions)."""
    griffe = pytest.importorskip("griffe")
    extensions = griffe.load_extensions(f"{DOCS / 'griffe_runtime.py'}:RuntimeSignature")
    package = griffe.load("packer", search_paths=[str(REPO)], extensions=extensions, docstring_parser="google",
                          resolve_aliases=True)
    names = ["pack", "export", "read_manifest", "open_dataset", "make_loader", "to_device", "stream", "to_hf",
             "scan_folder"]
    classes = ["reading.dataset.PackedDataset", "lightning.PackedDataModule"]
    objects = [package[n] for n in names + classes]
    for obj in objects:
        function = obj.members["__init__"] if obj.is_class else obj
        documented = {p.name for s in (obj.docstring.parsed if obj.docstring else [])
                      if s.kind.value in ("parameters", "other parameters") for p in s.value}
        documented = {name.lstrip("*") for name in documented}
        wanted = {p.name for p in function.parameters if p.name not in ("self",)}
        assert wanted - documented == set(), f"{obj.path}: arguments without a line in its Args"


def test_the_guarantees_name_tests_that_exist():
    """Each test the Guarantees page names is a test function in the file it names."""
    text = (DOCS / "guarantees.md").read_text(encoding="utf-8")
    named, file = [], None
    for m in re.finditer(r"`(tests/[\w/]+\.py)?(?:::(test_\w+))?`", text):
        file = m.group(1) or file
        if m.group(2):
            named.append((file, m.group(2)))
    assert len(named) >= 30
    missing = [(f, n) for f, n in named if not re.search(rf"^\s*def {n}\(", (REPO / f).read_text(encoding="utf-8"),
                                                          re.M)]
    assert missing == []


@pytest.mark.slow
def test_readme_install_commands_work_in_a_fresh_venv(tmp_path):
    """The Quick start's and the test command's install steps, exactly as written, in a fresh venv with its own
    pip, installing this tree; then the command answers as ``packer`` and as ``python -m packer``, and the dev
    extra builds the documentation site as CI does."""
    commands = [b.code for b in page_blocks(README) if b.lang == "bash" and b.code.startswith("python3 -m venv")]
    assert len(commands) == 2
    steps = []
    for command in commands:
        install, _ = install_and_rest(command)
        assert "python -m pip install --upgrade pip" in install, "an old pip fails to resolve the dev extra"
        steps += [s for s in install if s not in steps]
    tree = tmp_path / "tree"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.split()
    for f in files:
        if (REPO / f).is_file():
            (tree / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / f, tree / f)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if not p.startswith(sys.prefix))
    script = " && ".join(steps + ["packer --help", "python -m packer --help", "pip show packer-data",
                                  'python -c "import packer, sys; print(packer.__file__)"',
                                  'python -c "from packer.images import jpeg_window as j; '
                                  'print(\'window decoder:\', j.libjpeg_turbo_version())"',
                                  f"mkdocs build --strict --quiet --site-dir {tmp_path / 'site'}"])
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tree, env=env, capture_output=True,
                       text=True, timeout=1500)
    assert r.returncode == 0, f"{script}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert r.stdout.count("Usage:") == 2
    assert str(tree / "packer") in r.stdout  # this tree's packer, installed editable
    if libjpeg_turbo_headers():  # the optional extension, built by the plain install where it can be
        assert "window decoder: None" not in r.stdout and "window decoder: " in r.stdout, r.stdout[-3000:]
    assert (tmp_path / "site" / "reference" / "pack" / "index.html").is_file()
