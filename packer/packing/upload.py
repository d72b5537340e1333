"""``packer pack SRC URL``: convert into a local staging folder in the cache, then upload, manifest last.

A reader finds a dataset by its manifest, so the manifest is sent only once every data file it names is in
place (and, when replacing a dataset, the old manifest is deleted first): a reader never sees a half-written
dataset as a dataset. ``resume`` finishes the conversion in the staging folder if it was interrupted, and sends
only the files that are missing remotely or differ (size, then the S3 ETag's md5 where the store gives one, else
the sha256 recorded when the file was last sent)."""

from __future__ import annotations

import fnmatch
import functools
import hashlib
import json
import os
import shutil
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from ..arguments import shown_as, spelled
from ..errors import DestinationError, PackerError, UrlError
from ..manifest import JOURNAL, MANIFEST
from ..remote.cache import Cache
from ..remote.fetch import retrying
from ..remote.fs import filesystem
from ..remote.url import READ_ONLY, RemoteUrl, remote_url
from .coordinator import TIMEOUT_ENV, Coordinator, detect
from .dest import PART, PART_DIR
from .driver import pack_folder
from .lock import OutputLock
from .options import pack_options

DONE = ".packer-uploaded"  # under torchrun: a rank's part is uploaded


def _md5(path: Path) -> str:
    h = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def _listing(fs: Any, remote: RemoteUrl) -> dict[str, dict]:
    """Relative path -> info of every object under the dataset URL ({} when there is none)."""
    base = fs._strip_protocol(remote.url).rstrip("/")
    fs.invalidate_cache()  # a listing cached before this process's own uploads would be stale
    try:
        found = retrying(lambda: fs.find(remote.url, detail=True), remote.url, "list")
    except PackerError as exc:
        if "not found" in str(exc):
            return {}
        raise
    return {name[len(base) + 1:]: info for name, info in found.items() if name.startswith(base + "/")}


def _already_uploaded(local: Path, entry: dict, info: dict | None, sent: dict[str, str]) -> bool:
    """Whether the remote object ``info`` already holds the staged file ``local``."""
    if info is None or info.get("size") != entry["bytes"]:
        return False
    etag = str(info.get("ETag") or info.get("etag") or "").strip('"')
    if len(etag) == 32 and "-" not in etag:  # a single-part S3 upload: the ETag is the md5
        return etag == _md5(local)
    return sent.get(entry["path"]) == entry["sha256"]


def upload(staging: Path, manifest: dict, remote: RemoteUrl, storage_options: dict | None, resume: bool,
           files: list[dict] | None = None, last: bool = True, rank: int = 0) -> int:
    """Send the staged dataset's ``files`` (default: all) to ``remote``, then, with ``last``, the manifest;
    return the number of data files sent."""
    fs = filesystem(remote.protocol, storage_options)
    # path -> sha256 of the files already sent, one record per rank, beside the staging folder (not in it: the
    # conversion would not call the folder its own then)
    journal = staging.with_name(f"{staging.name}.sent-{rank}.json")
    sent = json.loads(journal.read_text()) if resume and journal.exists() else {}
    existing = _listing(fs, remote) if resume else {}
    count = 0
    for entry in manifest["files"] if files is None else files:
        local, url = staging / entry["path"], remote.join(entry["path"])
        if resume and _already_uploaded(local, entry, existing.get(entry["path"]), sent):
            continue
        retrying(functools.partial(fs.put_file, str(local), url), url, "write")
        sent[entry["path"]] = entry["sha256"]
        journal.write_text(json.dumps(sent))
        count += 1
    if last:
        manifest_url = remote.join(MANIFEST)
        text = (staging / MANIFEST).read_bytes()
        retrying(lambda: fs.pipe_file(manifest_url, text), manifest_url, "write")
        for record in staging.parent.glob(f"{staging.name}.sent-*.json"):
            record.unlink(missing_ok=True)
    return count


def _stale(existing: dict[str, dict], manifest: dict) -> list[str]:
    """Data files of a replaced dataset that the new one does not name (fewer shards, another format): only
    names a format writer uses, at the top or in a part folder; anything else under the URL is left alone."""
    from ..formats.base import writer_files

    patterns = writer_files()
    kept = {e["path"] for e in manifest["files"]} | {MANIFEST}
    stale = []
    for path in existing:
        folder, _, name = path.rpartition("/")
        if path not in kept and (not folder or PART_DIR.fullmatch(folder)) and any(
                fnmatch.fnmatchcase(name, p) for p in patterns):
            stale.append(path)
    return sorted(stale)


def _done_url(remote: RemoteUrl, rank: int) -> str:
    """Where a rank says its part is uploaded: ``part-NNNNN/.packer-uploaded`` holding this conversion's token."""
    return remote.join(f"{PART.format(rank)}/{DONE}")


