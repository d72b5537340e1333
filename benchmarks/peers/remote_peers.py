"""Training from object storage with a cache smaller than the dataset: packer vs MosaicML Streaming vs LitData.

The benchmark of issue 25: the same images (a 3,000-image folder resized to a short side of 256 and stored as
JPEG), in each tool's own format, on a local S3 server (``--server lite``, the default: ``s3_lite.py``, which
answers from the files with ``sendfile``; or ``--server moto``: the tests' ``S3Server``, answering a ranged GET
by reading only its range as S3 does (``s3_ranges.py``), behind the tests' latency proxy ``fault_proxy``), with
``--latency-ms`` added to every request, read from ``s3://`` through each tool's own cache bounded to
``--cache-fraction`` (1/8) of that tool's copy, with RandomResizedCrop 224 + horizontal flip, batch 64, 2 worker
processes. Each read is one fresh process reading ``--epochs`` (2) epochs with an empty cache; every row is
read once a round, for ``--repeats`` (3) rounds (medians), so that a drift of the machine's speed moves the
reference and the rows alike. The same packer dataset read from local files with a warm page cache is the
reference every row's epoch-2 images/s is divided by. Each row also scores its order's shuffle quality: packer's
``batch_mixing`` (mean total-variation distance between each batch's label histogram and the dataset's; 0 is
perfect) of the labels the loader yielded in epoch 1, and the CPU seconds its read took in the reading
processes and in the server (the server shares the machine's cores, where an object store would not: moto and
the proxy used 0.9-1.3 CPU-seconds of a packer read of two epochs on a 2-core machine, the lite server 0.2, hence
the lite default). Every copy
is stored in class order (the hard case for a shuffle), in blocks of about 1/``--blocks`` of the dataset (wds
shards, MDS shards, LitData chunks).

    python benchmarks/peers/remote_peers.py --smoke                  # 300 images, 1 repeat: 2-3 minutes
    python benchmarks/peers/remote_peers.py                          # 3,000 images, medians of 3
    python benchmarks/peers/remote_peers.py --tools packer --packer-formats wds,lmdb,hdf5

Rows:

- packer: ``packer.pack(src, d, "wds", store="jpeg", resize=256, shuffle=False, shard_samples=n/blocks)``,
  read by ``open_dataset("s3://...", cache_limit=..., random_resized_crop=224, flip=True)`` and
  ``make_loader(ds, batch_size=64, shuffle="blocks", num_workers=2)`` (``adapters/remote_packer.py``);
- streaming: ``MDSWriter(columns={"image": "jpeg", "label": "int"}, size_limit=block)``, read by
  ``StreamingDataset(remote="s3://...", local=cache, cache_limit=..., shuffle=True, shuffle_algo="py1e")``
  (``adapters/remote_streaming.py``; endpoint from ``S3_ENDPOINT_URL``);
- litdata: ``optimize(..., chunk_bytes=block)``, read by ``StreamingDataset("s3://...", max_cache_size=...,
  cache_dir=cache, storage_options={"endpoint_url": ...})`` + ``StreamingDataLoader``
  (``adapters/remote_litdata.py``).

The peers get packer's own JPEGs (``packer.export`` of its copy), so every tool decodes the same bytes. The
peers run in the venvs ``run_peers.py`` builds (``--venvs``, reused when their recipe holds). The load average
is taken at the start and the end as in ``run_peers.py``: above the core count, the run is marked not
publishable. Results: ``OUT/results.json`` and ``OUT/results.md`` (default ``bench-out/remote``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import resource
import shlex
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
ADAPTERS = HERE / "adapters"
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "tests"))

import run_peers  # noqa: E402 - beside this script
import s3_lite  # noqa: E402 - beside this script
from s3_ranges import serve_ranges_at_their_cost  # noqa: E402 - beside this script
from support.remote import S3Server, fault_proxy  # noqa: E402 - the tests' servers

# tool -> (the peer whose venv it runs in, its adapter)
TOOLS = {"packer": ("packer", "remote_packer.py"), "streaming": ("streaming", "remote_streaming.py"),
         "streaming-tuned": ("streaming", "remote_streaming.py"),
         "litdata": ("litdata", "remote_litdata.py")}
BUCKET = "bench"
CLASSES = 5


# -- the data -------------------------------------------------------------------------------------------------

def data_bytes(root: Path) -> int:
    """Bytes of every file under ``root``."""
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def pack_packer(src: Path, dest: Path, fmt: str, images: int, blocks: int) -> None:
    """packer's copy: JPEG at a short side of 256, in class order; wds in ``blocks`` shards."""
    import packer

    shutil.rmtree(dest, ignore_errors=True)
    extra = {"shard_samples": math.ceil(images / blocks)} if fmt == "wds" else {}
    packer.pack(src, dest, fmt, store="jpeg", resize=256, shuffle=False, progress=False, **extra)


