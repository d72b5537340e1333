"""The interface every format implements: a :class:`Writer` and a :class:`Reader`, and the registry of formats.

A format module defines one subclass of each and registers them with :func:`register` (``formats/__init__.py``
imports every format module, so importing :mod:`packer.formats` registers them all). The converter only talks
to ``Writer``; the generic :class:`packer.reading.dataset.PackedDataset`, ``verify``, ``export`` and the repack source
only to ``Reader``. Neither needs torch: ``packer pack``, ``info``, ``verify`` and ``export`` start without it.
"""

from __future__ import annotations

import operator
import os
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import numpy as np

from ..errors import CorruptDataError, UsageError
from ..fields import Field, extra_fields, fields_crc32, schema_of
from ..images.transforms import Encoded, TransformSpec
from ..manifest import add_key_check, label_bounds, read_local_manifest
from .layout import Layout, RangeSource, join_rows


class Writer(ABC):
    """Writes converted samples, in order, into ``dest``. Lives in the main process only. A format's writer is
    made as ``Writer(dest, spec, expected_count, options)``; the count and options are for its own use."""

    format: ClassVar[str]
    RESUMES_FROM: ClassVar[str] = "nothing"  # what an interrupted conversion keeps, for messages
    # fnmatch patterns of every file the writer leaves in DEST, finished or interrupted: --overwrite deletes
    # only these (and packer's own manifest, journal and loader.json)
    FILES: ClassVar[tuple[str, ...]] = ()
    # read in its stored order (streamed), so that order should be a shuffle: packing shuffles by default
    READ_IN_ORDER: ClassVar[bool] = False

    def __init__(self, dest: Path, spec: TransformSpec, expected_count: int, options: dict[str, Any] | None = None):
        self.dest = dest
        self.spec = spec
        self.count = 0
        # the fields beyond the image and the class (options["schema"]: absent for image-and-class datasets)
        self.extra_fields: list[Field] = extra_fields((options or {}).get("schema") or schema_of({}))

    @classmethod  # noqa: B027 - a format that stores any schema checks nothing
    def check_schema(cls, schema: Sequence[Field], options: dict[str, Any] | None = None, where: object = "") -> None:
        """Refuse, before anything is read or written, a schema this format cannot store (a field name it cannot
        write): a :class:`~packer.errors.UsageError` whose one line begins with ``where`` (``"TABLE: "``) and
        names the field. ``options`` are the writer's (WebDataset's ``caption``). Each format owns its rule."""

    @abstractmethod
    def write(self, label: int, relpath: str, item: Encoded, extras: tuple[bytes, ...] = ()) -> int | None:
        """Append one sample; its index is ``self.count`` before the call. ``extras`` are the stored bytes of
        :attr:`extras`' fields, in order. When the call made samples durable (a committed transaction, a
        finished shard), return how many are now durable, else None."""

    def state(self) -> dict[str, Any]:
        """What :meth:`restore` needs to continue after the durable samples; saved in the journal."""
        return {"count": self.count}

    def restore(self, state: dict[str, Any]) -> int:
        """Drop anything written after ``state`` and continue from there; return the samples kept (0 restarts)."""
        return 0

    @abstractmethod
    def close(self) -> dict[str, Any]:
        """Finish every data file and return the manifest entries they add (at least ``files``)."""

    def abort(self) -> None:  # noqa: B027 - most writers have nothing to release
        """Release what is open after a failure; leave the files for --resume."""

    @classmethod
    def merge_parts(cls, parts: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """The manifest entries of a conversion made in parts (one per rank), from each part's record by its
        folder (``part-00000``...): every part's ``files``, named from DEST. Formats that add keys of their own
        (WebDataset's ``shards``) merge those too."""
        return prefixed_entries(parts, ("files",))


class Sample(NamedTuple):
    """One stored sample as a reader finds it: the payload (a buffer, not yet copied) and what it needs."""

    payload: memoryview | bytes
    label: int
    shape: tuple[int, int, int]
    crc32: int | None


class StreamSample(NamedTuple):
    """One sample as a format's sequential reader (:meth:`Reader.stream_file`) finds it, for ``packer.stream``:
    its key, the image's stored bytes and extension (``jpg``, ``png``, ``npy``...), the label (-1: none) and the
    stored bytes of the requested extra fields, by name."""

    key: str
    image: bytes
    ext: str
    label: int
    fields: dict[str, bytes | memoryview]


class Reader(ABC):
    """Reads the stored samples of one dataset: its manifest, its data files, and sample ``i`` as a
    :class:`Sample`. No decoding (that is :class:`packer.reading.decoding.Decoding`'s) and no torch.

    Nothing that cannot cross a fork or a pickle is opened in ``__init__``: each process opens its own handles
    on first use (:meth:`open`, checked by pid), and pickling drops them (the attributes named in ``HANDLES``).
    Indices given to the methods are in range (:meth:`check_index` makes them so).

    Args:
        root: the dataset folder.
        manifest: its manifest, when the caller has read it already.
    """

    format: str = ""  # the registered name; a reader over parts or blocks of one names it per instance
    ACCEPTS_PARTS: ClassVar[bool] = False  # only the parted reader reads a manifest of several parts
    HANDLES: ClassVar[tuple[str, ...]] = ()  # per-process handles, dropped when pickled

    def __init__(self, root: str | os.PathLike, manifest: dict | None = None):
        self.root = Path(root)
        self.manifest = manifest if manifest is not None else read_local_manifest(self.root)
        if self.manifest.get("parts") is not None and not self.ACCEPTS_PARTS:
            raise ValueError(f"{self.root}: converted in {len(self.manifest['parts'])} parts (by several ranks); "
                             "open it with packer.open_dataset")
        self.schema: list[Field] = schema_of(self.manifest, str(self.root / "manifest.json"))
        self.extra_fields: list[Field] = extra_fields(self.schema)
        self.classes: list[str] = list(self.manifest["classes"])
        self.class_to_idx: dict[str, int] = dict(self.manifest["class_to_idx"])
        self.spec = TransformSpec.from_dict(self.manifest["transform"])
        self.label_low, self.label_high = label_bounds(self.manifest)
        self._pid: int | None = None
        self._validated = False  # whether _check_data passed (carried to workers with the reader)
        self.skipped: list[tuple[str, str]] = []  # ("FILE/MEMBER", why) left out of data other tools wrote

    # -- what each format implements ----------------------------------------------------------------------------
    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def _open(self) -> None:
        """Open this process's handles (LMDB env, HDF5 file, mapped shards)."""

    @abstractmethod
    def read(self, index: int) -> Sample:
        """The stored sample at ``index``; the reader is open (:meth:`open`)."""

    def read_many(self, indices: list[int]) -> list[Sample]:
        """Several samples at once; formats override this to serve a batch in one call."""
        return [self.read(i) for i in indices]

    def read_extras(self, index: int) -> tuple[memoryview | bytes, ...]:
        """The stored bytes of sample ``index``'s extra fields (:attr:`extras`, in order); the reader is open.
        Formats with extra fields implement it."""
        return ()

    def fields_checksum(self, index: int) -> int | None:
        """The checksum recorded for sample ``index``'s extra fields (:func:`packer.fields.fields_crc32`)."""
        return None

    def read_fields(self, index: int, verify: bool = False) -> dict[str, memoryview | bytes]:
        """Sample ``index``'s extra fields as stored bytes, by name (decode them with :func:`packer.fields.decode`;
        images and masks are encoded images). With ``verify``, their checksum is checked first."""
        if not self.extra_fields:
            return {}
        index = self.check_index(index)
        self.open()
        values = self.read_extras(index)
        if len(values) != len(self.extra_fields):
            raise CorruptDataError(f"{self.describe(index)}: holds {len(values)} fields, the manifest says "
                                   f"{len(self.extra_fields)}; run `packer verify`")
        if verify:
            self.check_fields(index, values)
        return {f.name: v for f, v in zip(self.extra_fields, values, strict=True)}

    def check_fields(self, index: int, values: Sequence[memoryview | bytes]) -> None:
        """:class:`CorruptDataError` unless sample ``index``'s extra fields as stored (``values``, in order) match
        the checksum recorded for them (when the format records one; a dataset without extra fields has none)."""
        if not self.extra_fields:
            return
        crc = self.fields_checksum(index)
        if crc is not None and fields_crc32(values) != crc:
            raise CorruptDataError(f"{self.describe(index)}: checksum mismatch in its fields, the stored bytes are "
                                   "damaged; run `packer verify` and re-pack")

    def read_fields_many(self, indices: list[int], verify: bool = False) -> list[dict[str, memoryview | bytes]]:
        """:meth:`read_fields` of several samples."""
        return [self.read_fields(i, verify) for i in indices]

    def class_counts(self) -> np.ndarray:
        """How many samples each label has (index: label), from the stored records without decoding; the reader
        is open. Formats with a label index may answer from it. Samples without a class (-1) are not counted."""
        labels = np.fromiter((self.read(i).label for i in range(len(self))), dtype=np.int64, count=len(self))
        return np.bincount(labels[labels >= 0], minlength=len(self.manifest["classes"]))

    def gather_raw(self, indices: list[int], out: np.ndarray) -> np.ndarray | None:
        """Formats that can copy a batch of fixed-shape raw images in one call do so into ``out`` and return the
        labels; None means "read them one by one"."""
        return None

    @abstractmethod
    def relpath(self, index: int) -> str:
        """The sample's path relative to the source folder, with '/' separators (opens the reader if needed)."""

    def describe(self, index: int) -> str:
        """Where sample ``index`` lives, for error messages."""
        return f"{self.root} sample {index}"

    @abstractmethod
    def sample_file(self, index: int) -> str:
        """The data file that holds sample ``index``, relative to :attr:`root` as the manifest's ``files`` name it."""

    # -- what the data says against the manifest, checked when a dataset opens --------------------------------------
    def validate(self) -> None:
        """Check the data files against the manifest (:meth:`_check_data`) once, before ``len()``, the first
        read or :meth:`open` answer anything from the manifest's numbers; a lie is one line of
        :class:`CorruptDataError` or :class:`~packer.errors.ManifestError` naming the file."""
        if not self._validated:
            self._check_data()
            self._validated = True

    def _check_data(self) -> None:  # noqa: B027 - a reader with nothing beyond the manifest to check
        """The format's checks of its data files against the manifest (counts, index lengths, labels, shapes),
        reading only metadata and the per-sample index; no per-process handle is kept."""

    def check_labels(self, where: object, labels: np.ndarray) -> None:
        """:class:`CorruptDataError` naming ``where`` unless every label is a class index (-1 too for a dataset
        without class labels)."""
        if len(labels) and not (self.label_low <= int(labels.min()) and int(labels.max()) < self.label_high):
            bad = labels[(labels < self.label_low) | (labels >= self.label_high)][0]
            raise CorruptDataError(f"{where}: label {int(bad)} is not a class index ({self.label_low}.."
                                   f"{self.label_high - 1}); the dataset is damaged, run `packer verify` and re-pack")

    def check_shapes(self, where: object, shapes: np.ndarray) -> None:
        """:class:`CorruptDataError` naming ``where`` unless every (H, W, C) row is an image of the dataset's
        channels (sides are uint16: at most MAX_SIDE). A sample of another shape than the manifest's is named
        as it is read (``packer verify --deep`` names each)."""
        if not len(shapes):
            return
        bad = (shapes[:, 0] < 1) | (shapes[:, 1] < 1) | (shapes[:, 2] != self.spec.channels)
        if bad.any():
            raise CorruptDataError(f"{where}: sample {int(np.flatnonzero(bad)[0])} has shape "
                                   f"{tuple(shapes[bad][0].tolist())}, not an (H, W, {self.spec.channels}) image; "
                                   "the dataset is damaged, re-pack")

    def bad_count(self, where: object, found: int) -> CorruptDataError:
        """The error for data that holds ``found`` samples where the manifest says another count."""
        return CorruptDataError(f"{where}: holds {found} samples, the manifest says {self.manifest['count']}; the "
                                "manifest or the data is damaged, run `packer verify` and re-pack")

    def blocks(self, target_bytes: int) -> np.ndarray:
        """The start index of each block: contiguous runs of samples cheap to read sequentially, of about
        ``target_bytes`` each (``make_loader(shuffle="blocks")``). This default cuts the samples evenly by the
        data files' sizes the manifest records; formats that know each sample's size or their files' layout
        override it. An increasing int64 array from 0 (empty for an empty dataset)."""
        n = len(self)
        total = sum(int(e.get("bytes", 0)) for e in self.manifest.get("files", []) if isinstance(e, dict))
        step = max(1, int(target_bytes * n // total)) if total > 0 else 1
        return np.arange(0, n, step, dtype=np.int64)

    # -- reading by byte ranges (a dataset larger than the local cache: packer.formats.layout) ------------------
    @classmethod
    def layout(cls, manifest: dict, source: RangeSource, where: str) -> Layout:
        """Each sample's byte range in the data files, and the per-sample arrays :meth:`ranged_sample` needs,
        computed from byte ranges of the files (``source``) without reading the samples' payloads. ``where``
        (the dataset's URL or folder) names the dataset in errors.

        Raises:
            UsageError: the format cannot be read a block at a time.
            CorruptDataError: the files disagree with ``manifest``."""
        raise UsageError(f"{where}: {cls.format or 'this'} datasets cannot be read a block at a time; raise "
                         "cache_limit to the dataset's size")

    @classmethod
    def join_index(cls, indexes: Sequence[dict[str, np.ndarray]], counts: Sequence[int],
                   where: object) -> dict[str, np.ndarray]:
        """The ``index`` of the layout of a conversion made in parts, from each part's (``counts``: its
        samples), in order: by default each array end to end, which must hold one row a sample
        (:func:`~packer.formats.layout.join_rows`); a format whose index holds more joins it here."""
        return join_rows(indexes, counts, where)

    @classmethod
    def ranged_sample(cls, index: int, data: memoryview, layout: Layout, where: str) -> Sample:
        """Sample ``index`` from its range's bytes (``data``: bytes ``layout.start[index]:layout.end[index]``
        of its file); :class:`CorruptDataError` naming the sample (:meth:`Layout.sample_name` of ``where``, the
        dataset's URL or folder) when they are not a sample. Called once a sample read: it names nothing else."""
        raise NotImplementedError

    @classmethod
    def ranged_extras(cls, index: int, data: memoryview, layout: Layout, extras: Sequence[Field],
                      where: str) -> tuple[memoryview | bytes, ...]:
        """:meth:`read_extras` of sample ``index`` from its range's bytes (``extras``: the manifest's extra
        fields, in order; ``where``: the dataset's URL or folder, as for :meth:`ranged_sample`)."""
        raise NotImplementedError

    @classmethod
    def ranged_fields_checksum(cls, index: int, data: memoryview, layout: Layout) -> int | None:
        """:meth:`fields_checksum` of sample ``index`` from its range's bytes."""
        raise NotImplementedError

    # -- verify hooks --------------------------------------------------------------------------------------------
    def count_problems(self) -> list[str]:
        """Where the open data disagrees with the manifest's sample count (``packer verify``)."""
        return []

    def index_files(self) -> tuple[str, ...]:
        """Data files (as :meth:`sample_file` names them) that locate every sample: when one is damaged,
        ``packer verify`` checks every sample."""
        return ()

    def member_problems(self, deep: bool, damaged_files: set[str], key_offset: int = 0) -> list[str]:
        """Checks of what other tools read from the data files beyond packer's own index (``packer verify``):
        for the files in ``damaged_files``, or every file with ``deep``. ``key_offset`` is where the sample keys
        of a part of a distributed conversion start."""
        return []

    # -- what each format knows of its own manifest keys, files and handles --------------------------------------
    @classmethod  # noqa: B027 - a format without manifest keys of its own checks nothing
    def check_manifest(cls, data: dict, where: str) -> None:
        """Check the manifest keys this format owns, wherever they appear (any manifest that has them): a
        :class:`~packer.errors.ManifestError` naming ``where``. Run by :func:`packer.manifest.parse_manifest`
        for every registered format."""

    @classmethod
    def summary(cls, dest: str, manifest: dict) -> list[str]:
        """Lines ``packer info`` adds about this format's own keys (indented by two spaces)."""
        return []

    @classmethod
    def stream_files(cls, manifest: dict) -> list[tuple[str, int]] | None:
        """The data files ``packer.stream`` reads from start to end, with their sample counts, in the stored
        order; None for a format that is not read sequentially."""
        return None

    @classmethod
    def stream_file(cls, path: Path, extras: Sequence[Field] = (), where: object = None,
                    wanted: Callable[[int], bool] | None = None,
                    stored: Sequence[Field] | None = None) -> Iterator[StreamSample | None]:
        """The samples of one of :meth:`stream_files`' files (a local copy at ``path``; ``where`` names it in
        messages), read sequentially; ``extras``: the extra fields to give, of ``stored``, the dataset's extra
        fields in stored order (default: ``extras``). A sample ``wanted`` declines (given its place in the file,
        from 0) is None, and need not be read."""
        raise NotImplementedError(f"{cls.format} is not read sequentially")

    @classmethod
    def from_foreign(cls, paths: list[Path], label_key: str | None = None) -> Reader | None:
        """A reader over data files another tool wrote (``packer pack`` from them), every member kept as a
        field; what it leaves out is in its ``skipped``. None when this format reads no such files."""
        return None

    @classmethod  # noqa: B027 - most formats keep no handles beyond a reader's own
    def close_process_handles(cls) -> None:
        """Close the handles this format's readers share per process (they reopen on next use); only while no
        loader is reading. Most formats keep handles per reader and have none."""

    def stored_sizes(self) -> np.ndarray | None:
        """The stored bytes of each sample (int64, by index), when the format knows them without reading the
        samples; else None."""
        return None

    def stored_shapes(self) -> np.ndarray | None:
        """The stored (H, W, C) of each sample, ``(N, 3)``, when the format knows them without reading the
        samples (an index of them); else None."""
        return None

    # -- shared machinery -------------------------------------------------------------------------------------------
    def open(self) -> None:
        """Open this process's handles now (once per process; later calls return at once), so that a missing,
        damaged or replaced data file is reported before any sample is asked for."""
        if self._pid != os.getpid():
            self.validate()
            self._open()
            self._pid = os.getpid()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_pid"] = None
        for key in self.HANDLES:
            state[key] = None
        return state

    @property
    def is_raw(self) -> bool:
        """Whether samples are stored as raw pixel arrays (store ``raw``) rather than encoded images."""
        return self.spec.store == "raw"

    def check_index(self, index: int) -> int:
        """``index`` as a sample index in range: an int, numpy integer or EpochIndex, negative from the end;
        IndexError out of range (1.5 is a TypeError, not sample 1)."""
        index = operator.index(index)
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"sample index {index} out of range for {n} samples")
        return index % n

    def checked(self, index: int, sample: Sample) -> Sample:
        """``sample`` after checking its crc32 and label; :class:`CorruptDataError` when either is damaged."""
        if sample.crc32 is not None:
            if zlib.crc32(sample.payload) != sample.crc32:
                raise CorruptDataError(f"{self.describe(index)}: checksum mismatch, the stored bytes are damaged; "
                                       "run `packer verify` and re-pack")
            self.check_label(index, sample.label)
        return sample

    def check_label(self, index: int, label: int) -> None:
        """The crc32 covers the payload only, so a damaged label is caught by comparing it with the class folder
        that starts the sample's relative path, which packer stores separately (ImageFolder: that folder is the
        class). A dataset packed from a table or from shards has no class folders: its label is not checked so."""
        if "fields" in self.manifest:
            return
        folder = self.relpath(index).split("/", 1)[0]
        expected = self.class_to_idx.get(folder)
        if expected is not None and expected != label:
            raise CorruptDataError(f"{self.describe(index)}: label {label} does not match its class folder "
                                   f"{folder!r} ({expected}); the stored label is damaged, run `packer verify`")

    def stored_array(self, index: int, sample: Sample) -> np.ndarray | None:
        """The sample's pixels, (H, W, C), when it is stored as an array (a read-only view of the stored data);
        None when it is an encoded image."""
        if not self.is_raw:
            return None
        return self._as_array(index, sample, self.spec.dtype)

    def _as_array(self, index: int, sample: Sample, dtype: str) -> np.ndarray:
        try:
            return np.frombuffer(sample.payload, dtype=dtype).reshape(sample.shape)
        except ValueError:
            raise CorruptDataError(f"{self.describe(index)}: stored array has {len(sample.payload)} bytes, not the "
                                   f"{sample.shape} it should; re-pack") from None

    def raw_sample(self, index: int, verify: bool = True) -> tuple[bytes | np.ndarray, int]:
        """The export hook: the stored bytes (encoded stores) or a copy of the stored array, and the label;
        checked first with ``verify``."""
        self.open()
        sample = self.read(index)
        if verify:
            sample = self.checked(index, sample)
        array = self.stored_array(index, sample)
        if array is not None:
            return array.copy(), sample.label
        return bytes(sample.payload), sample.label


def blocks_by_size(sizes: np.ndarray, target_bytes: int) -> np.ndarray:
    """Block starts over samples of these stored ``sizes`` (in index order, laid out one after another): a
    block holds the samples that begin within one ``target_bytes`` stretch of the data (at least one sample)."""
    sizes = np.asarray(sizes, dtype=np.int64)
    if sizes.size == 0:
        return np.zeros(0, np.int64)
    begins = np.cumsum(sizes) - sizes
    marks = np.arange(0, int(begins[-1]) + 1, max(1, int(target_bytes)), dtype=np.int64)
    return np.unique(np.searchsorted(begins, marks, side="left"))


def run_starts(values: np.ndarray) -> np.ndarray:
    """Where each run of equal ``values`` begins (block starts over, say, each sample's shard number)."""
    values = np.asarray(values)
    if values.size == 0:
        return np.zeros(0, np.int64)
    return np.concatenate([[0], np.flatnonzero(values[1:] != values[:-1]) + 1]).astype(np.int64)


_REGISTRY: dict[str, tuple[type[Writer], type[Reader]]] = {}


def register(name: str, writer: type[Writer], reader: type[Reader]) -> None:
    """Make format ``name`` known: its writer and reader (called by each format module as it is imported)."""
    writer.format = name
    reader.format = name
    _REGISTRY[name] = (writer, reader)
    add_key_check(reader.check_manifest)


def get_format(name: str) -> tuple[type[Writer], type[Reader]]:
    """The writer and reader classes of format ``name``; ValueError naming the known formats otherwise."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown format {name!r}; choose one of {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def format_names() -> list[str]:
    """The registered formats, in the order they were registered (the first is the default)."""
    return list(_REGISTRY)


def readers() -> list[type[Reader]]:
    """The registered formats' reader classes, in :func:`format_names`' order."""
    return [reader for _, reader in _REGISTRY.values()]


def prefixed_entries(parts: dict[str, dict[str, Any]], keys: Sequence[str]) -> dict[str, Any]:
    """Each of ``keys``' entry lists over the parts of a conversion (``{folder: the part's record}``), each
    entry's ``path`` under its part's folder; a key no part has is left out."""
    merged: dict[str, Any] = {}
    for folder, info in parts.items():
        for key in keys:
            if key in info:
                merged.setdefault(key, []).extend({**e, "path": f"{folder}/{e['path']}"} for e in info[key])
    return merged


def writer_files() -> tuple[str, ...]:
    """The file-name patterns (fnmatch) that any format's writer leaves in DEST."""
    return tuple(pattern for writer, _ in _REGISTRY.values() for pattern in writer.FILES)
