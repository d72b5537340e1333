"""The cost of mid-epoch resume: ``state_dict()`` per call, and the time from ``load_state_dict`` to the first
batch against a fresh start, for ``make_loader`` (threads, and 2 worker processes) and ``packer.stream``.

    python scripts/make_sample_data.py /tmp/img --per-class 600            # 3,000 images
    python -m packer pack /tmp/img /tmp/ds --format lmdb --store jpeg --resize 72 --center-crop 64
    python -m packer pack /tmp/ds /tmp/ds-wds --format wds
    python benchmarks/resume_cost.py /tmp/ds --stream /tmp/ds-wds

The state is taken after 3 batches of 256; each time is the median of ``--repeat`` fresh loaders (page cache
warm).
"""

from __future__ import annotations

import argparse
import statistics
import time

import packer


def first_batch_seconds(make, state, repeat: int) -> tuple[float, float]:
    """Median seconds to the first batch of a new loader: fresh, and after ``load_state_dict(state)``."""
    fresh, resumed = [], []
    for _ in range(repeat):
        for times, load in ((fresh, False), (resumed, True)):
            loader = make()
            start = time.perf_counter()
            if load:
                loader.load_state_dict(state)
            next(iter(loader))
            times.append(time.perf_counter() - start)
            del loader
    return statistics.median(fresh), statistics.median(resumed)


def measure(name: str, make, calls: int, repeat: int) -> None:
    loader = make()
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    start = time.perf_counter()
    for _ in range(calls):
        loader.state_dict()
    per_call = (time.perf_counter() - start) / calls
    state = loader.state_dict()
    del batches, loader
    fresh, resumed = first_batch_seconds(make, state, repeat)
    print(f"{name}: state_dict {per_call * 1e6:.2f} us/call ({len(str(state))} chars); first batch: fresh "
          f"{fresh * 1e3:.1f} ms, after load_state_dict {resumed * 1e3:.1f} ms ({resumed / fresh:.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dataset", help="a packed dataset (any format)")
    parser.add_argument("--stream", help="a wds dataset, to measure packer.stream too")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    ds = packer.open_dataset(args.dataset)
    for name, kwargs in (("make_loader, threads", {}), ("make_loader, 2 workers", {"num_workers": 2})):
        measure(name, lambda kw=kwargs: packer.make_loader(ds, batch_size=args.batch_size, seed=0, **kw),
                args.calls, args.repeat)
    if args.stream:
        for workers in (0, 2):
            measure(f"stream, {workers} workers", lambda w=workers: packer.stream(args.stream, args.batch_size,
                                                                                  num_workers=w),
                    args.calls, args.repeat)


if __name__ == "__main__":
    main()
