"""Running packer as users do, in other processes: the command's one-line errors, torchrun launches of packer
and of the test workers (tests/workers/), and what they wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.packed import free_port

WORKERS = Path(__file__).resolve().parents[1] / "workers"
RESUME_WORKER = WORKERS / "resume_worker.py"


def one_line_value_error(call, *words: str) -> str:
    with pytest.raises(ValueError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message, message
    for word in words:
        assert word in message, (word, message)
    return message


def packer_limited(*args, memory: int | None = None, files: int | None = None,
                   timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m packer ARGS`` under an address-space limit (``memory`` bytes: a runaway allocation fails in
    this process instead of taking the machine) and an open-files limit (``files``)."""
    import resource

    def limit() -> None:
        if memory is not None:
            resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        if files is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (files, files))

    env = dict(os.environ, PYTHONIOENCODING="utf-8", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "packer", *map(str, args)], capture_output=True, text=True,
                          encoding="utf-8", env=env, timeout=timeout, preexec_fn=limit)


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("packer: error:")]


def assert_one_line_error(proc: subprocess.CompletedProcess, *names, code: int | None = None) -> str:
    """A failed command: non-zero exit, exactly one 'packer: error:' line naming ``names``, no traceback, and
    nothing on stderr but packer's own lines."""
    assert proc.returncode != 0, proc
    if code is not None:
        assert proc.returncode == code, proc
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout, proc.stderr
    errors = error_lines(proc)
    assert len(errors) == 1, proc.stderr
    for name in names:
        assert str(name) in errors[0], (name, errors[0])
    assert all(line.startswith("packer: ") for line in proc.stderr.splitlines() if line.strip()), proc.stderr
    return errors[0]


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr


def torchrun(*args, env: dict | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node=2 -m packer ARGS``; the timeout is generous, only a hang reaches it."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", "-m", "packer", *map(str, args)]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONIOENCODING="utf-8", **(env or {}))
    return subprocess.run(cmd, capture_output=True, text=True, encoding="utf-8", env=full_env, timeout=timeout)


def launch(jobs: list[dict], tmp: Path, name: str, ranks: int = 0) -> None:
    """Run the worker over ``jobs``: as a plain process, or under torchrun with ``ranks`` ranks."""
    spec = tmp / f"{name}.json"
    spec.write_text(json.dumps(jobs))
    if ranks:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--master_addr=127.0.0.1",
               f"--master_port={free_port()}", str(RESUME_WORKER), str(spec)]
    else:
        cmd = [sys.executable, str(RESUME_WORKER), str(spec)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-12000:]  # a hung worker's stacks too


def read_out(path: str, rank: int = 0) -> dict:
    return json.loads(Path(path.format(rank=rank)).read_text())


def stream_of(segments: list[dict]) -> list:
    return [batch for seg in segments for batch in read_out(seg["out"])["batches"]]