def prepare(args: argparse.Namespace, log: Any) -> dict[str, dict[str, Any]]:
    """Pack every tool's copy under ``OUT/work``: ``{row: {"tool", "path", "bytes", ...}}`` (a peer that cannot
    be installed or pack gets ``"error"``)."""
    import packer

    work = args.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    count = sum(1 for _ in image_files(args.src))
    copies: dict[str, dict[str, Any]] = {}
    for fmt in args.packer_formats:
        dest = work / f"packer-{fmt}"
        print(f"packing packer {fmt}", file=log, flush=True)
        pack_packer(args.src, dest, fmt, count, args.blocks)
        copies[f"packer {fmt}"] = {"tool": "packer", "format": fmt, "path": dest, "bytes": data_bytes(dest)}
    first = copies[f"packer {args.packer_formats[0]}"]
    block = max(1, first["bytes"] // args.blocks)
    images = work / "images-256"
    shutil.rmtree(images, ignore_errors=True)
    packer.export(first["path"], images, progress=False)  # the same JPEG bytes for every peer
    packed: dict[str, dict[str, Any]] = {}  # by peer: streaming-tuned reads streaming's copy
    for tool in args.tools:
        if tool == "packer":
            continue
        name = TOOLS[tool][0]
        if name not in packed:
            packed[name] = pack_peer(tool, name, images, work / name, block, args, log)
        copies[tool] = {**packed[name], "tool": tool}
    return copies


def pack_peer(tool: str, name: str, images: Path, dest: Path, block: int, args: argparse.Namespace,
              log: Any) -> dict[str, Any]:
    """Install the peer ``name`` if needed and pack ``images`` with it into ``dest``: the copy, or its error."""
    shutil.rmtree(dest, ignore_errors=True)
    print(f"installing (if needed) and packing {name}", file=log, flush=True)
    try:
        python, _ = run_peers.ensure_venv(run_peers.PEERS[name], args.venvs, args.logs / f"{tool}.log", False,
                                          False)
        code = adapter_run(tool, python, ["pack", "--src", str(images), "--dest", str(dest), "--block-bytes",
                                          str(block)], args, env={})
        if code != 0:
            raise run_peers.SkipPeer(f"packing exited with {code}: see {args.logs / (tool + '.log')}")
    except run_peers.SkipPeer as exc:
        return {"error": str(exc).splitlines()[0]}
    return {"format": name, "path": dest, "bytes": data_bytes(dest), "python": python}


def image_files(root: Path) -> list[Path]:
    """The images of an ImageFolder (ImageFolder's extensions)."""
    exts = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
    return [p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in exts]


def upload(s3: S3Server, copies: dict[str, dict[str, Any]]) -> None:
    """Every copy to ``s3://BUCKET/<name>/``, straight to the server (not through the proxy)."""
    import boto3

    client = boto3.client("s3", endpoint_url=s3.url)
    client.create_bucket(Bucket=BUCKET)
    for name, copy in copies.items():
        if "error" in copy:
            continue
        key = name.replace(" ", "-")
        for path in sorted(p for p in copy["path"].rglob("*") if p.is_file()):
            client.upload_file(str(path), BUCKET, f"{key}/{path.relative_to(copy['path']).as_posix()}")
        copy["url"] = f"s3://{BUCKET}/{key}"


@contextlib.contextmanager
def s3_endpoint(kind: str, copies: dict[str, dict[str, Any]], latency: float, work: Path) -> Any:
    """Every copy on an S3 server of ``kind`` behind ``latency`` seconds a request: yields what counts the GETs
    (``gets(suffix)``, its ``url`` the endpoint the readers are given). ``lite``: :mod:`s3_lite` serving hard
    links of the copies, the latency its own; ``moto``: moto (ranged GETs read only their range) behind the
    tests' latency proxy."""
    if kind == "lite":
        root = work / "s3-lite"
        shutil.rmtree(root, ignore_errors=True)
        for name, copy in copies.items():
            if "error" not in copy:
                shutil.copytree(copy["path"], root / BUCKET / name.replace(" ", "-"), copy_function=os.link)
                copy["url"] = f"s3://{BUCKET}/{name.replace(' ', '-')}"
        server = s3_lite.serve(root, latency)
        try:
            yield server
        finally:
            server.stop()
        return
    serve_ranges_at_their_cost()
    s3 = S3Server(buckets=())
    proxy = fault_proxy(s3.url, latency=latency)
    proxy.server.handle_error = lambda request, address: None  # a reader closing a connection is not news
    try:
        upload(s3, copies)
        yield proxy
    finally:
        proxy.stop()
        s3.stop()


def cpu_seconds(who: int) -> float:
    """User and system CPU seconds of ``resource.RUSAGE_SELF`` or ``RUSAGE_CHILDREN`` so far."""
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


# -- reading --------------------------------------------------------------------------------------------------

def adapter_run(tool: str, python: str, argv: list[str], args: argparse.Namespace, env: dict[str, str]) -> int | str:
    """Run ``tool``'s adapter in its interpreter (a peer's without this checkout's ``PYTHONPATH``), output into
    its log; its exit code, or why it was stopped."""
    full = {**os.environ, **env}
    if tool != "packer":
        full.pop("PYTHONPATH", None)
    full.setdefault("LITDATA_DISABLE_VERSION_CHECK", "1")
    cmd = [python, str(ADAPTERS / TOOLS[tool][1]), *argv]
    return run_peers._run_group(cmd, args.logs / f"{tool}.log", full, args.timeout)


class CacheWatch:
    """The largest total size of the files under ``folder`` (each inode once), sampled every 0.2 s in a
    background thread (each sample the smaller of two walks in a row)."""

    def __init__(self, folder: Path):
        self.folder, self.peak = folder, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _size(self) -> int:
        sizes: dict[tuple[int, int], int] = {}  # by inode: a hard link is not a second copy
        for dirpath, _, names in os.walk(self.folder):
            for name in names:
                try:
                    st = os.stat(os.path.join(dirpath, name))
                except OSError:
                    continue
                sizes[(st.st_dev, st.st_ino)] = st.st_size
        return sum(sizes.values())

    def _count(self) -> int:
        # the smaller of two walks in a row (as the tests' CachePoll): a walk lists the folders one after another,
        # and may find a file before it is evicted and, later in the same walk, the download that took its room
        return min(self._size(), self._size())

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self.peak = max(self.peak, self._count())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, self._count())


