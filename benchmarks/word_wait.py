"""How late the run-ahead worker sees a word that another agent writes: sleeping polls against the spin.

    PYTHONPATH=src python -m benchmarks.word_wait [--words 300] [--json FILE]

On a GPU machine the GPU writes the ready word into pinned host memory once a CPU part's input has
landed, and the worker (:mod:`vramshard.runtime.run_ahead`) waits for it. Here a second process
stands in for the GPU (it needs no GIL, as the GPU does not): it writes words into shared memory
after random pauses of 0.1-0.4 ms (the GPU's part of a MoE layer) and notes when, and this process
waits for each as the worker does: ``poll`` (its Python loop, yielding then sleeping 20 us between
reads, as before session 39) and ``spin`` (:func:`vramshard.layers.cpu_gemv.wait_for_word` first, for up to
``run_ahead.SPIN_S``, then the same loop). The bound is zero: the word's write itself.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import random
import statistics
import time
from multiprocessing import shared_memory

import numpy as np
import torch

from vramshard.layers import cpu_gemv
from vramshard.runtime import run_ahead

from .common import hardware, now, rounded, write_json

log = logging.getLogger("word_wait")


def _writer(word_name: str, times_name: str, gaps: list[float]) -> None:
    """Write 1, 2, ... into the shared word after each pause, noting each write's time; wait for the
    reader's acknowledgement (the word's negation) before the next pause."""
    word_memory, times_memory = shared_memory.SharedMemory(name=word_name), shared_memory.SharedMemory(name=times_name)
    word = np.ndarray((1,), np.int64, word_memory.buf)
    written = np.ndarray((len(gaps),), np.float64, times_memory.buf)
    for n, gap in enumerate(gaps, start=1):
        end = time.perf_counter() + gap
        while time.perf_counter() < end:
            pass
        written[n - 1] = time.perf_counter()
        word[0] = n
        while word[0] != -n:
            pass
    del word, written
    word_memory.close()
    times_memory.close()


def lateness(spin_s: float, count: int) -> list[float]:
    """Seconds from each write to this process seeing it, waiting with a spin of ``spin_s`` first (0: none)."""
    word_memory = shared_memory.SharedMemory(create=True, size=8)
    times_memory = shared_memory.SharedMemory(create=True, size=8 * count)
    try:
        view = np.ndarray((1,), np.int64, word_memory.buf)
        view[0] = 0
        word = torch.from_numpy(view)
        gaps = [random.uniform(1e-4, 4e-4) for _ in range(count)]
        writer = multiprocessing.get_context("spawn").Process(target=_writer,
                                                              args=(word_memory.name, times_memory.name, gaps))
        writer.start()
        seen = []
        for n in range(1, count + 1):
            if spin_s:
                cpu_gemv.wait_for_word(word, n, spin_s)
            polls = 0
            while view[0] < n:  # (run_ahead.RunAhead._run's loop)
                polls += 1
                time.sleep(0 if polls < run_ahead.YIELDING_POLLS else run_ahead.POLL_SLEEP_S)
            seen.append(time.perf_counter())
            view[0] = -n
        writer.join()
        written = np.ndarray((count,), np.float64, times_memory.buf)
        out = [s - w for s, w in zip(seen, written)]
        del view, word, written
        return out
    finally:
        word_memory.close()
        word_memory.unlink()
        times_memory.close()
        times_memory.unlink()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--words", type=int, default=300)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if cpu_gemv.library() is None:
        raise SystemExit("the C library does not build here")
    cells = {}
    for name, spin_s in (("poll", 0.0), ("spin", run_ahead.SPIN_S or 5e-4)):
        late = sorted(float(s) for s in lateness(spin_s, args.words))
        cells[name] = {"median_us": statistics.median(late) * 1e6, "p90_us": late[int(len(late) * 0.9)] * 1e6,
                       "spin_us": spin_s * 1e6}
        log.info("%s: %s", name, rounded(cells[name]))
    result = {"date": now(), "hardware": hardware(), "words": args.words, "bound_us": 0.0, "cells": cells}
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
