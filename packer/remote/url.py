"""Telling URLs from local paths: ``s3://bucket/ds`` is remote, ``data/ds`` is local, and ``s3:/bucket/ds`` (a
URL whose ``//`` a ``Path`` collapsed) or ``foo://x`` (no such protocol) is an error, never a local folder."""

from __future__ import annotations

import os
import re
from typing import NamedTuple

from ..errors import UrlError

READ_ONLY = ("http", "https")  # fsspec's HTTP filesystem cannot write: packer reads datasets there, never packs
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+):(//)?(.*)", re.DOTALL)  # two letters at least: not "C:"


class RemoteUrl(NamedTuple):
    """A parsed URL: ``protocol`` (fsspec's name), and ``url`` without a trailing slash."""

    protocol: str
    url: str

    def join(self, relpath: str) -> str:
        """The URL of ``relpath`` inside this one."""
        return f"{self.url}/{relpath}"


def known_protocols() -> set[str]:
    """Every protocol fsspec knows (installed or not): s3, gs, http, https, az, hf..."""
    from fsspec.registry import known_implementations, registry

    return set(known_implementations) | set(registry)


def parse_url(text: str | os.PathLike) -> RemoteUrl | None:
    """The :class:`RemoteUrl` that ``text`` names, or None for a local path.

    Raises:
        UrlError: ``text`` has a scheme fsspec does not know, or looks like a URL that lost its ``//``
            (``s3:/bucket/ds``, ``s3:``), which would otherwise become a local folder named ``s3:``.
    """
    text = os.fspath(text)
    match = _SCHEME.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        return None
    scheme, slashes, rest = match.group(1).lower(), match.group(2), match.group(3)
    protocols = known_protocols()
    if not slashes:
        if scheme in protocols and (not rest or rest.startswith("/")):  # what Path() makes of s3://b/ds, s3://
            example = f"{scheme}://{rest.lstrip('/')}" if rest.strip("/") else f"{scheme}://bucket/dataset"
            raise UrlError(f"{text}: looks like a {scheme}:// URL that lost its '//' (a Path() collapses it); "
                           f"write it as {example}, or ./{text} for a local folder")
        return None  # "name:with:colons" is a local name
    if scheme not in protocols:
        raise UrlError(f"{text}: unknown URL scheme {scheme!r}; packer reads and writes s3://, gs://, http(s):// "
                       "and the other fsspec protocols; a local path needs no scheme")
    if not rest.strip("/"):
        raise UrlError(f"{text}: names no bucket or path; give one like {scheme}://bucket/dataset")
    return RemoteUrl(scheme, f"{scheme}://{rest.rstrip('/')}")


def remote_url(text: str | os.PathLike) -> RemoteUrl:
    """The :class:`RemoteUrl` of ``text``, which the caller (past an entry point's :func:`parse_url`) knows is one."""
    remote = parse_url(text)
    assert remote is not None, text  # an entry point sends only URLs this way, never a local path
    return remote


def is_url(text: str | os.PathLike) -> bool:
    """Whether ``text`` is a remote URL (see :func:`parse_url`, whose errors it raises)."""
    return parse_url(text) is not None
