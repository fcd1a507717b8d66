"""Stream fills raw and coded (runtime/wire_codec.py) on a GPU, against the link's bound, in one process.

For the packed weights of real shapes (random, at std 0.02 as the benchmark models are, and with the heavy
tails of trained weights), each timed with CUDA events on a copy stream as the ring runs them:

- ``raw``: one pinned host->device copy of the buffer (the ring without the codec; also the link's rate);
- ``coded``: :meth:`CodedBuffer.fill` through a staging buffer of the ring's size (copies of coded blocks,
  each round decoded by one kernel launch on the copy stream);
- ``overlapped``: the same through the staging's two halves, each round decoded on a stream of its own
  beside the next round's copy (:class:`OverlappedDecode`, what the executor's ring does on a GPU), issued round
  by round; ``graph``: the same fill replayed from the CUDA graph captured at its second run (what the ring does
  by default, ``VRAMSHARD_FILL_GRAPHS``); with the host's seconds to issue each;
- ``decode``: the kernel alone over the whole buffer's coded blocks already in VRAM;
- ``bound``: the coded bytes at the raw copy's rate (the decode free, the copy engine never idle).

Also the seconds of coding each buffer on the GPU. Usage (a GPU machine):
``PYTHONPATH=src:. python -m benchmarks.wire_codec --out results.json``

``--exponents`` (any machine, no GPU): the exponent statistics of weight distributions against the block format
(entropy, distinct values, escapes a block, blocks overflowed), beside DFloat11's ~2.6 bits and ~40 values of
trained LLMs' bf16 weights.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time

import torch

from vramshard.runtime import wire_codec
from vramshard.runtime.wire_codec import CodedBuffer, FillStats, OverlappedDecode, decode_into

log = logging.getLogger("wire_codec")

# (name, dtype, matrices [rows, cols]) of one packed buffer each.
SHAPES = [
    ("llama3-8b FFN", torch.bfloat16, [(14336, 4096)] * 3),
    ("llama3-8b attention", torch.bfloat16, [(6144, 4096), (4096, 4096)]),
    ("qwen3-30b-a3b expert", torch.bfloat16, [(768, 2048)] * 3),
    ("nemo-8b FFN (fp16)", torch.float16, [(14336, 5120)] * 3),
]


def packed(matrices, dtype, tails: bool, seed: int = 0) -> torch.Tensor:
    """A pinned uint8 buffer of the matrices back to back, random at std 0.02 (made on the GPU);
    ``tails``: divided by sqrt(uniform) as a t-like heavy tail."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    parts = []
    for rows, cols in matrices:
        x = torch.randn(rows, cols, device="cuda", generator=g) * 0.02
        if tails:
            x /= torch.rand(rows, cols, device="cuda", generator=g).clamp_min(1e-3).sqrt()
        parts.append(x.to(dtype).view(torch.uint8).view(-1))
    device_bytes = torch.cat(parts)
    host = torch.empty(device_bytes.numel(), dtype=torch.uint8, pin_memory=True)
    host.copy_(device_bytes)
    return host


def timed(fn, stream: torch.cuda.Stream, repeats: int, warmup: int = 1, host: list | None = None) -> float:
    """Median seconds of ``fn`` queued on ``stream`` (events around each run, after ``warmup`` runs); ``host``:
    appended the median host seconds of queuing it."""
    times, issues = [], []
    for i in range(repeats + warmup):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            began = time.perf_counter()
            fn()
            issued = time.perf_counter() - began
            end.record(stream)
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end) / 1e3)
            issues.append(issued)
    if host is not None:
        host.append(statistics.median(issues))
    return statistics.median(times)


