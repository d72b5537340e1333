"""``packer bench`` and ``packer bench --tune``: the structure and arithmetic of what they write, never a timing."""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import json
import math
import statistics
from pathlib import Path

import numpy as np
import pytest
from conftest import write_image

import packer
from packer import bench
from packer.bench.limits import decode_like_reader

FORMATS = ("lmdb", "hdf5", "wds")
STORES = ("original", "jpeg 32/24", "raw 32/24")
OUTPUT_BYTES = 24 * 24 * 3
REAL_DISKS = ("ext4", "xfs", "btrfs")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    """24 small images of varied sizes in 2 classes, one of them a PNG."""
    root = tmp_path_factory.mktemp("bench") / "src"
    for i in range(24):
        name = f"{('ant', 'bee')[i % 2]}/{i:02d}.{'png' if i == 5 else 'jpg'}"
        write_image(root / name, width=40 + i, height=36 + 3 * (i % 5), seed=i)
    return root


@pytest.fixture(scope="module")
def bench_run(tiny_folder, run_packer):
    out = tiny_folder.parent / "out"
    proc = run_packer("bench", tiny_folder, "--full", "--workers", "0", "--epochs", "1", "--cache", "warm,cold",
                      "--resize", "32", "--center-crop", "24", "--read-resize", "32", "--read-crop", "24",
                      "--batch-size", "4", "--repeats", "1", "--step-ms", "1", "--disk-test-mb", "8", "--out", out,
                      "--quiet")
    assert proc.returncode == 0, proc.stderr
    return proc, out, json.loads((out / "results.json").read_text())


def test_writes_every_output_and_removes_the_work_folder(bench_run):
    proc, out, _ = bench_run
    for name in ("results.json", "results.md", "results.txt"):
        assert (out / name).stat().st_size > 0
    assert (out / "bench.png").exists() == (importlib.util.find_spec("matplotlib") is not None)
    assert not list(out.glob("packer-bench-*")), "the work folder stays only with --keep"
    assert "samples/s" in proc.stdout and "folder" in proc.stdout
    assert "| dataset |" in (out / "results.md").read_text()


def test_one_row_per_dataset_store_workers_epoch_cache(bench_run):
    rows = bench_run[2]["rows"]
    keys = [(r["dataset"], r["store"], r["pipeline"], r["workers"], r["epoch"], r["cache"]) for r in rows]
    both = ("val", "train")  # the default --pipeline
    expected = [(f, s, p, 0, 1, c) for f, s in itertools.product(FORMATS, STORES) for p in both
                for c in ("warm", "cold")]
    expected += [("folder", "files", p, 0, 1, c) for p in both for c in ("warm", "cold")]
    assert sorted(keys) == sorted(expected)


def test_rates_are_positive_and_megabytes_follow_from_them(bench_run):
    results = bench_run[2]
    assert results["output"] == {"shape": [3, 24, 24], "dtype": "uint8"}
    for r in results["rows"]:
        assert r["samples"] > 0 and r["samples_per_s"] > 0 and r["first_batch_s"] >= 0
        assert r["bytes_per_sample_decoded"] == OUTPUT_BYTES
        assert r["mb_per_s_decoded"] == pytest.approx(r["samples_per_s"] * OUTPUT_BYTES / 1e6)
        assert r["mb_per_s_read"] == pytest.approx(r["samples_per_s"] * r["bytes_per_sample_read"] / 1e6)
        assert 0 <= r["data_stall"] <= 1


def test_bytes_read_per_sample_come_from_the_files(bench_run, tiny_folder):
    results = bench_run[2]
    source = sum(p.stat().st_size for p in tiny_folder.rglob("*.*"))
    assert results["source"] == {"root": str(tiny_folder.resolve()), "images": 24, "bytes": source}
    conversions = {(c["dataset"], c["store"]): c for c in results["conversions"]}
    assert set(conversions) == set(itertools.product(FORMATS, STORES))
    for r in results["rows"]:
        size = source if r["dataset"] == "folder" else conversions[(r["dataset"], r["store"])]["bytes_on_disk"]
        assert r["bytes_per_sample_read"] == pytest.approx(size / 24)
    for c in conversions.values():
        assert c["images"] == 24 and c["seconds"] > 0
        assert c["images_per_s"] == pytest.approx(24 / c["seconds"])
        assert c["size_vs_source"] == pytest.approx(c["bytes_on_disk"] / source)


