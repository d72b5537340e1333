"""The ``packer`` command: a thin click layer over the Python API.

Every :class:`PackerError` becomes one line on stderr and a non-zero exit code, never a traceback; Ctrl-C
exits with 130.

Each command imports its own stack (formats, packing, exports, verify, bench) when it runs, so that ``packer
--help`` and a mistyped option answer without loading h5py, lmdb and the codecs: these are the package's only
imports that climb its layers (``scripts/count_climbs.py``; tests/test_project.py holds the list).
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import sys
import traceback

import click

from . import __version__, arguments
from .errors import ManifestError, PackerError, UsageError
from .packing.options import click_options
from .remote.entry import read_manifest
from .remote.url import parse_url


def one_line(exc: click.ClickException) -> str:
    """A click error as one line: the option it is about, what is wrong, and where to read more."""
    message = " ".join(exc.format_message().split()).rstrip(".")
    if isinstance(exc, click.BadParameter) and not isinstance(exc, click.MissingParameter) and exc.param:
        param = exc.param
        name = "/".join(param.opts) if isinstance(param, click.Option) else param.human_readable_name
        message = f"{name}: {' '.join(exc.message.split()).rstrip('.')}"
    ctx = getattr(exc, "ctx", None)
    names = []
    while ctx is not None and ctx.parent is not None:
        names.append(ctx.info_name)
        ctx = ctx.parent
    return f"{message} (see `packer {' '.join([*reversed(names), '--help']) if names else '--help'}`)"


class PackerGroup(click.Group):
    """Prints click's own usage errors as one line, as packer's errors are; exit 2."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            code = super().main(args, prog_name, complete_var, False, **extra)
        except click.exceptions.NoArgsIsHelpError as exc:  # plain `packer`: the help, as asked
            click.echo(exc.ctx.get_help())
            code = 0
        except click.ClickException as exc:
            click.echo(f"packer: error: {one_line(exc)}", err=True)
            code = exc.exit_code
        except click.exceptions.Abort:
            click.echo("packer: interrupted", err=True)
            code = 130
        sys.exit(code if isinstance(code, int) else 0)


DEBUG_ENV = "PACKER_DEBUG"


