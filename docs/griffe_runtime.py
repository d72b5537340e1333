"""griffe extensions for the API reference (``mkdocs.yml`` loads them).

- :class:`RuntimeSignature`: a function whose module sets its ``__signature__`` at import time (``packer.pack``,
  whose options are declared once, in the options module, and added to its signature and to its docstring's
  Args when it is imported) is documented as Python sees it, not as its source reads.
- :class:`SphinxRoles`: the docstrings' Sphinx roles (``:func:`packer.pack```) become code spans.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import griffe

KINDS = {
    inspect.Parameter.POSITIONAL_ONLY: griffe.ParameterKind.positional_only,
    inspect.Parameter.POSITIONAL_OR_KEYWORD: griffe.ParameterKind.positional_or_keyword,
    inspect.Parameter.VAR_POSITIONAL: griffe.ParameterKind.var_positional,
    inspect.Parameter.KEYWORD_ONLY: griffe.ParameterKind.keyword_only,
    inspect.Parameter.VAR_KEYWORD: griffe.ParameterKind.var_keyword,
}
ROLE = re.compile(r":(?:mod|class|func|meth|attr|data|exc|obj|py:\w+):`(~?)([^`]+)`")


class RuntimeSignature(griffe.Extension):
    """Replaces the parameters and the docstring of a function whose ``__signature__`` its module assigns."""

    def on_function_instance(self, *, func: griffe.Function, **kwargs: Any) -> None:
        path = func.module.filepath
        if not isinstance(path, Path) or f"{func.name}.__signature__ =" not in path.read_text(encoding="utf-8"):
            return
        runtime = griffe.dynamic_import(func.path)
        static = {p.name: p for p in func.parameters}
        func.parameters = griffe.Parameters(*(
            static.get(p.name) or griffe.Parameter(
                p.name, kind=KINDS[p.kind],
                annotation=None if p.annotation is inspect.Parameter.empty else str(p.annotation),
                default=None if p.default is inspect.Parameter.empty else repr(p.default))
            for p in inspect.signature(runtime).parameters.values()))
        old = func.docstring
        func.docstring = griffe.Docstring(plain(inspect.cleandoc(runtime.__doc__ or "")), parent=func,
                                          lineno=old.lineno if old else None, endlineno=old.endlineno if old else None,
                                          parser=old.parser if old else None,
                                          parser_options=old.parser_options if old else None)


class SphinxRoles(griffe.Extension):
    """``:func:`packer.pack``` as ```packer.pack```, ``:class:`~packer.dataset.WdsDataset``` as ```WdsDataset```."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = plain(obj.docstring.value)


def plain(text: str) -> str:
    """``text`` with each Sphinx role a code span (``~`` keeps the last name only, as Sphinx does)."""
    return ROLE.sub(lambda m: f"`{m[2].rsplit('.', 1)[-1] if m[1] else m[2]}`", text)
