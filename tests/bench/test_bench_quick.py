"""``packer bench SRC``, the quick default: the verdict first (a command that packs when pasted), rows as they finish,
figures read for a minimum time, waits per batch, results.json and ``--compare``. Never a timing against a number."""

from __future__ import annotations

import copy
import io
import itertools
import json
import os
import re
import shlex
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import write_image

import packer
from packer import bench
from packer.bench.chart import comparable_ceiling
from packer.bench.compare import compare_lines
from packer.bench.live import LiveTable
from packer.bench.measure import Pass, add_drift, spread
from packer.bench.passes import pass_figures
from packer.bench.quick import fitting, raw_bytes
from packer.bench.verdict import verdict

FORMATS = ("lmdb", "hdf5", "wds")
STORES = ("jpeg 32/24", "raw 32/24")
QUICK = ("--resize", "32", "--center-crop", "24", "--read-resize", "32", "--read-crop", "24", "--batch-size", "4",
         "--min-seconds", "0.05")


def stream_packer(*args: str | os.PathLike, cwd: Path) -> tuple[str, list[tuple[str, bool]], int]:
    """Run the CLI with its output piped: stdout, each stderr line with whether the process was still running when
    the line was read, and the exit code."""
    env = dict(os.environ, PYTHONIOENCODING="utf-8")
    proc = subprocess.Popen([sys.executable, "-m", "packer", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, encoding="utf-8", cwd=cwd, env=env)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.append(proc.stdout.read()))
    reader.start()
    lines = [(line.rstrip("\n"), proc.poll() is None) for line in proc.stderr]
    reader.join()
    return out[0], lines, proc.wait(timeout=300)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """24 small images of varied sizes in 2 classes, one of them a PNG."""
    root = tmp_path_factory.mktemp("quick") / "src"
    for i in range(24):
        write_image(root / f"{('ant', 'bee')[i % 2]}/{i:02d}.{'png' if i == 5 else 'jpg'}", width=40 + i,
                    height=36 + 3 * (i % 5), seed=i)
    return root


@pytest.fixture(scope="module")
def quick(folder):
    """``packer bench src`` with the defaults but tiny sizes and a short minimum time, run in src's parent."""
    stdout, stderr, code = stream_packer("bench", "src", *QUICK, "--out", "out", cwd=folder.parent)
    assert code == 0, "\n".join(line for line, _ in stderr)
    return stdout, stderr, json.loads((folder.parent / "out" / "results.json").read_text())


@pytest.mark.slow
def test_the_verdict_comes_first_and_its_command_packs_when_pasted(quick, folder, run_packer):
    stdout, _, results = quick
    lines = stdout.splitlines()
    assert lines[0].startswith("Pack with: packer pack src ")
    command = lines[0].removeprefix("Pack with: ")
    assert command == results["verdict"]["command"]
    choice = results["verdict"]["choice"]
    words = shlex.split(command)
    assert words[:3] == ["packer", "pack", "src"] and words[3] == f"src-{choice['dataset']}-{choice['store_mode']}"
    proc = run_packer(*words[1:], "--quiet", cwd=folder.parent)  # the command as pasted in the folder bench ran in
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((folder.parent / words[3] / "manifest.json").read_text())
    assert (manifest["format"], manifest["store"], manifest["count"]) == (choice["dataset"], choice["store_mode"], 24)
    verdict_block = lines[:lines.index("")]
    for start in ("  training (random resized crop + flip): ", "  validation (resize + centre crop): ",
                  "  on disk: ", "  if disk is short: ", "  workers: "):
        assert any(line.startswith(start) for line in verdict_block), start
    assert verdict_block == results["verdict"]["lines"] + [f"WARNING: {w}" for w in results["warnings"]]


