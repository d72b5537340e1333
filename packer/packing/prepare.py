"""DEST made ready for a conversion, in one place: the interrupted conversion's journal to resume, or DEST checked,
emptied where ``--overwrite`` allows it, and given a fresh journal."""

from __future__ import annotations

from pathlib import Path

from ..errors import DestinationError, warn
from ..manifest import JOURNAL
from .dest import check_output, dataset_problems, empty_folder, only_leftovers
from .journal import resumable, start
from .lock import check_parts_free
from .plan import Plan


def open_dest(dest: Path, plan: Plan) -> tuple[dict, bool]:
    """DEST's journal and whether it resumes: the interrupted conversion's, or a fresh one in DEST prepared.

    Raises:
        DestinationError: ``dest`` would hold or be inside the source, cannot be used (nothing is deleted), or
            holds an interrupted conversion with other options.
        DestinationBusyError: a part folder in ``dest`` is being written.
    """
    journal = resumable(dest, plan.record, plan.options.resume)
    if journal is not None:
        if journal.get("writer") is None and "world_size" not in plan.record:
            # one process, nothing durable: what the interrupted run wrote goes (HDF5's temporary files, an LMDB
            # before its first commit); a distributed conversion keeps its progress in its part folders
            empty_folder(dest, keep=(JOURNAL,))
        return journal, True
    if plan.options.resume:
        warn(f"nothing to resume in {dest}; starting afresh")
    problem = plan.source.dest_problem(dest)
    if problem:
        raise DestinationError(problem)
    if plan.options.overwrite:
        check_parts_free(dest)
    try:
        if only_leftovers(dest):  # a conversion killed before its progress record was in place
            empty_folder(dest)
        if check_output(dest, plan.options.overwrite, dataset_problems, "packer dataset"):
            # the new progress record first: from here DEST is this unfinished conversion, whenever it is killed
            journal = start(dest, plan.record)
            empty_folder(dest, keep=(JOURNAL,))
            return journal, False
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DestinationError(f"{dest}: cannot create or empty this folder ({exc.strerror or exc}); choose "
                               "another destination") from None
    return start(dest, plan.record), False
