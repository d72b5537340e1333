"""Packed datasets on object storage and HTTP: moving bytes only (URLs, fsspec filesystems, a bounded shared
cache, retries).

Nothing here runs a conversion, a check or a benchmark, and nothing imports a format: the public entry points
(``pack``, ``open_dataset``, ``export``, ``to_hf``, ``verify``, ``stream``, the CLI) resolve a URL through this
package and hand local folders (or :class:`packer.loading.stream.Fetchable` files) down.

- :mod:`.url` tells URLs from local paths (and refuses mangled ones);
- :mod:`.fs` makes fsspec filesystems per process and turns storage errors into one line;
- :mod:`.fetch` reads with retries and checks size and sha256;
- :mod:`.cache` is the local cache (LRU, locks, pins);
- :mod:`.resolve` turns a dataset URL into a local folder the readers open, or into one fetchable file per
  data file (for ``stream``);
- :mod:`.ranges` reads byte ranges of the data files, and keeps blocks (ranges) of them in the cache, for a
  dataset larger than the cache;
- :mod:`.entry` is what the entry points call: :func:`~.entry.local_dataset`, :func:`~.entry.open_remote` and
  :func:`~.entry.read_manifest`.

Uploading a conversion is :mod:`packer.packing.upload`'s, ``packer verify URL`` is :mod:`packer.verify`'s, ``packer
bench URL`` is :mod:`packer.bench.remote`'s.
"""

from __future__ import annotations

from .url import is_url, parse_url

__all__ = ["is_url", "parse_url"]