@pytest.mark.slow
def test_rows_stream_on_stderr_as_they_finish_when_piped(quick):
    stdout, stderr, results = quick
    lines = [line for line, _ in stderr]
    header = next(i for i, line in enumerate(lines) if line.startswith("dataset "))
    rows = lines[header + 2:header + 2 + len(results["rows"])]
    assert len(rows) == len(results["rows"])
    for line, row in zip(rows, results["rows"], strict=True):
        assert line.split()[:2] == [row["dataset"], row["store"].split()[0]]
    assert stderr[header + 2][1], "the first row was printed while the benchmark was still running"
    assert not any("\x1b" in line or "\r" in line for line in lines), "plain lines when piped: nothing redrawn"
    table = stdout.splitlines()
    assert any(line.startswith("dataset ") for line in table), "stdout keeps the whole table under the verdict"


@pytest.mark.slow
def test_every_format_and_store_is_read_warm_and_cold_for_training_and_validation(quick):
    results = quick[2]
    rows = results["rows"]
    default = results["settings"]["default_workers"]
    keys = sorted((r["dataset"], r["store"], r["pipeline"], r["cache"]) for r in rows if r["workers"] == default)
    expected = [(d, s, p, c) for d, s in [("folder", "files"), *((f, s) for f in FORMATS for s in STORES)]
                for p in ("train", "val") for c in ("warm", "cold")]
    assert keys == sorted(expected)
    sweep = [r for r in rows if r["workers"] != default]
    choice = results["verdict"]["choice"]
    assert [(r["dataset"], r["store"], r["pipeline"], r["cache"], r["workers"]) for r in sweep] == [
        (choice["dataset"], choice["store"], "train", "warm", n) for n in bench.sweep_workers(default)]
    for r in rows:
        assert r["samples_per_s"] > 0 and r["samples"] > 0 and r["seconds"] > 0
        assert r["wait_p50_ms"] <= r["wait_p95_ms"] <= r["wait_max_ms"]
        assert r["data_stall"] is None, "no step without --step-ms"
        if r["cache"] == "warm":  # 6 batches an epoch: the figure repeated the dataset's epochs in one loader
            assert r["epochs_read"] > 1 and r["passes"] >= 1
        else:
            assert r["eviction_ok"] is not None


@pytest.mark.slow
def test_results_json_keeps_every_figure_with_machine_command_load_and_versions(quick):
    results = quick[2]
    assert results["mode"] == "quick" and results["command"].startswith("packer bench src ")
    assert set(results["machine"]["versions"]) >= {"torch", "numpy", "pillow", "simplejpeg", "h5py", "lmdb"}
    assert len(results["load_average"]["start"]) == len(results["load_average"]["end"]) == 3
    for key in ("samples_per_s", "noise", "samples_per_s_parts", "wait_p50_ms", "wait_p95_ms", "wait_max_ms",
                "waits_ms", "batches", "seconds", "speedup_vs_folder", "bytes_on_disk", "plan"):
        assert all(key in r for r in results["rows"]), key
    assert {(c["dataset"], c["store"]) for c in results["conversions"]} == {(f, s) for f in FORMATS for s in STORES}
    assert results["machine_drift"] is not None  # each validation dataset's ceiling was taken beside its 2 figures
    for r in results["rows"]:
        assert r["noise"] is None or r["noise"] >= r["noise_within"]


@pytest.mark.slow
def test_short_cold_epochs_are_warned_about_with_the_reason(quick):
    """6 batches an epoch: a cold epoch is mostly its start, which the warning says; warm figures are not warned
    about, since they repeat epochs."""
    stdout, _, results = quick
    [cold] = [w for w in results["warnings"] if "cold figures" in w]
    assert cold.startswith("the cold figures read epochs of 6 batches of 4: the start of each")
    assert f"WARNING: {cold}" in stdout.splitlines()
    assert not any("not meaningful" in w for w in results["warnings"])


