"""The attention kernel of a CUDA-graph decode step: each of ``static_attention``'s kernels,
captured in a graph of 40 calls (one per layer of nemo-8b), against the flash split-KV kernel
that eager decode runs on exact key lengths, and the bound of reading the keys and values once.

    PYTHONPATH=src python3 -m benchmarks.decode_attention [--batches 1,16,64] [--keys 1088,4160]

Shapes of nemo-8b (32 query heads, 8 KV heads, head_dim 128, fp16). Keys and values come in the
layout ``static_attend`` gathers them to ([B, L, Hkv, D], L a key bucket); every row's position
lies in the bucket's last 64 keys, as the bucket rounding leaves it. Each kernel's output is
compared with masked SDPA's. Two entries time a layer's whole attention work from a shuffled
pool of 16-position blocks: the Triton paged kernel (stores the new key and value, reads the
blocks in place) against what the graphs ran before it (two indexed stores, two gathers, flash).
Writes ``$OUT/decode_attention.json``.
"""

from __future__ import annotations

import argparse
import logging

import torch
import torch.nn.functional as F

from vramshard.layers.paged_decode import paged_decode_attention
from vramshard.layers.static_attention import (DECODE_KERNELS, decode_mask, flash_lengths, flash_varlen_attention,
                                               masked_attention, matmul_attention)

from .common import hardware, now, out_dir, versions, write_json

log = logging.getLogger("decode_attention")
HEADS, KV_HEADS, HEAD_DIM, LAYERS = 32, 8, 128, 40


def attention(kernel: str, q, keys, values, lengths, mask, scale):
    """q [B, H, D], keys/values [B, L, Hkv, D] → [B, H, D] by ``kernel``; ``lengths``: the step's
    :func:`flash_lengths`, made once per step as the engine makes them."""
    B = q.shape[0]
    if kernel == "flash-varlen":
        return flash_varlen_attention(q, keys, values, lengths, scale)
    query = q.view(B, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)
    k, v = keys.transpose(1, 2), values.transpose(1, 2)
    fn = matmul_attention if kernel == "matmul" else masked_attention
    return fn(query, k, v, mask, scale).reshape(B, HEADS, HEAD_DIM)


