"""``PackedDataModule``: packed datasets as a Lightning ``LightningDataModule`` (the ``lightning`` extra).

Training resumes mid-epoch through Lightning's own checkpoints: ``make_loader``'s loaders have ``state_dict`` and
``load_state_dict``, so Lightning stores the train loader's position in every checkpoint and, on
``trainer.fit(..., ckpt_path=...)``, the resumed epoch reads exactly the samples it had not read yet.

Lightning counts a resumed epoch's batches from where it stopped, up to the loader's ``len``, so the loaders it
is given (:class:`EpochLoader`) say the whole epoch's batches also in a resumed pass, where ``make_loader``'s
loader says the batches left. They are not ``DataLoader`` objects, so Lightning leaves their sampler alone: under
DDP each rank reads its share of every epoch through packer's own sampler, which reads ``torch.distributed``
(Lightning initializes it before it asks for the loaders); ``use_distributed_sampler`` makes no difference.
"""

from __future__ import annotations

import os
from typing import Any

from . import arguments
from .errors import UsageError
from .install_hints import pip_hint

try:
    import lightning.pytorch as pl
except ImportError:  # one line, not Lightning's traceback
    raise ImportError(f"packer.lightning needs Lightning, which is not installed: {pip_hint('lightning')}") from None

from .loading.loader import PrefetchLoader, make_loader
from .loading.sampler import EpochPass, ResumableSampler
from .reading.dataset import PackedDataset, open_dataset

Dest = str | os.PathLike


class EpochLoader:
    """A ``make_loader`` loader as Lightning counts it: ``len`` is the whole epoch's batches (on this rank) also
    in a resumed pass, whose batches Lightning numbers from where the checkpoint stopped. An iteration starts the
    loader's pass at its first batch, not at ``iter()``. Iteration,
    ``state_dict``/``load_state_dict`` and every other attribute are the loader's (``loader.dataset``...).

    Args:
        loader: what ``packer.make_loader`` returned.
    """

    def __init__(self, loader: PrefetchLoader):
        self.loader = loader

    def __iter__(self):
        # a generator: the loader's pass starts at the first batch asked for, not at iter(), which Lightning also
        # calls to check that the loader is iterable (and drops): that pass would take the epoch's place
        yield from self.loader

    def __len__(self) -> int:
        sampler = self.loader.sampler
        if not isinstance(sampler, ResumableSampler) or self.loader.batch_size != sampler.batch_size:
            return len(self.loader)  # a sampler of the caller's (loader_options): no resume to count
        whole = EpochPass(0, 0, sampler.world, sampler.rank, sampler.length, sampler.batch_size, sampler.seed,
                          sampler.shuffle, sampler.drop_last)
        return whole.batches

    def state_dict(self) -> dict[str, Any]:
        """The loader's position (see ``PrefetchLoader.state_dict``); Lightning saves it in each checkpoint."""
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next iteration the rest of ``state``'s epoch (see ``PrefetchLoader.load_state_dict``)."""
        self.loader.load_state_dict(state)

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)