def read_once(tool: str, python: str, url: str, limit: int, args: argparse.Namespace, env: dict[str, str],
              proxy: Any, block: int) -> dict[str, Any]:
    """One fresh process reading ``url`` for ``--epochs`` epochs with an empty cache: its timings, labels, peak
    cache bytes, the GETs that reached the server and the CPU seconds of the reader and of the server."""
    # a new folder every read: Streaming keys its shared memory on the local folder, and a second process on
    # the same (emptied) folder found its predecessor's state and read shards that were no longer there
    cache = args.out / "work" / "cache" / f"{tool}-{time.time_ns()}"
    cache.mkdir(parents=True)
    result = args.out / "work" / f"read-{tool}.json"
    result.unlink(missing_ok=True)
    gets = proxy.gets("") if proxy else 0
    watch = CacheWatch(cache)
    server_cpu, reader_cpu = cpu_seconds(resource.RUSAGE_SELF), cpu_seconds(resource.RUSAGE_CHILDREN)
    argv = ["read", "--url", url, "--cache-dir", str(cache), "--cache-limit", str(limit), "--batch-size",
            str(args.batch_size), "--workers", str(args.workers), "--epochs", str(args.epochs), "--result",
            str(result), "--block-bytes", str(block)]
    code = adapter_run(tool, python, argv, args, env)
    server_cpu = cpu_seconds(resource.RUSAGE_SELF) - server_cpu  # the server's threads (and the cache watch)
    reader_cpu = cpu_seconds(resource.RUSAGE_CHILDREN) - reader_cpu  # the read's process and its workers
    peak = watch.stop()
    out = json.loads(result.read_text()) if result.exists() else {}
    if "epochs" not in out:
        why = out.get("error") or f"the read exited with {code}; see {args.logs / (tool + '.log')}"
        raise RuntimeError(why)
    out.update(peak_cache=peak, gets=(proxy.gets("") - gets) if proxy else 0, server_cpu=server_cpu,
               reader_cpu=reader_cpu)
    shutil.rmtree(cache, ignore_errors=True)
    return out