def test_speedup_is_the_rate_over_the_folder_rate_with_the_same_settings(bench_run):
    rows = bench_run[2]["rows"]
    folder = {(r["pipeline"], r["workers"], r["epoch"], r["cache"]): r["samples_per_s"] for r in rows
              if r["dataset"] == "folder"}
    for r in rows:
        base = folder[(r["pipeline"], r["workers"], r["epoch"], r["cache"])]
        assert r["speedup_vs_folder"] == pytest.approx(r["samples_per_s"] / base)


def test_fraction_of_ceiling_is_the_rate_over_the_lowest_bound(bench_run):
    results = bench_run[2]
    limits = results["limits"]
    assert limits["memory_copy_gb_per_s"] > 0 and limits["disk"]["mb_per_s"] > 0
    for r in results["rows"]:
        if r["pipeline"] == "train":  # no decode ceiling for it: only the disk bounds it, on a cold cache
            assert r["cpu_ceiling_samples_per_s"] is None
            assert r["ceiling_samples_per_s"] == r["disk_ceiling_samples_per_s"]
            assert (r["ceiling_kind"] == "disk") == (r["cache"] == "cold")
            continue
        bounds = {r["ceiling_kind"]: r["ceiling_samples_per_s"]}
        if r["cache"] == "cold":
            assert r["disk_ceiling_samples_per_s"] == pytest.approx(
                limits["disk"]["mb_per_s"] * 1e6 / r["bytes_per_sample_read"])
            bounds["disk"] = r["disk_ceiling_samples_per_s"]
        else:
            assert r["disk_ceiling_samples_per_s"] is None
        assert r["ceiling_samples_per_s"] == pytest.approx(min(r["cpu_ceiling_samples_per_s"], *bounds.values()))
        assert r["fraction_of_ceiling"] == pytest.approx(r["samples_per_s"] / r["ceiling_samples_per_s"])
        if r["store"].startswith("raw"):  # stored at the output size: nothing to decode, a copy is the bound
            assert r["cpu_ceiling_samples_per_s"] == pytest.approx(
                limits["memory_copy_gb_per_s"] * 1e9 / OUTPUT_BYTES)
        else:
            assert r["cpu_ceiling_samples_per_s"] > 0


def test_cold_rows_say_whether_the_eviction_took(bench_run):
    results = bench_run[2]
    for r in results["rows"]:
        if r["cache"] == "warm":
            assert r["eviction_ok"] is None
            assert r["resident_before"] is None or r["resident_before"] > 0.99
        else:
            assert isinstance(r["eviction_ok"], bool)
            if results["machine"]["work_filesystem"] in REAL_DISKS:
                assert r["eviction_ok"] and r["resident_before"] < bench.EVICTED_BELOW


def test_machine_and_settings_are_recorded(bench_run):
    results = bench_run[2]
    machine = results["machine"]
    assert machine["usable_cores"] >= 1 and machine["memory_gib"] > 0 and machine["start_method"]
    assert set(machine["versions"]) >= {"torch", "pillow", "simplejpeg", "h5py", "lmdb", "webdataset"}
    assert machine["work_filesystem"] and results["command"].startswith("packer bench")
    assert results["settings"]["read_crop"] == 24 and results["settings"]["workers"] == [0]


