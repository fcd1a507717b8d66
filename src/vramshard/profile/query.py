"""Reading a profile: the times the estimator asks for, interpolated between measurements.

    profile = Profile.from_dict(data)          # or store.load() / synthetic(...)
    profile.matmul_s(16, 4096, 14336, "bf16", "cpu", threads=8, contended=True)
    profile.transfer_s(64 * 2**20, "h2d")
    profile.attention_s(1, 4096, 32, 8, 128, "bf16", "cuda")
    profile.dispatch_s("cpu")

Full tables are measured at all cores; other thread counts and the CPU under PCIe load
are smaller tables read as a ratio to the full one on their common grid, so the
shape-dependence comes from the full table and the scaling from the small one. How the
tables read between and beyond their points is in :mod:`vramshard.profile.tables`;
``benchmarks/interp_check.py`` measures it by leave-one-out on a measured profile.
"""

from __future__ import annotations

import copy
import math

from ..env import cpu_gemv_rows
from ..errors import InvalidInputError, ProfileError
from .schema import validate
from .tables import Curve, Grid2D, MatmulTable, interp_linear

PEAK_POINTS = 5  # the summary's peak GFLOP/s: the median of this many fastest points of a table
# A smaller run-ahead worker team is chosen over the largest only where it is this much faster (noise).
TEAM_MARGIN = 0.05

_DTYPE_NAMES = {
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
}


def dtype_name(dtype) -> str:
    """``"bf16"``, ``"fp16"`` or ``"fp32"`` from a torch dtype or a name such as ``"bfloat16"``."""
    name = _DTYPE_NAMES.get(str(dtype).lower())
    if name is None:
        raise InvalidInputError(f"dtype {dtype!r} is not profiled; use bf16, fp16 or fp32")
    return name


def device_name(device) -> str:
    """``"cpu"`` or ``"cuda"`` from ``"cuda:0"``, ``"gpu"``, a torch.device, …"""
    text = str(device).lower().split(":")[0]
    if text in ("cuda", "gpu"):
        return "cuda"
    if text == "cpu":
        return "cpu"
    raise InvalidInputError(f"device {device!r} is not profiled; use 'cpu' or 'cuda'")


def fastest_team(rates: dict) -> int:
    """The worker team size (a key of ``rates``: team size -> rate) to compute with: the fastest, where
    it beats the largest team by more than :data:`TEAM_MARGIN`; else the largest."""
    by_team = {int(team): float(rate) for team, rate in rates.items()}
    largest = max(by_team)
    best = max(by_team, key=lambda team: (by_team[team], team))
    return best if by_team[best] > by_team[largest] * (1 + TEAM_MARGIN) else largest