def paged_inputs(q, keys, values, positions, block_size: int = 16):
    """The same keys and values in a shuffled pool of blocks, with block tables, for the paged kernel
    (which also stores each row's new key and value, here the ones at its position)."""
    B, L = keys.shape[:2]
    nb = -(-L // block_size)
    order = torch.randperm(B * nb, device=keys.device)
    tables = order.view(B, nb)
    pool_k = torch.zeros(B * nb, block_size, *keys.shape[2:], dtype=keys.dtype, device=keys.device)
    pool_v = torch.zeros_like(pool_k)
    padded = nb * block_size
    pool_k[tables.reshape(-1)] = F.pad(keys, (0, 0, 0, 0, 0, padded - L)).view(B * nb, block_size, *keys.shape[2:])
    pool_v[tables.reshape(-1)] = F.pad(values, (0, 0, 0, 0, 0, padded - L)).view(B * nb, block_size, *keys.shape[2:])
    rows = torch.arange(B, device=keys.device)
    write = tables[rows, positions // block_size] * block_size + positions % block_size
    new_k, new_v = keys[rows, positions], values[rows, positions]  # [B, Hkv, D]
    return new_k, new_v, pool_k, pool_v, tables, positions, write, rows, padded


def old_pipeline(q, new_k, new_v, pool_k, pool_v, tables, positions, write, lengths, scale, length):
    """What a decode graph ran per layer before the paged kernel: store, gather the blocks, flash."""
    B = q.shape[0]
    flat_k, flat_v = pool_k.view(-1, KV_HEADS, HEAD_DIM), pool_v.view(-1, KV_HEADS, HEAD_DIM)
    flat_k.index_copy_(0, write, new_k)
    flat_v.index_copy_(0, write, new_v)
    blocks = tables.reshape(-1)
    k = pool_k.index_select(0, blocks).view(B, -1, KV_HEADS, HEAD_DIM)[:, :length]
    v = pool_v.index_select(0, blocks).view(B, -1, KV_HEADS, HEAD_DIM)[:, :length]
    return flash_varlen_attention(q, k, v, lengths, scale)


def graph_ms(fn, repeat: int = 20) -> float:
    """Milliseconds of one replay of a graph of ``LAYERS`` calls of ``fn``, per call."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(LAYERS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeat / LAYERS


def eager_flash_ms(q, keys, values, positions, scale, repeat: int = 20) -> float:
    """Eager decode's kernel: SDPA without a mask on each row's exact keys (flash split-KV)."""
    rows = [(q[b:b + 1, :, None],
             keys[b:b + 1, : int(positions[b]) + 1].transpose(1, 2),
             values[b:b + 1, : int(positions[b]) + 1].transpose(1, 2)) for b in range(q.shape[0])]

    def run():
        for query, k, v in rows:  # [1, H, 1, D] over [1, Hkv, n, D]
            F.scaled_dot_product_attention(query, k, v, scale=scale, enable_gqa=True)

    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeat


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--keys", default="1088,4160")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if not torch.cuda.is_available():
        raise SystemExit("decode_attention needs a CUDA GPU")
    torch.manual_seed(0)
    device, dtype = torch.device("cuda"), torch.float16
    scale = HEAD_DIM ** -0.5
    # The bound: keys and values read once at the device's copy rate.
    probe = torch.empty(2**30, dtype=torch.uint8, device=device)
    copy = torch.empty_like(probe)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    copy.copy_(probe)
    start.record()
    for _ in range(10):
        copy.copy_(probe)
    end.record()
    torch.cuda.synchronize()
    device_gbps = 2 * 10 * probe.numel() / (start.elapsed_time(end) / 1e3) / 1e9
    del probe, copy
    cells = []
    for batch in (int(b) for b in args.batches.split(",")):
        for length in (int(n) for n in args.keys.split(",")):
            q = torch.randn(batch, HEADS, HEAD_DIM, device=device, dtype=dtype)
            keys = torch.randn(batch, length, KV_HEADS, HEAD_DIM, device=device, dtype=dtype)
            values = torch.randn_like(keys)
            positions = torch.randint(length - 64, length, (batch,), device=device)
            mask = decode_mask(positions, torch.arange(length, device=device))
            lengths = flash_lengths(positions, length)
            reference = attention("sdpa", q, keys, values, lengths, mask, scale)
            kv_bytes = sum(2 * (int(p) + 1) * KV_HEADS * HEAD_DIM * 2 for p in positions.tolist())
            cell = {"batch": batch, "keys": length, "kv_bytes": kv_bytes,
                    "bound_us": kv_bytes / (device_gbps * 1e9) * 1e6, "kernels": {}}
            paged = paged_inputs(q, keys, values, positions)
            pipelines = {  # whole per-layer work: the new key stored, the keys read, attention
                "paged (store + in-place)": lambda: paged_decode_attention(q, *paged[:4], paged[4], paged[5],
                                                                           paged[6], paged[7], paged[8]),
                "flash-varlen (store + gather)": lambda: old_pipeline(q, *paged[:7], lengths, scale, length)}
            for name, fn in pipelines.items():
                try:
                    error = float((fn().float() - reference.float()).abs().max())
                    cell["kernels"][name] = {"us": graph_ms(fn) * 1e3, "max_abs_error": error}
                except Exception as exc:
                    cell["kernels"][name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            for kernel in (k for k in DECODE_KERNELS if k not in ("auto", "paged")):  # on gathered keys
                try:
                    out = attention(kernel, q, keys, values, lengths, mask, scale)
                    error = float((out.float() - reference.float()).abs().max())
                    us = graph_ms(lambda: attention(kernel, q, keys, values, lengths, mask, scale)) * 1e3
                    cell["kernels"][kernel] = {"us": us, "max_abs_error": error}
                except Exception as exc:  # a kernel this torch build lacks is reported, not fatal
                    cell["kernels"][kernel] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            cell["eager_flash_us"] = eager_flash_ms(q, keys, values, positions, scale) * 1e3
            cells.append(cell)
            log.info("%s", cell)
    write_json(out_dir() / "decode_attention.json", {
        "date": now(), "hardware": hardware(), "versions": versions(), "device_gbps": device_gbps,
        "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "dtype": "fp16",
                  "graph_calls": LAYERS},
        "cells": cells})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
