"""The name packer is installed under: ``packer`` on PyPI is another project, so every install hint names this."""

from __future__ import annotations

DIST_NAME = "packer-data"


def pip_hint(extra: str | None = None) -> str:
    """The pip command that installs packer, with an optional extra: ``pip install 'packer-data[s3]'``."""
    return f"pip install '{DIST_NAME}[{extra}]'" if extra else f"pip install -U {DIST_NAME}"
