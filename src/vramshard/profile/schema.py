"""The profile file's layout, and its validation.

Top level: ``schema`` ("vramshard-profile"), ``version``, ``vramshard_version``,
``created`` (ISO date), ``fingerprint`` and ``fingerprint_hash``, ``quick``, ``synthetic``,
``elapsed_s``, ``cpu`` (``threads``: measured counts, ``default_threads``: all cores,
``read_gb_s`` (optional; absent in profiles made before 2026-12-04): host memory read with all
cores, GB/s, the mean of a timing before the CPU tables and one after; ``gather_gb_s`` (optional; absent
before session 63): KV-cache blocks gathered into a pinned buffer with all cores, GB/s arriving), and the tables:

- ``matmul``: list of ``{device, dtype, threads, contended, shapes: [[K, N]], m: [M],
  seconds: [[per M] per shape], estimated}`` (``threads`` is null on "cuda");
- ``transfer``: list of ``{direction: "h2d"|"d2h", contended, bytes: [...], seconds: [...]}``;
- ``attention``: list of ``{device, dtype, threads, heads, kv_heads, head_dim, n_new: [...],
  context: [...], seconds: [[per context] per n_new], estimated}``;
- ``dispatch``: ``{"cpu": seconds, "cuda": seconds}``, and where measured (profiles since session 58)
  ``"cuda_graph"``: the host's seconds to replay a CUDA graph of the same sub-layer's kernels,
  ``"cuda_graph_node"``: its seconds per kernel more in a graph;
- ``split_part`` (optional): ``{dtype: factor}``, a split dense FFN's CPU part's time per byte
  over the whole FFN's (absent: 1);
- ``packed_ffn`` (optional): ``{dtype: {rows: factor}}``, a dense FFN's CPU time from
  oneDNN-prepacked weights over plain ones (absent: 1; a dtype oneDNN cannot pack is absent);
- ``tiles_ffn`` (optional, since session 61): ``{dtype: {rows: factor}}``, a dense FFN's CPU time through the C
  kernel's matrix tiles (AMX) over torch's (absent: 1; only bf16, where the tiles are);
- ``host_experts`` (optional): ``{dtype: {rows: bytes per second}}``, the rate of the CPU's
  compiled pass over a MoE layer's routed experts: its assignments' expert bytes over its time
  (absent: the estimator times experts on the CPU from the matmul tables);
- ``host_experts_worker`` (optional): the same on the run-ahead worker thread while another thread
  runs Python, as the executor computes it there (absent: as ``host_experts``; measured only where
  there is a GPU, which the run-ahead worker needs); with the worker's fastest OpenMP team;
- ``host_experts_worker_teams`` (optional): ``{dtype: {team size: bytes per second}}``, the one-token
  pass on that worker by the size of its OpenMP team (the planner gives the worker the fastest);
- ``host_experts_worker_beside`` (optional): ``"launches"`` where the other thread made a torch call
  every few microseconds as the executor's host thread does (since session 39); absent: it ran Python
  alone, a worst case that priced the worker's one-token experts 3.7x slower than the engine computed
  them, and the estimator takes ``host_experts`` for the worker too.

- ``cpu_gemv`` (optional): the instruction set of the C kernel for one-row half-precision products
  (:mod:`~vramshard.layers.cpu_gemv`) that the one-row CPU tables were timed through, where it served
  (absent: timed through torch's paths, as every profile before 2026-12-05);
- ``host_experts_cpu_gemv`` (optional): the instruction set of the C kernel that ``host_experts``
  (and ``host_experts_worker``) were timed through (:func:`~vramshard.layers.cpu_gemv.routed_experts`,
  since session 35; absent: the compiled pass timed them, and the estimator prices a token's experts
  by the C kernel from the one-row tables where those were timed through it);
- ``zero_copy`` (optional): ``{bytes, seconds, copy_seconds}``, one token's routed experts computed by the
  GPU's kernels straight from pinned host memory (:mod:`~vramshard.profile.bench_zero_copy`) and the copy
  engine's copy of the same bytes (absent: the estimator takes the H200 machine's 92%; measured where the
  kernels run, since 2026-12-06);
- ``vram_decode`` (optional): ``{bytes, seconds}``, the raw bytes one Triton decode of coded bf16 weights
  rebuilds in VRAM and its seconds (:mod:`~vramshard.profile.bench_decode`; since 2026-12-07; absent: the
  estimator prices decodes from the GPU's one-row read);
- ``fill_issue`` (optional, since session 62): ``{graph, graph_round, round}``, the host's seconds to issue one
  coded stream fill as the ring does, replayed from its CUDA graph (``graph``, and ``graph_round`` each round of
  :data:`~vramshard.runtime.wire_codec.ROUND_RAW_BYTES` more), and each round of one issued round by round
  (:mod:`~vramshard.profile.bench_fill_issue`; absent: the estimator takes the fifty-fifth GPU session's H100
  figures);
- ``elapsed_by_table_s`` (optional): ``{table: seconds}``, where the profile's wall time went, by
  table (``"cpu matmul bf16 threads=16"``, ``"cuda attention fp16"``, …; see
  :class:`~vramshard.profile.progress.TableClock`);
- ``host_beside`` (optional, since 2026-12-07): ``{others_cores, steal_cores, own_cores, by_table: {table:
  {the same}}}``, the cores other processes kept busy while the profile ran (on average, and over each table's
  points), the steal among them (a virtual machine's host running its other guests), and the cores the
  profile's own threads kept busy (Linux only; own_cores may be absent); ``retimed_points`` and
  ``stolen_points`` (optional counts): CPU timings taken again because steal reached a quarter of a core over
  them, and those still under steal after their retries (:class:`~vramshard.profile.timing.StealGuard`).

GPU tables are absent when the machine has no CUDA device.
"""

