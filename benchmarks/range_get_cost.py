"""CPU seconds per ranged GET of an ``http://`` URL as packer fetches a block: through its kept-alive
``http.client`` path (``packer.remote.presigned.plain_range``) and through fsspec's HTTP filesystem (aiohttp on
its event-loop thread), side by side, against the lite S3 server (``peers/s3_lite.py``, path-style URLs are plain
HTTP) running in a child process, so that this process's CPU is the client's alone.

    python benchmarks/range_get_cost.py                    # 0.6 MB ranges of a 64 MB file, 200 GETs x 3 rounds
    python benchmarks/range_get_cost.py --range-bytes 65536

Each round reads the same ranges once per path, alternating; the figure is the median over the rounds of this
process's CPU (user + system) divided by the GETs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE / "peers"), str(HERE.parent / "tests")]

import s3_lite  # noqa: E402 - in peers/, beside the remote benchmark


def cpu() -> float:
    times = os.times()
    return times.user + times.system


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--range-bytes", type=int, default=620_000)
    p.add_argument("--gets", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    from packer.remote import presigned
    from packer.remote.fetch import _stream
    from packer.remote.fs import filesystem

    with tempfile.TemporaryDirectory() as root:
        (Path(root) / "bucket").mkdir()
        (Path(root) / "bucket" / "data").write_bytes(os.urandom(64 << 20))
        with s3_lite.served_in_child(Path(root)) as (endpoint, _):
            url = f"{endpoint}/bucket/data"
            fs = filesystem("http")
            starts = [(i * args.range_bytes) % ((64 << 20) - args.range_bytes) for i in range(args.gets)]
            ranges = [(start, start + args.range_bytes) for start in starts]
            paths = {"http.client (packer)": lambda s, e: presigned.plain_range(fs, url, s, e),
                     "fsspec HTTP (aiohttp)": lambda s, e: _stream(fs, url, s, e - s)}  # packer's fallback
            for read in paths.values():  # connections, the event loop, the first GET's imports
                assert read(0, args.range_bytes) is not None
            taken: dict[str, list[float]] = {name: [] for name in paths}
            for _ in range(args.rounds):
                for name, read in paths.items():
                    before = cpu()
                    for start, end in ranges:
                        data = read(start, end)
                        assert data is not None and len(data) == end - start, name
                    taken[name].append((cpu() - before) / len(ranges))
    print(f"ranged GETs of {args.range_bytes:,} bytes, {args.gets} per round, {args.rounds} rounds, "
          f"{time.strftime('%Y-%m-%d')}, load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    for name, values in taken.items():
        print(f"  {name:<24} {statistics.median(values) * 1e3:.2f} ms CPU a GET "
              f"({', '.join(f'{v * 1e3:.2f}' for v in values)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
