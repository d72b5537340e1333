"""Packed datasets on object storage and HTTP: URLs, fsspec filesystems, a bounded shared cache, retries.

- :mod:`.url` tells URLs from local paths (and refuses mangled ones);
- :mod:`.fs` makes fsspec filesystems per process and turns storage errors into one line;
- :mod:`.fetch` reads with retries and checks size and sha256;
- :mod:`.cache` is the local cache (LRU, locks, pins);
- :mod:`.resolve` turns a dataset URL into a local folder the readers open;
- :mod:`.upload` sends a locally packed dataset, manifest last;
- :mod:`.check` is ``packer verify`` for a URL.
"""

from __future__ import annotations

from .url import is_url, parse_url

__all__ = ["is_url", "parse_url"]