class Row:
    """One row of the table: its reads (one per round, see :func:`main`) and what they gave."""

    def __init__(self, name: str, copy: dict[str, Any], url: str, limit: int, env: dict[str, str], block: int):
        self.name, self.copy, self.url, self.limit, self.env, self.block = name, copy, url, limit, env, block
        self.runs: list[dict[str, Any]] = []
        self.failures: list[str] = []
        self.timed_out = False
        self.versions: dict[str, str] = {}
        self.labels_sorted: list[int] = []

    def read(self, args: argparse.Namespace, proxy: Any, repeat: int) -> None:
        """One read of the row (none once a read timed out): its timings, cache, GETs, CPU and mixing, or its
        failure."""
        from packer.bench.shuffle_quality import batch_mixing

        if self.timed_out:
            return
        print(f"[{self.name}] read {repeat + 1}/{args.repeats} from {self.url}", file=sys.stderr, flush=True)
        if "://" not in self.url:
            warm_files(Path(self.url))
        try:
            out = read_once(self.copy["tool"], self.copy.get("python", sys.executable), self.url, self.limit, args,
                            self.env, proxy if "://" in self.url else None, self.block)
        except RuntimeError as exc:
            self.failures.append(str(exc))
            self.timed_out = "timeout" in str(exc)
            return
        run = {f"epoch{i}_sps": e["samples_per_s"] for i, e in enumerate(out["epochs"], 1)}
        run.update({f"epoch{i}_samples": e["samples"] for i, e in enumerate(out["epochs"], 1)},
                   first_batch_s=out["epochs"][0]["first_batch_s"], peak_cache=out["peak_cache"],
                   gets=out["gets"], mixing=batch_mixing(out["labels"][0], args.batch_size),
                   server_cpu=out["server_cpu"], reader_cpu=out["reader_cpu"])
        self.runs.append(run)
        self.versions = out.get("versions", {})
        self.labels_sorted = sorted(out["labels"][0])  # the stored (class) order, for the reference rows

    def summary(self) -> dict[str, Any]:
        """Medians over the reads that finished (images/s also min and max), the largest cache seen; the
        failures counted (``failures``, their messages); ``error`` when no read finished."""
        row: dict[str, Any] = {"row": self.name, "tool": self.copy["tool"], "format": self.copy["format"],
                               "url": self.url, "cache_limit": self.limit, "bytes": self.copy["bytes"],
                               "versions": self.versions}
        if self.failures:
            row["failures"] = self.failures
        if not self.runs:
            row["error"] = self.failures[0] if self.failures else "not read"
            return row
        for key in self.runs[0]:
            values = [r[key] for r in self.runs]
            row[key] = max(values) if key == "peak_cache" else statistics.median(values)
            if key.endswith("_sps"):
                row[f"{key}_min"], row[f"{key}_max"] = min(values), max(values)
        row.update(runs=self.runs, repeats=len(self.runs) + len(self.failures))
        return row