@pytest.mark.slow
def test_step_ms_reports_the_share_of_the_step_spent_waiting(folder, tmp_path, run_packer):
    """And --images: a sample of the folder measured, the verdict's command still packing all of it."""
    proc = run_packer("bench", folder, *QUICK, "--formats", "hdf5", "--store", "jpeg", "--cache", "warm",
                      "--step-ms", "5", "--no-limits", "--images", "12", "--out", tmp_path, "--quiet")
    assert proc.returncode == 0, proc.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    assert (results["source"]["images"], results["source"]["all_images"]) == (12, 24)
    assert results["conversions"][0]["images"] == 12
    assert results["verdict"]["command"].split()[2] == str(folder)
    [size] = [line for line in results["verdict"]["lines"] if line.startswith("  on disk: ")]
    assert " for the 12 images measured: about " in size and size.endswith(" for all 24")
    for r in results["rows"]:
        assert 0 <= r["data_stall"] <= 1 and r["step_ms"] == 5
        assert r["wait_p50_ms"] <= r["wait_p95_ms"] <= r["wait_max_ms"]
    table = proc.stdout.splitlines()
    assert any("step waits" in line and "wait p50 ms" in line and "p95 ms" in line for line in table)
    [workers] = [line for line in table if line.startswith("  workers: ")]
    assert "5 ms step" in workers and ("would not wait" in workers or "even with" in workers)
    assert proc.stderr == "", "--quiet: no live table"


@pytest.mark.slow
def test_compare_prints_what_changed_beyond_the_noise(quick, folder, tmp_path, run_packer):
    out = folder.parent / "out"
    same = run_packer("bench", "--compare", out, out / "results.json")
    assert same.returncode == 0, same.stderr
    rows = len(quick[2]["rows"])
    assert f"{rows} of {rows} rows within noise" in same.stdout.splitlines()
    assert "machine and package versions: the same" in same.stdout
    before = copy.deepcopy(quick[2])
    before["rows"][0]["noise_within"] = 0.02  # a figure measured to within 2%
    changed = copy.deepcopy(before)
    row = changed["rows"][0]
    row["samples_per_s"] *= 3
    changed["machine"]["versions"]["torch"] = "0.0-other"
    (tmp_path / "a.json").write_text(json.dumps(before))
    (tmp_path / "results.json").write_text(json.dumps(changed))
    proc = run_packer("bench", "--compare", tmp_path / "a.json", tmp_path)
    key = " ".join(map(str, (row["dataset"], row["store"], row["pipeline"], row["cache"], row["workers"])))
    [line] = [x for x in proc.stdout.splitlines() if x.startswith(key)]
    assert "+200.0%" in line and line.endswith("faster, beyond noise")
    assert f"torch: {quick[2]['machine']['versions']['torch']} | 0.0-other" in proc.stdout
    bad = run_packer("bench", "--compare", out, tmp_path / "nothing.json")
    assert bad.returncode == 2 and bad.stderr.startswith("packer: error:") and "nothing.json" in bad.stderr


@pytest.mark.slow
def test_full_still_measures_the_matrix_and_compares_with_the_quick_rows(quick, folder, tmp_path, run_packer):
    proc = run_packer("bench", folder, "--full", "--formats", "hdf5", "--store", "jpeg:32/24", "--workers",
                      str(quick[2]["settings"]["default_workers"]), "--epochs", "2", "--repeats", "1",
                      "--pipeline", "train", "--cache", "warm", "--no-limits", "--disk-test-mb", "0",
                      "--resize", "32", "--center-crop", "24", "--read-resize", "32", "--read-crop", "24",
                      "--batch-size", "4", "--out", tmp_path, "--quiet")
    assert proc.returncode == 0, proc.stderr
    full = json.loads((tmp_path / "results.json").read_text())
    assert sorted((r["dataset"], r["epoch"]) for r in full["rows"]) == [
        ("folder", 1), ("folder", 2), ("hdf5", 1), ("hdf5", 2)]
    lines = compare_lines(quick[2], full)
    assert any(re.fullmatch(r"[012] of 2 rows within noise", line) for line in lines), "the folder's row and hdf5's"
    assert any(line.startswith("hdf5 jpeg 32/24 train warm") for line in lines)


