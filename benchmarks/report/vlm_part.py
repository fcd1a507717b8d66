"""The VLM parts (Table 8): vlm_bench's grid for vramshard (``vlm``) and for the transformers
``device_map="auto"`` baseline (``vlm-hf``), each row written as soon as it is measured."""

from __future__ import annotations

from .. import vlm_bench
from ..common import Deadline
from .parts import Part
from .record import PartRecord


class _LiveRows(list):
    """A list that rewrites the part's JSON whenever vlm_bench appends a row."""

    def __init__(self, record: PartRecord):
        super().__init__()
        self.record = record

    def append(self, row) -> None:
        super().append({**row, "grid": "vlm"})
        self.record.write()


def run_vlm(part: Part, record: PartRecord, settings, deadline: Deadline) -> None:
    """vramshard (``part.grid == "vlm"``) or transformers (``"vlm-hf"``) over budgets x images
    (x option sets for vramshard), stopping at the part's deadline like vlm_bench does."""
    names = settings.images or tuple(vlm_bench.RESOLUTIONS)
    option_sets = {k: v for k, v in vlm_bench.OPTION_SETS.items()
                   if settings.option_sets is None or k in settings.option_sets}
    images = {name: vlm_bench.image_inputs(name) for name in names}
    rows = _LiveRows(record)
    record.data["cells"] = rows
    record.set(shape=vlm_bench.SHAPE, answer_tokens=vlm_bench.ANSWER, context=vlm_bench.CONTEXT,
               step_tokens=vlm_bench.STEP_TOKENS)
    clock = vlm_bench.Clock(deadline.left())
    budgets = tuple(int(b) for b in part.budgets)
    if part.grid == "vlm":
        vlm_bench.run_ours(rows, budgets, images, option_sets, settings.vlm_decode, clock)
    else:
        vlm_bench.run_hf(rows, budgets, images, min(settings.vlm_decode, 4), clock)
