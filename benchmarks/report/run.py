"""Run one part of the report on the GPU machine and write its JSON."""

from __future__ import annotations

import dataclasses
import logging
import shlex
import sys
from pathlib import Path

import torch

from vramshard.errors import InvalidInputError

from ..common import Deadline
from .grids import Settings, run_batch, run_dense
from .parts import get_part
from .record import PartRecord

log = logging.getLogger("report")


def run_part(name: str, out_dir: str | Path, settings: Settings | None = None, budgets=None, contexts=None,
             batch_sizes=None, deadline_s: float | None = None, command: str | None = None) -> Path:
    """Run the part ``name`` (see :data:`parts.PARTS`) and write ``report-<name>.json`` in
    ``out_dir``; returns its path. ``budgets`` / ``contexts`` / ``batch_sizes`` / ``deadline_s``
    replace the part's own (smoke tests, re-running a few cells)."""
    part = get_part(name)
    changes = {k: tuple(v) for k, v in (("budgets", budgets), ("contexts", contexts),
                                       ("batch_sizes", batch_sizes)) if v}
    if deadline_s:
        changes["deadline_s"] = deadline_s
    part = dataclasses.replace(part, **changes)
    if not torch.cuda.is_available():
        raise InvalidInputError(f"report part {name} needs a CUDA GPU; run it on the GPU machine "
                                f"(see benchmarks/README.md), then merge its JSON here")
    settings = settings or Settings()
    deadline = Deadline(part.deadline_s)
    record = PartRecord(part, out_dir, command or " ".join(["python -m benchmarks.report", *map(shlex.quote,
                                                                                              sys.argv[1:])]),
                        {**dataclasses.asdict(settings), "budgets": part.budgets, "contexts": part.contexts,
                         "batch_sizes": part.batch_sizes, "deadline_s": part.deadline_s})
    runner = {"dense": run_dense, "batch": run_batch}.get(part.grid)
    if runner is None:
        from .vlm_part import run_vlm

        runner = run_vlm
    try:
        runner(part, record, settings, deadline)
    finally:
        record.write()
    return record.finish()
