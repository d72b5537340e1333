"""``packer verify URL``: every data file is fetched and checked against the manifest's size and sha256 (a
damaged object is named by its URL and never handed to a reader); when all are sound, the local checks (counts,
and with ``deep`` every sample) run on the fetched copy, with the problems naming the URL.

Everything is fetched afresh into a temporary cache, deleted afterwards: a sound copy in the shared cache
(objects are named by their sha256) says nothing about the remote objects."""

from __future__ import annotations

import tempfile
from collections.abc import Callable

from ..errors import PackerError
from .cache import Cache
from .resolve import release, resolve
from .url import parse_url


def verify_url(verify: Callable[..., list[str]], url: str, deep: bool = False, storage_options: dict | None = None,
               cache_dir=None, cache_limit=None) -> list[str]:
    """The problems found in the dataset at ``url`` (empty when it is sound); ``verify`` is
    :func:`packer.verify.verify`, which checks the fetched copy (passed in: that module calls this one)."""

    damaged: list[str] = []
    parent = Cache(cache_dir).root
    with tempfile.TemporaryDirectory(prefix="verify-", dir=parent) as fresh:
        view = resolve(url, storage_options, fresh, cache_limit, damaged=damaged)
        if damaged:
            return damaged
        base = parse_url(url).url
        try:
            problems = verify(view, deep=deep)
        except PackerError as exc:
            problems = [str(exc)]
        release(view)
    return [p.replace(str(view), base) for p in problems]
