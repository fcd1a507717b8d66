"""Can a GPU kernel read weights straight from pinned host memory at PCIe speed?

    PYTHONPATH=src python -m benchmarks.zero_copy --json out.json

A MoE decode step waits, in every layer, for its router on the host before the missing experts
can be copied (the MoE issue: 30% of its bound). A kernel that reads a missing expert from pinned
host memory itself (zero-copy, through the GPU's mapping of it) needs no host round trip: the
routing could stay on the GPU and the layer could run in a CUDA graph. That is only worth building
if such reads come near the copy engine's bandwidth. This measures, for one-token projections
(a matrix-vector product, as a decode step's expert is) over weights of several sizes:

- ``zero_copy``: a Triton GEMV reading the weight from pinned host memory;
- ``copy_then_gemv``: the copy engine's copy of the weight to VRAM, then ``torch.mv`` there;
- ``copy``: the copy alone (the PCIe bound of the second);
- ``vram``: the same Triton GEMV on a VRAM copy (the kernel's own speed).

Each as GB/s of weight bytes, median of repeats; results are checked against ``torch.mv``.

``--experts``: instead, one MoE layer's routed experts as the executor reads them
(:func:`vramshard.runtime.zero_copy_experts.routed_experts`, qwen3-30b-a3b's shapes: 128 experts,
hidden 2048, expert FFN 768, 8 routed, 1 and 4 tokens): from pinned host memory, from VRAM (the
kernels' own speed), and the copy engine's copy of the same routed bytes (the PCIe bound);
GB/s of routed-expert bytes read, checked against the float32 reference. The host experts lie in memory
of each ``--host-memory`` kind: ``torch`` (``pin_memory``: cudaHostAlloc), ``huge`` and ``small`` (the
executor's :func:`~vramshard.runtime.pinned_host.pinned_empty`, anonymous memory registered with CUDA, on 2 MiB
pages asked for, or on 4 KiB pages: ``VRAMSHARD_HOST_PAGES``).
"""

from __future__ import annotations

import argparse
import logging
import statistics

import torch

from .common import hardware, now, write_json

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

log = logging.getLogger("zero_copy")

