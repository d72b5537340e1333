"""Project metadata agrees with itself: environment.yml and pyproject.toml list the same dependencies.

Lint is not run here: CI (.ci/run) runs ``ruff check .`` before the tests."""

from __future__ import annotations

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
    assert version("packer") == packer.__version__  # the installed metadata is this checkout's


def test_ci_lints_with_ruff():
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    assert re.search(r"^\s*ruff check", ci, re.M)
    assert "pytest" in ci
