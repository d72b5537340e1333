"""The options of ``packer pack`` and :func:`packer.pack`, declared once.

:class:`PackOptions` holds each option with its default and help text. From it derive the click options of
``packer pack`` (:func:`click_options`), the keyword arguments and the ``Args:`` of :func:`packer.pack`
(:func:`signature_parameters`, :func:`args_doc`), and the manifest's ``transform`` record
(:meth:`PackOptions.transform_spec`, filling :class:`packer.images.transforms.TransformSpec` field by field).
"""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import click

from ..arguments import parse_bytes, spelled
from ..errors import UsageError
from ..images.transforms import (
    DEFAULT_MAX_PIXELS,
    IMAGENET_MEAN,
    IMAGENET_STD,
    INTERPOLATIONS,
    MAX_SIDE,
    STORES,
    TransformSpec,
    as_pair,
    parse_size,
)


def floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of numbers") from None


class Parsed(click.ParamType):
    """A value checked by ``parse`` (``parse_size``: N or WxH; ``parse_bytes``: 256MB), so that a bad value is
    an error naming its option."""

    def __init__(self, name: str, parse: Callable[[Any], Any]) -> None:
        self.name, self.parse = name, parse

    def convert(self, value, param, ctx):
        try:
            return self.parse(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


class FormatChoice(click.Choice):
    """The registered formats, asked of the registry only when the CLI parses or prints help: building the
    command must not import the format modules."""

    def __init__(self) -> None:
        super().__init__((), case_sensitive=True)

    @property
    def choices(self) -> tuple[str, ...]:
        from ..formats.base import format_names

        return tuple(format_names())

    @choices.setter
    def choices(self, value) -> None:  # click.Choice.__init__ sets it; the registry decides
        pass


def option(default: Any, help: str, *, cli: dict[str, Any] | None = None) -> Any:
    """A field of :class:`PackOptions`: its default, its help text, and how ``packer pack`` spells it
    (``cli``: click's keyword arguments, plus ``decls`` for flag names; None: not a command-line option)."""
    return field(default=default, metadata={"help": help, "cli": cli})


@dataclass(frozen=True)
class PackOptions:
    """Every option of a conversion, as given (``None``: decided from the source and the other options)."""

    format: str = option("lmdb", "Output format.", cli=dict(type=FormatChoice(), required=True))
    store: str | None = option(
        None, "original: the file's bytes (default without resize/crop); jpeg: re-encode (default when resizing); "
              "png: lossless; raw: decoded uint8 pixels, the fastest to load.", cli=dict(type=click.Choice(STORES)))
    resize: int | str | tuple[int, int] | None = option(
        None, "N: shorter side to N (aspect kept); WxH: exact size.", cli=dict(type=Parsed("size", parse_size)))
    max_size: int | None = option(None, "Cap the longer side at N; never upscales.", cli=dict(type=click.IntRange(1)))
    center_crop: int | str | tuple[int, int] | None = option(
        None, "N or WxH: crop the centre after the resize.", cli=dict(type=Parsed("size", parse_size)))
    interpolation: str = option("bilinear", "Resampling filter of the resize.",
                                cli=dict(type=click.Choice(list(INTERPOLATIONS)), show_default=True))
    quality: int = option(90, "JPEG quality.", cli=dict(type=click.IntRange(1, 100), show_default=True))
    mode: str | None = option(
        None, "RGB as ImageFolder (the default), or L to keep one channel; a packed SRC keeps its own mode.",
        cli=dict(type=click.Choice(["RGB", "L"])))
    exif_transpose: bool = option(False, "Apply the EXIF orientation (ImageFolder does not).", cli=dict(is_flag=True))
    normalize: bool = option(False, "Store (x/255 - mean)/std as float arrays (store raw).", cli=dict(is_flag=True))
    mean: tuple[float, ...] | None = option(
        None, "With --normalize: one value per channel [default: 0.485,0.456,0.406; 0.485 for --mode L].",
        cli=dict(type=floats))
    std: tuple[float, ...] | None = option(
        None, "With --normalize: one positive value per channel [default: 0.229,0.224,0.225; 0.229 for L].",
        cli=dict(type=floats))
    dtype: str | None = option(None, "Dtype of normalized arrays (default float16).",
                               cli=dict(type=click.Choice(["float16", "float32"])))
    workers: int | None = option(None, "Worker processes (default: all cores).", cli=dict(type=click.IntRange(1)))
    shuffle: bool | None = option(None, "Shuffle the sample order (default: on for wds, off for lmdb and hdf5).",
                                  cli=dict(decls=("--shuffle/--no-shuffle",)))
    seed: int = option(0, "Seed of the shuffle (0 to 2**63-1).", cli=dict(type=click.IntRange(0, 2**63 - 1),
                                                                         show_default=True))
    shard_size: int | None = option(None, "WebDataset: bytes per shard at most, e.g. 256MB.",
                                    cli=dict(type=Parsed("bytes", parse_bytes)))
    shard_samples: int | None = option(None, "WebDataset: samples per shard.", cli=dict(type=click.IntRange(1)))
    strict: bool = option(False, "Stop at the first unreadable image instead of skipping it.", cli=dict(is_flag=True))
    overwrite: bool = option(False, "Replace an existing packer dataset at DEST.", cli=dict(is_flag=True))
    resume: bool = option(False, "Continue an interrupted conversion into DEST (same SRC and options); exits 0 if "
                                 "finished.", cli=dict(is_flag=True))
    include_hidden: bool = option(False, "Keep files and folders whose names start with '.'.", cli=dict(is_flag=True))
    max_pixels: int = option(DEFAULT_MAX_PIXELS, "Skip images with more pixels, before or after the resize "
                                                 "(decompression bombs).",
                             cli=dict(type=click.IntRange(1), show_default=True))
    label_key: str | None = option(None, "WebDataset SRC: the member that holds the integer label: cls (default), "
                                         "txt, json:FIELD...", cli={})
    image_column: str | None = option(None, "Annotation table SRC: the column of image paths (default image); hf: "
                                            "SRC: the Image() column (default: the first).", cli={})
    root: str | os.PathLike | None = option(
        None, "Annotation table SRC: the folder its image paths are relative to (default: the table's folder).",
        cli={})
    label_column: str | None = option(None, "Annotation table SRC: the class column (strings become classes in "
                                            "sorted order, as ImageFolder's folders; integers are kept); hf: SRC: "
                                            "the ClassLabel column (default: the first).", cli={})
    field: tuple[str, ...] = option((), "Annotation table SRC: a column's type, NAME:TYPE (repeatable): text, json, "
                                        "int64, float32, int64[n] or float32[] vectors, image, mask, class.",
                                    cli=dict(multiple=True))
    caption_column: str | None = option(None, "WebDataset: the text field also written as KEY.txt, as img2dataset "
                                              "and open_clip read captions (default: the only text field).", cli={})
    split: str | None = option(None, "hf: SRC holding a DatasetDict: the split to pack (default train).", cli={})
    distributed: bool | None = option(None, "False: convert in this process only, even under torchrun; True: "
                                            "require a distributed launch (default: detect it).")
    progress: bool = option(True, "Show a progress bar on stderr (the CLI's --quiet turns it off).")

    def __post_init__(self) -> None:
        from ..formats.base import format_names

        if self.format not in format_names():
            raise UsageError(f"unknown format {self.format!r}; choose one of {', '.join(sorted(format_names()))}")
        for name in ("shard_size", "shard_samples"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise UsageError(f"--{name.replace('_', '-')}: {value!r} is not a positive number")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise UsageError(f"{spelled('seed', self.seed)}: the seed must be an int from 0 to 2**63-1")

    @property
    def table(self) -> dict[str, Any]:
        """The options of an annotation-table source (:class:`packer.sources.table.TableSource`)."""
        root = None if self.root is None else str(self.root)
        return {"image_column": self.image_column or "image", "root": root, "label_column": self.label_column,
                "field": tuple(self.field)}

    @property
    def hf(self) -> dict[str, Any]:
        """The options of a Hugging Face source (:class:`packer.sources.hf.HfSource`)."""
        return {"split": self.split, "image_column": self.image_column, "label_column": self.label_column}

    def transform_spec(self, default_store: str | None = None, default_mode: str | None = None) -> TransformSpec:
        """The transform these options ask for, defaults filled in: ``original`` unless pixels change, ``jpeg``
        when resizing, ``raw`` to normalize; ImageNet's mean and std (their first value for mode L).

        Args:
            default_store: the source's store when none is given (a repack of raw pixels stays raw).
            default_mode: the source's mode when none is given (RGB if None).

        Returns:
            The spec the manifest records as ``transform``.

        Raises:
            UsageError: a bad size or normalisation value, naming its option.
        """
        store = self.store if self.store is not None else default_store
        mode = self.mode or default_mode or "RGB"
        crop = _size("--center-crop", self.center_crop)
        crop = as_pair(crop)
        resize = _size("--resize", self.resize)
        channels = 1 if mode == "L" else 3
        mean = IMAGENET_MEAN[:channels] if self.mean is None else tuple(self.mean)
        std = IMAGENET_STD[:channels] if self.std is None else tuple(self.std)
        if self.normalize:
            for name, values in (("--mean", mean), ("--std", std)):
                if len(values) != channels:
                    raise UsageError(f"{name}: {len(values)} values, but mode {mode} has {channels} channel"
                                     f"{'s' if channels > 1 else ''}; give one value per channel")
                if not all(math.isfinite(v) for v in values) or (name == "--std" and min(values) <= 0):
                    raise UsageError(f"{name}: {','.join(map(str, values))} must be finite numbers"
                                     f"{' above 0' if name == '--std' else ''}")
        else:  # unused without normalize: recorded as the defaults, so that they change no manifest
            mean, std = IMAGENET_MEAN, IMAGENET_STD
        changes = bool(resize or self.max_size or crop or mode != "RGB" or self.exif_transpose)
        if store is None:
            store = "raw" if self.normalize else ("jpeg" if changes else "original")
        dtype = self.dtype or ("float16" if self.normalize else "uint8")
        for name, size in (("--resize", resize), ("--center-crop", crop)):
            if isinstance(size, tuple) and (size[0] * size[1] > self.max_pixels or max(size) > MAX_SIDE):
                raise UsageError(f"{name}: {size[0]}x{size[1]} is over the {self.max_pixels:,}-pixel limit "
                                 f"(--max-pixels) or a side of {MAX_SIDE}")
        settled = {"store": store, "resize": resize, "center_crop": crop, "mode": mode, "mean": tuple(mean),
                   "std": tuple(std), "dtype": dtype}
        return TransformSpec(**{f.name: settled.get(f.name, getattr(self, f.name)) for f in fields(TransformSpec)})


def _size(option: str, value: int | str | tuple[int, int] | None) -> int | tuple[int, int] | None:
    try:
        return parse_size(value)
    except ValueError as exc:
        raise UsageError(f"{option}: {exc}") from None


def click_options(command: Callable) -> Callable:
    """Decorate a click command with one option per :class:`PackOptions` field that has a command-line form, in
    the fields' order; each is passed to the command under the field's name."""
    for f in reversed(fields(PackOptions)):
        cli = f.metadata["cli"]
        if cli is None:
            continue
        kwargs = {k: v for k, v in cli.items() if k != "decls"}
        decls = cli.get("decls", ("--" + f.name.replace("_", "-"),))
        if not kwargs.get("required"):
            kwargs["default"] = f.default
        command = click.option(*decls, f.name, help=f.metadata["help"], **kwargs)(command)
    return command


def signature_parameters() -> list[inspect.Parameter]:
    """``pack()``'s keyword-only parameters, one per field after ``format`` (which is positional)."""
    return [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
            for f in fields(PackOptions) if f.name != "format"]


def args_doc(indent: str = "        ") -> str:
    """Google-style ``Args:`` lines for every field but ``format``."""
    return "\n".join(f"{indent}{f.name}: {f.metadata['help']}" for f in fields(PackOptions) if f.name != "format")


def pack_options(format: str, given: dict[str, Any]) -> PackOptions:
    """:class:`PackOptions` from ``pack()``'s keyword arguments; an unknown name is a TypeError, as for any
    function."""
    names = {f.name for f in fields(PackOptions)}
    unknown = sorted(set(given) - names)
    if unknown:
        raise TypeError(f"pack() got an unexpected keyword argument {unknown[0]!r}")
    return PackOptions(format=format, **given)