def warm_files(root: Path) -> None:
    """Read every file under ``root`` once, so that a local read starts with a warm page cache."""
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        with open(path, "rb") as f:
            while f.read(1 << 22):
                pass


# -- the report -----------------------------------------------------------------------------------------------

def _mb(n: float | None) -> str:
    return "" if n is None else f"{n / 2**20:.1f} MB"


def _cpu(row: dict[str, Any]) -> str:
    if row.get("reader_cpu") is None:
        return ""
    return f"{row['reader_cpu']:.1f}, {row['server_cpu']:.1f}"


def _sps(row: dict[str, Any], key: str) -> str:
    if row.get(key) is None:
        return ""
    spread = f" [{row[key + '_min']:.0f}-{row[key + '_max']:.0f}]" if row.get("runs", [0, 0])[1:] else ""
    return f"{row[key]:.0f}{spread}"


def table(results: dict[str, Any]) -> str:
    """The Markdown report: machine and load, the rows, the reference orders."""
    m = results["machine"]
    lines = [f"Remote epochs with a cache of {results['cache_fraction']:g} of each dataset: {results['images']} "
             f"images (JPEG, short side 256), {results['latency_ms']:g} ms added to every request, "
             f"RandomResizedCrop 224 + flip, batch {results['batch_size']}, {results['workers']} workers, "
             f"medians of {results['repeats']} ({results['date']}); S3 server: "
             f"{results.get('server', 'moto')}.", "",
             f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB; load average at the start "
             f"{' '.join(f'{v:.2f}' for v in m['load_start'])}, at the end "
             f"{' '.join(f'{v:.2f}' for v in m.get('load_end', []))}."
             + ("" if results.get("publishable") else " **Not publishable: the load exceeded the core count.**"),
             "", f"Command: `{results['command']}`", "",
             "| tool | read from | cache limit | peak cache | samples/epoch | epoch 1 img/s | epoch 2 img/s "
             "| × packer local warm | GETs | CPU s: reader, server | shuffle mixing (0 best) |",
             "|---|---|" + "---:|" * 9]
    local = results.get("local_sps", {})
    for row in results["rows"]:
        if "error" in row:
            lines.append(f"| {row['row']} | {row.get('url', '')} | {_mb(row.get('cache_limit'))} | | | failed: "
                         f"{row['error']} | | | | | |")
            continue
        base = local.get(row.get("format") if row["tool"] == "packer" else results.get("first_format"))
        ratio = f"{row['epoch2_sps'] / base:.2f}" if base and "://" in row["url"] else ""
        limit = _mb(row["cache_limit"]) if row["cache_limit"] else "none"
        failed = row.get("failures", [])
        name = f"{row['row']} ({len(failed)} of {row['repeats']} reads failed: {failed[0]})" if failed else row["row"]
        lines.append(f"| {name} | {'URL' if '://' in row['url'] else 'local files, warm'} | {limit} | "
                     f"{_mb(row['peak_cache']) if '://' in row['url'] else ''} | {row['epoch1_samples']:.0f} | "
                     f"{_sps(row, 'epoch1_sps')} | "
                     f"{_sps(row, 'epoch2_sps')} | {ratio} | {row['gets']:.0f} | {_cpu(row)} | "
                     f"{row['mixing']:.3f} |")
    for row in results.get("reference", []):
        lines.append(f"| {row['order']} | | | | | | | | | | {row['mixing']:.3f} |")
    lines += ["", "Epoch 1 is a fresh process with an empty cache (start-up included), epoch 2 the same process's "
              "next epoch (opening the dataset, which fetches its index, is not timed); × packer local warm is "
              "epoch 2 over packer's epoch 2 of the same format from local files in the page cache (for the "
              f"peers: packer {results.get('first_format')}'s). GETs: requests that reached the server in the "
              "row's epochs. Peak cache: the largest size of the row's cache folder, sampled every 0.2 s (the "
              "smaller of two walks in a row: one walk may count a file about to be evicted and, later, the "
              "download taking its room). CPU s: the "
              "CPU seconds of one read (its epochs and start-up), of the reading process and its workers, and of "
              "the S3 server's threads (with the latency proxy for moto, and the driver's cache sampling), "
              "which share the machine's cores."]
    return "\n".join(lines)