def test_tune_writes_loader_json_that_make_loader_uses(tiny_folder, tmp_path, run_packer, capsys):
    dest = tmp_path / "ds"
    packer.pack(tiny_folder, dest, "lmdb", store="jpeg", resize=32, center_crop=24, progress=False)
    proc = run_packer("bench", "--tune", dest, "--workers", "0,1", "--batch-size", "4", "--prefetch-factors",
                      "2", "--read-resize", "none", "--read-crop", "none", "--quiet")
    assert proc.returncode == 0, proc.stderr
    data = json.loads((dest / "loader.json").read_text())
    results = data["measured"]["results"]
    threads = sorted({1, packer.system.usable_cores()})
    assert sorted((r["num_workers"], r["threads"], r["prefetch_factor"]) for r in results) == [
        *((0, t, 2) for t in threads), (1, 1, 2)]
    assert {r["batch_size"] for r in results} == {4}, "every config reads the same batch size"
    best = max(results, key=lambda r: r["samples_per_s"])
    assert "batch_size" not in data["loader"]
    assert {k: data["loader"][k] for k in ("num_workers", "prefetch_factor")} == {
        k: best[k] for k in ("num_workers", "prefetch_factor")}
    assert data["measured"]["samples_per_s"] == best["samples_per_s"] > 0

    loader = packer.make_loader(packer.open_dataset(dest))
    assert (loader.num_workers, loader.batch_size) == (best["num_workers"], 64), "batch_size is never tuned"
    prefetch = loader.prefetch_factor if best["num_workers"] else loader.prefetch_batches
    assert prefetch == best["prefetch_factor"]
    if best["num_workers"] == 0:
        assert loader.threads == best["threads"]
    assert "loader.json" in capsys.readouterr().err
    assert data["measured"]["plan"] == str(loader.plan)  # what make_loader now does with it, and why
    assert f"make_loader's plan from it: {loader.plan}" in proc.stdout


def _tuned(dest: Path, view: dict | None, **loader) -> None:
    (dest / "loader.json").write_text(json.dumps({"loader": loader, **({"view": view} if view else {})}))


@pytest.fixture
def tuned_dest(tiny_folder, tmp_path) -> Path:
    dest = tmp_path / "ds"
    packer.pack(tiny_folder, dest, "lmdb", store="raw", resize=32, center_crop=24, progress=False)
    return dest


def test_explicit_arguments_win_silently_and_the_line_names_only_what_applies(tuned_dest, capsys):
    from packer.loading.tuned import read_view

    _tuned(tuned_dest, read_view(packer.open_dataset(tuned_dest)), num_workers=0, threads=1, prefetch_factor=3,
           batch_size=5)
    ds = packer.open_dataset(tuned_dest)
    loader = packer.make_loader(ds)
    assert (loader.batch_size, loader.num_workers, loader.threads, loader.prefetch_batches) == (64, 0, 1, 3)
    err = capsys.readouterr().err
    assert "num_workers" in err and "prefetch_factor" in err and "batch_size" not in err
    loader = packer.make_loader(ds, batch_size=256, prefetch_batches=2)
    assert (loader.batch_size, loader.prefetch_batches, loader.threads) == (256, 2, 1)
    [line] = capsys.readouterr().err.splitlines()
    assert "prefetch_factor" not in line and "num_workers" not in line and "batch_size" not in line
    assert "'threads': 1" in line
    loader = packer.make_loader(ds, num_workers=0, threads=2, prefetch_batches=1)
    assert (loader.num_workers, loader.threads, loader.prefetch_batches) == (0, 2, 1)
    assert capsys.readouterr().err == "", "nothing tuned applies: nothing said"


def test_settings_tuned_for_another_view_are_not_applied(tuned_dest, capsys):
    from packer.loading.tuned import read_view

    _tuned(tuned_dest, read_view(packer.open_dataset(tuned_dest)), num_workers=0, prefetch_factor=3)
    cropped = packer.open_dataset(tuned_dest, random_resized_crop=16, flip=True)
    loader = packer.make_loader(cropped)
    assert loader.batch_size == 64 and not (loader.num_workers == 0 and loader.prefetch_batches == 3)
    [line] = capsys.readouterr().err.splitlines()
    assert "another view" in line and "random_resized_crop" in line and "packer bench --tune" in line


def test_tune_records_the_view_and_warns_when_its_figures_are_noise(tuned_dest, capsys):
    data = bench.tune(tuned_dest, workers=[0], prefetch_factors=[2], batch_size=4, samples=4, min_seconds=0,
                      read_resize=None, read_crop=24, pipeline="train", progress=False)
    # the train view: the random resized crop at the output size (the stored one, 24), with flips
    assert data["view"]["random_resized_crop"] == [24, 24] and data["view"]["flip"] is True
    assert data["measured"]["noise"] and "these figures are noise" in data["measured"]["noise"]
    assert f"packer: warning: {data['measured']['noise']}" in capsys.readouterr().err.splitlines()
    assert "WARNING: " in bench.format_tune(data, tuned_dest)
    plain = packer.make_loader(packer.open_dataset(tuned_dest))
    assert "another view" in capsys.readouterr().err and plain.batch_size == 64
    train = packer.make_loader(packer.open_dataset(tuned_dest, random_resized_crop=24, flip=True))
    assert "using tuned loader settings" in capsys.readouterr().err and train.num_workers == 0