if triton is not None:

    @triton.jit
    def _gemv(w_ptr, x_ptr, y_ptr, rows, cols, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        """y[r] = sum_k w[r, k] x[k] for a row-major [rows, cols] weight wherever it lives."""
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for k0 in range(0, cols, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            w = tl.load(w_ptr + r[:, None].to(tl.int64) * cols + k[None, :],
                        mask=(r[:, None] < rows) & (k[None, :] < cols), other=0.0)
            x = tl.load(x_ptr + k, mask=k < cols, other=0.0)
            acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        tl.store(y_ptr + r, acc.to(y_ptr.dtype.element_ty), mask=r < rows)


def gemv(weight: torch.Tensor, x: torch.Tensor, out: torch.Tensor, block_r: int = 8, block_k: int = 512) -> torch.Tensor:
    """``weight @ x`` into ``out`` by the Triton kernel (``weight`` in VRAM or pinned host memory)."""
    rows, cols = weight.shape
    _gemv[(triton.cdiv(rows, block_r),)](weight, x, out, rows, cols, BLOCK_R=block_r, BLOCK_K=block_k)
    return out


def _time(fn, repeat: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _host_copy(t: torch.Tensor, kind: str) -> torch.Tensor:
    """``t`` copied into pinned host memory of ``kind`` (see the module docstring)."""
    if kind == "torch":
        return t.cpu().pin_memory()
    from vramshard.runtime import pinned_host

    pinned_host.HOST_PAGES = kind  # (read when memory is mapped)
    return pinned_host.pinned_empty(t.nbytes).view(t.dtype).view(t.shape).copy_(t)


def routed_experts_cells(repeat: int, kinds: tuple[str, ...] = ("torch",)) -> list[dict]:
    """``--experts``: one MoE layer's routed experts from pinned host memory, from VRAM, and the copy
    engine's copy of the same bytes (GB/s of routed-expert bytes)."""
    from vramshard.layers.moe import Routing, StackedExperts
    from vramshard.runtime.zero_copy_experts import routed_experts

    dtype, gpu = torch.bfloat16, torch.device("cuda")
    experts, hidden, width, top_k = 128, 2048, 768, 8
    gate_up = (torch.randn(experts, 2 * width, hidden, device=gpu) * 0.02).to(dtype)
    down = (torch.randn(experts, hidden, width, device=gpu) * 0.02).to(dtype)
    hosts = {kind: StackedExperts(_host_copy(gate_up, kind), _host_copy(down, kind)) for kind in kinds}
    vram = StackedExperts(gate_up, down)
    expert_bytes = (gate_up[0].numel() + down[0].numel()) * dtype.itemsize
    cells = []
    for tokens in (1, 4):
        chosen = torch.randperm(experts, device=gpu)[: tokens * top_k].view(tokens, top_k)  # distinct experts
        routing = Routing(chosen, torch.full((tokens, top_k), 1.0 / top_k, dtype=dtype, device=gpu))
        h = torch.randn(tokens, hidden, dtype=dtype, device=gpu)
        expected = torch.zeros(tokens, hidden, device=gpu)
        for t in range(tokens):
            for e in chosen[t].tolist():
                g, u = (h[t].float() @ gate_up[e].float().T).chunk(2)
                expected[t] += (torch.nn.functional.silu(g) * u) @ down[e].float().T / top_k
        routed = tokens * top_k * expert_bytes
        staging = torch.empty(routed, dtype=torch.uint8, device=gpu)
        source = torch.empty(routed, dtype=torch.uint8, pin_memory=True)
        cell = {"tokens": tokens, "routed_mib": routed / 2**20,
                "vram_gb_s": routed / _time(lambda: routed_experts(vram, h, routing), repeat) / 1e9,
                "copy_gb_s": routed / _time(lambda: staging.copy_(source, non_blocking=True), repeat) / 1e9}
        for kind, host in hosts.items():
            got = routed_experts(host, h, routing).float()
            cell[f"wrong_{kind}"] = not torch.allclose(got, expected, rtol=3e-2, atol=3e-2 * expected.abs().max().item())
            cell[f"zero_copy_{kind}_gb_s"] = routed / _time(lambda: routed_experts(host, h, routing), repeat) / 1e9
        log.info("%s", {k: round(v, 2) if isinstance(v, float) else v for k, v in cell.items()})
        cells.append(cell)
    return cells


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", default="6,24,96,384", help="weight sizes (MiB); 6 MiB is one qwen3-30b-a3b expert")
    parser.add_argument("--cols", type=int, default=2048)
    parser.add_argument("--blocks", default="8x512,16x256,4x1024", help="BLOCK_R x BLOCK_K variants of the kernel")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--experts", action="store_true", help="one MoE layer's routed experts instead (see above)")
    parser.add_argument("--host-memory", default="torch", help="with --experts: host memory kinds, comma-separated, "
                        "of torch, huge, small (see above)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if triton is None or not torch.cuda.is_available():
        raise SystemExit("zero_copy needs a CUDA GPU and Triton")
    if args.experts:
        result = {"date": now(), "hardware": hardware(), "dtype": "bfloat16", "experts": routed_experts_cells(args.repeat, tuple(args.host_memory.split(",")))}
        if args.json:
            write_json(args.json, result)
        return
    dtype, gpu = torch.bfloat16, torch.device("cuda")
    result = {"date": now(), "hardware": hardware(), "cols": args.cols, "dtype": "bfloat16", "cells": []}
    for mib in (int(m) for m in args.mib.split(",")):
        rows = mib * 2**20 // (args.cols * dtype.itemsize)
        host = torch.randn(rows, args.cols, dtype=dtype, device=gpu).cpu().pin_memory()
        vram = host.to(gpu)
        staging = torch.empty_like(vram)
        x = torch.randn(args.cols, dtype=dtype, device=gpu)
        out = torch.empty(rows, dtype=dtype, device=gpu)
        expected = torch.mv(vram.float(), x.float())
        nbytes = host.numel() * host.element_size()
        cell = {"mib": mib, "rows": rows}
        for variant in args.blocks.split(","):
            block_r, block_k = (int(v) for v in variant.split("x"))
            got = gemv(host, x, out, block_r, block_k).float()
            wrong = not torch.allclose(got, expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())
            seconds = _time(lambda: gemv(host, x, out, block_r, block_k), args.repeat)
            cell[f"zero_copy_{variant}_gb_s"] = nbytes / seconds / 1e9
            cell[f"zero_copy_{variant}_wrong"] = bool(wrong)
            cell[f"vram_{variant}_gb_s"] = nbytes / _time(lambda: gemv(vram, x, out, block_r, block_k), args.repeat) / 1e9
        cell["copy_gb_s"] = nbytes / _time(lambda: staging.copy_(host, non_blocking=True), args.repeat) / 1e9
        cell["copy_then_gemv_gb_s"] = nbytes / _time(
            lambda: torch.mv(staging.copy_(host, non_blocking=True), x), args.repeat) / 1e9
        log.info("%s", {k: round(v, 2) if isinstance(v, float) else v for k, v in cell.items()})
        result["cells"].append(cell)
        del host, vram, staging
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