from __future__ import annotations

import math

from ..errors import ProfileError

SCHEMA = "vramshard-profile"
VERSION = 1
DEVICES = ("cpu", "cuda")


def _positive(value, what: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ProfileError(f"{what} must be a positive number, found {value!r}")


def _positive_figures(data: dict, section: str, keys: tuple[str, ...], what: str) -> None:
    """An optional section of named positive figures (``keys``)."""
    figures = data.get(section)
    if figures is None:
        return
    if not isinstance(figures, dict):
        raise ProfileError(f"profile {section!r} section must hold {', '.join(keys[:-1])} and {keys[-1]}")
    for key in keys:
        _positive(figures.get(key), f"{what}: {key}")


def _factors_by_rows(data: dict, section: str, what: str, key: str = "rows") -> None:
    """An optional ``{dtype: {rows: positive number}}`` section (``key``: what the counts count)."""
    by_dtype = data.get(section, {})
    if not isinstance(by_dtype, dict) or not all(isinstance(v, dict) and v for v in by_dtype.values()):
        raise ProfileError(f"profile '{section}' section must map dtypes to {{{key}: factor}}")
    for dtype, by_rows in by_dtype.items():
        for rows, value in by_rows.items():
            if not str(rows).isdigit() or int(rows) < 1:
                raise ProfileError(f"profile '{section}' {key} for {dtype} must be positive integers, got {rows!r}")
            _positive(value, f"{what} for {dtype} at {rows} {key}")


def _grid(table: dict, rows_key: str, cols_key: str, what: str) -> None:
    rows, cols, seconds = table.get(rows_key), table.get(cols_key), table.get("seconds")
    if not isinstance(rows, list) or not isinstance(cols, list) or not isinstance(seconds, list) or not rows or not cols:
        raise ProfileError(f"{what}: needs non-empty '{rows_key}', '{cols_key}' and 'seconds' lists")
    if len(seconds) != len(rows) or any(not isinstance(r, list) or len(r) != len(cols) for r in seconds):
        raise ProfileError(f"{what}: 'seconds' is not a {len(rows)}×{len(cols)} grid")
    for row in seconds:
        for value in row:
            _positive(value, f"{what}: a time")


def validate(data) -> None:
    """Raise :class:`ProfileError` naming the first thing wrong with a profile dict."""
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise ProfileError(f"not a vramshard profile (missing \"schema\": \"{SCHEMA}\")")
    if data.get("version") != VERSION:
        raise ProfileError(f"profile format version {data.get('version')!r} is not the supported {VERSION}")
    for key in ("fingerprint", "fingerprint_hash", "cpu", "matmul", "transfer", "attention", "dispatch"):
        if key not in data:
            raise ProfileError(f"profile lacks the '{key}' section")
    cpu = data["cpu"]
    if not isinstance(cpu, dict) or not isinstance(cpu.get("threads"), list) or not cpu["threads"]:
        raise ProfileError("profile 'cpu' section lacks the measured 'threads' list")
    for key in ("read_gb_s", "gather_gb_s"):
        rate = cpu.get(key)
        if rate is not None and not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
            raise ProfileError(f"profile 'cpu' section: {key} must be a positive number of GB/s, got {rate!r}")
    for index, table in enumerate(data["matmul"]):
        what = f"matmul table {index}"
        if not isinstance(table, dict) or table.get("device") not in DEVICES:
            raise ProfileError(f"{what}: device must be one of {DEVICES}")
        _grid(table, "shapes", "m", what)
        if any(not isinstance(s, list) or len(s) != 2 for s in table["shapes"]):
            raise ProfileError(f"{what}: each shape must be [K, N]")
    for index, table in enumerate(data["transfer"]):
        what = f"transfer table {index}"
        if not isinstance(table, dict) or table.get("direction") not in ("h2d", "d2h"):
            raise ProfileError(f"{what}: direction must be 'h2d' or 'd2h'")
        if len(table.get("bytes") or []) != len(table.get("seconds") or []) or not table.get("bytes"):
            raise ProfileError(f"{what}: 'bytes' and 'seconds' must be non-empty lists of equal length")
        for value in table["seconds"]:
            _positive(value, f"{what}: a time")
    for index, table in enumerate(data["attention"]):
        what = f"attention table {index}"
        if not isinstance(table, dict) or table.get("device") not in DEVICES:
            raise ProfileError(f"{what}: device must be one of {DEVICES}")
        for key in ("heads", "kv_heads", "head_dim"):
            _positive(table.get(key), f"{what}: {key}")
        _grid(table, "n_new", "context", what)
    if not isinstance(data["dispatch"], dict) or "cpu" not in data["dispatch"]:
        raise ProfileError("profile 'dispatch' section lacks the 'cpu' time")
    for device, value in data["dispatch"].items():
        _positive(value, f"dispatch time on {device}")
    split_part = data.get("split_part", {})
    if not isinstance(split_part, dict):
        raise ProfileError("profile 'split_part' section must map dtypes to factors")
    for dtype, value in split_part.items():
        _positive(value, f"split FFN part factor for {dtype}")
    _factors_by_rows(data, "packed_ffn", "packed FFN factor")
    _factors_by_rows(data, "tiles_ffn", "matrix-tile FFN factor")
    _factors_by_rows(data, "host_experts", "routed experts' compiled pass rate")
    _factors_by_rows(data, "host_experts_worker", "routed experts' compiled pass rate on the run-ahead worker")
    _factors_by_rows(data, "host_experts_worker_teams", "the one-token pass's rate on the run-ahead worker", "threads")
    _positive_figures(data, "zero_copy", ("bytes", "seconds", "copy_seconds"), "zero-copy expert reads")
    _positive_figures(data, "vram_decode", ("bytes", "seconds"), "decode of coded weights")
    _positive_figures(data, "fill_issue", ("graph", "graph_round", "round"), "a coded fill's host issue")
    by_table = data.get("elapsed_by_table_s", {})
    if not isinstance(by_table, dict) or not all(_at_least_zero(v) for v in by_table.values()):
        raise ProfileError("profile 'elapsed_by_table_s' section must map tables to seconds (numbers ≥ 0)")
    beside = data.get("host_beside")
    if beside is not None:
        by_table = beside.get("by_table") if isinstance(beside, dict) else None
        if not isinstance(by_table, dict) or not all(_cores_beside(row) for row in (beside, *by_table.values())):
            raise ProfileError("profile 'host_beside' section must hold others_cores and steal_cores (numbers ≥ 0), "
                               "overall and in by_table for each table")
        if not all(isinstance(beside.get(key, 0), int) and _at_least_zero(beside.get(key, 0))
                   for key in ("retimed_points", "stolen_points")):
            raise ProfileError("profile 'host_beside' section's retimed_points and stolen_points must be counts ≥ 0")


def _at_least_zero(value) -> bool:
    """Whether ``value`` is a finite number ≥ 0 (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _cores_beside(row) -> bool:
    """Whether ``row`` is a ``host_beside`` entry: others_cores and steal_cores, finite numbers ≥ 0."""
    return isinstance(row, dict) and all(_at_least_zero(row.get(key)) for key in ("others_cores", "steal_cores"))
