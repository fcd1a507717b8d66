"""Decode-sized half-precision products on the CPU by a small C kernel built on this machine.

A split FFN's CPU part at one token is three matrix-vector products over weights read from memory
once per step: it can go no faster than the host reads them. On the GPU machines' 16-core Xeons
oneDNN and ATen ran those products at 56-68 GB/s where the host read 107-137 GB/s (the profile's
CPU tables; docs/BENCHMARKS.md), and a decode step waits on that CPU work. ``cpu_gemv.c`` reads each
weight row once, dots it with every row of ``x`` (up to :data:`MAX_ROWS`) in float32, and splits the
rows over torch's OpenMP threads: AVX-512 (AVX512-BF16 dot products for bf16 where the CPU has
them), else AVX2 + F16C, else plain C, as this machine's compiler builds it (``-march=native``).
It reads the plain weights (a column slice of ``down`` included), so nothing is copied or packed.

The library is built once per machine, source and compiler into the cache directory
(:func:`~vramshard.paths.cache_dir` ``/cpu_gemv``, written atomically) and loaded with ``ctypes``,
whose calls leave the GIL free. Where there is no C compiler, OpenMP or a 64-bit little-endian
machine, :func:`library` says why once in the log and returns None; callers keep their torch path.
``VRAMSHARD_CPU_GEMV``: ``auto`` (the default) and ``on`` use it wherever it builds, ``off`` never. Beside
a GPU it computes split FFNs' one-row CPU parts; on a CPU-only engine every one-token FFN and projection
(the 2-core development machine: llama3-8b cut to 8 layers decoded at 7.09-7.23 tok/s with it against
5.60-6.37 without, ``vramshard bench --shape llama3-8b --layers 8 --device cpu``, session 32).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

from ..env import choice, cpu_gemv_rows

log = logging.getLogger(__name__)

MAX_ROWS = 16  # rows of x one call takes (VS_MAX_ROWS in the C source)
COLUMN_ROWS = 4  # rows of x a weight stored transposed takes (VS_COLUMN_ROWS)
# The most rows of dense FFN work (split parts, FFNs on the CPU) given to the kernel: at four rows it read an 8B
# FFN's weights at 29.4-29.7 GB/s on the development machine against 26.5-26.6 prepacked and 22.9-23.5 by
# F.linear, at eight 17.5-18.9 against 26.3-26.5 (docs/BENCHMARKS.md, session 36). VRAMSHARD_CPU_GEMV_ROWS=1
# gives it one row only, as before session 36.
FFN_ROWS = cpu_gemv_rows()
AMX_ROWS = 64  # rows of x the product through the CPU's matrix tiles takes (VS_AMX_ROWS)
MODES = ("auto", "on", "off")
DTYPES = {torch.bfloat16: 0, torch.float16: 1}  # the C source's VS_BF16 / VS_FP16
ROUTING_DTYPES = {**DTYPES, torch.float32: 2}  # routing weights may be float32 too (VS_FP32)
ISA_NAMES = {0: "plain C", 1: "AVX2 + F16C", 2: "AVX-512", 3: "AVX-512 with AVX512-BF16"}
SOURCE = Path(__file__).with_name("cpu_gemv.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-lm")

_lock = threading.Lock()
_library: list = []  # [the loaded library or None], once tried
_failure: list[str] = []  # why it is not there, once tried


def mode() -> str:
    return choice("VRAMSHARD_CPU_GEMV", MODES, "auto")


def wanted() -> bool:
    """Whether one-token products take this kernel here (``on`` or ``auto``; not ``off``). Whether it
    builds is :func:`library`'s to say; :func:`serves` asks both."""
    return mode() != "off"


def computes(rows: int) -> bool:
    """Whether dense FFN work of ``rows`` rows on the CPU goes through this kernel here, from the plain
    weights (so split parts need no prepacked or row-major copy): up to :data:`FFN_ROWS` rows, wanted,
    the library built."""
    return 1 <= rows <= FFN_ROWS and wanted() and library() is not None


def tiles_here() -> bool:
    """Whether the CPU's matrix tiles (AMX) compute bf16 products here: the library built with them, and the
    operating system lets this process use them (whether FFN work goes through them is :func:`amx`'s)."""
    lib = library()
    return lib is not None and hasattr(lib, "vs_amx_ready") and bool(lib.vs_amx_ready())


