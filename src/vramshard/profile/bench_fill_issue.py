"""The host's time to issue one coded stream fill (:mod:`~vramshard.runtime.wire_codec`), as the ring issues it.

A coded fill moves over the link in rounds of :data:`~vramshard.runtime.wire_codec.ROUND_RAW_BYTES`, each a copy
into a staging half and a decode out of it; replayed from its CUDA graph (the executor's default from a fill's
second run on) the whole fill is one launch whose host cost still grows with its rounds. The host thread that
issues fills also queues the GPU's work and computes the CPU's, so a step's price needs it: the fifty-fifth GPU
session's H100 host took 112 us to replay a llama3-8b FFN's fill (21 rounds) and 2.2 ms to issue it round by round,
and about 0.28 ms a fill (a range of a split part's) under cProfile inside planned decode steps, where the
estimator priced nothing.

Timed here as :meth:`~vramshard.runtime.streaming.SlotRing._copy` issues a fill (on the copy stream: wait for the
slot, the fill, the slot's event), of one round and of :data:`LONG_ROUNDS`, from the graph and round by round; only
the host's issuing is timed (each batch is waited for after its clock stops).
"""

from __future__ import annotations

import torch

from .progress import ProgressSink
from .timing import host_issue_s

LONG_ROUNDS = 6  # rounds of the longer fill (its per-round cost against the one-round fill's)
BATCHES = 9  # batches of back-to-back fills; the fastest batch's mean is kept
REPS = 4  # fills a batch


def measure_fill_issue(*, budget_s: float, progress: ProgressSink, weight: float) -> dict | None:
    """``{"graph", "graph_round", "round"}``: the host's seconds to issue a coded fill replayed from its graph
    (the part every fill pays), each round more, and each round of a fill issued round by round; None where
    coded fills do not run here (no Triton)."""
    from ..runtime import wire_codec
    from ..runtime.pinned_host import pinned_empty

    if wire_codec.triton is None:
        return None
    progress.step("host cost of issuing a coded stream fill")
    nbytes = LONG_ROUNDS * wire_codec.ROUND_RAW_BYTES
    raw = pinned_empty(nbytes)
    raw.view(torch.bfloat16).copy_((torch.randn(nbytes // 2, device="cuda") * 0.02).to(torch.bfloat16))
    coded = wire_codec.CodedBuffer(raw, device="cuda")
    if not coded.capturable:
        return None
    staging = torch.empty(wire_codec.STAGING_BYTES, dtype=torch.uint8, device="cuda")
    target = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    copy_stream, decode_stream = torch.cuda.Stream(), torch.cuda.Stream()
    free, filled = torch.cuda.Event(), torch.cuda.Event()
    free.record()

    def host_s(overlap: wire_codec.OverlappedDecode, rounds: int, share: float) -> float:
        end = rounds * wire_codec.ROUND_RAW_BYTES

        def issue() -> None:
            with torch.cuda.stream(copy_stream):
                copy_stream.wait_event(free)
                coded.fill(target[:end], 0, end, staging, None, overlap)
                filled.record(copy_stream)

        for _ in range(2):  # round by round once, then captured where the graphs are on
            issue()
        return host_issue_s(issue, share, BATCHES, REPS)

    graphs = wire_codec.OverlappedDecode(staging, decode_stream, graphs=True)
    one, long = host_s(graphs, 1, budget_s / 3), host_s(graphs, LONG_ROUNDS, budget_s / 3)
    eager = host_s(wire_codec.OverlappedDecode(staging, decode_stream, graphs=False), LONG_ROUNDS, budget_s / 3)
    replayed = graphs.replays > 0
    progress.advance(weight)
    if not replayed:  # (the capture failed: the ring's fills go round by round here too)
        return {"graph": eager, "graph_round": eager / LONG_ROUNDS, "round": eager / LONG_ROUNDS}
    per_round = max((long - one) / (LONG_ROUNDS - 1), 1e-9)  # (the schema takes positive times only)
    return {"graph": max(one - per_round, 1e-9), "graph_round": per_round, "round": eager / LONG_ROUNDS}
