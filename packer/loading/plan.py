"""How :func:`packer.make_loader` will read a dataset, decided in one place: :func:`plan_loader` returns a
:class:`LoaderPlan` (the engine, its workers, decode threads, pinning and prefetch, and a short reason for each)
that ``make_loader`` builds its loader from, that the loader keeps as ``loader.plan`` and logs, and that
``packer bench`` prints.

The three engines:

- ``"pool"``: packer's :class:`~packer.loading.workers.WorkerPool`, worker processes decoding whole batches into shared
  memory the main process owns (only the labels cross). For packer's datasets of one image shape without a
  per-item transform, and no DataLoader setting the pool does not carry out.
- ``"threads"``: the in-process loader: decode threads in the main process, a background thread ``prefetch``
  batches ahead. ``num_workers=0``, ``threads=`` or ``prefetch_batches=`` ask for it; packer's datasets get it
  where the pool would not serve them by default (one core, processes that do not fork, a small /dev/shm).
- ``"torch"``: torch's own DataLoader workers: other datasets, and packer's that the pool cannot serve.

Why each default is what it is: docs/benchmarks.md, "Loader"; ``packer bench`` measures it on your machine.
The settings ``packer bench --tune`` saved beside a dataset (``loader.json``) come in as ``tuned``
(:mod:`packer.loading.tuned`); an explicit argument always wins over them.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from ..reading.batches import BatchDataset
from ..reading.dataset import PackedDataset
from ..system import cores_per_rank
from .fetchahead import blocked_reader
from .tuned import applied_tuned
from .workers import default_start_method, shared_memory_free, slot_bytes

Engine = Literal["pool", "threads", "torch"]
PREFETCH = 4  # batches ahead: per worker process, or the in-process loader's background thread

# the DataLoader settings packer's WorkerPool carries out itself; with any other (generator, pin_memory_device...)
# the loader keeps torch's own workers
POOL_SETTINGS = frozenset({"batch_size", "num_workers", "pin_memory", "collate_fn", "drop_last",
                           "persistent_workers", "prefetch_factor", "worker_init_fn", "sampler", "batch_sampler",
                           "multiprocessing_context", "timeout"})


@dataclass(frozen=True)
class LoaderPlan:
    """How a loader reads: what :func:`plan_loader` decided, and why.

    Attributes:
        engine: ``"pool"`` (packer's worker processes), ``"threads"`` (decode threads in the main process) or
            ``"torch"`` (torch's DataLoader workers).
        workers: worker processes (0 for the in-process loader).
        threads: decode threads per batch, in each process that decodes.
        pin_memory: whether batches are asked for in pinned memory (it takes effect where CUDA is available).
        prefetch: batches made ahead: per worker process, or by the in-process loader's background thread.
        why: ``(setting, reason)`` for each of engine, workers, threads, pin_memory and prefetch.
        tuned: the settings from ``loader.json`` (``packer bench --tune``) the plan uses, as ``(name, value)``
            pairs (``dict(plan.tuned)``).
        decoder: the faster decoder for the dataset's read-time view, and what it gives up, where there is one
            (:func:`decoder_advice`); "" otherwise.
    """

    engine: Engine
    workers: int
    threads: int
    pin_memory: bool
    prefetch: int
    why: tuple[tuple[str, str], ...]
    tuned: tuple[tuple[str, Any], ...] = ()
    decoder: str = ""

    def reason(self, setting: str) -> str:
        """The reason given for ``setting`` (``"engine"``, ``"workers"``, ``"threads"``, ``"pin_memory"``,
        ``"prefetch"``); "" if none."""
        return dict(self.why).get(setting, "")

    def __str__(self) -> str:
        if self.engine == "threads":
            how = f"threads: {_count(self.threads, 'decode thread')} in this process"
        else:
            kind = "packer's pool" if self.engine == "pool" else "torch's workers"
            how = f"{self.engine}: {_count(self.workers, 'worker process', 'es')} ({kind}), " \
                  f"{_count(self.threads, 'decode thread')} each"
        per = " per worker" if self.workers else ""
        pinned = "pinned" if self.pin_memory else "not pinned"
        reasons = "; ".join(f"{setting}: {reason}" for setting, reason in self.why)
        advice = f"; {self.decoder}" if self.decoder else ""
        return f"{how}, prefetch {self.prefetch}{per}, {pinned} ({reasons}){advice}"


def _count(n: int, noun: str, plural: str = "s") -> str:
    return f"{n} {noun}{'' if n == 1 else plural}"


def pool_refusal(dataset: Any, overrides: Mapping[str, Any]) -> str | None:
    """Why packer's WorkerPool cannot make ``dataset``'s batches under the caller's DataLoader ``overrides``
    (packer's own ``collate_fn`` and ``worker_init_fn`` left out of them); None when it can: a packer dataset of
    decoded images of one shape without a per-item transform, workers kept across epochs, and no setting the
    pool does not carry out."""
    if not isinstance(dataset, BatchDataset):
        return f"{type(dataset).__name__} is not a packer dataset"
    extra = sorted(set(overrides) - POOL_SETTINGS)
    if extra:
        return f"{', '.join(extra)} given (the pool does not carry it out)"
    for name in ("collate_fn", "worker_init_fn"):
        if name in overrides:
            return f"a {name} of your own"
    if "persistent_workers" in overrides and not overrides["persistent_workers"]:
        return "persistent_workers=False"
    if dataset.transform is not None or dataset.target_transform is not None:
        return "a per-item transform"
    if not dataset.decode:
        return "decode=False"
    if dataset.batch_layout() is None:
        return "images of varying size (no read-time crop)"
    return None


def varying_sizes(dataset: Any, batch_size: int, overrides: Mapping[str, Any]) -> str | None:
    """Why ``dataset``'s batches cannot be made, said before the first one: a packer dataset decoded without any
    read-time geometry, whose stored images (as its index records them) are of several sizes, batched by
    packer's collate (no ``collate_fn``, ``batch_sampler`` or per-item ``transform`` of the caller's, which may
    make them one size) more than one at a time. None when they can be, or where the format keeps no index of
    the sizes (the first batch then says so)."""
    if not isinstance(dataset, PackedDataset) or not dataset.decode or dataset.transform is not None:
        return None
    if batch_size < 2 or {"collate_fn", "batch_sampler"} & set(overrides) or dataset.batch_layout() is not None:
        return None
    if dataset.resize or dataset.center_crop or dataset.random_resized_crop:
        return None  # a resize alone may give one size: the batches tell
    shapes = dataset.reader.stored_shapes()
    if shapes is None or not len(shapes):
        return None
    sizes = np.unique(np.asarray(shapes)[:, :2], axis=0)
    if len(sizes) < 2:
        return None
    seen = ", ".join(f"{int(w)}x{int(h)}" for h, w in sizes[:3].tolist())
    return (f"{dataset.root}: images of {len(sizes)} sizes ({seen}{'...' if len(sizes) > 3 else ''}) cannot be "
            "batched; pass resize= and center_crop= (or random_resized_crop=) to open_dataset, a collate_fn of your "
            "own to make_loader, or batch_size=1")


def _no_default_pool(dataset: BatchDataset, overrides: Mapping[str, Any], cores: int, batch_size: int,
                     prefetch: int) -> str | None:
    """Why ``dataset`` does not get packer's worker pool when ``num_workers`` is not given; None when it does: on
    two or more cores, outside a daemonic process (which may not start any), where the pool serves the settings
    asked for; where processes fork (spawn and forkserver re-import the main module, which a script must guard
    with ``if __name__ == "__main__"``: a user who did not ask for processes keeps threads), and where /dev/shm
    has room for the batches in flight (a container's is 64 MB by default; threads need none)."""
    if cores < 2:
        return "one usable core"
    if multiprocessing.current_process().daemon:
        return "a daemonic process may not start workers"
    refusal = pool_refusal(dataset, overrides)
    if refusal is not None:
        return refusal
    method = default_start_method()
    if overrides.get("multiprocessing_context") is None and method != "fork":
        return f"processes start by {method} here, which re-imports the main module"
    free = shared_memory_free()
    needed = 2 * (cores * prefetch + 2) * slot_bytes(dataset, batch_size)
    if free is not None and free < needed:
        return f"/dev/shm has {free >> 20} MB free, the pool's batches in flight need {needed >> 20} MB"
    return None


def plan_loader(dataset: Any, batch_size: int = 64, *, threads: int | None = None,
                prefetch_batches: int | None = None, overrides: Mapping[str, Any] | None = None,
                tuned: Mapping[str, Any] | None = None, cores: int | None = None,
                cuda: bool | None = None) -> LoaderPlan:
    """The loader :func:`packer.make_loader` makes for these arguments: engine, workers, threads, pinning and
    prefetch, each with its reason. An argument given explicitly always wins over a tuned setting, and a tuned
    setting over a default.

    Args:
        dataset: the dataset the loader reads.
        batch_size: samples per batch.
        threads: ``make_loader``'s ``threads`` (decode threads in the main process), or None.
        prefetch_batches: ``make_loader``'s ``prefetch_batches``, or None.
        overrides: the DataLoader arguments the caller gave (``num_workers``, ``pin_memory``...), without
            packer's own ``collate_fn`` and ``worker_init_fn``.
        tuned: the settings ``packer bench --tune`` saved (:func:`tuned_settings`), or None.
        cores: the usable cores of this rank (default :func:`~packer.system.cores_per_rank`).
        cuda: whether CUDA is available (default: torch says).

    Returns:
        The :class:`LoaderPlan`.
    """
    overrides = dict(overrides or {})
    cores = cores_per_rank() if cores is None else cores
    cuda = torch.cuda.is_available() if cuda is None else cuda
    applied = applied_tuned(tuned or {}, threads, prefetch_batches, overrides)
    packed = isinstance(dataset, BatchDataset)
    why: dict[str, str] = {}
    if threads is None and "threads" in applied and applied.get("num_workers", 0) == 0:
        threads, why["threads"] = applied["threads"], "tuned (loader.json)"
    elif threads is not None:
        why["threads"] = "threads= given"
    if "num_workers" in overrides or "num_workers" in applied or not packed:
        workers, why["workers"] = _given(overrides, applied, "num_workers", cores, "one per usable core")
        stopped = None
    else:
        stopped = _in_process(dataset, overrides, applied, cores, batch_size, threads, prefetch_batches,
                              tuned_threads=why.get("threads", "").startswith("tuned"))
        workers = 0 if stopped else cores
        why["workers"] = "none: the main process decodes" if stopped else "one per usable core"
    engine, why["engine"] = _engine(dataset, overrides, workers, stopped)
    if threads is None:
        threads = cores if workers == 0 and packed else 1
        why["threads"] = "one per usable core" if workers == 0 and packed else "one per process"
    pin, why["pin_memory"] = _given(overrides, applied, "pin_memory", cuda, "CUDA is available" if cuda else "no CUDA")
    if workers == 0:
        prefetch, why["prefetch"] = _prefetch(prefetch_batches, "prefetch_batches", applied)
    else:
        prefetch, why["prefetch"] = _prefetch(overrides.get("prefetch_factor"), "prefetch_factor", applied)
        if why["prefetch"] == "the default" and blocked_reader(dataset) is not None:
            prefetch, why["prefetch"] = 1, ("read a block at a time: the blocks of the batches in flight are "
                                            "held out of those fetched ahead")
    order = ("engine", "workers", "threads", "pin_memory", "prefetch")
    return LoaderPlan(engine, workers, threads, bool(pin), prefetch, tuple((k, why[k]) for k in order),
                      tuple(applied.items()), decoder_advice(dataset))


def decoder_advice(dataset: Any) -> str:
    """Which decoder would read ``dataset``'s view faster, and what it gives up; "" where its own is the fastest.

    The default decoder's read-time resize and crop stay within one level of ``decoder="pil"`` (torchvision's
    Pillow pipeline). Where the resize shrinks encoded images (an ``original`` store, or one stored larger than
    the read-time resize), Pillow's antialiased filter does it, and ``decoder="fast"`` (a JPEG decoded at a reduced
    DCT scale, OpenCV's resampler) is several times faster. Where the resize enlarges them (a store at most as
    large as the resize), the default's float32 kernel costs more than ``decoder="fast"``'s ``warpAffine``,
    whose positions are quantised to 1/32 pixel. Either way ``decoder="fast"`` is held to 30 dB PSNR of the
    default; docs/training.md ("Which decoder for what") says which to pick, docs/benchmarks.md has the figures."""
    if not isinstance(dataset, PackedDataset) or dataset.decoder != "auto" or dataset.random_resized_crop:
        return ""
    spec = dataset.reader.spec
    if dataset.resize is None or spec.store == "raw":
        return ""
    if _may_shrink(spec, dataset.resize):
        return ('decoder: "auto" shrinks with Pillow here, within one level of decoder="pil"; decoder="fast" '
                "decodes at a reduced DCT scale and resamples with OpenCV, several times faster, within 30 dB PSNR "
                "of it (docs: Training, 'Which decoder for what')")
    return ('decoder: "auto" enlarges with OpenCV in float32 here, within one level of decoder="pil"; '
            'decoder="fast" resamples with warpAffine (positions to 1/32 pixel), somewhat faster, within 30 dB PSNR '
            "of it (docs: Training, 'Which decoder for what')")


def _may_shrink(spec: Any, resize: int | tuple[int, int]) -> bool:
    """Whether a read-time ``resize`` may shrink images stored as ``spec`` says (any side of any image)."""
    want = min(resize) if isinstance(resize, tuple) else resize
    if spec.center_crop:
        short = min(spec.center_crop)
    elif isinstance(spec.resize, tuple):
        short = min(spec.resize)
    elif spec.resize:
        short = min(spec.resize, spec.max_size or spec.resize)
    elif spec.max_size:
        short = spec.max_size  # the short side is at most the long one's cap
    else:
        return True  # stored at their original size: anything
    return want < short


def _given(overrides: Mapping[str, Any], applied: Mapping[str, Any], name: str, default: Any,
           because: str) -> tuple[Any, str]:
    """A setting from the caller's arguments, else the tuned ones, else ``default``; and which it was."""
    if name in overrides:
        return overrides[name], f"{name}= given"
    if name in applied:
        return applied[name], "tuned (loader.json)"
    return default, because


def _in_process(dataset: BatchDataset, overrides: Mapping[str, Any], applied: Mapping[str, Any], cores: int,
                batch_size: int, threads: int | None, prefetch_batches: int | None, tuned_threads: bool) -> str | None:
    """Why a packer dataset whose ``num_workers`` nobody gave decodes in the main process; None: it gets the pool."""
    if threads is not None:
        return "tuned threads (loader.json)" if tuned_threads else "threads= given"
    if prefetch_batches is not None:
        return "prefetch_batches= given"
    factor = overrides.get("prefetch_factor") or applied.get("prefetch_factor", PREFETCH)
    return _no_default_pool(dataset, overrides, cores, batch_size, factor)


def _engine(dataset: Any, overrides: Mapping[str, Any], workers: int, stopped: str | None) -> tuple[Engine, str]:
    """The engine for ``workers`` processes, and why (``stopped``: why a packer dataset has none by default)."""
    if workers <= 0:
        return "threads", stopped or ("num_workers=0 given" if "num_workers" in overrides
                                      else "tuned num_workers=0 (loader.json)")
    refusal = pool_refusal(dataset, overrides)
    return ("torch", refusal) if refusal else ("pool", "images of one shape, decoded into shared memory")


def _prefetch(given: int | None, name: str, applied: Mapping[str, Any]) -> tuple[int, str]:
    if given is not None:
        return given, f"{name}= given"
    if "prefetch_factor" in applied:
        return applied["prefetch_factor"], "tuned (loader.json)"
    return PREFETCH, "the default"