def handle_errors(fn):
    """Print packer's errors as one line and exit with their code (2 for bad input, :class:`UsageError`); Ctrl-C
    exits 130. Any other exception is a bug in packer: one line asking for a report, exit 1, and the traceback
    only with ``PACKER_DEBUG=1``."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            with arguments.command_line():  # messages name flags (--overwrite), not Python arguments
                return fn(*args, **kwargs)
        except PackerError as exc:
            click.echo(f"packer: error: {exc}", err=True)
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("packer: interrupted. Run the same command with --resume to continue where it stopped.",
                       err=True)
            sys.exit(130)
        except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except Exception as exc:
            if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
                traceback.print_exc()
            message = " ".join(f"{type(exc).__name__}: {exc}".split())
            click.echo(f"packer: internal error: {message}; rerun with {DEBUG_ENV}=1 for the traceback and report it",
                       err=True)
            sys.exit(1)

    return wrapper


@click.group(cls=PackerGroup)
@click.version_option(__version__, prog_name="packer")
def main() -> None:
    """Pack an image folder into LMDB, HDF5 or WebDataset shards, read it back fast, and measure it."""


@main.command()
@click.argument("src", type=click.Path(path_type=str))
@click.argument("dest", type=click.Path(path_type=str))
@click_options
@click.option("--quiet", is_flag=True, help="No progress bar (warnings and errors still print).")
@handle_errors
def pack(src, dest, quiet, **options) -> None:
    """Convert SRC into a packed dataset in DEST. SRC is any of:

    \b
    - an image folder: a sub-folder per class, holding images at any depth
      (torchvision's ImageFolder);
    - an annotation table: a .csv, .tsv or .jsonl file of image paths with
      more columns (--image-column, --label-column, --root, --field);
    - a dataset packed by packer, to change its format or re-pack it with a
      new transform (a folder, or a URL: s3://, gs://, https://);
    - WebDataset shards from any tool: a folder of .tar files, one .tar, or a
      quoted glob such as 'shards/*.tar' (--label-key);
    - hf:PATH_OR_NAME, a Hugging Face dataset: a save_to_disk folder (--split
      of a DatasetDict), a folder of data files, or a Hub dataset already
      downloaded.

    DEST is a new or empty folder (with --overwrite, a dataset packer wrote), or
    an s3:// or gs:// URL: converted in a local cache, then uploaded.

    Started by torchrun (torchrun --nproc_per_node=K -m packer pack ...), every rank converts a part; DEST must
    then be on a filesystem every node shares. One process at a time writes DEST: a second fails at once."""
    from .packing.pack import pack as run_pack

    manifest = run_pack(src, dest, progress=not quiet, **options)
    if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 speaks for every rank
        click.echo(summary_line(dest, manifest))


def summary_line(dest: str, manifest: dict) -> str:
    size = sum(f["bytes"] for f in manifest["files"])
    skipped = f", {len(manifest['skipped'])} skipped" if manifest.get("skipped") else ""
    return (f"{dest}: {manifest['count']} images, {len(manifest['classes'])} classes, {manifest['format']} "
            f"({manifest['store']}), {size / 1e6:.1f} MB in {len(manifest['files'])} files{skipped}")


@main.command()
@click.argument("dest", type=click.Path(path_type=str))
@click.option("--json", "as_json", is_flag=True, help="Print the whole manifest as JSON.")
@handle_errors
def info(dest, as_json) -> None:
    """Summarise the packed dataset DEST."""
    from . import formats  # noqa: F401 - registers each format's check of its own manifest keys

    manifest = read_manifest(dest)
    if as_json:
        click.echo(json.dumps(manifest, indent=1, ensure_ascii=False))
        return
    try:
        lines = info_lines(dest, manifest)
    except (KeyError, TypeError, AttributeError, ValueError) as exc:  # a hand-edited manifest missing a field
        raise ManifestError(f"{os.path.join(dest, 'manifest.json')}: malformed ({type(exc).__name__}: {exc}); "
                            "re-pack the dataset") from None
    click.echo("\n".join(lines))


def _field_words(entry: dict) -> str:
    """``caption (text)``, ``box (float32[4])``, ``seg (mask uint8)``: a manifest field as ``info`` shows it."""
    shape = entry.get("shape")
    kind = entry["kind"] + ("[]" if "shape" in entry and shape is None else f"[{shape[0]}]" if shape else "")
    return f"{entry['name']} ({kind}{' ' + entry['pixels'] if entry.get('pixels') else ''})"


def info_lines(dest: str, manifest: dict) -> list[str]:
    t = manifest["transform"]
    lines = [summary_line(dest, manifest),
             f"  packed by packer {manifest.get('packer_version')} on {manifest.get('created')} from "
             f"{manifest.get('source', {}).get('root') or manifest.get('source', {}).get('dataset')}",
             f"  classes: {', '.join(manifest['classes'][:20])}{' ...' if len(manifest['classes']) > 20 else ''}",
             f"  store {t['store']}, mode {t['mode']}, dtype {manifest.get('dtype')}, shape "
             f"{manifest.get('shape') or 'varies'}"]
    geometry = [f"{k}={t[k]}" for k in ("resize", "max_size", "center_crop") if t.get(k)]
    if geometry:
        lines.append(f"  transform: {', '.join(geometry)}, interpolation {t['interpolation']}")
    if t.get("normalize"):
        lines.append(f"  normalized: mean {t['mean']}, std {t['std']}")
    lines += format_lines(dest, manifest)
    if manifest.get("parts"):
        lines.append(f"  converted by {len(manifest['parts'])} ranks, one folder each (part-00000...)")
    lines += class_count_lines(dest, manifest)
    order = manifest.get("order", {})
    lines.append(f"  order: {'shuffled, seed ' + str(order.get('seed')) if order.get('shuffle') else 'scan order'}")
    if "fields" in manifest:
        lines.append("  fields: " + ", ".join(_field_words(f) for f in manifest["fields"]))
    for entry in manifest.get("skipped", []):
        lines.append(f"  skipped {entry['path']}: {entry['error']}")
    if manifest.get("hidden_skipped"):
        lines.append(f"  hidden entries skipped: {manifest['hidden_skipped']}")
    return lines


def format_lines(dest: str, manifest: dict) -> list[str]:
    """What the dataset's format says of its own manifest keys (:meth:`packer.formats.Reader.summary`: WebDataset's
    shards); nothing for a format this packer does not know (``verify`` names that)."""
    from .formats import get_format

    try:
        _, reader = get_format(manifest["format"])
    except ValueError:
        return []
    return reader.summary(dest, manifest)


def class_count_lines(dest: str, manifest: dict) -> list[str]:
    """Samples per class and in total: the manifest's ``class_counts`` (nothing else is read) where they add up
    to its count, else, for a local dataset (packed before the manifest recorded them, or damaged), its records'
    (none for a URL: that would fetch it)."""
    from .formats import open_reader

    if not manifest["classes"]:
        return []  # no classes: the header line has the total
    counts = manifest.get("class_counts")
    if counts is not None and sum(counts) != manifest["count"]:
        counts = None  # the manifest disagrees with itself: the data's own counts, or the error that names it
    if counts is None:
        if parse_url(dest) is not None:
            return []  # counting would fetch the data
        try:
            reader = open_reader(dest)
            reader.open()
            counts = reader.class_counts()
        except PackerError as exc:  # info still summarises a damaged dataset; verify names what is wrong
            return [f"  samples per class: unreadable ({exc}); run packer verify"]
    width = max(len(c) for c in manifest["classes"]) if manifest["classes"] else 0
    rows = [f"    {name:<{width}} {int(n):>10,}" for name, n in zip(manifest["classes"], counts, strict=False)]
    return ["  samples per class:", *rows, f"    {'total':<{width}} {sum(int(n) for n in counts):>10,}"]


@main.command()
@click.argument("dest", type=click.Path(path_type=str))
@click.argument("out", type=click.Path(path_type=str))
@click.option("--overwrite", is_flag=True, help="Replace OUT if it is an image folder (a previous export).")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@handle_errors
def export(dest, out, overwrite, quiet) -> None:
    """Write the packed dataset DEST out as an image folder OUT, a sub-folder per class: the stored bytes (the
    original files when stored original), raw pixels as lossless PNG. A dataset with fields: its images and
    OUT/annotations.csv, which packs back to the same samples."""
    from .exports.folder import export as run_export

    result = run_export(dest, out, overwrite=overwrite, progress=not quiet)
    if "table" in result:
        click.echo(f"{out}: {result['count']} samples, their images and {result['table']}; pack it back with: "
                   f"{result['command']}")
        return
    renamed = f" ({result['renamed']} renamed to match their encoding)" if result["renamed"] else ""
    click.echo(f"{out}: {result['count']} images in {result['classes']} class folders{renamed}")


@main.command()
@click.argument("dest", type=click.Path(path_type=str))
@click.option("--deep", is_flag=True,
              help="Also check every sample's checksum, decode it and its fields, check shape and label.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@handle_errors
def verify(dest, deep, quiet) -> None:
    """Check DEST against its manifest; print each problem with its file and sample; exit 1 if any."""
    from .verify import verify as run_verify

    problems = run_verify(dest, deep=deep, progress=not quiet)
    for problem in problems:
        click.echo(problem)
    if problems:
        click.echo(f"packer: {dest}: {len(problems)} problem(s) found; re-pack the dataset", err=True)
        sys.exit(1)
    click.echo(f"{dest}: ok ({'every sample and field decoded' if deep else 'files, checksums and counts'})")


@main.command()
@click.argument("src", required=False, type=click.Path(path_type=str))
@click.option("--full", is_flag=True, help="Measure the whole matrix instead: every store, worker count, epoch and "
              "cache, the median of 3 runs each (minutes).")
@click.option("--min-seconds", type=click.FloatRange(0, min_open=True), default=None,
              help="Each figure reads for at least this long, repeating the dataset's epochs [default: 1; not with "
              "--full].")
@click.option("--images", type=click.IntRange(0), default=None,
              help="Measure a random sample of this many images of a larger folder (0: all) [default: 2000; not with "
              "--full].")
@click.option("--compare", nargs=2, type=click.Path(path_type=str), default=None, metavar="A B",
              help="Print how run B's figures differ from run A's (results.json files, or the --out folders).")
@click.option("--formats", default="lmdb,hdf5,wds", show_default=True, help="Formats to pack and read.")
@click.option("--store", "stores", default=None,
              help="Storage modes; STORE:RESIZE[/CROP] (e.g. jpeg:256) packs that one with its own resize/crop "
              "[default: jpeg,raw, raw only where it fits the disk; with --full original,jpeg,raw].")
@click.option("--resize", default="256", show_default=True, help="Offline resize for jpeg/png/raw ('none': off).")
@click.option("--center-crop", default="224", show_default=True, help="Offline crop for jpeg/png/raw ('none': off).")
@click.option("--read-resize", default="256", show_default=True,
              help="Read-time resize of the folder (and of packed data not stored at the final size).")
@click.option("--read-crop", default="224", show_default=True, help="Read-time centre crop: the output size.")
@click.option("--batch-size", type=click.IntRange(1), default=64, show_default=True)
@click.option("--workers", default=None, help="Loader worker counts, e.g. 0,1,2 [default: make_loader's default, "
              "then 1, 2, 4... below it on the chosen dataset; with --full 0, 1, half and all usable cores; with "
              "--tune 0, 1, 2, 4... cores].")
@click.option("--epochs", type=click.IntRange(1), default=None, help="With --full: epochs per run [default: 2].")
@click.option("--cache", "caches", default="warm,cold", show_default=True,
              help="warm: files read once first; cold: evicted from the page cache before each epoch.")
@click.option("--step-ms", type=click.FloatRange(0), default=0, show_default=True,
              help="A simulated training step after each batch: reports the share of the time it waits for data, "
              "and the smallest number of workers with which it would not.")
@click.option("--repeats", type=click.IntRange(1), default=None,
              help="With --full: runs per figure, each with a fresh loader; the table reports their median "
              "[default: 3].")
@click.option("--prefetch-factor", type=click.IntRange(1), default=None, help="With --full [default: 4].")
@click.option("--packed", multiple=True, type=click.Path(path_type=str),
              help="Benchmark this packed dataset instead of packing SRC (repeat the option for several).")
@click.option("--out", default="bench-out", show_default=True,
              help="Folder for results.json, results.md, results.txt and bench.png.")
@click.option("--work", default=None, help="Where to pack (default: inside --out); use a real disk for cold runs.")
@click.option("--keep", is_flag=True, help="Keep the packed datasets in the work folder.")
@click.option("--disk-test-mb", type=click.IntRange(0), default=None,
              help="Size of the file read to measure the disk (0: skip) [default: 0; with --full 384].")
@click.option("--no-limits", is_flag=True, help="Skip the decode, memory and disk ceilings.")
@click.option("--tune", "tune_dest", default=None, type=click.Path(path_type=str),
              help="DEST: sweep workers, threads, prefetch factor (and pinning, with CUDA) on DEST read as "
              "--read-resize/--read-crop (--pipeline train: random resized crop) give, at --batch-size; write "
              "DEST/loader.json.")
@click.option("--prefetch-factors", default="2,4", show_default=True, help="With --tune: prefetch factors to try.")
@click.option("--pipeline", "pipelines", default=None,
              help="train: random resized crop + flip fused into decoding (the folder baseline decodes with "
              "Pillow, as ImageFolder + torchvision's transforms); val: read-time resize and centre crop "
              "[default: train,val; with --full and --tune val,train]. With --tune: the first one named is the view "
              "tuned for.")
@click.option("--quiet", is_flag=True, help="No live table or progress bars.")
@handle_errors
def bench(src, full, min_seconds, images, compare, formats, stores, resize, center_crop, read_resize, read_crop,
          batch_size, workers, epochs, caches, step_ms, repeats, prefetch_factor, packed, out, work, keep, disk_test_mb,
          no_limits, tune_dest, prefetch_factors, pipelines, quiet) -> None:
    """Measure how fast SRC loads packed in each format against the folder itself, and say what to pack with.

    By default, in a minute or two: each format with store jpeg and raw (where it fits the disk), read by
    make_loader's default loader with the training and the validation pipeline, warm and cold, each figure read
    for --min-seconds; the verdict first (the pack command, its speed over the folder, its size on disk, the
    choice if disk is short, how few workers keep a training step fed), then the table (each row printed live on
    stderr as it finishes), then the chart. --full measures the whole matrix; --tune DEST finds the fastest loader
    settings for a packed dataset; --compare A B compares two runs.
    """
    from . import bench as b

    if compare:
        if src or tune_dest:
            raise UsageError("give --compare A B alone, without SRC or --tune")
        first, second = (b.load_results(p) for p in compare)
        click.echo("\n".join(b.compare_lines(first, second)))
        return
    quick_only = {"--min-seconds": min_seconds, "--images": images}
    full_only = {"--epochs": epochs, "--repeats": repeats, "--prefetch-factor": prefetch_factor}
    given = [name for name, value in (full_only if not full else quick_only).items() if value is not None]
    if given and not tune_dest:
        raise UsageError(f"{', '.join(given)}: only {'with --full' if not full else 'without --full'} (the quick "
                         "run reads each figure for --min-seconds through make_loader's default loader)")
    pipelines = pipelines or ("train,val" if src and not full and not tune_dest else "val,train")
    try:  # bench's parsers raise ValueError for text that is not what they parse: that is bad input
        counts = b.split_ints(workers) if workers else None
        for text in b.split_names(stores) if stores and not tune_dest else ():
            b.parse_variant(text)
        b.parse_pipelines(b.split_names(pipelines))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if src and parse_url(src) is not None:  # a packed dataset at a URL: one cold and one warm epoch
        rows = b.bench_url(src, batch_size=batch_size, workers=counts[0] if counts else 0,
                         resize=b.optional_size(read_resize), center_crop=b.optional_size(read_crop))
        click.echo(b.format_bench_url(src, rows))
        return
    if tune_dest:
        if src:
            raise UsageError("give SRC to benchmark, or --tune DEST, not both")
        data = b.tune(tune_dest, workers=counts, batch_size=batch_size,
                      prefetch_factors=b.split_ints(prefetch_factors), read_resize=b.optional_size(read_resize),
                      read_crop=b.optional_size(read_crop), pipeline=b.split_names(pipelines)[0],
                      progress=not quiet)
        click.echo(b.format_tune(data, tune_dest))
        return
    if not src:
        raise UsageError("give the image folder SRC to benchmark (or --tune DEST, or --compare A B)")
    command = " ".join(["packer", *map(shlex.quote, sys.argv[1:])])
    common = dict(formats=b.split_names(formats), resize=b.optional_size(resize),
                  center_crop=b.optional_size(center_crop), batch_size=batch_size, workers=counts,
                  caches=b.split_names(caches), step_ms=step_ms, out=out, keep=keep, packed=packed,
                  read_resize=b.optional_size(read_resize), read_crop=b.optional_size(read_crop), work=work,
                  limits=not no_limits, progress=not quiet, pipelines=b.split_names(pipelines), command=command)
    if full:
        results = b.run_bench(src, stores=b.split_names(stores or "original,jpeg,raw"), epochs=epochs or 2,
                              repeats=repeats or 3, prefetch_factor=prefetch_factor or 4,
                              disk_test_mb=384 if disk_test_mb is None else disk_test_mb, log=click.echo, **common)
    else:
        results = b.run_quick(src, stores=b.split_names(stores) if stores else None,
                              min_seconds=min_seconds or b.MIN_SECONDS, disk_test_mb=disk_test_mb or 0,
                              images=b.IMAGES if images is None else images or None, **common)
    click.echo(b.render_text(results), nl=False)
    click.echo(f"wrote {', '.join(results['outputs'].values())}")
    if results.get("work"):
        click.echo(f"packed datasets kept in {results['work']}")


if __name__ == "__main__":
    main()
