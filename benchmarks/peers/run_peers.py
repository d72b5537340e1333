"""Benchmark packer against the tools users would pick instead, side by side, in one run.

Each peer (Hugging Face ``datasets``, MosaicML Streaming, LitData, ``webdataset``, torchvision's ImageFolder,
FFCV) is installed only for this benchmark, in its own venv under ``--venvs`` so their pins never meet, and
measured by a small adapter script (``adapters/<peer>.py``) run in that venv: it packs the same folder with the
peer's own writer and reads it back through the peer's own reader, with the same batch size, workers and final
output (uint8 224x224) as packer's rows. A peer that cannot be installed or run is reported with its error and
skipped; no row is ever made up. packer's own rows run in this interpreter.

    python benchmarks/peers/run_peers.py FOLDER                 # every peer, results in bench-out/peers
    python benchmarks/peers/run_peers.py --per-class 600        # make a 3000-image folder first, then run
    python benchmarks/peers/run_peers.py FOLDER --peers packer,datasets --update-readme
    python benchmarks/peers/run_peers.py FOLDER --pipeline train --repeats 1   # training rows only, once each

Two pipelines: ``val`` (resize 256 + centre crop 224) and ``train`` (RandomResizedCrop 224 + horizontal flip);
each row's "x baseline" is against torchvision's ImageFolder row of the same pipeline in the same run. Each row
is read ``--repeats`` times and its median reported. The load average is taken at the start and the end: a run
where it exceeded the core count is marked not publishable, and ``--update-readme`` then refuses (``--force``
overrides).

See benchmarks/peers/README.md for what each adapter does and how each number is measured.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
ADAPTERS = HERE / "adapters"
sys.path.insert(0, str(HERE))

import report  # noqa: E402 - beside this script, found through the path set above

# What every venv gets first. torch 2.13.0 (CPU) is the project's; peers that need torchvision get the pair that
# installs together from this machine's wheels (the CPU torch 2.13 has no matching torchvision wheel).
BASE = ["numpy", "pillow", "psutil"]
TORCH = ["torch==2.13.0", *BASE]
TORCHVISION = ["torch==2.14.1", "torchvision==0.29.1", *BASE]
RECIPE = ".peer-recipe.json"


@dataclass
class Peer:
    """A tool to compare: how to install it and which adapter measures it."""

    name: str
    adapter: str
    steps: list[list[str]] = field(default_factory=list)  # pip installs in order; [] runs in this interpreter
    apt: list[str] = field(default_factory=list)  # Debian packages its build needs
    pkgconfig: list[str] = field(default_factory=list)  # pkg-config names that show those are present
    env: dict[str, str] = field(default_factory=dict)


PEERS: dict[str, Peer] = {p.name: p for p in [
    Peer("packer", "packer_rows.py"),
    Peer("folder", "folder_pil.py"),
    Peer("torchvision", "tv_imagefolder.py", [TORCHVISION]),
    # the training rows use torchvision's RandomResizedCrop, as the library's users would: torch 2.14.1 + torchvision
    Peer("datasets", "hf_datasets.py", [TORCHVISION, ["datasets==5.2.0"]]),
    # Streaming 0.13 pulls torchvision (and an older huggingface-hub than datasets 5): its own venv, torch 2.14.1
    Peer("streaming", "mosaic_streaming.py", [TORCHVISION, ["mosaicml-streaming==0.13.0"]]),
    # LitData decodes images with torchvision, whose PyPI wheels do not load beside the CPU torch 2.13
    Peer("litdata", "lit_data.py", [TORCHVISION, ["litdata==0.2.76"]]),
    Peer("webdataset", "wds_official.py", [TORCHVISION, ["webdataset==1.0.2"]]),
    # FFCV has no wheels: pip builds it against OpenCV and libjpeg-turbo (pkg-config finds them); it imports
    # Pillow without declaring it (in BASE)
    Peer("ffcv", "ffcv_beton.py", [TORCH, ["ffcv==1.0.2"]],
         apt=["libopencv-dev", "libturbojpeg0-dev", "pkg-config"], pkgconfig=["opencv4", "libturbojpeg"]),
]}


class SkipPeer(Exception):
    """The peer cannot be measured here; the message says exactly why."""


# -- venvs ----------------------------------------------------------------------------------------------------

def _tail(text: str, lines: int = 15) -> str:
    """The last lines of pip/apt output, without pip's noise about the local index folders."""
    kept = [line for line in text.splitlines() if line.strip() and "is ignored: it is neither" not in line]
    return "\n".join(kept[-lines:])