def reference_orders(labels_sorted: list[int], batch_size: int) -> list[dict[str, Any]]:
    """The stored (class) order and a full permutation (``shuffle=True``), scored the same way: the worst and
    the best an order does here."""
    from packer.bench.shuffle_quality import batch_mixing, sampler_labels

    return [{"order": "(stored class order)", "mixing": batch_mixing(labels_sorted, batch_size)},
            {"order": "(a full permutation, packer shuffle=True)",
             "mixing": batch_mixing(sampler_labels(labels_sorted, batch_size, True, 0), batch_size)}]


def tool_env(tool: str, images: int, args: argparse.Namespace) -> dict[str, str]:
    """What a row's adapter is told beside the endpoint: streaming-tuned's ``predownload``, the samples a
    worker fetches ahead, sized so that both workers' together fill about half the cache (Streaming's default,
    8 batches a worker, is more than a 1/8 cache holds), never under a batch."""
    if tool != "streaming-tuned":
        return {}
    fits = images * args.cache_fraction / (2 * max(1, args.workers))
    return {"REMOTE_STREAMING_PREDOWNLOAD": str(max(args.batch_size, int(fits)))}


def command_line(argv: list[str] | None) -> str:
    """The command that reproduces this run, from the repository root."""
    return shlex.join(["python", "benchmarks/peers/remote_peers.py", *(sys.argv[1:] if argv is None else argv)])


