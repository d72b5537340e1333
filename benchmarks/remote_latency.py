"""``packer bench URL`` against a local file server with injected latency: one cold epoch (empty cache), one warm
epoch, and the same cached files read as a local dataset, per packed dataset given.

    python -m packer pack sample_data /tmp/r/lmdb --format lmdb
    python -m packer pack sample_data /tmp/r/hdf5 --format hdf5
    python -m packer pack sample_data /tmp/r/wds --format wds --shard-samples 16
    python benchmarks/remote_latency.py /tmp/r lmdb hdf5 wds --latency-ms 20

The server is the tests' Range-capable HTTP server on 127.0.0.1 behind their proxy, which sleeps ``--latency-ms``
before every request.

Its successor for issue 25 is ``benchmarks/peers/remote_peers.py``: a cache smaller than the dataset (1/8),
RandomResizedCrop 224 + flip, ``shuffle="blocks"``, from a local S3 server behind the same proxy, side by side
with MosaicML Streaming and LitData under the same latency and cache bound, with each order's shuffle quality
(see benchmarks/peers/README.md, "From object storage with a small cache").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from support.remote import fault_proxy, serve_files  # noqa: E402

from packer.bench.remote import bench_url, format_bench_url  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", help="folder holding the packed datasets")
    parser.add_argument("names", nargs="+", help="dataset folders under ROOT")
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--resize", type=int, default=64)
    parser.add_argument("--crop", type=int, default=56)
    args = parser.parse_args()
    server = serve_files(Path(args.root))
    proxy = fault_proxy(server.url, latency=args.latency_ms / 1000)
    try:
        for name in args.names:
            url = f"{proxy.url}/{name}"
            rows = bench_url(url, batch_size=args.batch_size, workers=args.workers, resize=args.resize,
                             center_crop=args.crop)
            print(format_bench_url(url, rows), end="\n\n", flush=True)
    finally:
        proxy.stop()
        server.stop()


if __name__ == "__main__":
    main()