class PackedDataModule(pl.LightningDataModule):
    """A train (and optional validation) packed dataset with ``make_loader``'s loaders, resumable mid-epoch.

    The training set gets the augmentation arguments; the validation set is read plainly (``resize`` and
    ``center_crop`` only), in order, every sample once per validation run (on each rank its share under DDP).

    Args:
        train: the training set's folder or URL (what ``packer pack`` wrote).
        val: the validation set's folder or URL, or None for no validation loader.
        batch_size: samples per batch, for both loaders.
        val_batch_size: the validation loader's batch size, if another.
        shuffle: a new random order every epoch for the training set.
        seed: the training order's and the augmentation's seed.
        drop_last: drop the last, smaller batch of each training epoch.
        resize: the read-time resize of both sets (the training set's only without ``random_resized_crop``); see
            ``packer.open_dataset``.
        center_crop: the read-time centre crop of both sets (the training set's only without
            ``random_resized_crop``).
        random_resized_crop: the training set's random resized crop: an int or ``(height, width)``.
        scale: the random resized crop's area range, ``(min, max)``, as ``packer.open_dataset`` takes it.
        ratio: the random resized crop's aspect-ratio range, ``(min, max)``.
        flip: mirror half the training images left-right.
        dataset_options: more ``packer.open_dataset`` arguments, for both sets (``transform``, ``fields``,
            ``storage_options``...).
        loader_options: more ``packer.make_loader`` arguments, for both loaders (``num_workers``, ``threads``...).

    Raises:
        ValueError: (one line) an argument of the wrong type or range, naming it: here for this class's own,
            at :meth:`setup` for ``open_dataset``'s and at the loaders for ``make_loader``'s.
    """

    def __init__(self, train: Dest, val: Dest | None = None, *, batch_size: int = 64, val_batch_size: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False, resize: int | str | None = None,
                 center_crop: int | str | None = None, random_resized_crop: int | tuple[int, int] | None = None,
                 scale: tuple[float, float] = (0.08, 1.0), ratio: tuple[float, float] = (3 / 4, 4 / 3),
                 flip: bool = False, dataset_options: dict[str, Any] | None = None,
                 loader_options: dict[str, Any] | None = None):
        super().__init__()
        arguments.int_at_least("batch_size", batch_size, 1)
        arguments.optional_int("val_batch_size", val_batch_size, 1)
        for name, value in (("shuffle", shuffle), ("drop_last", drop_last)):
            arguments.flag(name, value)
        arguments.seed("seed", seed)
        for name, given in (("dataset_options", dataset_options), ("loader_options", loader_options)):
            if given is not None and not isinstance(given, dict):
                raise UsageError(f"{name} must be a dict of keyword arguments or None, not {given!r}")
        self.train_root, self.val_root = train, val
        self.batch_size, self.val_batch_size = batch_size, val_batch_size or batch_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.view: dict[str, Any] = {"resize": resize, "center_crop": center_crop}
        self.augment: dict[str, Any] = {"random_resized_crop": random_resized_crop, "scale": scale, "ratio": ratio,
                                        "flip": flip}
        self.dataset_options = dict(dataset_options or {})
        self.loader_options = dict(loader_options or {})
        for name, options in (("dataset_options", self.dataset_options), ("loader_options", self.loader_options)):
            if "seed" in options:
                raise UsageError(f"{name} must not hold 'seed'; pass seed= to PackedDataModule")
        self.train_set: PackedDataset | None = None
        self.val_set: PackedDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        """Open the datasets (on every rank; cheap: the manifest and the index)."""
        if self.train_set is None and stage in (None, "fit"):
            train_view = self.augment if self.augment["random_resized_crop"] is not None else self.view
            flip = {"flip": self.augment["flip"]} if train_view is self.view else {}
            self.train_set = open_dataset(self.train_root, seed=self.seed, **train_view, **flip,
                                          **self.dataset_options)
        if self.val_set is None and self.val_root is not None and stage in (None, "fit", "validate"):
            self.val_set = open_dataset(self.val_root, **self.view, **self.dataset_options)

    def train_dataloader(self) -> EpochLoader:
        """The training loader, at the Trainer's current epoch (its checkpoint then moves it to where it stopped)."""
        if self.train_set is None:
            self.setup("fit")
        assert self.train_set is not None  # setup("fit") opened it
        loader = make_loader(self.train_set, self.batch_size, shuffle=self.shuffle, seed=self.seed,
                             drop_last=self.drop_last, **self.loader_options)
        trainer = self.trainer
        if trainer is not None:
            loader.set_epoch(trainer.current_epoch)  # a loader made again (reload_dataloaders_every_n_epochs)
        return EpochLoader(loader)

    def val_dataloader(self) -> EpochLoader | list:
        """The validation loader, in order; ``[]`` (no validation) without ``val``."""
        if self.val_root is None:
            return []
        if self.val_set is None:
            self.setup("validate")
        assert self.val_set is not None  # setup("validate") opened it (there is a val)
        return EpochLoader(make_loader(self.val_set, self.val_batch_size, shuffle=False, **self.loader_options))