def amx() -> bool:
    """Whether bf16 FFN work of ``FFN_ROWS + 1`` to :data:`AMX_ROWS` rows goes through the CPU's matrix tiles
    (AMX) here: the kernel wanted, the tiles here (:func:`tiles_here`), and ``VRAMSHARD_CPU_AMX`` ``on``, or
    ``auto`` (the default) in a process without a CUDA GPU. Beside a GPU ``auto`` leaves them off until a GPU
    machine's host has timed them in the engine; on the 2-core development machine a CPU-only llama3-8b (4 layers)
    took a 64-token prompt 1.34x and batch 64 1.16-1.22x faster through them, one and 16 rows unchanged (session 62,
    docs/BENCHMARKS.md)."""
    asked = choice("VRAMSHARD_CPU_AMX", MODES, "auto")
    return (asked == "on" or asked == "auto" and not torch.cuda.is_available()) and wanted() and tiles_here()


def amx_rows_times_weight(x: torch.Tensor, w: torch.Tensor, lib=None) -> torch.Tensor:
    """``x[T, K] @ w[N, K].T`` in float32 through the matrix tiles, for bf16 ``x`` (1 <= T <= :data:`AMX_ROWS`, rows
    contiguous) and ``w`` by rows (a column slice of a wider weight included): where :func:`tiles_here`. For
    tests and the profile; FFN work reaches it through :func:`swiglu`."""
    lib = lib or library()
    x = x.contiguous()
    out = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
    ok = x.dtype == w.dtype == torch.bfloat16 and x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1] \
        and _by_rows(w) and x.device.type == w.device.type == "cpu"
    status = lib.vs_amx_rows_times_weight(w.data_ptr(), w.stride(0), x.data_ptr(), out.data_ptr(), x.shape[0],
                                          w.shape[0], w.shape[1], torch.get_num_threads()) if ok else -1
    if status == -3:
        raise RuntimeError("the CPU's matrix tiles are not there (tiles_here)")
    _check(status, "its buffer for x's column pairs", lambda: f"x {tuple(x.shape)} @ w {tuple(w.shape)} (strides "
                                                           f"{w.stride()}, {x.dtype}) through the matrix tiles")
    return out


def amx_computes(rows: int, dtype: torch.dtype) -> bool:
    """Whether dense FFN work of ``rows`` rows in ``dtype`` goes through the matrix tiles (:func:`amx`) from weights
    by rows (a split part's down needs its row-major copy: :mod:`~vramshard.runtime.cpu_down`)."""
    return FFN_ROWS < rows <= AMX_ROWS and dtype == torch.bfloat16 and amx()