def test_noise_warning_needs_two_batches_and_two_seconds_per_config():
    enough = {"batches": 40, "seconds": 3.0}
    assert bench.noise_warning([enough]) is None
    assert "noise" in bench.noise_warning([enough, {"batches": 1, "seconds": 5.0}])
    assert "1 batches in 5.00 s" in bench.noise_warning([enough, {"batches": 1, "seconds": 5.0}])
    assert bench.noise_warning([{"batches": 100, "seconds": 0.5}]).startswith("1 of 1 configs")


@pytest.mark.parametrize("args, message", [
    ((), "give the image folder SRC"),
    (("src", "--tune", "dest"), "not both"),
    (("src", "--store", "zip"), "unknown store"),
    (("src", "--workers", "0,x"), "whole numbers"),
    (("src", "--pipeline", "val,test"), "unknown pipeline test"),
])
def test_bad_arguments_are_one_line_errors(run_packer, tmp_path, args, message):
    proc = run_packer("bench", *args, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.startswith("packer: error:") and message in proc.stderr and "Traceback" not in proc.stderr


def test_train_pipeline_reads_with_random_resized_crop_and_flip(tiny_folder):
    """The train rows' datasets: the folder through Pillow (ImageFolder + torchvision's transforms), packed
    datasets with the default decoder; both crop to the output size."""
    target = bench.folder_target(tiny_folder, 32, 24)
    train = dataclasses.replace(target, pipeline="train").open()
    assert (train.decoder, train.random_resized_crop, train.flip) == ("pil", (24, 24), True)
    assert train.output_shape() == (24, 24, 3) == target.open().output_shape()
    assert bench.train_size(None, (40, 30)) == (30, 40)  # a WxH output is a (height, width) crop


def test_store_variants_parse():
    assert bench.parse_variant("jpeg", 256, 224) == bench.Variant("jpeg", 256, 224)
    assert bench.parse_variant("original", 256, 224) == bench.Variant("original")
    assert bench.parse_variant("jpeg:256", 256, 224) == bench.Variant("jpeg", 256, None)
    assert bench.parse_variant("raw:320x240/224").label == "raw 320x240/224"
    with pytest.raises(ValueError, match="cannot resize"):
        bench.parse_variant("original:256")


@pytest.mark.parametrize("shape, transform, expected", [
    ([224, 224, 3], {"resize": 256, "center_crop": [224, 224]}, (None, None)),  # stored at the output size
    (None, {"resize": 256, "center_crop": None}, (None, 224)),  # stored resized: crop only
    (None, {"resize": None, "center_crop": None}, (256, 224)),  # original: both
    ([200, 200, 3], {"resize": 200, "center_crop": [200, 200]}, (256, 224)),  # another size: both
])
def test_read_geometry_brings_every_dataset_to_the_output_size(shape, transform, expected):
    assert bench.read_geometry({"shape": shape, "transform": transform}, 256, 224) == expected


def test_rates_exclude_the_warm_up_batches():
    class Loader:
        def __init__(self, sizes):
            self.sizes = sizes

        def __len__(self):
            return len(self.sizes)

        def __iter__(self):
            import torch

            return iter([(torch.zeros(n, 3, 2, 2, dtype=torch.uint8), None) for n in self.sizes])

    first, second = bench.run_epochs(Loader([4, 4, 4, 4, 2]), epochs=2)
    assert (first.skipped_batches, first.samples, first.batches) == (2, 10, 5)
    assert (second.skipped_batches, second.samples) == (0, 18)
    assert first.decoded_bytes == 10 * 12
    short = bench.run_epochs(Loader([4, 4, 1]), epochs=1)[0]
    assert (short.skipped_batches, short.samples) == (1, 5), "at most half of a short epoch is skipped"
    assert math.isfinite(first.seconds) and first.seconds >= first.wait


def test_short_epochs_say_the_figures_are_not_meaningful(bench_run):
    """24 images in batches of 4: 6 batches an epoch."""
    proc, out, results = bench_run
    assert results["batches_per_epoch"] == 6
    [warning] = [w for w in results["warnings"] if "not meaningful" in w]
    assert warning.startswith("only 6 batches per epoch (fewer than 20)")
    assert "scripts/make_sample_data.py" in warning
    assert f"WARNING: {warning}" in proc.stdout.splitlines()
    assert f"WARNING: {warning}" in (out / "results.txt").read_text().splitlines()
    assert f"**Warning:** {warning}" in (out / "results.md").read_text()


def test_load_average_is_printed_at_the_start_and_recorded_at_both_ends(bench_run):
    proc, out, results = bench_run
    load = results["load_average"]
    cores = results["machine"]["usable_cores"]
    assert len(load["start"]) == len(load["end"]) == 3 and load["usable_cores"] == cores
    start, end = (", ".join(f"{v:.2f}" for v in load[k]) for k in ("start", "end"))
    assert proc.stdout.splitlines()[0] == f"load average at the start (1, 5, 15 min): {start}, on {cores} usable cores"
    assert load["busy"] == (load["start"][0] > cores or load["end"][0] > 2 * cores)
    assert ("figures taken on a busy machine are not publishable" in proc.stdout) == load["busy"]
    assert f"load average (1, 5, 15 min): {start} at the start, {end} at the end" in (out / "results.txt").read_text()


def test_repeats_report_the_median_of_their_runs(tiny_folder, tmp_path):
    """Three runs per row with a fresh loader each; 24 batches of 1 an epoch, so no short-epoch warning."""
    bench.run_bench(tiny_folder, formats=["lmdb"], stores=["raw:32/24"], workers=[0], epochs=1, caches=["warm"],
                    batch_size=1, repeats=3, read_resize=32, read_crop=24, pipelines=["val"], limits=False,
                    out=tmp_path, progress=False)
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["settings"]["repeats"] == 3 and results["batches_per_epoch"] == 24
    assert [(r["dataset"], r["repeats"]) for r in results["rows"]] == [("folder", 3), ("lmdb", 3)]
    for r in results["rows"]:
        assert len(r["samples_per_s_runs"]) == 3
        assert r["samples_per_s"] == statistics.median(r["samples_per_s_runs"])
        assert r["mb_per_s_read"] == pytest.approx(r["samples_per_s"] * r["bytes_per_sample_read"] / 1e6)
    assert not any("not meaningful" in w for w in results["warnings"])
    assert "each figure is the median of 3 runs" in (tmp_path / "results.txt").read_text()


def test_chart_shows_the_default_loader_beside_the_most_worker_processes():
    rows = [{"workers": w} for w in (0, 1, 2)]
    assert bench.chart_workers(rows) == [0, 2]
    assert bench.chart_workers(rows[:1]) == [0]
    assert bench.chart_workers(rows[1:]) == [2]


def test_decode_ceiling_decodes_as_the_reader_does(tiny_folder, tmp_path):
    """The ceiling's decode is the reader's own: the same pixels as reading the sample."""
    dest = tmp_path / "ds"
    packer.pack(tiny_folder, dest, "wds", store="jpeg", resize=32, progress=False)
    ds = packer.open_dataset(dest, center_crop=24)
    for i in (0, 5, 23):
        payload, _ = ds.raw_sample(i)
        out = decode_like_reader(ds, payload, i, np.empty((24, 24, 3), np.uint8))
        assert np.array_equal(out, ds[i][0].permute(1, 2, 0).numpy())


def test_shuffle_quality_section_compares_the_orders(bench_run):
    _, out, results = bench_run
    orders = {row["order"]: row["mixing"] for row in results["shuffle_quality"]["rows"]}
    # 2 classes packed in class order, batch 4: every batch but the one across the classes holds one class
    assert orders["packed order (no shuffle)"] > 0.4
    assert orders["make_loader(shuffle=True)"] < orders["packed order (no shuffle)"]
    assert "## Shuffle quality" in (out / "results.md").read_text()


def test_first_screen_says_what_to_use_and_how_much_faster_before_the_table(bench_run):
    proc, out, results = bench_run
    lines = proc.stdout.splitlines()
    for pipeline in ("val", "train"):
        steady = [r for r in results["rows"] if r["pipeline"] == pipeline and r["cache"] == "warm"]
        best = max((r for r in steady if r["dataset"] != "folder"), key=lambda r: r["samples_per_s"])
        folder = max((r for r in steady if r["dataset"] == "folder"), key=lambda r: r["samples_per_s"])
        ratio = best["samples_per_s"] / folder["samples_per_s"]
        [line] = [x for x in lines if x.startswith("Use: ") and f"[{pipeline}: " in x]
        slower = f"{ratio:.2f}x your folder (slower: the folder is faster here)"
        times = f"{ratio:.1f}x your folder" if ratio >= 1 else slower
        assert line.startswith(f"Use: {best['dataset']}, store {best['store']}, in-process loader "
                               f"({best['threads']} threads): {times} "
                               f"({best['samples_per_s']:,.0f} img/s vs {folder['samples_per_s']:,.0f}, ")
        assert lines.index(line) < lines.index(next(x for x in lines if x.startswith("machine: ")))
    chart = results["chart"]
    if importlib.util.find_spec("matplotlib") is None:
        assert chart is None
        assert "no chart: matplotlib is not installed; pip install matplotlib draws one" in lines
    else:
        assert f"chart: {chart}" in lines and Path(chart).exists()
    assert lines[1].startswith("Use: ") and "Use: " in (out / "results.txt").read_text().splitlines()[0]


def test_each_row_and_the_first_screen_name_the_loader_plan(bench_run):
    proc, _, results = bench_run
    for row in results["rows"]:  # --workers 0: make_loader's in-process loader, and why it was chosen
        assert row["engine"] == "threads" and row["plan"].startswith(f"threads: {row['threads']} decode thread")
        assert "engine: num_workers=0 given" in row["plan"]
    lines = proc.stdout.splitlines()
    use = next(i for i, line in enumerate(lines) if line.startswith("Use: "))
    assert lines[use + 1].startswith("  its loader: threads: ")


def test_summary_picks_the_fastest_packed_row_against_the_folder_at_its_fastest():
    def row(dataset, store, workers, rate, cache="warm", epoch=2):
        return {"dataset": dataset, "store": store, "pipeline": "val", "workers": workers, "threads": 2,
                "cache": cache, "epoch": epoch, "samples_per_s": rate}

    rows = [row("folder", "files", 0, 150.0), row("folder", "files", 2, 202.0), row("lmdb", "jpeg", 0, 900.0),
            row("lmdb", "jpeg", 2, 1234.0), row("wds", "raw", 2, 1100.0), row("hdf5", "raw", 2, 5000.0, epoch=1),
            row("hdf5", "raw", 2, 9000.0, cache="cold", epoch=1), row("folder", "files", 2, 50.0, "cold", 1)]
    choice = bench.best_choice(rows, "val")
    assert (choice["row"]["dataset"], choice["row"]["workers"], choice["folder"]["workers"]) == ("lmdb", 2, 2)
    assert choice["ratio"] == pytest.approx(1234 / 202)
    [line] = bench.summary_lines({"rows": rows})
    assert line.startswith("Use: lmdb, store jpeg, 2 worker processes: 6.1x your folder (1,234 img/s vs 202, "
                           "the folder's fastest: 2 worker processes) [val: ")
    slower = [r for r in rows if r["dataset"] == "folder" or r["samples_per_s"] < 200]
    assert "0.74x your folder (slower: the folder is faster here)" in bench.summary_lines(
        {"rows": [*slower, row("wds", "raw", 0, 150.0)]})[0]
    cold = bench.best_choice([r for r in rows if r["cache"] == "cold"], "val")
    assert cold["ratio"] == pytest.approx(9000 / 50)
    assert bench.summary_lines({"rows": rows, "chart": None})[1] == (
        "no chart: matplotlib is not installed; pip install matplotlib draws one")
