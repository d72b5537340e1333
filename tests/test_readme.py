"""The README as a new user follows it: every bash and Python code block runs (on sample_data, on CPU), and its two
install commands work in a fresh venv with the venv's own pip.

A block preceded by ``<!-- no-test: why -->`` is not run (it needs a bucket or a cluster); the test says how many
blocks it ran and skipped."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
# Shrinks a block for the test, the only edits made to what the README says: two epochs instead of 90, a checkpoint
# every step instead of every 500 (so that its second run resumes from one).
SMALLER = {"epochs, start_epoch, step = 90, 0, 0": "epochs, start_epoch, step = 2, 0, 0",
           "if step % 500 == 0:": "if step % 1 == 0:"}
INSTALL_STEP = re.compile(r"^(python3 -m venv |\. \.venv/bin/activate$|python -m pip install |pip install )")


def readme_blocks() -> list[tuple[int, str, str, bool]]:
    """(line, language, code, runnable) for each fenced block of the README, in order."""
    lines = README.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = re.fullmatch(r"```(\w*)\s*", lines[i])
        if not m:
            i += 1
            continue
        start, skipped = i + 1, i > 0 and lines[i - 1].startswith("<!-- no-test")
        end = next(j for j in range(start, len(lines)) if lines[j].startswith("```"))
        blocks.append((start, m.group(1), "\n".join(lines[start:end]) + "\n", not skipped))
        i = end + 1
    return blocks


def install_and_rest(command: str) -> tuple[list[str], str]:
    """Split a one-line README command into its install steps and what it runs after them."""
    steps = [s.strip() for s in command.strip().split(" && ")]
    n = next((k for k, s in enumerate(steps) if not INSTALL_STEP.match(s)), len(steps))
    return steps[:n], " && ".join(steps[n:])


def run_env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env.pop("PACKER_DEBUG", None)
    return env


@pytest.mark.slow
def test_every_readme_code_block_runs(tmp_path, capsys):
    """Bash blocks run in a folder holding sample_data and sample_masks (install steps left to the fresh-venv test
    below), Python blocks are pasted into ``python -``; the first Python block twice (packing again must not
    fail)."""
    for name in ("sample_data", "sample_masks"):  # the README's examples read both
        (tmp_path / name).symlink_to(REPO / name)
    env, ran, skipped, pythons = run_env(tmp_path), 0, 0, 0
    for line, lang, code, runnable in readme_blocks():
        if lang not in ("bash", "python"):
            continue
        if not runnable:
            skipped += 1
            continue
        if lang == "bash":
            if code.startswith("python3 -m venv"):
                _, code = install_and_rest(code)
                if code.startswith("python -m pytest"):
                    continue  # the test command: this suite itself; its install runs in the fresh-venv test
            cmd, stdin = ["bash", "-euo", "pipefail", "-c", code], None
        else:
            for a, b in SMALLER.items():
                code = code.replace(a, b)
            cmd, stdin = [sys.executable, "-"], code
        pythons += lang == "python"
        for attempt in range(2 if (lang == "python" and pythons == 1) or "checkpoint.pt" in code else 1):
            r = subprocess.run(cmd, input=stdin, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
            assert r.returncode == 0, f"README.md:{line} ({lang}, run {attempt + 1}) failed:\n{r.stdout}\n{r.stderr}"
            if "checkpoint.pt" in code:  # the training loop says how it goes, and resumes where it stopped
                assert ("resumed at epoch" in r.stdout) == (attempt == 1), r.stdout
                assert "epoch 1 done" in r.stdout or attempt == 1, r.stdout
        ran += 1
    with capsys.disabled():
        print(f"\nREADME: ran {ran} code blocks, skipped {skipped} marked no-test")
    assert ran >= 6 and skipped >= 5


@pytest.mark.slow
def test_readme_install_commands_work_in_a_fresh_venv(tmp_path):
    """The Quick start's and the test command's install steps, exactly as written, in a fresh venv with its own
    pip, installing this tree; then the command answers as ``packer`` and as ``python -m packer``."""
    commands = [code for _, lang, code, _ in readme_blocks() if lang == "bash" and code.startswith("python3 -m venv")]
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
                                  'python -c "import packer, sys; print(packer.__file__)"'])
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tree, env=env, capture_output=True,
                       text=True, timeout=1500)
    assert r.returncode == 0, f"{script}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert r.stdout.count("Usage:") == 2
    assert str(tree / "packer") in r.stdout  # this tree's packer, installed editable