# -- the run --------------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", nargs="?", type=Path, help="ImageFolder-layout folder (default: a sample folder of "
                                                     "--images images, made once under bench-out/)")
    p.add_argument("--images", type=int, help="images of the sample folder (default 3000; 300 with --smoke)")
    p.add_argument("--smoke", action="store_true",
                   help="a quick check that every row runs: 300 images, 1 repeat, no settling (not publishable); "
                        "--images, --repeats and --settle still apply")
    p.add_argument("--tools", default=",".join(TOOLS), help=f"comma-separated, from {', '.join(TOOLS)}")
    p.add_argument("--packer-formats", default="wds,lmdb,hdf5",
                   help="packer formats to read, each from the URL and locally (default wds,lmdb,hdf5); the first "
                        "one's images are the peers' and its local row their reference")
    p.add_argument("--latency-ms", type=float, default=20.0, help="added to every request (default 20)")
    p.add_argument("--server", choices=("lite", "moto"), default="lite",
                   help="the S3 server: lite (s3_lite.py, default) or moto behind the tests' latency proxy")
    p.add_argument("--cache-fraction", type=float, default=1 / 8,
                   help="each tool's cache limit as a fraction of its copy's bytes (default 0.125)")
    p.add_argument("--blocks", type=int, default=64, help="shards/chunks/blocks per copy (default 64)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2, help="epochs per read (default 2)")
    p.add_argument("--repeats", type=int, help="reads per row; medians are reported (default 3; 1 with --smoke)")
    p.add_argument("--out", type=Path, default=REPO / "bench-out" / "remote", help="results folder")
    p.add_argument("--venvs", type=Path, default=REPO / "bench-out" / "peer-venvs", help="where peer venvs live")
    p.add_argument("--timeout", type=float, default=900, help="seconds one read (or one peer's packing) may take")
    p.add_argument("--settle", type=float, default=None,
                   help="seconds to wait at the start and the end for the load to fall to the core count "
                        "(default 120; 0 with --smoke)")
    args = p.parse_args(argv)
    smoke = {"images": 300, "repeats": 1, "settle": 0} if args.smoke else {"images": 3000, "repeats": 3, "settle": 120}
    for key, value in smoke.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.tools = [t for t in args.tools.split(",") if t]
    unknown = [t for t in args.tools if t not in TOOLS]
    if unknown or not args.tools:
        p.error(f"unknown tool(s) {', '.join(unknown)}; choose from {', '.join(TOOLS)}")
    args.packer_formats = [f for f in args.packer_formats.split(",") if f]
    if not args.packer_formats or set(args.packer_formats) - {"wds", "lmdb", "hdf5"}:
        p.error("--packer-formats: choose from wds, lmdb, hdf5")
    if args.repeats < 1 or args.blocks < 1 or not 0 < args.cache_fraction:
        p.error("--repeats and --blocks must be at least 1, --cache-fraction above 0")
    args.out = args.out.resolve()
    args.logs = args.out / "logs"
    if args.src is None:
        args.src = run_peers.make_sample(args.images // CLASSES, CLASSES, REPO / "bench-out")
    args.src = args.src.resolve()
    if not args.src.is_dir():
        p.error(f"{args.src} is not a folder")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.logs.mkdir(parents=True, exist_ok=True)
    for log in args.logs.glob("*.log"):
        log.write_text("")
    started = time.perf_counter()
    load = run_peers.LoadWatch(args.settle)
    results: dict[str, Any] = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": command_line(argv), "machine": {**run_peers.machine(), "load_start": list(load.start)},
        "src": str(args.src), "images": len(image_files(args.src)), "latency_ms": args.latency_ms,
        "cache_fraction": args.cache_fraction, "blocks": args.blocks, "batch_size": args.batch_size,
        "workers": args.workers, "epochs": args.epochs, "repeats": args.repeats, "smoke": args.smoke,
        "server": args.server, "rows": []}
    copies = prepare(args, sys.stderr)
    with s3_endpoint(args.server, copies, args.latency_ms / 1000, args.out / "work") as server:
        env = {**S3Server.ENV, "AWS_ENDPOINT_URL": server.url, "S3_ENDPOINT_URL": server.url}
        first = copies[f"packer {args.packer_formats[0]}"]
        block = max(1, first["bytes"] // args.blocks)
        results["first_format"] = args.packer_formats[0]
        listed = [(f"{name} local", copy, str(copy["path"]), 0) for name, copy in copies.items()
                  if copy["tool"] == "packer"]
        listed += [(name, copy, copy.get("url", ""), int(copy.get("bytes", 0) * args.cache_fraction))
                   for name, copy in copies.items() if copy["tool"] in args.tools]
        rows: list[Row | dict[str, Any]] = [
            {"row": name, "tool": copy["tool"], "error": copy["error"]} if "error" in copy else
            Row(name, copy, url, limit, {**env, **tool_env(copy["tool"], results["images"], args)},
                block if copy["tool"] == "packer" else 0)
            for name, copy, url, limit in listed]
        # round-robin, every row's first read, then every row's second...: a drift of the machine's speed during
        # the run (these machines are shared) moves the local reference and the URL rows alike, where each row's
        # reads one after another put minutes between the reference and the rows divided by it
        for repeat in range(args.repeats):
            for row in rows:
                if isinstance(row, Row):
                    row.read(args, server, repeat)
            results["rows"] = [row.summary() if isinstance(row, Row) else row for row in rows]
            results["local_sps"] = {row["format"]: row["epoch2_sps"] for row in results["rows"]
                                    if row["row"].endswith(" local") and "error" not in row}
            results["seconds"] = time.perf_counter() - started
            (args.out / "results.json").write_text(json.dumps(results, indent=2, default=str))
        local = next((r for r in rows if isinstance(r, Row) and r.name.endswith(" local") and r.runs), None)
        if local is not None:
            results["reference"] = reference_orders(local.labels_sorted, args.batch_size)
    idle = load.finish(args.settle)
    results["machine"].update(load_end=idle["load_end"], others_cpu_share=idle["others_cpu_share"])
    results["publishable"] = idle["publishable"] and not args.smoke
    results["seconds"] = time.perf_counter() - started
    (args.out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    text = table(results)
    (args.out / "results.md").write_text(text + "\n")
    print(text)
    print(f"\ntook {results['seconds']:.0f} s; wrote {args.out / 'results.md'} and results.json", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
