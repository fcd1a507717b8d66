"""The JSON document one part writes: what ran, where, when, with which command, and its cells.

Rewritten after every cell, so a part cut short (time limit, crash) still reports what it did.

    {"report_version": 1, "part": "dense-nemo-a", "grid": "dense", "model": "nemo-8b",
     "command": "...", "date": "...", "started_unix": ..., "hardware": {...}, "versions": {...},
     "bandwidth_gb_s": {...}, "profile": "...", "settings": {...}, "elapsed_s": ..., "complete": bool,
     "cells": [{"system": "vramshard", "budget_gib": 2.0, "context": 1024, "decode_tok_s": ..., ...},
               {"system": "bound", ...}, {"system": "layers:max", ..., "error": "why it could not run"}]}

Batch cells carry ``batch`` and ``tok_s``; VLM cells are vlm_bench's rows.
"""

from __future__ import annotations

import time
from pathlib import Path

from ..common import hardware, now, versions, write_json
from .parts import Part

REPORT_VERSION = 1


def part_path(out_dir: str | Path, part_name: str) -> Path:
    return Path(out_dir) / f"report-{part_name}.json"


class PartRecord:
    """Cells of one part run, written to ``report-<part>.json`` in ``out_dir`` as they come."""

    def __init__(self, part: Part, out_dir: str | Path, command: str, settings: dict):
        self.path = part_path(out_dir, part.name)
        self.started = time.perf_counter()
        self.data = {"report_version": REPORT_VERSION, "part": part.name, "grid": part.grid, "model": part.model,
                     "command": command, "date": now(), "started_unix": time.time(), "hardware": hardware(),
                     "versions": versions(), "settings": settings, "cells": [], "complete": False}

    @property
    def cells(self) -> list[dict]:
        return self.data["cells"]

    def set(self, **items) -> None:
        self.data.update(items)
        self.write()

    def add(self, cell: dict) -> None:
        self.cells.append(cell)
        self.write()

    def write(self) -> None:
        self.data["elapsed_s"] = time.perf_counter() - self.started
        write_json(self.path, self.data)

    def finish(self) -> Path:
        self.data["complete"] = True
        self.write()
        return self.path
