"""One run of test_lightning.py's DDP test: ``lightning_ddp_worker.py DATASET OUT_DIR MODE``, a Lightning
``Trainer(strategy="ddp", devices=2)`` on CPU (Lightning starts the second rank by running this script again).

Each rank writes the labels of its batches (one image per class: a label is a sample) to ``OUT_DIR/MODE-RANK.json``.
MODE ``full`` fits one epoch; ``kill`` checkpoints after every step and exits with status 3 after step 2; ``resume``
fits from the ``kill`` run's checkpoint at step 1.
"""

from __future__ import annotations

import json
import sys

import lightning.pytorch as pl
import torch

from packer.lightning import PackedDataModule


class Recorder(pl.LightningModule):
    def __init__(self, classes: int, out: str):
        super().__init__()
        self.linear = torch.nn.Linear(3, classes)
        self.out = out
        self.seen: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        images, labels = batch
        self.seen.append(labels.tolist())
        return torch.nn.functional.cross_entropy(self.linear(images.float().mean((2, 3))), labels)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def save(self) -> None:
        with open(f"{self.out}-{self.global_rank}.json", "w") as f:
            json.dump(self.seen, f)

    def on_train_end(self) -> None:
        self.save()


class KillAfterStep2(pl.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 2:
            pl_module.save()
            raise SystemExit(3)


def main() -> None:
    dataset, out_dir, mode = sys.argv[1:4]
    data = PackedDataModule(dataset, batch_size=4, loader_options={"num_workers": 0})
    data.setup("fit")
    callbacks = [pl.callbacks.ModelCheckpoint(dirpath=f"{out_dir}/ckpt", every_n_train_steps=1, save_top_k=-1),
                 KillAfterStep2()] if mode == "kill" else []
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                         enable_checkpointing=mode == "kill")
    ckpt = f"{out_dir}/ckpt/epoch=0-step=1.ckpt" if mode == "resume" else None
    trainer.fit(Recorder(len(data.train_set.classes), f"{out_dir}/{mode}"), data, ckpt_path=ckpt)


if __name__ == "__main__":
    main()