def measure(name: str, dtype, matrices, tails: bool, repeats: int) -> dict:
    host = packed(matrices, dtype, tails)
    n = host.numel()
    began = time.perf_counter()
    coded = CodedBuffer(host, "cuda")
    torch.cuda.synchronize()
    encode_s = time.perf_counter() - began
    target = torch.empty(n, dtype=torch.uint8, device="cuda")
    staging = torch.empty(wire_codec.STAGING_BYTES, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    raw_s = timed(lambda: target.copy_(host, non_blocking=True), stream, repeats)
    coded_s = timed(lambda: coded.fill(target, 0, n, staging), stream, repeats)
    torch.cuda.synchronize()
    exact = torch.equal(target.cpu(), host)
    # The ring's way on a GPU: rounds through the staging's halves, decoded on their own stream; issued round by round,
    # and replayed from the graph captured at the second fill (VRAMSHARD_FILL_GRAPHS; two warm-up fills).
    issue, filled = [], {}
    for graphs in (False, True):
        overlap = OverlappedDecode(staging, torch.cuda.Stream(), graphs=graphs)
        target.fill_(0)
        filled[graphs] = timed(lambda: coded.fill(target, 0, n, staging, None, overlap), stream, repeats, 2, issue)
        torch.cuda.synchronize()
        exact = exact and torch.equal(target.cpu(), host)
    overlap_s, graph_s = filled[False], filled[True]
    row = {"buffer": name, "tails": tails, "dtype": str(dtype).split(".")[-1], "raw_bytes": n,
           "wire_bytes": coded.wire_bytes(), "coded": coded.coded is not None, "overflowed_blocks": len(coded.overflow),
           "encode_s": encode_s, "raw_s": raw_s, "coded_s": coded_s, "overlap_s": overlap_s, "exact": exact,
           "graph_s": graph_s, "overlap_issue_s": issue[0], "graph_issue_s": issue[1],
           "link_gb_s": n / raw_s / 1e9, "bound_s": coded.wire_bytes() / (n / raw_s)}
    if coded.coded is not None:
        on_device = coded.coded.cuda()
        row["decode_s"] = timed(lambda: decode_into(on_device, target[: coded.blocks * wire_codec.BLOCK_BYTES].view(
            torch.int16)), stream, repeats)
    row["speedup"] = raw_s / coded_s
    row["of_bound"] = row["bound_s"] / coded_s
    row["overlap_speedup"] = raw_s / overlap_s
    row["overlap_of_bound"] = row["bound_s"] / overlap_s
    stats = FillStats()
    coded.fill(target, 0, n, staging, stats)
    torch.cuda.synchronize()
    log.info("%-22s %s: %.1f MB, wire x%.3f; raw %.2f ms (%.1f GB/s), coded %.2f ms (x%.2f faster, %.0f%% of its "
             "bound %.2f ms), overlapped %.2f ms (%.0f%%; host %.0f us to issue), from its graph %.2f ms (host %.0f "
             "us), decode alone %s; coded in %.2f s; exact %s", name,
             "tails" if tails else "normal", n / 1e6, coded.wire_bytes() / n, raw_s * 1e3, row["link_gb_s"],
             coded_s * 1e3, row["speedup"], 100 * row["of_bound"], row["bound_s"] * 1e3, overlap_s * 1e3,
             100 * row["overlap_of_bound"], issue[0] * 1e6, graph_s * 1e3, issue[1] * 1e6,
             f"{row['decode_s'] * 1e3:.3f} ms" if "decode_s" in row else "-", encode_s, exact)
    return row


def exponent_stats(weights: torch.Tensor, name: str) -> dict:
    """How the bf16 ``weights`` (any float tensor) meet the block format: the exponents' entropy and distinct values
    over all of them, escapes a block (mean and most), blocks overflowed."""
    words = weights.to(torch.bfloat16).view(-1).view(torch.int16)
    exponent = ((words >> 7) & 0xFF).long()
    p = torch.bincount(exponent, minlength=256).double()
    p = p[p > 0] / p.sum()
    blocks = wire_codec.encode_blocks(words[: words.numel() // wire_codec.BLOCK * wire_codec.BLOCK])
    pairs = blocks[:, wire_codec.CODES_AT : wire_codec.ESC_AT]
    escapes = ((pairs & 15) == wire_codec.ESCAPE).sum(1) + ((pairs >> 4) == wire_codec.ESCAPE).sum(1)
    row = {"weights": name, "entropy_bits": float(-(p * p.log2()).sum()), "values": int(p.numel()),
           "escapes_mean": float(escapes.double().mean()), "escapes_max": int(escapes.max()),
           "blocks": int(blocks.shape[0]), "overflowed": int(blocks[:, wire_codec.ESCAPE].sum())}
    log.info("%-16s exponent entropy %.2f bits, %d values; escapes a block %.3f (most %d of %d); %d of %d blocks "
             "overflowed", name, row["entropy_bits"], row["values"], row["escapes_mean"], row["escapes_max"],
             wire_codec.ESCAPES, row["overflowed"], row["blocks"])
    return row


def exponent_rows(count: int = 64 << 20) -> list[dict]:
    """:func:`exponent_stats` of ``count`` weights of each distribution: normal at std 0.02 (the benchmark models'),
    the heavy-tailed one the fills above use, Student's t with 3 degrees of freedom, and Laplace."""
    g = torch.Generator().manual_seed(0)
    normal = torch.randn(count, generator=g) * 0.02
    torch.manual_seed(0)
    return [exponent_stats(normal, "normal"),
            exponent_stats(normal / torch.rand(count, generator=g).clamp_min(1e-3).sqrt(), "heavy tails"),
            exponent_stats(torch.distributions.StudentT(3.0).sample((count,)) * 0.01, "student-t(3)"),
            exponent_stats(torch.distributions.Laplace(0.0, 0.015).sample((count,)), "laplace")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--exponents", action="store_true", help="the exponent statistics only (no GPU needed)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.exponents:
        rows = exponent_rows()
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "rows": rows}, f, indent=1)
        return 0
    if not torch.cuda.is_available():
        parser.error("this benchmark needs a CUDA GPU")
    rows = [measure(name, dtype, matrices, tails, args.repeats)
            for name, dtype, matrices in SHAPES for tails in ((False, True) if dtype == torch.bfloat16 else (False,))]
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "staging_bytes": wire_codec.STAGING_BYTES,
              "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
