"""The one resume protocol of packer's loaders: :class:`Stateful`, :func:`check_state` and :class:`CountingIterator`.

``make_loader``'s loaders and ``packer.stream`` both save their position as a small JSON-able dict: a version,
the epoch, a position in it (``samples_seen`` or ``batches``), and the settings that fix which batch comes when.
:func:`check_state` checks such a dict key by key and type by type before anything is taken from it, so that a
damaged or foreign state is one ``ValueError`` line at ``load_state_dict`` and never a failure at the next batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

STATE_VERSION = 1
INT64_MAX = 2**63 - 1  # torch indexes with int64: a larger epoch or position overflows at the next batch


@runtime_checkable
class Stateful(Protocol):
    """What can be saved and resumed: ``torchdata``'s ``Stateful`` protocol, which Lightning also uses."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class StateSchema:
    """What a state of one kind of loader holds.

    Args:
        what: how messages name the state and its owner (``"loader"``, ``"stream"``).
        position: the key of the position within the epoch (``"samples_seen"``, ``"batches"``).
        limit: the largest valid position (the dataset's length, or the epoch's batches).
        settings: the keys and values that must match the loader that loads the state.
        free: other keys the state holds that need not match (``world_size`` of an elastic resume): a positive
            int each.
        version: the state's ``version`` (a loader whose state changes meaning bumps its own).
    """

    what: str
    position: str
    limit: int
    settings: Mapping[str, Any]
    free: tuple[str, ...] = ()
    version: int = STATE_VERSION

    def keys(self) -> set[str]:
        return {"version", "epoch", self.position, *self.settings, *self.free}


def check_state(state: Any, schema: StateSchema) -> tuple[int, int]:
    """The ``(epoch, position)`` of a saved state, after checking every key and its type.

    Raises:
        ValueError: one line: not a dict or another version, a missing or unknown key, a value of the wrong type
            or range (each named), or a setting that differs from this loader's (it says which).
    """
    what = schema.what
    if not isinstance(state, Mapping) or state.get("version") != schema.version:
        raise ValueError(f"not a packer {what} state (version {schema.version}): {str(state)[:200]}; pass what "
                         f"state_dict() returned")
    for key, mine in schema.settings.items():  # first: a different setting explains a different set of keys
        if key not in state:
            continue
        theirs = state[key]
        if theirs != mine or type(theirs) is not type(mine):
            raise ValueError(f"the {what} state was saved with {key}={theirs!r}, this {what} has {key}={mine!r}; "
                             f"resume with the same {key}")
    missing = sorted(schema.keys() - set(state))
    if missing:
        raise ValueError(f"the {what} state has no {', '.join(map(repr, missing))}; pass what state_dict() returned")
    unknown = sorted(map(str, set(state) - schema.keys()))
    if unknown:
        raise ValueError(f"the {what} state has unknown key{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(map(repr, unknown))}; pass what state_dict() returned")
    for key in schema.free:
        if not _is_int(state[key]) or not 1 <= state[key] <= INT64_MAX:
            raise ValueError(f"the {what} state has {key}={state[key]!r}; it must be a positive int")
    epoch, position = state["epoch"], state[schema.position]
    if not _is_int(epoch) or not 0 <= epoch <= INT64_MAX:
        raise ValueError(f"the {what} state has epoch={epoch!r}; it must be an int from 0 to 2**63-1")
    if not _is_int(position) or not 0 <= position <= schema.limit:
        raise ValueError(f"the {what} state has {schema.position}={position!r}; it must be an int from 0 to "
                         f"{schema.limit}")
    return epoch, position


class Progress:
    """The pass an iteration makes, and how many batches the caller has received from it.

    Args:
        plan: the pass (an ``EpochPass`` or a ``StreamPlan``).
        total: the batches the caller will receive in this iteration.
        start: where in the epoch the iteration started (in the plan's unit), 0 for a whole epoch.
    """

    __slots__ = ("plan", "total", "start", "received")

    def __init__(self, plan: Any, total: int, start: int = 0):
        self.plan, self.total, self.start = plan, total, start
        self.received = 0

    @property
    def finished(self) -> bool:
        return self.received >= self.total


class CountingIterator:
    """Counts the batches handed to the caller in a :class:`Progress`. The loader holds the progress, not this
    iterator, so dropping the iterator still ends whatever it wraps (a prefetch thread, worker processes)."""

    def __init__(self, iterator: Iterator, progress: Progress):
        self.iterator = iterator
        self.progress = progress

    def __iter__(self) -> CountingIterator:
        return self

    def __next__(self) -> Any:
        batch = next(self.iterator)
        self.progress.received += 1
        return batch

    def __len__(self) -> int:
        return self.progress.total
