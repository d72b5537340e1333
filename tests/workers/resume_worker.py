"""One process of a resume test (test_resume_loader.py, test_stream_elastic.py, test_mix_loader.py):
``resume_worker.py JOBS.json``, run plainly or under ``torchrun``. Each job makes ``packer.make_loader`` over a
dataset (or ``packer.stream``),
loads a saved state (if any), iterates up to a stop point or to the end of epoch ``epochs - 1``, saves the state
there and writes what it saw.

A job: ``{"path", "open": {kwargs of open_dataset}, "loader": {kwargs of make_loader} (or "stream": {kwargs of
stream}; or "mix": {"paths", "weights", "seed", "samples_per_epoch"}: ``packer.mix`` over those datasets, each
opened with "open", read by make_loader with "loader"), "epochs", "state_in": file or null, "stop":
{"after_batches": n} | {"after_epochs": n} | null, "state_out", "out", "sync": optional, true to wait for every
rank after each batch (DDP's per-step all-reduce keeps training ranks together; without it a rank may run far
ahead of the others)}``. Output (``out``, with ``{rank}`` replaced): ``{"batches": [[epoch, digest, labels,
indices]...], "state", "states_equal", "world", "lengths"}``; ``indices`` recognises samples by their pixels in
the dataset opened without augmentation (None when a sample is not found there), or in ``"table": {"path",
"open": {kwargs of open_dataset}}`` when the job gives one (a URL's local copy, opened with the same resize); for
a mixture, as ``[source, index]`` in its datasets opened plainly, with each batch's sources after its indices.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist

import packer


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha1(tensor.contiguous().numpy().tobytes()).hexdigest()


def recognised(job: dict) -> dict:
    """Each sample's index (for a mixture: ``[source, index]``) by its pixels."""
    if "mix" in job:
        plains = [packer.open_dataset(path) for path in job["mix"]["paths"]]
        return {digest(ds[i][0]): [k, i] for k, ds in enumerate(plains) for i in range(len(ds))}
    table_of = job.get("table", {"path": job.get("path")})  # where samples are recognised: a URL's local copy
    plain = packer.open_dataset(table_of["path"], **table_of.get("open", {}))
    return {digest(plain[i][0]): i for i in range(len(plain))}


def run(job: dict, rank: int, world: int) -> None:
    table = recognised(job)
    if "stream" in job:  # packer.stream(path, **job["stream"])
        loader = packer.stream(job["path"], **job["stream"])
    elif "mix" in job:
        spec = job["mix"]
        mixed = packer.mix([packer.open_dataset(path, **job["open"]) for path in spec["paths"]], spec.get("weights"),
                           seed=spec.get("seed", 0), samples_per_epoch=spec.get("samples_per_epoch"))
        loader = packer.make_loader(mixed, **job["loader"])
    else:
        loader = packer.make_loader(packer.open_dataset(job["path"], **job["open"]), **job["loader"])
    start = 0
    if job["state_in"]:
        with open(job["state_in"], encoding="utf-8") as f:
            state = json.load(f)
        loader.load_state_dict(state)
        start = state["epoch"]
    stop = job["stop"] or {}
    batches, lengths, done = [], [], False
    for epoch in range(start, job["epochs"]):
        lengths.append(len(loader))
        for images, labels, *sources in loader:
            batches.append([epoch, digest(images), labels.tolist(), [table.get(digest(im)) for im in images],
                            *(s.tolist() for s in sources)])
            if job.get("sync") and world > 1:
                dist.barrier()
            if len(batches) == stop.get("after_batches"):
                done = True
                break
        if done or epoch + 1 - start == stop.get("after_epochs"):
            break
    state = loader.state_dict()
    states_equal = True
    if world > 1:
        states = [None] * world
        dist.all_gather_object(states, state)
        states_equal = all(s == state for s in states)
    if job["state_out"] and rank == 0:
        with open(job["state_out"], "w", encoding="utf-8") as f:
            json.dump(state, f)
    with open(job["out"].format(rank=rank), "w", encoding="utf-8") as f:
        json.dump({"batches": batches, "state": state, "states_equal": states_equal, "world": world,
                   "lengths": lengths}, f)


def main() -> None:
    with open(sys.argv[1], encoding="utf-8") as f:
        jobs = json.load(f)
    distributed = "RANK" in os.environ  # under torchrun
    if distributed:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    for job in jobs:
        run(job, rank, world)
        if distributed:
            dist.barrier()
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