class Profile:
    """Measured speeds of one machine, with interpolating queries (all results in seconds)."""

    def __init__(self, data: dict):
        validate(data)
        self.data = data
        self.threads: list[int] = sorted(int(t) for t in data["cpu"]["threads"])
        self.default_threads: int = int(data["cpu"].get("default_threads") or self.threads[-1])
        read = data["cpu"].get("read_gb_s")
        self.cpu_read_bps: float | None = read * 1e9 if read else None  # host memory read, all cores
        gather = data["cpu"].get("gather_gb_s")
        self._gather_bps: float | None = gather * 1e9 if gather else None  # KV blocks gathered, all cores
        self._matmul: dict[tuple, MatmulTable] = {}
        for t in data["matmul"]:
            threads = int(t["threads"]) if t["device"] == "cpu" and t.get("threads") else None
            key = (t["device"], t["dtype"], threads, bool(t.get("contended")))
            # GPU launches overlap the previous kernel: small kernels sit on the launch floor.
            self._matmul[key] = MatmulTable(t["shapes"], t["m"], t["seconds"], floor=t["device"] == "cuda")
        self._transfer = {
            (t["direction"], bool(t.get("contended"))): Curve(t["bytes"], t["seconds"]) for t in data["transfer"]
        }
        self._attention: dict[tuple, list[tuple[dict, Grid2D]]] = {}
        for t in data["attention"]:
            key = (t["device"], t["dtype"])
            self._attention.setdefault(key, []).append((t, Grid2D(t["n_new"], t["context"], t["seconds"])))
        self._subsets: dict[tuple, MatmulTable] = {}
        self._has_gpu = any(key[0] == "cuda" for key in self._matmul)
        self._transfers: dict[tuple, float] = {}  # (bytes, direction, contended) -> seconds, memo for the planner
        self.cpu_scale = 1.0  # CPU compute as fitted to this machine while it runs (see calibrated)
        self.split_part_scale = 1.0  # a split FFN's CPU part as fitted to this machine while it runs
        # CPU compute by rows (tokens) as measured in the engine's steps: ((rows, factor), ...) sorted
        self.cpu_rows: tuple[tuple[int, float], ...] = ()
        # CPU compute by rows as timed on this host when the engine loads (profile/drift.py), beside cpu_rows
        self.compute_rows: tuple[tuple[int, float], ...] = ()
        # oneDNN-prepacked over plain products of one dtype by rows as timed then, in place of the profile's
        self.packed_now: tuple[str, tuple[tuple[int, float], ...]] | None = None
        # Split dense FFNs' CPU parts by rows as measured in the engine's steps, on top of cpu_rows
        self.split_rows: tuple[tuple[int, float], ...] = ()
        self.dispatch_scale = 1.0  # the host's cost of dispatching GPU work, as fitted in the engine's steps
        self.copy_scale = 1.0  # copies beside CPU work (contended transfers) as timed on this host now
        self.thread_limit: int | None = None  # the most CPU threads the engine may use (see limited_to)

    # --- construction -------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict) -> "Profile":
        """A profile from its JSON dict (validated; raises ProfileError)."""
        return cls(data)

    def to_dict(self) -> dict:
        """The JSON dict (the same object the profile was built from)."""
        return self.data

    @classmethod
    def synthetic(cls, **peaks) -> "Profile":
        """A profile built from peak numbers instead of measurements; see :func:`synthetic`."""
        from .synthetic import synthetic_data

        return cls(synthetic_data(**peaks))

    def calibrated(self, cpu_scale: float = 1.0, split_part_scale: float = 1.0,
                   cpu_rows: dict[int, float] | None = None, dispatch_scale: float = 1.0,
                   split_rows: dict[int, float] | None = None, copy_scale: float = 1.0,
                   compute_rows: dict[int, float] | None = None) -> "Profile":
        """This profile fitted to the engine's measured steps (:mod:`vramshard.plan.calibrate`): CPU
        compute times (matmuls, attention, the compiled pass over host experts) ``cpu_scale`` times
        longer, and a split FFN's CPU part (:meth:`split_part_factor`) ``split_part_scale`` times
        longer on top. ``cpu_rows``: {rows: factor} on CPU compute of that many rows (tokens), on
        top of the factor the profile already had there (:meth:`cpu_row_factor`). ``dispatch_scale``:
        the host's cost of dispatching GPU work (:meth:`dispatch_s` on "cuda") that many times the
        profile's. ``split_rows``: {rows: factor} on a split FFN's CPU part of that many rows, on top
        of everything else (:meth:`split_row_factor`). ``copy_scale``: copies beside CPU work (contended
        transfers) that many times the profile's (:func:`vramshard.profile.drift.copies_corrected`).
        ``compute_rows``: {rows: factor} on CPU compute of that many rows as this host computes them now
        against the profile's tables (:func:`vramshard.profile.drift.corrected`), kept apart from the
        engine's fitted ``cpu_rows`` (:meth:`fitted_row_factor`); :meth:`cpu_row_factor` is both. Copies
        alone and the GPU's own times stay as measured; the file is not changed. Factors compose."""
        rows = dict(cpu_rows or {})
        split = dict(split_rows or {})
        compute = dict(compute_rows or {})
        for name, value in (("cpu_scale", cpu_scale), ("split_part_scale", split_part_scale),
                            ("dispatch_scale", dispatch_scale), ("copy_scale", copy_scale),
                            *((f"the factor at {m} rows", f) for m, f in rows.items()),
                            *((f"the split parts' factor at {m} rows", f) for m, f in split.items()),
                            *((f"the host's compute factor at {m} rows", f) for m, f in compute.items())):
            if not math.isfinite(value) or value <= 0:
                raise InvalidInputError(f"{name} must be a positive number, got {value!r}")
        for what, table in (("cpu_rows", rows), ("split_rows", split), ("compute_rows", compute)):
            if any(not isinstance(m, int) or m < 1 for m in table):
                raise InvalidInputError(f"{what} are keyed by whole row counts >= 1, got {sorted(table)}")
        clone = copy.copy(self)  # shares the read-only tables
        clone.cpu_scale = self.cpu_scale * cpu_scale
        clone.split_part_scale = self.split_part_scale * split_part_scale
        clone.dispatch_scale = self.dispatch_scale * dispatch_scale
        clone.copy_scale = self.copy_scale * copy_scale
        if rows:
            table = dict(self.cpu_rows)
            table.update({m: self.fitted_row_factor(m) * f for m, f in rows.items()})
            clone.cpu_rows = tuple(sorted(table.items()))
        if compute:
            table = dict(self.compute_rows)
            table.update({m: _by_rows(self.compute_rows, m) * f for m, f in compute.items()})
            clone.compute_rows = tuple(sorted(table.items()))
        if split:
            table = dict(self.split_rows)
            table.update({m: self.split_row_factor(m) * f for m, f in split.items()})
            clone.split_rows = tuple(sorted(table.items()))
        return clone

    def limited_to(self, threads: int | None) -> "Profile":
        """This profile for an engine that may use at most ``threads`` CPU threads (``--threads``:
        cores left to a game or other work beside it; None: all): CPU work asked of more threads, or of
        the default (all cores), is priced at ``threads``, from the tables' thread ratios as any count
        below all cores is. The file is not changed."""
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise InvalidInputError(f"the CPU thread limit must be a whole number of threads >= 1, got {threads!r}")
        clone = copy.copy(self)
        clone.thread_limit = None if threads is None or threads >= self.default_threads else threads
        return clone

    def fitted_factors(self) -> dict:
        """The factors fitted while the engine runs (:meth:`calibrated`), as JSON; the profile is
        this dict's :meth:`with_fitted_factors` over :meth:`to_dict`."""
        return {"cpu_scale": self.cpu_scale, "split_part_scale": self.split_part_scale,
                "dispatch_scale": self.dispatch_scale, "cpu_rows": [list(r) for r in self.cpu_rows],
                "split_rows": [list(r) for r in self.split_rows], "copy_scale": self.copy_scale,
                "compute_rows": [list(r) for r in self.compute_rows],
                "packed_now": [self.packed_now[0], [list(r) for r in self.packed_now[1]]] if self.packed_now else None}

    def with_fitted_factors(self, factors: dict) -> "Profile":
        """This profile with the factors of :meth:`fitted_factors` in place of its own."""
        clone = copy.copy(self)
        clone.cpu_scale, clone.split_part_scale = float(factors["cpu_scale"]), float(factors["split_part_scale"])
        clone.dispatch_scale = float(factors["dispatch_scale"])
        clone.cpu_rows = tuple((int(m), float(f)) for m, f in factors["cpu_rows"])
        clone.split_rows = tuple((int(m), float(f)) for m, f in factors["split_rows"])
        clone.copy_scale = float(factors.get("copy_scale", 1.0))  # (not in the factors stored before session 53)
        clone.compute_rows = tuple((int(m), float(f)) for m, f in factors.get("compute_rows", ()))  # (nor this, 54)
        packed = factors.get("packed_now")  # (nor this)
        clone.packed_now = (str(packed[0]), tuple((int(m), float(f)) for m, f in packed[1])) if packed else None
        return clone

    def with_packed_now(self, dtype, rows: dict[int, float]) -> "Profile":
        """This profile with ``dtype``'s dense FFNs on the CPU priced, oneDNN-prepacked, at ``rows`` ({rows:
        packed time over plain}, as this host runs them now: :func:`vramshard.profile.drift.corrected`) in
        place of the profile's ``packed_ffn`` factors (:meth:`packed_ffn_factor`). The file is not changed."""
        if not rows or any(not isinstance(m, int) or m < 1 or not math.isfinite(f) or f <= 0 for m, f in rows.items()):
            raise InvalidInputError(f"packed factors are positive numbers keyed by whole row counts >= 1, got {rows!r}")
        clone = copy.copy(self)
        clone.packed_now = (dtype_name(dtype), tuple(sorted((int(m), float(f)) for m, f in rows.items())))
        return clone

    def cpu_row_factor(self, rows: int) -> float:
        """The in-situ factor on CPU compute of ``rows`` rows: the engine's fit (:meth:`fitted_row_factor`)
        times the host's compute now against the profile's (``compute_rows``), each interpolated in log
        rows between the row counts measured (:meth:`calibrated`), the nearest one's beyond them, 1
        without any."""
        if not (self.cpu_rows or self.compute_rows):
            return 1.0  # (the planner asks this of every CPU time it prices)
        return _by_rows(self.cpu_rows, rows) * _by_rows(self.compute_rows, rows)

    def fitted_row_factor(self, rows: int) -> float:
        """The factor the engine fitted to its own steps on CPU compute of ``rows`` rows (``cpu_rows``)."""
        return _by_rows(self.cpu_rows, rows)

    def split_row_factor(self, rows: int) -> float:
        """The in-situ factor on a split FFN's CPU part of ``rows`` rows beyond :meth:`cpu_row_factor`
        (the estimator applies both), interpolated as that is."""
        return _by_rows(self.split_rows, rows)

    # --- facts --------------------------------------------------------------------------
    @property
    def has_gpu(self) -> bool:
        """Whether the profile holds GPU and PCIe measurements."""
        return self._has_gpu

    @property
    def cpu_gemv(self) -> str | None:
        """The C kernel's instruction set where the one-row CPU tables were timed through it, else None."""
        return self.data.get("cpu_gemv")

    @property
    def host_experts_cpu_gemv(self) -> str | None:
        """The C kernel's instruction set where the host-experts rates were timed through it, else None
        (the compiled pass timed them)."""
        return self.data.get("host_experts_cpu_gemv")

    def one_row_read_bps(self, dtype=None) -> float | None:
        """The fastest weight read of the CPU's one-row products (all threads, alone) in the matmul
        tables: bytes of the weight over the time of its product with one row; of ``dtype``'s products
        where given and measured, else of every dtype's (None: no such point). The dtypes go different
        ways (on the H100 machine's profile the fastest fp32 product, torch's, read at 138 GB/s, the
        fastest bf16 one, the C kernel's, at 121)."""
        itemsize = {"bf16": 2, "fp16": 2, "fp32": 4}
        rates = [(name, k * n * itemsize[name] / row[table.ms.index(1)])
                 for (device, name, threads, contended), table in self._matmul.items()
                 if device == "cpu" and threads == self.default_threads and not contended and 1 in table.ms
                 and name in itemsize
                 for (k, n), row in zip(table.shapes, table.seconds)]
        wanted = dtype_name(dtype) if dtype is not None else None
        mine = [rate for name, rate in rates if name == wanted]
        return max(mine or [rate for _, rate in rates]) if rates else None

    @property
    def zero_copy_efficiency(self) -> float | None:
        """The GPU kernels' read of routed experts from pinned host memory over the copy engine's rate
        for the same bytes, as measured (the ``zero_copy`` table), else None."""
        table = self.data.get("zero_copy")
        return table["copy_seconds"] / table["seconds"] if table else None

    @property
    def vram_decode_bps(self) -> float | None:
        """Raw bytes a second the GPU rebuilds from coded weights in VRAM, as measured (``vram_decode``), else
        None."""
        table = self.data.get("vram_decode")
        return table["bytes"] / table["seconds"] if table else None

    @property
    def fingerprint_hash(self) -> str:
        return self.data["fingerprint_hash"]

    def _require_gpu(self, what: str) -> None:
        if not self.has_gpu:
            raise ProfileError(
                f"the profile has no GPU data, so it cannot estimate {what}; it was measured on a machine "
                "without CUDA (re-run `vramshard profile` on a machine with a GPU, or plan for the CPU only)"
            )

    # --- queries ------------------------------------------------------------------------
    def matmul_s(self, m: int, k: int, n: int, dtype, device, threads: int | None = None, contended: bool = False) -> float:
        """Seconds of ``[m, k] @ [k, n]`` in ``dtype`` on ``device``.

        ``threads``: CPU threads (default all cores); ignored on the GPU. ``contended``: the
        CPU shares the memory controller with a PCIe stream (ignored on the GPU).
        """
        dtype, device = dtype_name(dtype), device_name(device)
        if min(m, k, n) < 0:
            raise InvalidInputError(f"matmul dimensions must not be negative, got M={m} K={k} N={n}")
        if m == 0 or k == 0 or n == 0:
            return 0.0
        if device == "cuda":
            self._require_gpu("a GPU matmul")
            table = self._matmul.get(("cuda", dtype, None, False))
            if table is None:
                raise ProfileError(f"the profile has no GPU matmul data for {dtype}; re-run `vramshard profile`")
            return table(m, k, n)
        full = self._cpu_full(dtype)
        seconds = full(m, k, n)
        threads = self._check_threads(threads)
        if threads != self.default_threads:
            seconds *= self._thread_ratio(dtype, threads, m, k, n)
        if contended:
            seconds *= self._ratio(("cpu", dtype, self.default_threads, True), full, m, k, n)
        return seconds * self.cpu_scale * self.cpu_row_factor(m)

    def matmul_grid(self, dtype, device) -> tuple[list[tuple[int, int]], list[int]]:
        """The ``(K, N)`` shapes and the M values the all-cores table of ``dtype`` on ``device``
        measured: where :meth:`matmul_s` returns a measurement rather than an interpolation."""
        dtype, device = dtype_name(dtype), device_name(device)
        table = self._matmul.get(("cuda", dtype, None, False)) if device == "cuda" else self._cpu_full(dtype)
        if table is None:
            raise ProfileError(f"the profile has no {device} matmul data for {dtype}; re-run `vramshard profile`")
        return list(table.shapes), sorted(table.ms)

    def attention_grid(self, dtype, device, heads: int, kv_heads: int, head_dim: int) -> tuple[list[int], list[int]]:
        """The new-token counts and contexts measured for the head layout :meth:`attention_s`
        reads for ``heads``, ``kv_heads`` and ``head_dim``."""
        layout, _ = self._attention_layout(dtype_name(dtype), device_name(device), heads, kv_heads, head_dim)
        return sorted(int(n) for n in layout["n_new"]), sorted(int(c) for c in layout["context"])

    def transfer_s(self, nbytes: int, direction: str = "h2d", contended: bool = False) -> float:
        """Seconds to copy ``nbytes`` between pinned host memory and the GPU.

        ``direction``: "h2d" or "d2h". ``contended``: while the CPU computes (times ``copy_scale``).
        """
        key = (nbytes, direction, bool(contended))
        seconds = self._transfers.get(key)  # (the curve's time, which clones with other scales share)
        if seconds is not None:  # the planner's simulations ask the same few sizes thousands of times
            return seconds * self.copy_scale if contended else seconds
        if direction not in ("h2d", "d2h"):
            raise InvalidInputError(f"transfer direction must be 'h2d' or 'd2h', got {direction!r}")
        self._require_gpu("a PCIe transfer")
        if nbytes <= 0:
            return 0.0
        curve = self._transfer.get((direction, bool(contended))) or self._transfer.get((direction, False))
        if curve is None:
            raise ProfileError(f"the profile has no {direction} transfer data; re-run `vramshard profile`")
        seconds = self._transfers[key] = curve(nbytes)
        return seconds * self.copy_scale if contended else seconds

    def attention_s(
        self, n_new: int, context: int, heads: int, kv_heads: int, head_dim: int, dtype, device,
        threads: int | None = None,
    ) -> float:
        """Seconds of attention of ``n_new`` query tokens over ``context`` cached tokens.

        Measured for a few head layouts; others scale from the layout with the nearest
        ``head_dim`` and KV grouping (:func:`_layout_scale`).
        """
        dtype, device = dtype_name(dtype), device_name(device)
        if n_new <= 0 or context <= 0:
            return 0.0
        if device == "cuda":
            self._require_gpu("GPU attention")
        layout, grid = self._attention_layout(dtype, device, heads, kv_heads, head_dim)
        seconds = grid(n_new, context) * _layout_scale(layout, n_new, heads, kv_heads, head_dim)
        if device == "cpu":
            threads = self._check_threads(threads)
            if threads != self.default_threads:
                seconds *= self._thread_ratio(dtype, threads, max(n_new, 1), 4096, 4096)
            seconds *= self.cpu_scale * self.cpu_row_factor(n_new)
        return seconds

    def split_part_factor(self, dtype) -> float:
        """Time per byte of a split dense FFN's CPU part over the whole FFN's on the CPU (1 when
        the profile did not measure it), times the in-situ ``split_part_scale``."""
        return float(self.data.get("split_part", {}).get(dtype_name(dtype), 1.0)) * self.split_part_scale

    def packed_ffn_factor(self, dtype, rows: int) -> float:
        """A dense FFN's CPU time from oneDNN-prepacked weights over plain ones at ``rows`` (linear
        in log rows between the measured counts, the nearest beyond them; 1 when the profile did not
        measure it or oneDNN could not pack the dtype here): as timed on this host when the engine loaded
        where it was (:meth:`with_packed_now`, a decode step's rows), else the profile's."""
        if self.packed_now and self.packed_now[0] == dtype_name(dtype) and KERNEL_ROWS < rows <= DECODE_ROWS:
            return _by_rows(self.packed_now[1], rows)
        return self._factor_by_rows("packed_ffn", dtype, rows)

    def tiles_ffn_factor(self, dtype, rows: int) -> float:
        """A dense FFN's CPU time through the C kernel's matrix tiles over torch's at ``rows`` (between the measured
        counts as :meth:`packed_ffn_factor`; 1 when the profile did not measure it: no tiles on its machine, or a
        profile from before session 61)."""
        return self._factor_by_rows("tiles_ffn", dtype, rows)

    def host_experts_rate(self, dtype, rows: int, on_worker: bool = False) -> float | None:
        """Bytes per second of the CPU's one pass over a step's routed experts at ``rows`` (the C
        kernel's where :attr:`host_experts_cpu_gemv`, else the compiled one: its assignments' expert
        bytes over its time; between the measured counts as
        :meth:`packed_ffn_factor`), or None when the profile did not measure it. ``on_worker``: as
        the run-ahead worker computes it, beside the host thread's Python (where the profile
        measured that beside a host thread that launches work: :attr:`worker_rates_measured`; else the
        rate alone). Slowed, as every CPU compute time, by the in-situ factors (:meth:`calibrated`):
        the pass is CPU compute."""
        if not self.data.get("host_experts", {}).get(dtype_name(dtype)):
            return None
        section = "host_experts_worker" if on_worker and self.worker_rates_measured and self.data.get(
            "host_experts_worker", {}).get(dtype_name(dtype)) else "host_experts"
        return self._factor_by_rows(section, dtype, rows) / (  # (a read-bound pass: not compute_rows)
            self.cpu_scale * self.fitted_row_factor(rows))

    @property
    def worker_rates_measured(self) -> bool:
        """Whether the pass's rates on the run-ahead worker were timed beside a host thread that
        launches work as the executor's does (since session 39). Earlier profiles timed them beside
        Python alone: on the H100 machine (thirty-fourth GPU session) that gave 33 GB/s where the
        engine's worker computed the same experts at 104 GB/s (0.72 ms a layer, 0.61 alone), so
        those rates are not used: the rate alone prices the worker's parts."""
        return self.data.get("host_experts_worker_beside") == "launches"

    def worker_team(self, dtype) -> int | None:
        """The run-ahead worker's OpenMP team for decode-sized parts of ``dtype`` (:func:`fastest_team`
        over the profile's timings of the one-token expert pass beside the host thread by team size;
        another dtype's where this one was not timed); None where the profile did not time teams, or
        timed them beside Python alone (not :attr:`worker_rates_measured`: the H100 machine's two
        profiles of that kind named 8 threads and 15, and the thirty-fourth session's experts-cpu
        steps computed near the rate alone with 15)."""
        if not self.worker_rates_measured:
            return None
        teams = self.data.get("host_experts_worker_teams", {})
        rates = teams.get(dtype_name(dtype)) or next(iter(teams.values()), None)
        return fastest_team(rates) if rates else None

    def _factor_by_rows(self, section: str, dtype, rows: int) -> float:
        by_rows = self.data.get(section, {}).get(dtype_name(dtype))
        if not by_rows:
            return 1.0
        points = sorted((int(r), float(f)) for r, f in by_rows.items())
        rows = max(int(rows), 1)
        if rows <= points[0][0]:
            return points[0][1]
        for (r0, f0), (r1, f1) in zip(points, points[1:]):
            if rows <= r1:
                t = (math.log(rows) - math.log(r0)) / (math.log(r1) - math.log(r0))
                return f0 + t * (f1 - f0)
        return points[-1][1]

    def dispatch_s(self, device) -> float:
        """Fixed seconds to dispatch one sub-layer (Python and launch overhead) on ``device``."""
        device = device_name(device)
        if device == "cuda":
            self._require_gpu("GPU dispatch cost")
            return float(self.data["dispatch"][device]) * self.dispatch_scale
        return float(self.data["dispatch"][device])

    def graph_replay_s(self, kernels: int) -> float | None:
        """The host's seconds to replay a CUDA graph of ``kernels`` kernels (scaled as :meth:`dispatch_s`
        on "cuda"), from the profile's replay of one tiny sub-layer and its cost per kernel more; None where
        the profile did not measure it (made before session 58, or without a GPU)."""
        dispatch = self.data["dispatch"]
        if "cuda_graph" not in dispatch or "cuda_graph_node" not in dispatch:
            return None
        from .bench_dispatch import TINY_LAUNCHES

        node = float(dispatch["cuda_graph_node"])
        return max(0.0, float(dispatch["cuda_graph"]) + (kernels - TINY_LAUNCHES) * node) * self.dispatch_scale

    def fill_issue_s(self, rounds: int, graphs: bool = True) -> float:
        """The host's seconds to issue one coded stream fill of ``rounds`` rounds as the ring does: replayed from
        its CUDA graph (``graphs``) or round by round; as the profile timed it (``fill_issue``), else as the
        fifty-fifth GPU session's H100 host did against its dispatch cost (:data:`FILL_ISSUE_H100`) at this
        profile's. Scaled as :meth:`dispatch_s` on "cuda" (an engine's fit of its host work)."""
        figures, scale = self.data.get("fill_issue"), self.dispatch_scale
        if figures is None:
            figures, scale = FILL_ISSUE_H100, self.dispatch_s("cuda") / FILL_ISSUE_H100_DISPATCH_S
        rounds = max(int(rounds), 1)
        seconds = figures["graph"] + rounds * figures["graph_round"] if graphs else rounds * figures["round"]
        return seconds * scale

    def host_gather_s(self, nbytes: int) -> float:
        """Seconds the host takes to gather ``nbytes`` of KV-cache blocks into a pinned buffer (or scatter them
        back) with all torch threads: as the profile measured it (``cpu.gather_gb_s``), else at
        :data:`GATHER_READ_SHARE` of its host read, else at :data:`DEFAULT_GATHER_BPS`; CPU times' scale on top
        (the gather is memory-bound work the host's state slows as it slows the CPU's one-row products)."""
        rate = self._gather_bps or (self.cpu_read_bps * GATHER_READ_SHARE if self.cpu_read_bps
                                    else DEFAULT_GATHER_BPS)
        return nbytes / rate * self.cpu_scale

    def fill_call_s(self) -> float:
        """The host's seconds of one call of a stream fill's issue (a copy, a kernel's launch, an event's record or
        wait, a stream's switch): a round issued round by round makes :data:`FILL_ROUND_CALLS` of them."""
        return self.fill_issue_s(1, graphs=False) / FILL_ROUND_CALLS

    # --- helpers ------------------------------------------------------------------------
    def _cpu_full(self, dtype: str) -> MatmulTable:
        table = self._matmul.get(("cpu", dtype, self.default_threads, False))
        if table is None:
            raise ProfileError(f"the profile has no CPU matmul data for {dtype}; re-run `vramshard profile`")
        return table

    def _attention_layout(self, dtype: str, device: str, heads: int, kv_heads: int, head_dim: int):
        """(layout, grid) of the measured head layout nearest ``head_dim`` and the KV grouping."""
        tables = self._attention.get((device, dtype))
        if not tables:
            raise ProfileError(f"the profile has no {device} attention data for {dtype}; re-run `vramshard profile`")
        group = heads / max(kv_heads, 1)

        def distance(entry):
            t = entry[0]
            return (abs(math.log(head_dim / t["head_dim"])), abs(math.log(group * t["kv_heads"] / t["heads"])))

        return min(tables, key=distance)

    def cpu_thread_factor(self, dtype, threads: int | None, m: int, k: int, n: int) -> float:
        """How much longer CPU work shaped like an (m, k, n) matmul takes on ``threads`` threads
        than on the profile's default count (1 for None or that count): for CPU work the profile
        timed at the default count only (the compiled expert pass)."""
        threads = self._check_threads(threads)
        if threads == self.default_threads or not self.data["matmul"]:
            return 1.0
        return self._thread_ratio(dtype_name(dtype), threads, m, k, n)

    def _check_threads(self, threads: int | None) -> int:
        if threads is None:
            threads = self.default_threads
        if threads < 1:
            raise InvalidInputError(f"threads must be ≥ 1, got {threads}")
        return min(int(threads), self.thread_limit or threads)

    def _ratio(self, key: tuple, full: MatmulTable, m: int, k: int, n: int) -> float:
        """Time of table ``key`` over the full table, both read on ``key``'s grid (1 if absent)."""
        small = self._matmul.get(key)
        if small is None or key[2] == self.default_threads and not key[3]:
            return 1.0
        base = self._subsets.get(key)
        if base is None:
            base = self._subsets[key] = full.subset(small.shapes, small.ms)
        return small(m, k, n) / base(m, k, n)

    def _thread_ratio(self, dtype: str, threads: int, m: int, k: int, n: int) -> float:
        """How much slower ``threads`` CPU threads are than all cores, for this shape."""
        full = self._cpu_full(dtype)
        counts = [t for t in self.threads if ("cpu", dtype, t, False) in self._matmul]
        ratios = [self._ratio(("cpu", dtype, t, False), full, m, k, n) for t in counts]
        if threads >= counts[-1]:
            return ratios[-1]
        if threads <= counts[0]:
            return ratios[0] * counts[0] / threads  # fewer threads than measured: linear
        # Amdahl: time is a serial part plus a parallel part / threads, so the ratio is linear in
        # 1/threads (reading it in log space over-predicted between counts, as in tables.py).
        inverse = [1.0 / t for t in reversed(counts)]
        return interp_linear(1.0 / threads, inverse, list(reversed(ratios)))

    # --- summary ------------------------------------------------------------------------
    def summary(self) -> dict:
        """Main figures: peak GFLOP/s per device and dtype (the median of the PEAK_POINTS fastest
        points of its table; ``matmul_fastest_point_gflops``: the fastest one), PCIe GB/s alone and
        under CPU load (with what the CPU read meanwhile, ``cpu_read_beside``, where recorded), dispatch
        µs, thread counts, the cores other work kept busy beside the profile (``host_beside_cores``, where
        recorded). Plain JSON-able dict."""
        peaks: dict[str, dict[str, float]] = {}
        fastest: dict[str, dict[str, float]] = {}
        for (device, dtype, threads, contended), table in self._matmul.items():
            if contended or (device == "cpu" and threads != self.default_threads):
                continue
            rates = sorted((2 * m * k * n / t / 1e9 for (k, n), row in zip(table.shapes, table.seconds)
                            for m, t in zip(table.ms, row)), reverse=True)
            # The median of the PEAK_POINTS fastest points: the single fastest is one lucky timing
            # (two full profiles on the H200 host: max +15%, this figure +2.4% apart).
            top = rates[:PEAK_POINTS]
            peaks.setdefault(device, {})[dtype] = top[len(top) // 2]
            fastest.setdefault(device, {})[dtype] = rates[0]
        transfer: dict[str, dict[str, float]] = {}
        for (direction, contended), curve in self._transfer.items():
            best = max(b / t / 1e9 for b, t in zip(curve.xs, curve.seconds))
            transfer.setdefault(direction, {})["contended" if contended else "alone"] = best
        for table in self.data["transfer"]:  # what the CPU read beside the contended copies (since session 53)
            if table.get("contended") and table.get("load_cpu_gbps"):
                transfer[table["direction"]]["cpu_read_beside"] = float(table["load_cpu_gbps"])
        return {
            "matmul_peak_gflops": peaks,
            "matmul_fastest_point_gflops": fastest,
            "transfer_gbps": transfer,
            "dispatch_us": {device: s * 1e6 for device, s in self.data["dispatch"].items()},
            "split_part_factor": dict(self.data.get("split_part", {})),
            "packed_ffn_factor": dict(self.data.get("packed_ffn", {})),
            "tiles_ffn_factor": dict(self.data.get("tiles_ffn", {})),
            "host_experts_gb_s": {dtype: {rows: rate / 1e9 for rows, rate in by_rows.items()}
                                  for dtype, by_rows in self.data.get("host_experts", {}).items()},
            "host_experts_worker_gb_s": {dtype: {rows: rate / 1e9 for rows, rate in by_rows.items()}
                                         for dtype, by_rows in self.data.get("host_experts_worker", {}).items()},
            "host_experts_worker_teams_gb_s": {dtype: {team: rate / 1e9 for team, rate in by_team.items()}
                                               for dtype, by_team in self.data.get("host_experts_worker_teams",
                                                                                   {}).items()},
            "zero_copy_gb_s": ({"kernels": self.data["zero_copy"]["bytes"] / self.data["zero_copy"]["seconds"] / 1e9,
                                "copy_engine": self.data["zero_copy"]["bytes"]
                                / self.data["zero_copy"]["copy_seconds"] / 1e9}
                               if "zero_copy" in self.data else None),
            "vram_decode_gb_s": self.vram_decode_bps / 1e9 if self.vram_decode_bps else None,
            "fill_issue_us": ({key: seconds * 1e6 for key, seconds in self.data["fill_issue"].items()}
                              if "fill_issue" in self.data else None),
            "cpu_threads": self.threads,
            "default_threads": self.default_threads,
            "cpu_read_gb_s": self.cpu_read_bps / 1e9 if self.cpu_read_bps else None,
            "cpu_gather_gb_s": self._gather_bps / 1e9 if self._gather_bps else None,
            "host_beside_cores": ({key: self.data["host_beside"][key] for key in ("others_cores", "steal_cores")}
                                  if "host_beside" in self.data else None),
            "has_gpu": self.has_gpu,
        }


# KV-cache blocks gathered into pinned memory where the profile did not time it (``cpu.gather_gb_s``): a share of the
# host's read, for the gather reads and writes each byte: 13.2 against 30.3 GB/s on the development machine (2 cores,
# session 63), ~46 against 90 GB/s inside the fifty-sixth GPU session's batch-64 steps on an H100 host (its
# `index_select`s over the profiled steps' staged KV). Without a read figure either, one thread's ~10 GB/s.
GATHER_READ_SHARE = 0.5
DEFAULT_GATHER_BPS = 10e9

# A coded fill's host issue where the profile did not time it (``fill_issue``): `python3 -m benchmarks.wire_codec`
# on the fifty-fifth GPU session's H100 host (torch 2.11+cu130) replayed fills of 1, 5 and 21 rounds in 12, 36 and
# 112 us of host time, and issued them round by round in 115, 561 and 2221 us; its two full profiles timed the
# dispatch probe (one tiny sub-layer's launches) at 110.5 and 102.4 us. A profile without the figures takes them at
# its own dispatch cost.
FILL_ISSUE_H100 = {"graph": 10e-6, "graph_round": 4.8e-6, "round": 106e-6}
FILL_ISSUE_H100_DISPATCH_S = 106e-6
# Host calls of a coded round issued by itself (OverlappedDecode.round): the wait for its staging half, the copy, its
# event, the decode stream's wait, the switch to that stream and back, the decode, its event.
FILL_ROUND_CALLS = 8

# New tokens from which attention follows the query heads' work rather than the KV bytes read.
COMPUTE_BOUND_TOKENS = 16


def _layout_scale(layout: dict, n_new: int, heads: int, kv_heads: int, head_dim: int) -> float:
    """Attention time of a head layout over that of the measured ``layout``, at ``n_new`` new tokens.

    One new token reads every cached key and value once and does little with each: its time follows
    the KV bytes (``kv_heads * head_dim``). From :data:`COMPUTE_BOUND_TOKENS` new tokens on it
    follows the query heads' work (``heads * head_dim``); log-linear between. On the 2-core
    development machine (session 24, ``benchmarks/cpu_attention``: cold caches, bf16, 1K-16K keys)
    one token over (32, 4, 128) took 0.56-0.71x and over (16, 8, 128) 0.93-1.07x the time over the
    profiled (32, 8, 128), and 16 tokens 0.90-0.98x and 0.46-0.60x. The query heads alone (the rule before) priced one
    token at 1.0x and 0.5x."""
    by_work = heads * head_dim / (layout["heads"] * layout["head_dim"])
    by_bytes = kv_heads * head_dim / (layout["kv_heads"] * layout["head_dim"])
    reads = max(0.0, 1.0 - math.log(max(n_new, 1)) / math.log(COMPUTE_BOUND_TOKENS))
    return reads * by_bytes + (1.0 - reads) * by_work


def synthetic(**peaks) -> Profile:
    """A :class:`Profile` from peak numbers, for tests and what-if planning.

    See :func:`vramshard.profile.synthetic.synthetic_data` for the arguments, e.g.
    ``synthetic(cpu_gflops=200, gpu_gflops=50_000, h2d_gbps=4)`` makes PCIe slow.
    """
    return Profile.synthetic(**peaks)


# The most rows of a decode-sized step: the default tiers' largest decode tier, and the most rows the
# CPU computes through its few-row paths (the C kernel at one row, the compiled few-row SwiGLU, parts
# prepacked for oneDNN: runtime/cpu_packed.py); prompt chunks run plain matrix products into reused buffers.
DECODE_ROWS = 64
# The most rows of the C kernel's dense FFN work (layers/cpu_gemv.FFN_ROWS, from the same variable), through
# which the profile's one-row tables are timed; more rows take torch's paths (compiled, prepacked, F.linear).
KERNEL_ROWS = cpu_gemv_rows()


def _row_class(rows: int) -> int:
    """Which of the CPU's code paths computes ``rows`` rows: 0 the C kernel's few rows (KERNEL_ROWS),
    1 the rest of a decode-sized step (DECODE_ROWS), 2 prompt chunks."""
    return 0 if rows <= KERNEL_ROWS else 1 if rows <= DECODE_ROWS else 2


def _by_rows(table: tuple[tuple[int, float], ...], rows: int) -> float:
    """A factor from ``table`` ((rows, factor), sorted) at ``rows``: linear in log rows between the
    row counts in it, the nearest one's beyond them, 1 for an empty table. Only row counts that the
    same code computes as ``rows`` count (:func:`_row_class`). In the thirtieth GPU session (session
    33) llama3-8b's split parts ran 0.29-0.54x their prediction at 64 rows (prepacked); carried to
    1024 rows, that factor made the planner split the prompt tier's FFNs, whose CPU work then took up
    to 3.6x its prediction there, and a 1K prompt 1.4-2.3 s to its first token against a 0.2 s bound.
    In the thirty-ninth (session 44) each llama3-8b engine at 8 GiB fitted its 64-row tier first
    (factors 1.2-4.0); carried to one row, where the C kernel computes, that priced `layers:17` at
    150 ms a step where it ran at 65, and the planned decode lost to it 0.76-0.98x (docs/BENCHMARKS.md)."""
    table = tuple((m, f) for m, f in table if _row_class(m) == _row_class(rows))
    if not table:
        return 1.0
    if rows <= table[0][0]:
        return table[0][1]
    for (m0, f0), (m1, f1) in zip(table, table[1:]):
        if rows <= m1:
            t = math.log(rows / m0) / math.log(m1 / m0)
            return f0 + t * (f1 - f0)
    return table[-1][1]