def serves(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the one-token projection ``x[1, K] @ w[N, K].T`` may take this kernel (one candidate of
    :mod:`.cpu_linear`'s): one row, wanted here, the library built, shapes it takes. Projections of more
    rows keep torch's paths: their candidates are tried in turn on real calls, and the kernel's sums
    round differently from theirs."""
    return x.dim() == 2 and x.shape[0] == 1 and wanted() and takes(x, w) and library() is not None


def swiglu(h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """``down(silu(gate(h)) * up(h))`` for a few rows ``h`` [T, D] (T <= :data:`FFN_ROWS`, or more through the
    matrix tiles: :func:`amx_computes`) from the plain
    weights (gate/up [r, D], down [D, r], a column slice of a wider one or stored transposed included),
    the activation in float32 rounded once to ``h``'s dtype before ``down``. Each row's sums are the
    same whatever rows come with it. Returns [T, D] in ``h``'s dtype."""
    lib = library()
    if hasattr(lib, "vs_swiglu"):  # one call (an earlier revision's source, built by benchmarks, has it not)
        out = torch.empty(h.shape, dtype=h.dtype)
        h = h.contiguous()
        _check(lib.vs_swiglu(*_swiglu_args(h, gate, up, down, out), torch.get_num_threads()),
               "its buffers for the FFN's products", lambda: _describe_swiglu(h, gate, up, down))
        return out
    act = (torch.nn.functional.silu(rows_times_weight(h, gate)) * rows_times_weight(h, up)).to(h.dtype)
    return rows_times_weight(act, down).to(h.dtype)


def _swiglu_args(h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, out: torch.Tensor) -> tuple:
    """``vs_swiglu``'s arguments but the thread count, for tensors :func:`serves_swiglu` takes (``h`` and ``out``
    [T, D] rows contiguous)."""
    columns = not _by_rows(down)  # stored transposed: down.T [R, D] by rows
    return (DTYPES[h.dtype], gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0), down.data_ptr(),
            down.stride(1) if columns else down.stride(0), int(columns), h.data_ptr(), h.shape[0], h.shape[1],
            gate.shape[0], out.data_ptr())


def _describe_swiglu(h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> str:
    return (f"the SwiGLU of x {tuple(h.shape)} (gate {tuple(gate.shape)}, up {tuple(up.shape)}, down "
            f"{tuple(down.shape)} strides {down.stride()}, {h.dtype})")


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _version(compiler: str) -> str:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _cpu_flags() -> str:
    """The CPU's feature flags (Linux), so a cache shared between machines keys on what -march=native saw."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _build(compiler: str, target: Path, flags: tuple[str, ...]) -> None:
    """Compile the source into ``target`` atomically (a half-written library is never loaded)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *flags, str(SOURCE), "-o", partial], capture_output=True, text=True,
                              timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{Path(compiler).name} failed: {done.stderr.strip()[-400:]}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def library():
    """The loaded kernel library (built the first time on this machine), or None where it cannot be
    (said once in the log)."""
    if _library:
        return _library[0]
    with _lock:
        if _library:
            return _library[0]
        lib = None
        try:
            lib = _load()
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            _failure.append(str(exc))
            log.info("CPU decode products run through torch: the C kernel is not available here (%s)", exc)
        _library.append(lib)
        return lib


def failure() -> str | None:
    """Why :func:`library` is None (None before it was tried or where it loaded)."""
    return _failure[0] if _failure else None


def _load(flags: tuple[str, ...] = FLAGS):
    """Build (once per key) and load the library with ``flags`` (tests add ``-mno-...`` to reach the
    narrower instruction sets)."""
    from ..paths import cache_dir

    if sys.byteorder != "little" or ctypes.sizeof(ctypes.c_void_p) != 8 or ctypes.sizeof(ctypes.c_long) != 8:
        raise RuntimeError("it needs a 64-bit little-endian machine with 64-bit longs")
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler (cc, gcc or clang; or $CC)")
    key = hashlib.sha256("\0".join([SOURCE.read_text(), compiler, _version(compiler), " ".join(flags),
                                    _cpu_flags()]).encode()).hexdigest()[:20]
    target = cache_dir() / "cpu_gemv" / f"cpu_gemv-{key}.so"
    if not target.exists():
        _build(compiler, target, flags)
        log.info("built the CPU decode kernel (%s)", target)
    lib = ctypes.CDLL(str(target))
    lib.vs_rows_times_weight.restype = ctypes.c_int
    lib.vs_rows_times_weight.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p,
                                         ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_int]
    if hasattr(lib, "vs_rows_times_columns"):  # (an earlier revision's source, built by benchmarks, has it not)
        lib.vs_rows_times_columns.restype = ctypes.c_int
        lib.vs_rows_times_columns.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p,
                                              ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long,
                                              ctypes.c_int, ctypes.c_void_p]
    lib.vs_routed_experts.restype = ctypes.c_int
    lib.vs_routed_experts.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_long,  # gate_up
                                      ctypes.c_void_p, ctypes.c_long, ctypes.c_long,  # down
                                      ctypes.c_void_p, ctypes.c_long,  # x, T
                                      ctypes.c_void_p, ctypes.c_long, ctypes.c_long,  # experts
                                      ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_long,  # weights
                                      ctypes.c_void_p, ctypes.c_long, ctypes.c_long,  # keep
                                      ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_long,  # k, D, F, E
                                      ctypes.c_void_p, ctypes.c_int]  # y, threads
    if hasattr(lib, "vs_routed_experts_part"):
        lib.vs_routed_experts_part.restype = ctypes.c_int
        lib.vs_routed_experts_part.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_long,
                                               ctypes.c_void_p,  # ready, ticket, number, ns, waited_ns
                                               *lib.vs_routed_experts.argtypes[:16],  # (no keep)
                                               *lib.vs_routed_experts.argtypes[19:]]
    if hasattr(lib, "vs_amx_ready"):
        lib.vs_amx_ready.restype = ctypes.c_int
        lib.vs_amx_ready.argtypes = []
        lib.vs_amx_rows_times_weight.restype = ctypes.c_int
        lib.vs_amx_rows_times_weight.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p,
                                                 ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_int]
    if hasattr(lib, "vs_swiglu"):
        lib.vs_swiglu.restype = ctypes.c_int
        lib.vs_swiglu.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_long,  # G, U
                                  ctypes.c_void_p, ctypes.c_long, ctypes.c_int,  # down, its stride, by columns
                                  ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long,  # x, T, D, R
                                  ctypes.c_void_p, ctypes.c_int]  # y, threads
        lib.vs_swiglu_part.restype = ctypes.c_int
        lib.vs_swiglu_part.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_long,
                                       ctypes.c_void_p, *lib.vs_swiglu.argtypes]  # ready, ticket, number, ns, waited
    if hasattr(lib, "vs_decode_attention"):
        lib.vs_decode_attention.restype = ctypes.c_int
        lib.vs_decode_attention.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_long,  # q, H, D
                                            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long,  # K, V, L
                                            ctypes.c_long, ctypes.c_long, ctypes.c_long,  # Hkv, ld, hd
                                            ctypes.c_float, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    if hasattr(lib, "vs_decode_attention_rows"):
        lib.vs_decode_attention_rows.restype = ctypes.c_int
        lib.vs_decode_attention_rows.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_long,  # q, B, H
                                                 ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p,  # D, K, V
                                                 ctypes.c_void_p, ctypes.c_void_p,  # starts, lengths
                                                 ctypes.c_long, ctypes.c_long, ctypes.c_long,  # Hkv, ld, hd
                                                 ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
    if hasattr(lib, "vs_transpose"):
        lib.vs_transpose.restype = ctypes.c_int
        lib.vs_transpose.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_long,
                                     ctypes.c_long, ctypes.c_int]
    if hasattr(lib, "vs_wait_word"):
        lib.vs_wait_word.restype = ctypes.c_int64
        lib.vs_wait_word.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_long]
    lib.vs_isa.restype = ctypes.c_int
    log.info("CPU decode kernel: %s", ISA_NAMES.get(lib.vs_isa(), "?"))
    return lib