def _run(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run ``cmd`` with its output streaming into ``log``; its exit code and the tail of what it printed."""
    with open(log, "a") as f:
        f.write(f"$ {shlex.join(cmd)}\n")
        f.flush()
        start = f.tell()
        code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    with open(log) as f:
        f.seek(start)
        return code, _tail(f.read())


def ensure_system_packages(peer: Peer, log: Path, allow_apt: bool) -> None:
    """Make sure the build dependencies pkg-config should find are there, installing them with apt if allowed."""
    if not peer.pkgconfig:
        return

    def found() -> bool:
        return shutil.which("pkg-config") is not None and subprocess.run(
            ["pkg-config", "--exists", *peer.pkgconfig], capture_output=True).returncode == 0

    if found():
        return
    if not allow_apt or os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise SkipPeer(f"needs the Debian packages {' '.join(peer.apt)} (pkg-config: {' '.join(peer.pkgconfig)}); "
                       f"run: apt-get install -y {' '.join(peer.apt)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", *peer.apt]):
        code, tail = _run(cmd, log, env)
        if code != 0:
            raise SkipPeer(f"`{shlex.join(cmd)}` failed:\n{tail}")
    if not found():
        raise SkipPeer(f"installed {' '.join(peer.apt)} but pkg-config still cannot find {' '.join(peer.pkgconfig)}")


def ensure_venv(peer: Peer, venvs: Path, log: Path, allow_apt: bool, reinstall: bool) -> tuple[str, float]:
    """The peer's python (made and installed if its recipe changed) and the seconds spent installing."""
    if not peer.steps:
        if importlib.util.find_spec("packer") is None:
            raise SkipPeer(f"{peer.name} runs in this interpreter, which cannot import packer; run with the "
                           "project's venv (pip install -e .)")
        return sys.executable, 0.0
    venv = venvs / peer.name
    python = venv / "bin" / "python"
    recipe = {"python": platform.python_version(), "steps": peer.steps, "apt": peer.apt}
    stamp = venv / RECIPE
    if not reinstall and python.exists() and stamp.exists() and json.loads(stamp.read_text()) == recipe:
        return str(python), 0.0
    start = time.perf_counter()
    ensure_system_packages(peer, log, allow_apt)
    shutil.rmtree(venv, ignore_errors=True)
    code, tail = _run([sys.executable, "-m", "venv", str(venv)], log)
    if code != 0:
        raise SkipPeer(f"python -m venv failed:\n{tail}")
    for step in peer.steps:
        code, tail = _run([str(python), "-m", "pip", "install", *step], log)
        if code != 0:
            raise SkipPeer(f"`pip install {' '.join(step)}` failed:\n{tail}")
    stamp.write_text(json.dumps(recipe))
    return str(python), time.perf_counter() - start


# -- running one peer -----------------------------------------------------------------------------------------

def _run_group(cmd: list[str], log: Path, env: dict[str, str], timeout: float) -> int | str:
    """Run ``cmd`` into ``log`` in its own process group, so that a timeout ends its readers and workers too."""
    with open(log, "a") as f:
        f.write(f"$ {shlex.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return f"a timeout ({timeout:.0f} s)"


def run_adapter(peer: Peer, python: str, args: argparse.Namespace, log: Path) -> tuple[list[dict[str, Any]], str]:
    """Run the peer's adapter in its venv: the rows it wrote (a crashed adapter keeps those it finished) and,
    if it did not exit cleanly, why."""
    work = args.out / "work" / peer.name
    rows_file = args.out / "rows" / f"{peer.name}.json"
    rows_file.parent.mkdir(parents=True, exist_ok=True)
    rows_file.unlink(missing_ok=True)
    cmd = [python, str(ADAPTERS / peer.adapter), "--src", str(args.src), "--work", str(work), "--out",
           str(rows_file), "--batch-size", str(args.batch_size), "--workers", str(args.workers),
           "--epochs", str(args.epochs), "--timeout", str(args.timeout), "--pipelines", ",".join(args.pipelines),
           "--repeats", str(args.repeats)]
    if args.variants:
        cmd += ["--variants", args.variants]
    env = {**os.environ, **peer.env, "PACKER_PEER_FORMATS": ",".join(args.packer_formats)}
    if peer.steps:
        env.pop("PYTHONPATH", None)  # a venv must see only its own packages; packer's rows keep this interpreter's
    code = _run_group(cmd, log, env, args.peer_timeout)
    rows = json.loads(rows_file.read_text()) if rows_file.exists() else []
    if not args.keep_packed:
        shutil.rmtree(work, ignore_errors=True)
    if code == 0:
        return rows, ""
    why = f"adapter exited with {code} after {len(rows)} row(s):\n{_tail(log.read_text(), 25)}"
    if not rows:
        raise SkipPeer(why)
    return rows, why


def measure_peer(peer: Peer, args: argparse.Namespace) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Install (if needed) and run one peer; its status entry and rows."""
    log = args.out / "logs" / f"{peer.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    status: dict[str, Any] = {"peer": peer.name, "adapter": peer.adapter, "log": str(log)}
    started = time.perf_counter()
    try:
        python, status["install_s"] = ensure_venv(peer, args.venvs, log, args.apt, args.reinstall)
        status["python"] = python
        rows, why = run_adapter(peer, python, args, log)
    except SkipPeer as exc:
        status.update(status="skipped", error=str(exc), seconds=time.perf_counter() - started)
        return status, []
    partial = why or any("error" in r for r in rows)
    status.update(status="partial" if partial else "ok", seconds=time.perf_counter() - started,
                  versions=next((r.get("versions") for r in rows if r.get("versions")), {}))
    if why:
        status["error"] = why
    return status, rows


# -- the run --------------------------------------------------------------------------------------------------

def make_sample(per_class: int, classes: int, out: Path) -> Path:
    """An ImageNet-like folder from scripts/make_sample_data.py (made once, then reused)."""
    folder = out / f"data-{per_class * classes}"
    if not folder.exists():
        cmd = [sys.executable, str(REPO / "scripts" / "make_sample_data.py"), str(folder), "--per-class",
               str(per_class), "--classes", str(classes)]
        subprocess.run(cmd, check=True)
    return folder


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"cpu": cpu, "cores": core_count(), "memory_gib": round(memory / 2**30, 1), "os": platform.platform(),
            "python": platform.python_version()}


# -- is the machine idle? -------------------------------------------------------------------------------------

def core_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def busy_cpu_seconds() -> float | None:
    """CPU seconds every process on the machine has used since boot (/proc/stat), or None where unknown."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """CPU seconds this process and its finished descendants (adapters, readers, their workers) have used."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def settled_load(cores: int, settle_s: float) -> tuple[float, float, float]:
    """The load average once its 1-minute figure is at most ``cores``, or after ``settle_s`` seconds."""
    deadline = time.perf_counter() + settle_s
    while os.getloadavg()[0] > cores and time.perf_counter() < deadline:
        time.sleep(5)
    return os.getloadavg()


class LoadWatch:
    """The load average at the start and the end of a run, and how much CPU other processes took meanwhile.

    Each end waits (up to ``settle_s``) for the 1-minute load average to fall to the core count: at the start
    for what ran just before (making the sample folder, say), at the end for this run's own readers, which it
    still holds."""

    def __init__(self, settle_s: float) -> None:
        self.cores = core_count()
        self.start = settled_load(self.cores, settle_s)
        self.started = time.perf_counter()
        self.busy0, self.own0 = busy_cpu_seconds(), own_cpu_seconds()
        self.report("start", self.start)

    def report(self, when: str, load: tuple[float, float, float]) -> None:
        print(f"load average at the {when}: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (1, 5, 15 min) on "
              f"{self.cores} cores", file=sys.stderr, flush=True)

    def finish(self, settle_s: float) -> dict[str, Any]:
        wall = time.perf_counter() - self.started
        busy, own = busy_cpu_seconds(), own_cpu_seconds()
        others = None
        if busy is not None and self.busy0 is not None and wall > 0:
            others = max(0.0, (busy - self.busy0) - (own - self.own0)) / (wall * self.cores)
        end = settled_load(self.cores, settle_s)
        self.report("end", end)
        worst = max(self.start[0], end[0])
        publishable = worst <= self.cores
        if others is not None:
            print(f"other processes used {100 * others:.0f}% of the cores during the run", file=sys.stderr)
        if not publishable:
            print(f"NOT PUBLISHABLE: load average {worst:.2f} > {self.cores} cores", file=sys.stderr, flush=True)
        return {"cores": self.cores, "load_start": list(self.start), "load_end": list(end),
                "others_cpu_share": others, "publishable": publishable}


def _display(path: Path) -> str:
    """``path`` relative to the repository when it is inside it (for the README), else as it is."""
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def command_line(argv: list[str] | None) -> str:
    """The command that reproduces this run, from the repository root."""
    args = sys.argv[1:] if argv is None else argv
    return shlex.join(["python", _display(Path(__file__)), *args])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", nargs="?", type=Path, help="ImageFolder-layout folder (or use --per-class)")
    p.add_argument("--per-class", type=int, help="make a sample folder with this many images per class first")
    p.add_argument("--classes", type=int, default=5, help="classes of the sample folder (default 5)")
    p.add_argument("--out", type=Path, default=REPO / "bench-out" / "peers", help="results folder")
    p.add_argument("--venvs", type=Path, default=REPO / "bench-out" / "peer-venvs", help="where peer venvs live")
    p.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated, from {', '.join(PEERS)}")
    p.add_argument("--pipeline", default="val,train", help="comma-separated pipelines: val, train (default both)")
    p.add_argument("--repeats", type=int, default=3, help="reads per row; the median is reported (default 3)")
    p.add_argument("--packer-formats", default="lmdb,hdf5,wds", help="packer formats to measure")
    p.add_argument("--variants", default="", help="only these variant names (as in the table)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2, help="warm epochs per row (plus one cold)")
    p.add_argument("--timeout", type=float, default=900, help="seconds one read may take")
    p.add_argument("--peer-timeout", type=float, default=3600, help="seconds one peer's adapter may take")
    p.add_argument("--no-apt", dest="apt", action="store_false", help="never run apt-get (FFCV's build deps)")
    p.add_argument("--reinstall", action="store_true", help="rebuild the peer venvs even if their recipe holds")
    p.add_argument("--keep-packed", action="store_true", help="keep each peer's packed copies in OUT/work")
    p.add_argument("--update-readme", action="store_true",
                   help="write the table into docs/benchmarks.md's peers section")
    p.add_argument("--force", action="store_true",
                   help="let --update-readme write a run that is not publishable (load average over the cores)")
    p.add_argument("--settle", type=float, default=120,
                   help="seconds to wait, at the start and at the end, for the load average to fall to the core "
                        "count (default 120)")
    p.add_argument("--readme", type=Path, default=REPO / "docs" / "benchmarks.md",
                   help="the page --update-readme writes")
    p.add_argument("--from-results", type=Path, metavar="JSON",
                   help="measure nothing: redo results.md, the chart (and the README with --update-readme) from "
                        "an earlier results.json")
    args = p.parse_args(argv)
    args.out = args.out.resolve()
    if args.from_results:
        return args
    if args.src is None:
        if args.per_class is None:
            p.error("give a folder or --per-class N")
        args.src = make_sample(args.per_class, args.classes, args.out.parent)
    args.src = args.src.resolve()
    if not args.src.is_dir():
        p.error(f"{args.src} is not a folder")
    args.peer_names = [n.strip() for n in args.peers.split(",") if n.strip()]
    unknown = [n for n in args.peer_names if n not in PEERS]
    if unknown:
        p.error(f"unknown peer(s) {', '.join(unknown)}; choose from {', '.join(PEERS)}")
    args.packer_formats = [f for f in args.packer_formats.split(",") if f]
    args.pipelines = [n.strip() for n in args.pipeline.split(",") if n.strip()]
    wrong = [n for n in args.pipelines if n not in report.PIPELINES]
    if wrong or not args.pipelines:
        p.error(f"unknown pipeline(s) {', '.join(wrong)}; choose from {', '.join(report.PIPELINES)}")
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    return args


def write_results(args: argparse.Namespace, results: dict[str, Any]) -> tuple[dict[str, str], int]:
    """results.json/.md and the chart, then (with --update-readme) the README section, which a run that is not
    publishable may only write with --force. The paths written and the exit code."""
    paths = report.write_outputs(results, args.out)
    if not args.update_readme:
        return paths, 0
    if not report.publishable(results) and not args.force:
        print("error: not updating the README: this run is not publishable (the load average exceeded the core "
              "count); re-run on an idle machine, or pass --force", file=sys.stderr)
        return paths, 1
    report.update_readme(args.readme, results)
    return {**paths, "readme": str(args.readme)}, 0


def rerender(args: argparse.Namespace) -> int:
    """--from-results: the outputs of an earlier run, drawn again (after a change to the report, say)."""
    results = json.loads(args.from_results.read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    paths, code = write_results(args, results)
    print("wrote " + ", ".join(paths.values()), file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_results:
        return rerender(args)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    load = LoadWatch(args.settle)
    results: dict[str, Any] = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": command_line(argv),
        "machine": machine(), "src": str(args.src), "src_display": _display(args.src), "images": None,
        "batch_size": args.batch_size, "workers": args.workers, "epochs": args.epochs, "repeats": args.repeats,
        "pipelines": args.pipelines, "peers": [], "rows": []}
    results["machine"].update(load_start=list(load.start))
    for name in args.peer_names:
        print(f"== {name}", file=sys.stderr, flush=True)
        status, rows = measure_peer(PEERS[name], args)
        print(report.status_line(status), file=sys.stderr, flush=True)
        results["peers"].append(status)
        results["rows"].extend(rows)
        results["images"] = results["images"] or next((r.get("images") for r in rows if r.get("images")), None)
        results["seconds"] = time.perf_counter() - started
        report.write_outputs(results, args.out)  # after every peer, so an interrupted run keeps what it has
    idle = load.finish(args.settle)
    results["machine"].update(load_end=idle["load_end"], others_cpu_share=idle["others_cpu_share"])
    results["publishable"] = idle["publishable"]
    paths, code = write_results(args, results)
    print(report.pipeline_tables(results["rows"]))
    print(f"\ntook {results['seconds']:.0f} s; wrote " + ", ".join(paths.values()), file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