def _wait_for_ranks(remote: RemoteUrl, storage_options: dict | None, world: int, token: str,
                    timeout: float) -> None:
    """Rank 0: wait until every other rank has said (with this conversion's token) that its part is uploaded,
    so that the manifest goes last; files of an earlier upload of the same size prove nothing."""
    fs = filesystem(remote.protocol, storage_options)
    deadline = time.monotonic() + timeout
    for rank in range(1, world):
        url = _done_url(remote, rank)
        while True:
            try:
                if fs.cat_file(url).decode() == token:
                    break
            except FileNotFoundError:
                pass
            if time.monotonic() > deadline:
                raise PackerError(f"{url}: rank {rank} did not finish its upload within {timeout:.0f} s; run the "
                                  "same command with --resume")
            time.sleep(0.5)
            fs.invalidate_cache()


def pack_to_url(src: str | os.PathLike | Any, dest: str, format: str = "lmdb", *, overwrite: bool = False,
                resume: bool = False, storage_options: dict | None = None,
                cache_dir: str | os.PathLike | None = None, **options: Any) -> dict[str, Any]:
    """:func:`packer.pack` into the URL ``dest``: converted into ``CACHE/staging/...`` (the conversion sequence
    of :mod:`packer.packing.driver`), then uploaded. Data files of a replaced dataset that the new one does not name are
    deleted after the new manifest. Under torchrun the staging folder (the cache folder) must be shared by every
    rank, as a local DEST is; each rank uploads its own part, and rank 0 the manifest once every part is in place.

    Raises:
        DestinationError: ``dest`` already holds a dataset (without ``overwrite``/``resume``), or files of an
            interrupted upload (without ``resume``/``overwrite``).
    """
    remote = remote_url(dest)
    if remote.protocol in READ_ONLY:
        raise UrlError(f"{dest}: {remote.protocol}:// is read-only for packer; pack to s3://, gs:// or a folder, "
                       "and serve that over HTTP")
    context = detect(options.pop("distributed", None))  # the process group the conversion then uses, under torchrun
    rank = context.rank
    cache = Cache(cache_dir)
    staging = cache.root / "staging" / cache.view(remote.url).name
    # one upload of a URL at a time: held from before anything is deleted until the last file is sent (pack
    # below locks the staging folder only while it converts); under torchrun rank 0 holds it for every rank
    lock = OutputLock(staging.parent / f"{staging.name}.upload", shown=dest) if rank == 0 else nullcontext()
    try:
        with lock:
            return _pack_and_upload(src, dest, remote, format, staging, context, overwrite or resume, resume,
                                    storage_options, **options)
    finally:
        context.close()  # also when the lock is refused: the other ranks then stop too


def _pack_and_upload(src: str | os.PathLike | Any, dest: str, remote: RemoteUrl, format: str, staging: Path,
                     context: Coordinator, replacing: bool, resume: bool, storage_options: dict | None,
                     **options: Any) -> dict[str, Any]:
    """:func:`pack_to_url`'s work, under its lock."""
    rank = context.rank
    fs = filesystem(remote.protocol, storage_options)
    existing = _listing(fs, remote)
    finished = MANIFEST in existing
    if existing and not replacing:
        what = "a packed dataset" if finished else f"{len(existing)} files but no {MANIFEST} (an interrupted upload?)"
        raise DestinationError(f"{dest}: already holds {what}; pass {spelled('overwrite')} to replace it, or "
                               f"{spelled('resume')} to finish an interrupted one")
    if finished and rank == 0:  # first: no reader may pair the old manifest with new files
        retrying(lambda: fs.rm_file(remote.join(MANIFEST)), remote.join(MANIFEST), "delete")
    staging.parent.mkdir(parents=True, exist_ok=True)
    again = resume and ((staging / MANIFEST).exists() or (staging / JOURNAL).exists())
    if again and (staging / MANIFEST).exists() and rank == 0:
        print(f"packer: {dest}: the conversion had finished before the upload stopped; uploading the files that "
              "are not there yet", file=sys.stderr)
    ranks = context.world > 1
    opts = pack_options(format, {**options, "overwrite": True, "resume": again, "distributed": ranks})
    with shown_as(staging, dest):  # messages name what the caller gave, not the staging folder
        manifest = pack_folder(src, staging, opts, context)  # closes the coordinator, as the conversion ends
    if not ranks:
        upload(staging, manifest, remote, storage_options, resume)
    else:
        part = f"{PART.format(rank)}/"
        mine = [e for e in manifest["files"] if e["path"].startswith(part) or (rank == 0 and "/" not in e["path"])]
        upload(staging, manifest, remote, storage_options, resume, files=mine, last=False, rank=rank)
        token = hashlib.sha256((staging / MANIFEST).read_bytes()).hexdigest()  # this conversion's manifest
        if rank != 0:
            retrying(lambda: fs.pipe_file(_done_url(remote, rank), token.encode()), _done_url(remote, rank), "write")
            return manifest
        _wait_for_ranks(remote, storage_options, context.world, token, float(os.environ.get(TIMEOUT_ENV, 1800)))
        upload(staging, manifest, remote, storage_options, resume, files=[])
        for url in [_done_url(remote, r) for r in range(1, context.world)]:
            retrying(functools.partial(fs.rm_file, url), url, "delete")
    for url in [remote.join(path) for path in _stale(existing, manifest)]:  # after the new manifest: unread now
        retrying(functools.partial(fs.rm_file, url), url, "delete")
    shutil.rmtree(staging, ignore_errors=True)
    return manifest