def isa() -> str | None:
    """The instruction set the library was built for, None where there is none."""
    lib = library()
    return None if lib is None else ISA_NAMES.get(lib.vs_isa(), "?")


def _by_rows(w: torch.Tensor) -> bool:
    """Whether ``w`` [N, K] has unit column stride (its rows contiguous, at any row stride)."""
    return (w.stride(1) == 1 or w.shape[1] == 1) and w.stride(0) >= w.shape[1]


def _by_columns(w: torch.Tensor) -> bool:
    """Whether ``w`` [N, K] is stored transposed: ``w.T`` [K, N] with contiguous rows."""
    return (w.stride(0) == 1 or w.shape[0] == 1) and w.stride(1) >= w.shape[0]


def takes(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether :func:`rows_times_weight` computes ``x @ w.T`` (else use torch): CPU tensors of one
    half-precision dtype, ``x`` [T <= MAX_ROWS, K], ``w`` [N, K] with unit column stride (a column
    slice of a wider weight included), or, for up to :data:`COLUMN_ROWS` rows, ``w`` stored transposed
    (``w.T`` [K, N] by rows, as split FFNs' down projections lie in host memory)."""
    return (x.device.type == "cpu" and x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and not x.requires_grad
            and _takes_weight(w, x.dtype, x.shape[0], x.shape[1]))


def _takes_weight(w: torch.Tensor, dtype: torch.dtype, rows: int, k: int) -> bool:
    """The weight side of :func:`takes`, for ``rows`` rows of ``k`` elements in ``dtype``."""
    if not (w.device.type == "cpu" and dtype in DTYPES and w.dtype == dtype and w.dim() == 2 and w.shape[1] == k
            and w.shape[0] > 0 and k > 0 and not w.requires_grad):
        return False
    return _by_rows(w) or (rows <= COLUMN_ROWS and _by_columns(w))


def serves_swiglu(h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether :func:`swiglu` computes this SwiGLU of a few rows (gate/up [r, D], down [D, r]) here:
    dense FFN work of ``h``'s rows goes through the kernel (:func:`computes`), shapes it takes; or, where
    its rows go through the matrix tiles (:func:`amx_computes`), bf16 weights by rows."""
    rows = h.shape[0] if h.dim() == 2 else 0
    if computes(rows):
        return takes(h, gate) and _takes_weight(up, h.dtype, rows, h.shape[1]) \
            and _takes_weight(down, h.dtype, rows, gate.shape[0])
    return amx_computes(rows, h.dtype) and h.device.type == "cpu" and not h.requires_grad \
        and _takes_weight(gate, h.dtype, rows, h.shape[1]) and _takes_weight(up, h.dtype, rows, h.shape[1]) \
        and _takes_weight(down, h.dtype, rows, gate.shape[0])


def rows_times_weight(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, lib=None) -> torch.Tensor:
    """``x[T, K] @ w[N, K].T`` in float32 ([T, N]) by the C kernel on torch's thread count: dot products
    over ``w``'s rows (a column slice of a wider weight included), or, for ``w`` stored transposed, a
    sum of ``w.T``'s rows scaled by ``x``. The caller checks :func:`takes` and that :func:`library` is
    there (``lib``: another build of it, for tests)."""
    lib = lib or library()
    x = x.contiguous()
    rows, n, k = x.shape[0], w.shape[0], w.shape[1]
    if out is None:
        out = torch.empty(rows, n, dtype=torch.float32)
    threads = torch.get_num_threads()
    if _by_rows(w):
        status = lib.vs_rows_times_weight(DTYPES[x.dtype], w.data_ptr(), w.stride(0), x.data_ptr(), out.data_ptr(),
                                          rows, n, k, threads)
    else:
        scratch = _scratch(threads * rows * n)
        status = -1 if rows > COLUMN_ROWS else lib.vs_rows_times_columns(
            DTYPES[x.dtype], w.data_ptr(), w.stride(1), x.data_ptr(), out.data_ptr(), rows, k, n, threads,
            scratch.data_ptr())
    if status != 0:
        raise ValueError(f"the CPU decode kernel refused x {tuple(x.shape)} @ w {tuple(w.shape)} "
                         f"(strides {w.stride()}, {x.dtype})")
    return out


MAX_ASSIGNMENTS = 4096  # tokens x routed experts one call takes (the C source's guard)


def serves_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, experts: torch.Tensor | None = None,
                   weights: torch.Tensor | None = None, keep: torch.Tensor | None = None) -> bool:
    """Whether :func:`routed_experts` computes ``x`` [T, D] (T <= :data:`MAX_ROWS`, rows contiguous)
    over the stacked experts ``gate_up`` [E, 2F, D] and ``down`` [E, D, F] (rows contiguous at any
    expert and row stride, one half-precision dtype, on the CPU), routed by ``experts`` [T, k] int64
    with ``weights`` [T, k] half precision or float32 and ``keep`` [T, k] bool (where given), wanted
    here, the library built."""
    if not (x.device.type == "cpu" and x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.dtype in DTYPES
            and not x.requires_grad and x.stride(1) == 1 and x.stride(0) == x.shape[1]
            and gate_up.dim() == 3 and down.dim() == 3):
        return False
    routed = (x.shape[0], experts.shape[-1]) if experts is not None else None
    if experts is not None and not (experts.device.type == "cpu" and experts.dtype == torch.int64
                                    and experts.shape == routed and 1 <= experts.numel() <= MAX_ASSIGNMENTS):
        return False
    if weights is not None and not (weights.device.type == "cpu" and weights.dtype in ROUTING_DTYPES
                                    and weights.dim() == 2 and weights.shape == (routed or weights.shape)):
        return False
    if keep is not None and not (keep.device.type == "cpu" and keep.dtype == torch.bool and keep.shape == routed):
        return False
    experts, two_f, hidden = gate_up.shape
    width = two_f // 2
    return (two_f == 2 * width > 0 and hidden == x.shape[1] and down.shape == (experts, hidden, width)
            and all(w.device.type == "cpu" and w.dtype == x.dtype and not w.requires_grad and w.stride(2) == 1
                    and w.stride(1) >= w.shape[2] and w.stride(0) >= 0 for w in (gate_up, down))
            and wanted() and library() is not None)


def routed_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, experts: torch.Tensor,
                   weights: torch.Tensor, keep: torch.Tensor | None = None, lib=None) -> torch.Tensor:
    """A few tokens' weighted sums over their routed experts by the C kernel, in one call on torch's
    thread count: x [T, D]; gate_up [E, 2F, D] and down [E, D, F] as :func:`serves_experts` takes them;
    experts [T, k] int64 and weights [T, k] (half precision or float32), read as they lie; keep [T, k]
    bool: the assignments computed (the others count zero, their experts not read; None: all). Grouped
    by expert, each routed expert is read once for all its tokens; each gate and up product in
    float32, the activation rounded once to ``x``'s dtype, the down products summed over the experts
    in float32 and rounded once. Returns [T, D] in ``x``'s dtype. The GIL is given up twice, in the
    output's allocation (the only torch call) and the kernel's call, and taken back after each: beside
    a thread running Python each take waits for the switch interval. ValueError for an expert index outside the layer's (the caller checks
    :func:`serves_experts` with the routing first)."""
    lib = lib or library()
    E, two_f, D = gate_up.shape
    T, k = experts.shape
    out = torch.empty(T, D, dtype=x.dtype)
    status = lib.vs_routed_experts(DTYPES[x.dtype], gate_up.data_ptr(), gate_up.stride(0), gate_up.stride(1),
                                   down.data_ptr(), down.stride(0), down.stride(1), x.data_ptr(), T,
                                   experts.data_ptr(), experts.stride(0), experts.stride(1),
                                   weights.data_ptr(), ROUTING_DTYPES[weights.dtype], weights.stride(0),
                                   weights.stride(1),
                                   None if keep is None else keep.data_ptr(), 0 if keep is None else keep.stride(0),
                                   0 if keep is None else keep.stride(1), k, D, two_f // 2, E, out.data_ptr(),
                                   torch.get_num_threads())
    _check(status, "its scratch for the routed experts", lambda: f"the routed experts {experts.tolist()} of {E} "
           f"(gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)}, {x.dtype})")
    return out


def _check(status: int, scratch: str, refused) -> None:
    """Raise for a kernel call's status: -2 (``scratch`` could not be allocated) as MemoryError, another
    non-zero one as ValueError naming what it refused (``refused()``, made only then)."""
    if status == -2:
        raise MemoryError(f"the CPU decode kernel could not allocate {scratch}")
    if status != 0:
        raise ValueError(f"the CPU decode kernel refused {refused()}")


MAX_GROUP = 16  # query heads per key/value head the attention takes (VS_MAX_GROUP)


def serves_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether :func:`decode_attention` computes one new token's attention here: q [H, D] (rows contiguous)
    against keys and values [Hkv, L, D] of q's dtype with unit stride along D, one layout for both (a paged
    cache's rows [L, Hkv, D] viewed by head, as :func:`~vramshard.layers.attention.attend` hands them over),
    H a multiple of Hkv by at most :data:`MAX_GROUP`; wanted here, the library built."""
    if not (q.device.type == "cpu" and q.dim() == 2 and q.dtype in DTYPES and q.is_contiguous()
            and keys.dim() == 3 and values.shape == keys.shape and values.stride() == keys.stride()
            and keys.device.type == values.device.type == "cpu" and keys.dtype == values.dtype == q.dtype
            and keys.shape[2] == q.shape[1] and keys.stride(2) == 1 and keys.shape[1] > 0
            and not (q.requires_grad or keys.requires_grad or values.requires_grad)):
        return False
    heads, kv_heads = q.shape[0], keys.shape[0]
    return (kv_heads > 0 and heads % kv_heads == 0 and heads // kv_heads <= MAX_GROUP and wanted()
            and library() is not None)


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, lib=None) -> torch.Tensor:
    """One new token's attention by the C kernel: q [H, D] against keys and values [Hkv, L, D] as
    :func:`serves_attention` takes them, query head h reading key/value head h // (H / Hkv). Each thread
    takes a run of positions for every head, reading each key and value row once (flash-decoding), with
    a running maximum and sum in float32; the runs are combined and rounded once. Returns [H, D] in q's
    dtype. On the development machine a (32, 8, 128) head layout at 4096 positions took SDPA 2.24 ms
    over the cache's rows (7.5 GB/s; ``python -m benchmarks.cpu_attention``, session 36). ``lib``: another
    build of the library (tests)."""
    lib = lib or library()
    heads, dim = q.shape
    kv_heads, length = keys.shape[0], keys.shape[1]
    out = torch.empty(heads, dim, dtype=q.dtype)
    threads = torch.get_num_threads()
    scratch = _scratch(threads * heads * (dim + 2))
    status = lib.vs_decode_attention(DTYPES[q.dtype], q.data_ptr(), heads, dim, keys.data_ptr(), values.data_ptr(),
                                     length, kv_heads, keys.stride(1), keys.stride(0), float(scale), out.data_ptr(),
                                     threads, scratch.data_ptr())
    _check(status, "its copy of the query", lambda: f"attention of q {tuple(q.shape)} over keys "
           f"{tuple(keys.shape)} (strides {keys.stride()}, {q.dtype})")
    return out


def decode_attention_rows(q: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, starts: torch.Tensor,
                          lengths: torch.Tensor, scale: float, lib=None) -> torch.Tensor:
    """One new token of each of B sequences by the C kernel, in one call: q [B, H, D] (contiguous) against the
    rows of a pool, keys and values [rows, Hkv, D] (contiguous, q's dtype), sequence b's ``lengths[b]`` positions
    from row ``starts[b]`` (int64 [B] CPU tensors), query head h reading key/value head h // (H / Hkv). Each
    sequence as :func:`decode_attention` computes it; the threads take the sequences' runs of positions in one
    parallel region. Returns [B, H, D] in q's dtype. Raises ValueError where the kernel refuses the shapes."""
    lib = lib or library()
    batch, heads, dim = q.shape
    kv_heads = pool_k.shape[1]
    if not (q.is_contiguous() and pool_k.is_contiguous() and pool_v.is_contiguous() and pool_k.shape == pool_v.shape
            and pool_k.dtype == pool_v.dtype == q.dtype and q.dtype in DTYPES and pool_k.shape[2] == dim
            and starts.dtype == lengths.dtype == torch.int64 and starts.shape == lengths.shape == (batch,)
            and bool((starts + lengths <= pool_k.shape[0]).all())):
        raise ValueError(f"decode_attention_rows takes q [B, H, D] and a pool [rows, Hkv, D] of its dtype, contiguous, "
                         f"with each sequence's rows inside the pool; got q {tuple(q.shape)} {q.dtype}, pool "
                         f"{tuple(pool_k.shape)} {pool_k.dtype}")
    starts, lengths = starts.contiguous(), lengths.contiguous()
    out = torch.empty(batch, heads, dim, dtype=q.dtype)
    status = lib.vs_decode_attention_rows(DTYPES[q.dtype], q.data_ptr(), batch, heads, dim, pool_k.data_ptr(),
                                          pool_v.data_ptr(), starts.data_ptr(), lengths.data_ptr(), kv_heads,
                                          kv_heads * dim, dim, float(scale), out.data_ptr(), torch.get_num_threads())
    _check(status, "its scratch", lambda: f"attention of q {tuple(q.shape)} over a pool {tuple(pool_k.shape)} "
           f"({q.dtype}) at lengths {lengths.tolist()[:8]}")
    return out


def transpose_into(w: torch.Tensor, out: torch.Tensor | None = None, lib=None) -> torch.Tensor | None:
    """A row-major copy of ``w`` [N, K], a half-precision CPU weight stored transposed (``w.T`` [K, N] by
    rows, as a split FFN's down projection lies in host memory), by the library's tiled transpose on
    torch's thread count, into ``out`` (a contiguous [N, K] tensor of ``w``'s dtype; None: a new one);
    None where the library is not built or ``w`` is not such a view (the caller copies with torch
    then). Torch's own copy of that view runs on one thread: on the development machine 4096 x 6272
    bf16 took it 41 ms (1.25 GB/s)."""
    if not (w.device.type == "cpu" and w.dim() == 2 and w.dtype in DTYPES and _by_columns(w) and w.numel() > 0
            and not w.requires_grad):
        return None
    lib = lib or library()
    if lib is None or not hasattr(lib, "vs_transpose"):
        return None
    n, k = w.shape
    if out is None:
        out = torch.empty(n, k, dtype=w.dtype)
    elif not (out.shape == w.shape and out.dtype == w.dtype and out.is_contiguous() and out.device.type == "cpu"):
        raise ValueError(f"a row-major copy of {tuple(w.shape)} {w.dtype} needs a contiguous CPU tensor of that "
                         f"shape and dtype, got {tuple(out.shape)} {out.dtype}")
    _check(lib.vs_transpose(w.data_ptr(), w.stride(1), out.data_ptr(), k, k, n, torch.get_num_threads()), "",
           lambda: f"a transposed copy of {tuple(w.shape)} (strides {w.stride()})")
    return out


def wait_for_word(word: torch.Tensor, at_least: int, seconds: float, lib=None) -> int | None:
    """Read ``word[0]`` (a CPU int64 tensor that another agent writes: the GPU, into pinned memory) in a
    spin until it is ``>= at_least`` or ``seconds`` have passed, the GIL free meanwhile; the last value
    read. None where the library is not built (the caller polls its own way)."""
    if not (word.device.type == "cpu" and word.dtype == torch.int64 and word.numel() >= 1):
        raise ValueError(f"a word to wait for is a CPU int64 tensor, got {word.dtype} on {word.device}")
    lib = lib or library()
    if lib is None or not hasattr(lib, "vs_wait_word"):
        return None
    return lib.vs_wait_word(word.data_ptr(), int(at_least), max(0, int(seconds * 1e9)))


class BoundPart:
    """A run-ahead part's C call bound to its tensors ahead of time, for the run-ahead worker: :meth:`run` waits
    for the part's ready word, computes into its output and raises the part's ticket in one C call, the GIL free
    throughout (:func:`bind_routed_experts_part`, :func:`bind_swiglu_part`)."""

    NOT_READY = 1  # run's status where the ready word did not come within the wait

    def __init__(self, call, args: tuple, tensors: tuple, scratch: str, describe, experts: bool):
        self._call, self._args, self._scratch, self._describe = call, args, scratch, describe
        self.experts = experts  # a MoE layer's routed experts (else a dense FFN's part)
        self._tensors = tensors  # what the arguments point into: alive as long as the part
        self._waited = ctypes.c_long(0)

    def run(self, ready: torch.Tensor, ticket: torch.Tensor, number: int, seconds: float,
            threads: int) -> tuple[int, float]:
        """Wait up to ``seconds`` for ``ready[0] >= number``; then compute and set ``ticket[0] = number``.
        Returns (:data:`NOT_READY` or 0, seconds waited); raises as the unbound call would for a status the
        kernel refused (the ticket raised all the same)."""
        status = self._call(ready.data_ptr(), ticket.data_ptr(), int(number), max(0, int(seconds * 1e9)),
                            ctypes.byref(self._waited), *self._args, int(threads))
        if status not in (0, self.NOT_READY):
            _check(status, self._scratch, self._describe)
        return status, self._waited.value * 1e-9


def bind_routed_experts_part(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, experts: torch.Tensor,
                             weights: torch.Tensor, out: torch.Tensor, lib=None) -> BoundPart | None:
    """:func:`routed_experts` of ``x`` into ``out`` [T, D] (``x``'s dtype, rows contiguous) bound ahead of its
    inputs' values: ``x``, ``experts`` and ``weights`` may still be on their way (a copy from the GPU the
    part's ready word announces), so only their layout is checked here (as :func:`serves_experts` checks it);
    the kernel checks the expert indices when it runs. None where the kernel does not take these tensors, or
    the library is older than the call."""
    lib = lib or library()
    if lib is None or not hasattr(lib, "vs_routed_experts_part") or not serves_experts(x, gate_up, down, experts,
                                                                                       weights):
        return None
    if not (out.device.type == "cpu" and out.dtype == x.dtype and out.shape == x.shape and out.is_contiguous()):
        return None
    E, two_f, D = gate_up.shape
    T, k = experts.shape
    args = (DTYPES[x.dtype], gate_up.data_ptr(), gate_up.stride(0), gate_up.stride(1), down.data_ptr(),
            down.stride(0), down.stride(1), x.data_ptr(), T, experts.data_ptr(), experts.stride(0), experts.stride(1),
            weights.data_ptr(), ROUTING_DTYPES[weights.dtype], weights.stride(0), weights.stride(1), k, D, two_f // 2,
            E, out.data_ptr())

    def describe() -> str:
        return (f"the routed experts {experts.tolist()} of {E} (gate_up {tuple(gate_up.shape)}, "
                f"down {tuple(down.shape)}, {x.dtype})")

    return BoundPart(lib.vs_routed_experts_part, args, (x, gate_up, down, experts, weights, out),
                     "its scratch for the routed experts", describe, experts=True)


def bind_swiglu_part(h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, out: torch.Tensor,
                     lib=None) -> BoundPart | None:
    """:func:`swiglu` of ``h`` [T, D] into ``out`` (``h``'s shape and dtype, contiguous) bound ahead of ``h``'s
    values (a copy from the GPU the part's ready word announces): a split dense FFN's CPU part on the run-ahead
    worker. None where the kernel does not take these tensors (:func:`serves_swiglu`; ``h`` rows contiguous), or
    the library is older than the call."""
    lib = lib or library()
    if lib is None or not hasattr(lib, "vs_swiglu_part") or not (h.dim() == 2 and h.is_contiguous()) \
            or not serves_swiglu(h, gate, up, down):
        return None
    if not (out.device.type == "cpu" and out.dtype == h.dtype and out.shape == h.shape and out.is_contiguous()):
        return None
    return BoundPart(lib.vs_swiglu_part, _swiglu_args(h, gate, up, down, out), (h, gate, up, down, out),
                     "its buffers for the FFN's products", lambda: _describe_swiglu(h, gate, up, down), experts=False)


_scratches = threading.local()  # per calling thread: the host thread and the run-ahead worker


def _scratch(elements: int) -> torch.Tensor:
    """This thread's float32 scratch of at least ``elements`` (the threads' partial sums)."""
    buffer = getattr(_scratches, "buffer", None)
    if buffer is None or buffer.numel() < elements:
        buffer = _scratches.buffer = torch.empty(elements, dtype=torch.float32)
    return buffer
