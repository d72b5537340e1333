"""``packer bench``: measure how fast packed datasets load against the raw image folder, and what bounds them.

:func:`run_quick` (``packer bench SRC``) measures what decides the choice, in a minute or two: each format with
store jpeg and raw (where it fits the disk), read by make_loader's default loader with the training and the
validation pipeline, warm and cold, each figure read for a minimum time (:mod:`~packer.bench.passes`); it prints
each row as it finishes (:mod:`~packer.bench.live`) and puts its verdict first (:mod:`~packer.bench.verdict`): the
pack command, its speed over the folder, its size on disk, the choice if disk is short, and with how few workers a
training step would not wait. ``packer bench --compare A B`` (:mod:`~packer.bench.compare`) prints how two runs
differ. The rest of this docstring is ``--full``.

:func:`run_bench` (``packer bench SRC --full``) packs SRC into each asked format and storage mode (or reuses packed
datasets), then reads each one and the folder itself (``FolderDataset(decoder="pil")``: Pillow + Resize +
CenterCrop, the torchvision ImageFolder baseline) through :func:`packer.make_loader`, every one giving the same
uint8 NCHW batches. For each (dataset, store, workers, epoch, cache) it records samples/s, MB/s read and decoded,
time to the first batch, the speedup over the folder with the same settings and the fraction of a ceiling measured
in the same run:

- decode ceiling: the stored payloads decoded (and resized/cropped) by the readers' own read-time decode in a
  process pool of ``usable_cores()`` processes, with no loader, for encoded modes; one round before each of
  the dataset's runs, and their median, since the host's speed varies (see ``limits.interleaved_ceiling``);
- memory-copy ceiling: ``np.copyto`` bandwidth / bytes per sample, for raw arrays that need no transform;
- disk ceiling (cold cache only): sequential read speed of the work folder's disk / bytes read per sample.

A cold run first evicts every file of the dataset from the page cache (``fsync`` + ``POSIX_FADV_DONTNEED``, with
nothing mapped) and checks with ``mincore`` that the eviction took; tmpfs and some overlay filesystems keep the
pages, and the row then says ``eviction_ok: false``.

Each row is the median of ``repeats`` runs (3 by default), each with a fresh loader. The load average is taken
at the start and the end of the run; a busy machine, or fewer than 20 batches an epoch, is warned about in the
text, the JSON and on the chart.

:func:`tune` sweeps the loader's settings (workers, decode threads, prefetch factor, pinning; never the batch size)
on one packed dataset, for one read-time view, and writes the fastest with that view to ``DEST/loader.json``, which
:func:`packer.make_loader` then uses for that view.

Modules: ``machine`` (cores, memory, versions, filesystems, load average), ``cache`` (warm, evict, resident),
``targets`` (store variants, the datasets under test), ``pipelines`` (val and train), ``limits`` (memory, disk
and decode ceilings), ``measure`` (a loader's epochs, rows, speedups), ``report`` (tables, notes, warnings, JSON),
``chart`` (bench.png), ``summary`` (--full's first screen: what to use, how much faster), ``quick``, ``passes``,
``live``, ``verdict`` and ``compare`` (the quick run, above), ``tune``
(``DEST/loader.json``), ``run`` (:func:`run_bench`) and ``remote`` (``packer bench URL``: cold and warm epochs of
a packed dataset at a URL, with the bytes and requests fetched; not imported here).
"""

from .cache import EVICTED_BELOW, dataset_files, evict, prewarm, resident_bytes, resident_fraction
from .chart import chart_workers
from .compare import compare_lines, load_results
from .limits import (
                     DecodePool,
                     add_ceilings,
                     decode_rates,
                     disk_read_speed,
                     interleaved_ceiling,
                     measure_limits,
                     memory_bandwidth,
)
from .machine import describe_load, describe_machine, filesystem_type, load_average, machine_info
from .measure import WARMUP_BATCHES, EpochStats, add_speedups, build_loader, measure, output_signature, run_epochs
from .pipelines import PIPELINES, open_train, parse_pipelines, train_size
from .quick import IMAGES, MIN_SECONDS, run_quick, sample_folder, sweep_workers
from .remote import bench_url, format_bench_url
from .report import (
                     conversion_lines,
                     format_table,
                     limits_lines,
                     markdown_table,
                     plot,
                     render_markdown,
                     render_text,
                     write_outputs,
)
from .run import DEFAULT_OUT, default_workers, optional_size, run_bench, split_ints, split_names
from .summary import best_choice, summary_lines
from .targets import Size, Target, Variant, folder_target, pack_target, packed_target, parse_variant, read_geometry
from .tune import format_tune, noise_warning, tune, tune_workers
from .verdict import pack_command, verdict

__all__ = [
    "add_ceilings", "add_speedups", "bench_url", "best_choice", "build_loader", "chart_workers", "compare_lines",
    "conversion_lines", "dataset_files", "decode_rates", "DecodePool", "DEFAULT_OUT", "default_workers",
    "describe_load", "describe_machine", "disk_read_speed", "EpochStats", "evict", "EVICTED_BELOW", "filesystem_type",
    "folder_target", "format_bench_url", "format_table", "format_tune", "IMAGES", "interleaved_ceiling", "limits_lines",
    "load_average", "load_results", "machine_info", "markdown_table", "measure", "measure_limits", "memory_bandwidth",
    "MIN_SECONDS", "noise_warning", "open_train", "optional_size", "output_signature", "pack_command", "pack_target",
    "packed_target", "parse_pipelines", "parse_variant", "PIPELINES", "plot", "prewarm", "read_geometry",
    "render_markdown", "render_text", "resident_bytes", "resident_fraction", "run_bench", "run_epochs", "run_quick",
    "sample_folder", "Size", "split_ints", "split_names", "summary_lines", "sweep_workers", "Target", "train_size",
    "tune", "tune_workers", "Variant", "verdict", "WARMUP_BATCHES", "write_outputs"
]
