"""DEST made ready for a conversion, in one place: the interrupted conversion's journal to resume, or DEST checked,
emptied where ``--overwrite`` allows it, and given a fresh journal."""

from __future__ import annotations

from pathlib import Path

from ..errors import DestinationError, warn
from .dest import dataset_problems, prepare_output
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
        return journal, True
    if plan.options.resume:
        warn(f"nothing to resume in {dest}; starting afresh")
    problem = plan.source.dest_problem(dest)
    if problem:
        raise DestinationError(problem)
    if plan.options.overwrite:
        check_parts_free(dest)
    prepare_output(dest, plan.options.overwrite, dataset_problems, "packer dataset")
    return start(dest, plan.record), False