@pytest.mark.parametrize("args, message", [
    (("src", "--epochs", "2"), "--epochs: only with --full"),
    (("src", "--repeats", "3"), "--repeats: only with --full"),
    (("src", "--full", "--min-seconds", "2"), "--min-seconds: only without --full"),
    (("--compare", "a"), "--compare"),
    (("src", "--compare", "a", "b"), "alone"),
])
def test_options_of_the_other_mode_are_one_line_errors(run_packer, tmp_path, args, message):
    proc = run_packer("bench", *args, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.startswith("packer: error:") and message in proc.stderr and "Traceback" not in proc.stderr


def test_raw_is_left_out_where_it_would_not_fit_the_disk(tmp_path):
    jpeg, raw = bench.parse_variant("jpeg", 256, 224), bench.parse_variant("raw", 256, 224)
    assert raw_bytes(raw, 1000, 0) == 1000 * 224 * 224 * 3
    kept, skipped = fitting([jpeg, raw], FORMATS, 10, 10_000, tmp_path)
    assert (kept, skipped) == ([jpeg, raw], [])
    kept, skipped = fitting([jpeg, raw], FORMATS, 10**9, 10**12, tmp_path)  # 150 TB of pixels a format
    assert kept == [jpeg] and len(skipped) == 1
    assert skipped[0].startswith("store raw 256/224: 3 packs of about 150528.00 GB would not fit the ")


def test_each_row_s_noise_adds_how_much_the_machine_moved_between_figures():
    """The decode-ceiling rounds taken beside a run's figures move as the machine's speed does: their pooled spread
    is the run's drift, which each row's noise combines with the row's own spread; applied again (a later
    --compare reading the run), nothing changes."""
    results = {"limits": {"decode": {"a": {"rounds": [90.0, 110.0]}, "b": {"rounds": [100.0, 100.0]},
                                     "c": {"kind": "memcpy", "samples_per_s": None}}},
               "rows": [{"noise": 0.03}, {"noise": None}]}
    add_drift(results)
    assert results["machine_drift"] == pytest.approx(0.1)  # spreads 0.1414 and 0: their root mean square
    assert results["rows"][0]["noise"] == pytest.approx((0.03**2 + 0.1**2) ** 0.5)
    assert results["rows"][0]["noise_within"] == 0.03 and results["rows"][1]["noise"] is None
    again = copy.deepcopy(results)
    add_drift(again)
    assert again == results
    unmeasured = {"limits": {}, "rows": [{"noise": 0.03}]}  # --no-limits: no rounds, the row's own noise alone
    add_drift(unmeasured)
    assert unmeasured["machine_drift"] is None and unmeasured["rows"][0]["noise"] == 0.03


def test_a_rate_is_warned_about_for_what_moved_while_it_was_measured_and_the_run_for_its_drift():
    from packer.bench.report import quick_warnings

    def warnings(within: float, drift: float | None) -> list[str]:
        row = _row("hdf5", "jpeg 256/224", 5000, 300, noise=within, batches=40, seconds=1.0)
        results = {"rows": [row], "settings": {"batch_size": 64}, "source": {"images": 2000},
                   "load_average": {"busy": False}, "limits": {"decode": {"k": {"rounds": [1 - drift, 1 + drift]}}}
                   if drift else {}}
        add_drift(results)
        return quick_warnings(results)

    assert warnings(0.10, 0.0) == []
    assert warnings(0.20, 0.1) == [], "within 25% while measured: the drift is in its ± (and --compare's), not warned"
    [moved] = warnings(0.30, None)
    assert moved.startswith("1 rates moved by more than ±25% while measured") and "±30%" in moved
    [drifted] = warnings(0.10, 0.3)  # rounds 0.7 and 1.3: a spread of 42%
    assert drifted.startswith("the machine's speed moved by ±42% between figures")


def _row(dataset, store, rate, size, pipeline="train", cache="warm", workers=2, noise=0.02, **extra):
    return {"dataset": dataset, "store": store, "store_mode": store.split()[0], "pack_resize": 256, "pack_crop": 224,
            "pipeline": pipeline, "cache": cache, "workers": workers, "epoch": None, "samples_per_s": rate,
            "noise": noise, "bytes_on_disk": size, "wait_p95_ms": 1.0, **extra}


def _results(rows, step_ms=0.0):
    return {"rows": rows, "source": {"bytes": 1000}, "settings": {"default_workers": 2, "src_given": "my photos",
                                                                    "batch_size": 64, "step_ms": step_ms}}


def test_verdict_takes_the_fastest_for_training_and_the_next_best_if_disk_is_short():
    rows = [_row("folder", "files", 100, 1000), _row("hdf5", "raw 256/224", 5000, 9000),
            _row("lmdb", "raw 256/224", 4000, 9100), _row("hdf5", "jpeg 256/224", 1500, 300),
            _row("wds", "jpeg 256/224", 1400, 320), _row("folder", "files", 200, 1000, pipeline="val"),
            _row("hdf5", "raw 256/224", 9000, 9000, pipeline="val"), _row("hdf5", "jpeg 256/224", 3000, 300, "val"),
            _row("hdf5", "raw 256/224", 2500, 9000, workers=1)]
    lines = verdict(_results(rows))["lines"]
    assert lines[0] == ("Pack with: packer pack 'my photos' 'my photos-hdf5-raw' --format hdf5 --store raw "
                        "--resize 256 --center-crop 224")
    assert lines[1] == "  training (random resized crop + flip): 50.0x the folder (5,000 img/s against 100) warm"
    assert lines[2].startswith("  validation (resize + centre crop): 45.0x the folder (9,000 img/s against 200)")
    assert lines[3] == "  on disk: 9.0 KB, 9.00x the folder's 1.0 KB"
    assert lines[4].startswith("  if disk is short: packer pack 'my photos' 'my photos-hdf5-jpeg' --format hdf5 "
                               "--store jpeg --resize 256 --center-crop 224 (")
    assert "train 15.0x the folder" in lines[4] and "val 15.0x the folder" in lines[4]
    assert lines[5].startswith("  workers: a training step of 25.6 ms or more with 1, 12.8 ms or more with 2 workers")


def test_within_their_noise_the_smaller_on_disk_is_chosen():
    rows = [_row("folder", "files", 100, 1000), _row("hdf5", "raw 256/224", 5000, 9000, noise=0.1),
            _row("hdf5", "jpeg 256/224", 4600, 300, noise=0.1)]
    assert verdict(_results(rows))["choice"]["store"] == "jpeg 256/224"
    rows[2]["noise"] = 0.01
    rows[1]["noise"] = 0.01
    assert verdict(_results(rows))["choice"]["store"] == "raw 256/224", "a difference beyond the noise decides"


def test_with_a_step_the_verdict_names_the_fewest_workers_that_do_not_wait():
    rows = [_row("folder", "files", 100, 1000, data_stall=0.5), _row("hdf5", "jpeg 256/224", 900, 300,
                                                                      data_stall=0.01, workers=2),
            _row("hdf5", "jpeg 256/224", 500, 300, data_stall=0.3, workers=1)]
    [line] = [x for x in verdict(_results(rows, step_ms=40))["lines"] if x.startswith("  workers:")]
    assert line.startswith("  workers: with 2 the GPU would not wait: a 40 ms step waits for data 1.0% of the time")
    rows[1]["data_stall"] = 0.2
    [line] = [x for x in verdict(_results(rows, step_ms=40))["lines"] if x.startswith("  workers:")]
    assert line.startswith("  workers: even with 2 a 40 ms step waits for data 20% of the time")


def test_the_chart_draws_a_decode_ceiling_only_over_the_bar_it_compares_with():
    row = {"cache": "warm", "ceiling_kind": "decode", "workers": 2, "cpu_ceiling_samples_per_s": 900.0}
    assert comparable_ceiling(row, 2) == 900.0
    assert comparable_ceiling({**row, "workers": 1}, 2) is None, "the ceiling is every core's: not one worker's"
    assert comparable_ceiling({**row, "cache": "cold"}, 2) is None
    assert comparable_ceiling({**row, "ceiling_kind": "memcpy"}, 2) is None
    assert comparable_ceiling({**row, "ceiling_kind": None}, 2) is None


def test_the_live_table_redraws_on_a_terminal_and_prints_plain_lines_elsewhere():
    columns = [("dataset", "dataset", "{}"), ("store", "store", "{}"), ("samples_per_s", "img/s", "{:,.0f}")]
    row = {"dataset": "hdf5", "store": "jpeg", "samples_per_s": 1234.0}
    plain = io.StringIO()
    table = LiveTable(columns, [7, 5, 6], plain, tty=False)
    table.status("measuring")
    table.add(row)
    table.add({**row, "dataset": "wds"})
    table.close()
    assert plain.getvalue().splitlines() == ["dataset  store   img/s", "-------  -----  ------",
                                             "hdf5     jpeg    1,234", "wds      jpeg    1,234"]
    screen = io.StringIO()
    table = LiveTable(columns, [7, 5, 6], screen, tty=True)
    table.status("measuring hdf5")
    table.add(row)
    drawn = screen.getvalue()
    assert drawn == ("measuring hdf5\n\x1b[1A\r\x1b[J"  # the status line, then redrawn with the row above it
                     "dataset  store   img/s\n-------  -----  ------\nhdf5     jpeg    1,234\nmeasuring hdf5\n")
    table.close()
    assert screen.getvalue().endswith("\x1b[4A\r\x1b[J"), "erased: the report prints the table under the verdict"
    quiet = io.StringIO()
    LiveTable(columns, [7, 5, 6], quiet, enabled=False, tty=True).add(row)
    assert quiet.getvalue() == ""


def test_a_pasted_command_quotes_what_the_shell_would_split():
    row = {"dataset": "wds", "store_mode": "jpeg", "pack_resize": (320, 240), "pack_crop": 224}
    command = bench.pack_command("/data/my set", row)
    assert shlex.split(command) == ["packer", "pack", "/data/my set", "/data/my set-wds-jpeg", "--format", "wds",
                                    "--store", "jpeg", "--resize", "320x240", "--center-crop", "224"]
    assert packer.bench.pack_command("photos/", row).split()[3] == "photos-wds-jpeg"


def _pass(gaps: list[float], batch: int = 64) -> Pass:
    """A pass whose batches arrived ``gaps`` seconds apart."""
    arrivals = list(itertools.accumulate(gaps))
    return Pass(sizes=[batch] * len(gaps), arrivals=arrivals, waits=list(gaps), starts=[0.0] * len(gaps))


def test_a_figure_s_parts_last_long_enough_to_time_the_machine_not_a_burst():
    """A pass of 60 batches 10 ms apart whose last 8 (prefetched) arrive together as it drains: at the machine's
    steady speed throughout. Parts of about PART_SECONDS keep the burst inside a part long enough to dilute it,
    below the bench's ±25% warning; parts of a tenth of a second timed it as the machine's speed moving."""
    steady = _pass([0.01] * 52 + [0.0005] * 8)
    parts, tenths = steady.chunk_rates(skip=2), steady.chunk_rates(skip=2, part_seconds=0.0)
    assert len(parts) == 2 and len(tenths) == 5
    assert sum(64 * 29 / rate for rate in parts) == pytest.approx(steady.span(skip=2)[1])  # the timed span, in parts
    assert spread(parts) < 0.25 < spread(tenths)


def test_a_pass_shorter_than_two_parts_is_one_part_its_whole_rate():
    short = _pass([0.01] * 20)
    assert short.chunk_rates(skip=2) == [pytest.approx(short.rate(skip=2))]


def test_passes_too_short_to_split_are_timed_together():
    """A fast row's passes of 18 ms each (1,152 images at 64,000 img/s), one delayed by 20 ms (a hiccup of the
    scheduler): consecutive passes make parts of at least PART_SECONDS (13 passes with the hiccup, then 14; the
    13 left over make no part of their own), so the noise is the machine's over a quarter second."""
    passes = [_pass([0.001] * 20) for _ in range(40)]
    passes[7] = _pass([0.001] * 19 + [0.021])
    figures = pass_figures(passes, [], skip=2)
    parts = figures["samples_per_s_parts"]
    assert len(parts) == 2 and parts[1] == pytest.approx(64_000) and parts[0] == pytest.approx(13 * 1152 / 0.254)
    assert figures["noise"] < 0.1
    assert figures["samples_per_s"] == pytest.approx(40 * 1152 / (40 * 0.018 + 0.02))  # every pass still counts
