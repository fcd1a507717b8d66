"""Running the same teacher-forced token sequence through engines of different placements."""

import torch

from vramshard.layers.step import Step

PROMPT = [5, 17, 42, 3, 77, 12, 9, 60, 31, 2, 88, 14]
FORCED = [7, 1, 55, 23, 90, 4, 4, 61, 18, 33, 70, 2, 9, 41, 12, 80]  # 16 decode steps


def trace_logits(engine, prompt=PROMPT, forced=FORCED, prefill_chunk=None) -> torch.Tensor:
    """Logits of a prefill (all rows) followed by one row per forced decode token."""
    kv = engine.executor.new_kv_cache(slots=1, max_ctx=len(prompt) + len(forced))
    rows = []
    chunk = prefill_chunk or len(prompt)
    for begin in range(0, len(prompt), chunk):
        part = prompt[begin : begin + chunk]
        rows.append(engine.executor.forward(torch.tensor(part), Step.single(begin, len(part), all_logits=True, kv_lookup=kv)))
    for i, token in enumerate(forced):
        rows.append(engine.executor.forward(torch.tensor([token]), Step.single(len(prompt) + i, 1, kv_lookup=kv)))
    return torch.cat(rows)
