"""``packer.lightning.PackedDataModule`` with a real ``lightning.Trainer`` on CPU: one epoch reads every sample
once, and a fit that dies mid-epoch resumes from its checkpoint with exactly the samples that epoch had left.

The dataset has one image per class, so a batch's labels say which samples it holds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import write_image

import packer

pl = pytest.importorskip("lightning.pytorch")
from packer.lightning import PackedDataModule  # noqa: E402

N = 22  # samples (and classes); batches of 4: 6 a epoch, the last one of 2


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lightning")
    for i in range(N):
        write_image(root / "src" / f"c{i:02d}" / "a.jpg", width=24, height=20, seed=i)
    packer.pack(root / "src", root / "ds", format="lmdb", workers=1, progress=False)
    return root / "ds"


class Recorder(pl.LightningModule):
    """A tiny classifier that records the labels (= sample ids) and image shapes of every batch it is given."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, N)
        self.train_seen: list[list[int]] = []  # per training epoch
        self.val_seen: list[int] = []
        self.shapes: set[tuple[str, tuple[int, ...]]] = set()

    def training_step(self, batch, batch_idx):
        images, labels = batch
        if batch_idx == 0 or not self.train_seen:
            self.train_seen.append([])
        self.train_seen[-1] += labels.tolist()
        self.shapes.add(("train", tuple(images.shape[1:])))
        return torch.nn.functional.cross_entropy(self.linear(images.float().mean((2, 3))), labels)

    def validation_step(self, batch, batch_idx):
        images, labels = batch
        self.val_seen += labels.tolist()
        self.shapes.add(("val", tuple(images.shape[1:])))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Killed(RuntimeError):
    pass


class KillAtStep(pl.Callback):
    """Ends the fit with an error after ``step`` optimizer steps, as a killed job would."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            raise Killed(f"killed at step {self.step}")


def trainer(**kwargs) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, **kwargs)


def test_one_epoch_reads_every_train_and_val_sample_once(packed):
    """The training set with its augmentation (every sample once, at the crop's size), the validation set plainly
    (every sample once, in order, at resize + center_crop), with make_loader's default workers."""
    model = Recorder()
    data = PackedDataModule(packed, packed, batch_size=4, random_resized_crop=16, flip=True, resize=18,
                            center_crop=18)
    trainer(max_epochs=1, num_sanity_val_steps=0, enable_checkpointing=False).fit(model, data)
    assert len(model.train_seen) == 1 and sorted(model.train_seen[0]) == list(range(N))
    assert model.train_seen[0] != list(range(N))  # shuffled
    assert model.val_seen == list(range(N))
    assert model.shapes == {("train", (3, 16, 16)), ("val", (3, 18, 18))}


def test_fit_killed_mid_epoch_resumes_exactly_from_its_checkpoint(packed, tmp_path):
    """Checkpoints every 2 steps, killed at step 3 (so one batch after the checkpoint is lost with the job);
    ``fit(ckpt_path=)`` then reads exactly the samples epoch 0 had left after the checkpoint, and epoch 1 whole."""
    first = Recorder()
    checkpoints = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    with pytest.raises(Killed):
        trainer(max_epochs=2, callbacks=[checkpoints, KillAtStep(3)]).fit(first, PackedDataModule(packed, batch_size=4))
    assert len(first.train_seen[0]) == 12  # 3 batches read
    ckpt = tmp_path / "epoch=0-step=2.ckpt"
    assert sorted(p.name for p in tmp_path.iterdir()) == [ckpt.name]
    state = torch.load(ckpt, weights_only=False)["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert [(s["epoch"], s["samples_seen"]) for s in state] == [(0, 8)]  # the position, in Lightning's checkpoint

    second = Recorder()
    trainer(max_epochs=2, enable_checkpointing=False).fit(second, PackedDataModule(packed, batch_size=4),
                                                          ckpt_path=ckpt)
    rest, epoch1 = second.train_seen
    before = first.train_seen[0][:8]  # what the checkpoint had trained on
    assert sorted(before + rest) == list(range(N)), (before, rest)  # none twice, none lost
    assert sorted(epoch1) == list(range(N)) and epoch1 != first.train_seen[0]  # then a whole, new epoch

    again = Recorder()  # the same resume made twice gives the same batches
    trainer(max_epochs=1, enable_checkpointing=False).fit(again, PackedDataModule(packed, batch_size=4),
                                                          ckpt_path=ckpt)
    assert again.train_seen == [rest]


def test_checkpoint_at_an_epochs_last_batch_resumes_with_the_next_epoch(packed, tmp_path):
    """A checkpoint taken after the last batch of epoch 0 resumes with the whole of epoch 1, nothing of epoch 0."""
    first = Recorder()
    checkpoints = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=6, save_top_k=-1)
    with pytest.raises(Killed):
        trainer(max_epochs=2, callbacks=[checkpoints, KillAtStep(7)]).fit(first, PackedDataModule(packed, batch_size=4))
    epoch0, epoch1_begun = first.train_seen
    second = Recorder()
    trainer(max_epochs=2, enable_checkpointing=False).fit(second, PackedDataModule(packed, batch_size=4),
                                                          ckpt_path=tmp_path / "epoch=0-step=6.ckpt")
    assert len(second.train_seen) == 1 and sorted(second.train_seen[0]) == list(range(N))
    assert second.train_seen[0][:4] == epoch1_begun and second.train_seen[0] != epoch0


def test_import_packer_does_not_import_lightning_and_without_it_says_what_to_install():
    code = ("import sys; import packer; packer.open_dataset; packer.make_loader; "
            "assert not [m for m in sys.modules if m.startswith(('lightning', 'pytorch_lightning'))]; "
            "sys.modules['lightning'] = None; import packer.lightning")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last == ("ImportError: packer.lightning needs Lightning, which is not installed: "
                    "pip install 'packer-data[lightning]'"), r.stderr


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_ranks_share_each_epoch_and_resume_mid_epoch(packed, tmp_path):
    """``Trainer(strategy="ddp", devices=2)`` on CPU, with Lightning's default ``use_distributed_sampler``: the
    ranks read disjoint halves of the epoch, and a run killed at step 2 and resumed from its step-1 checkpoint
    reads exactly what each rank had left after step 1."""
    worker = Path(__file__).resolve().parents[1] / "workers" / "lightning_ddp_worker.py"

    def run(mode: str) -> list[list[list[int]]]:
        r = subprocess.run([sys.executable, str(worker), str(packed), str(tmp_path), mode], capture_output=True,
                           text=True, timeout=300, cwd=tmp_path)
        assert r.returncode == (3 if mode == "kill" else 0), r.stderr[-3000:]
        return [json.loads((tmp_path / f"{mode}-{rank}.json").read_text()) for rank in range(2)]

    full = run("full")
    assert [len(batches) for batches in full] == [3, 3]  # 11 samples a rank: 4 + 4 + 3
    assert sorted(label for batches in full for batch in batches for label in batch) == list(range(N))
    killed, resumed = run("kill"), run("resume")
    for rank in range(2):
        assert killed[rank] == full[rank][:2]  # the same order as the uninterrupted run
        assert resumed[rank] == full[rank][1:]  # after the step-1 checkpoint: the rest, none twice, none lost
