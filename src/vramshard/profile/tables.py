"""Interpolation tables: measured times on a grid, read back between and beyond the points.

Along each measured coordinate (M, bytes of a copy, context, new tokens, and K·N at one M)
time is a fixed cost plus a cost per unit of work, ``t = a + b·x``. In log-log space such a
curve is convex, so reading ``log t`` linearly in ``log x`` (as this module once did)
follows the chord above it and over-predicts every point between a latency-bound and a
throughput-bound one. So these coordinates are read linearly, exact for ``a + b·x``.

Below the first point the time is clamped (small work is latency-bound, so the smallest
measured time is a floor). Beyond the last point the time grows in proportion to the
coordinate: the throughput of the last measured point is assumed to hold.

A matmul table holds a handful of ``(K, N)`` shapes; an unmeasured shape is predicted at
each measured M from a roofline-like fit over the measured shapes nearest in size
(:func:`fit_work_time`), and then read over M like a measured one.
"""
from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

# Width, in natural-log units of K·N, of the Gaussian that weights measured shapes in the fit
# for an unmeasured one: shapes within 2.7× the weight count nearly fully, 10× away by 7%.
# Chosen by leave-one-out on the H200 profile (benchmarks/interp_check.py): 0.7-1.5 are within
# 2% of each other; narrower follows measurement noise, wider (4) loses 4% on the CPU.
SHAPE_BANDWIDTH = 1.0


def interp_linear(x: float, xs: Sequence[float], ys: Sequence[float]) -> float:
    """Time at ``x`` from points ``(xs, ys)`` (xs ascending, all positive).

    Linear inside the range (exact for ``a + b·x``), clamped below, proportional (constant
    throughput) above.
    """
    if len(xs) == 0:
        raise ValueError("interp_linear needs at least one point")
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1] * x / xs[-1]
    hi = bisect.bisect_right(xs, x)
    lo = hi - 1
    frac = (x - xs[lo]) / (xs[hi] - xs[lo])
    return ys[lo] + frac * (ys[hi] - ys[lo])


def fit_work_time(work: float, works: Sequence[float], seconds: Sequence[float], floor: bool = False) -> float:
    """Seconds of an unmeasured shape of ``work = K·N`` at one M, from measured shapes at that M.

    At one M the weights' bytes and FLOPs both grow as K·N, so time is a fixed cost plus a
    cost per weight: ``t = a + b·K·N`` with ``a, b ≥ 0``, a roofline whose throughput may
    change with size (caches, threads with too little work). It is fitted to the measured
    shapes weighted by closeness to ``work`` in log space (:data:`SHAPE_BANDWIDTH`),
    minimizing relative, not absolute, error.

    ``floor``: small kernels sit on a floor instead, ``t = max(f, a + b·K·N)``, as on the GPU,
    where launches overlap the previous kernel and the time per call is the larger of the
    host's launch time and the kernel's. The floor and the shapes on it are fitted once for
    all queries (:func:`_floor`), so the prediction stays continuous in ``work``; the line is
    then fitted as above to the shapes off the floor.

    Outside the measured works: clamped below, constant throughput above.
    """
    return _read(work, _floor(works, seconds) if floor else (0.0, list(zip(works, seconds))), min(works), max(works))


def _read(work: float, base: tuple[float, list], lowest: float, highest: float) -> float:
    """:func:`fit_work_time` given the floor and the points off it, ``base``."""
    level, off_floor = base
    if work <= lowest or work >= highest:
        edge = lowest if work <= lowest else highest
        at_edge = max(level, _local_line(edge, off_floor))
        return at_edge if work <= lowest else at_edge * work / edge
    return max(level, _local_line(work, off_floor))


def _local_line(work: float, points: Sequence[tuple[float, float]]) -> float:
    """``a + b·work`` fitted to ``(work, seconds)`` points weighted by closeness to ``work``."""
    log_work = math.log(work)
    distances = [((math.log(w) - log_work) / SHAPE_BANDWIDTH) ** 2 for w, _ in points]
    nearest = min(distances)
    weighted = [(w, t, math.exp(-0.5 * (d - nearest))) for (w, t), d in zip(points, distances)]  # never all 0
    a, b = _line(work, weighted)
    return a + b * work


def _floor(works: Sequence[float], seconds: Sequence[float]) -> tuple[float, list[tuple[float, float]]]:
    """``(f, points off the floor)`` of the best fit of ``max(f, a + b·w)`` over all points
    (the smallest ones on the floor), or ``(0, all points)`` if no floor fits clearly better."""
    points = sorted((w, t, 1.0) for w, t in zip(works, seconds))
    middle = points[len(points) // 2][0]
    a, b = _line(middle, points)
    best, best_residual = (0.0, points), _residual(points, 0.0, a, b)
    for split in range(1, len(points) - 1):
        low, high = points[:split], points[split:]
        level = sum(1 / t for _, t, _ in low) / sum(1 / t**2 for _, t, _ in low)  # relative least squares
        a, b = _line(middle, high)
        residual = _residual(points, level, a, b)
        if residual < best_residual * (1 - 1e-3):
            best, best_residual = (level, high), residual
    level, off_floor = best
    return level, [(w, t) for w, t, _ in off_floor]


def _residual(points, level: float, a: float, b: float) -> float:
    return sum(g * (max(level, a + b * w) / t - 1.0) ** 2 for w, t, g in points)


def _line(work: float, points) -> tuple[float, float]:
    """``(a, b)``, both ≥ 0, of the weighted relative least squares ``t ≈ a + b·w`` over
    ``points`` ``(w, t, weight)``."""
    reference = max(points, key=lambda p: p[2])[1]
    # In units of the query (u = a / reference, v = b·work / reference) both columns are O(1):
    # the relative error at point i is u·fixed_i + v·per_work_i - 1.
    fixed = [reference / t for _, t, _ in points]
    per_work = [reference * w / work / t for w, t, _ in points]
    weights = [g for _, _, g in points]
    ff = sum(g * f * f for g, f in zip(weights, fixed))
    fw = sum(g * f * p for g, f, p in zip(weights, fixed, per_work))
    ww = sum(g * p * p for g, p in zip(weights, per_work))
    f1 = sum(g * f for g, f in zip(weights, fixed))
    w1 = sum(g * p for g, p in zip(weights, per_work))
    # The non-negative optimum: both columns if their least squares has no negative coefficient,
    # else the better single column (column c alone: coefficient s_c / s_cc, and the residual
    # falls by s_c² / s_cc). Ties go to the cost per weight: one shape reads as constant throughput.
    determinant = ff * ww - fw**2
    u = v = -1.0
    if determinant > 1e-9 * ff * ww:
        u = (f1 * ww - w1 * fw) / determinant
        v = (w1 * ff - f1 * fw) / determinant
    if u < 0 or v < 0:
        u, v = (0.0, w1 / ww) if w1**2 / ww >= f1**2 / ff else (f1 / ff, 0.0)
    return reference * u, reference * v / work


class Curve:
    """Seconds by one coordinate (a transfer's bytes)."""

    def __init__(self, xs: Sequence[float], seconds: Sequence[float]):
        order = sorted(range(len(xs)), key=lambda i: xs[i])
        self.xs = [float(xs[i]) for i in order]
        self.seconds = [float(seconds[i]) for i in order]

    def __call__(self, x: float) -> float:
        return interp_linear(x, self.xs, self.seconds)


class Grid2D:
    """Seconds on an outer × inner grid: ``values[i][j]`` at ``(outer[i], inner[j])``.

    Interpolates over ``inner`` within each outer row, then over ``outer`` (both linearly).
    """

    def __init__(self, outer: Sequence[float], inner: Sequence[float], values: Sequence[Sequence[float]]):
        o_order = sorted(range(len(outer)), key=lambda i: outer[i])
        i_order = sorted(range(len(inner)), key=lambda j: inner[j])
        self.outer = [float(outer[i]) for i in o_order]
        self.inner = [float(inner[j]) for j in i_order]
        self.values = [[float(values[i][j]) for j in i_order] for i in o_order]

    def __call__(self, outer: float, inner: float) -> float:
        row_times = [interp_linear(inner, self.inner, row) for row in self.values]
        return interp_linear(outer, self.outer, row_times)


class MatmulTable:
    """Seconds of ``[M, K] @ [K, N]`` for a list of ``(K, N)`` shapes × a list of M.

    ``seconds[s][j]`` is shape ``shapes[s]`` at ``ms[j]``. A measured ``(K, N)`` reads its own
    row over M, linearly (within one kernel, time is the weights read once plus work per row),
    so measured points come back exactly. Any other shape first gets a row: at each measured M
    a fit over the measured shapes by ``K·N`` (:func:`fit_work_time`); the row is then read the
    same way.
    """

    def __init__(
        self, shapes: Sequence[Sequence[int]], ms: Sequence[int], seconds: Sequence[Sequence[float]],
        floor: bool = False,
    ):
        self.floor = floor
        self.shapes = [(int(k), int(n)) for k, n in shapes]
        self.ms = [int(m) for m in ms]
        self.seconds = [[float(t) for t in row] for row in seconds]
        m_order = sorted(range(len(self.ms)), key=lambda j: self.ms[j])
        self._sorted_ms = [float(self.ms[j]) for j in m_order]
        self._rows: dict[tuple[int, int], list[float]] = {}
        for shape, row in zip(self.shapes, self.seconds):
            self._rows[shape] = [row[j] for j in m_order]
        self._works = [float(k * n) for k, n in self.shapes]
        self._columns = [[row[j] for row in self.seconds] for j in m_order]  # per sorted M, per shape
        self._bases: list[tuple[float, list]] | None = None  # per sorted M: (floor, points off it)
        self._fitted: dict[tuple[int, int], list[float]] = {}  # unmeasured shape -> row, memo

    def __call__(self, m: int, k: int, n: int) -> float:
        return interp_linear(m, self._sorted_ms, self.row(int(k), int(n)))

    def row(self, k: int, n: int) -> list[float]:
        """Seconds of ``(k, n)`` at each measured M (ascending): measured, or fitted."""
        row = self._rows.get((k, n)) or self._fitted.get((k, n))
        if row is None:
            if self._bases is None:
                self._bases = [
                    _floor(self._works, column) if self.floor else (0.0, list(zip(self._works, column)))
                    for column in self._columns
                ]
            lowest, highest = min(self._works), max(self._works)
            row = self._fitted[(k, n)] = [_read(k * n, base, lowest, highest) for base in self._bases]
        return row

    def subset(self, shapes: Sequence[Sequence[int]], ms: Sequence[int]) -> "MatmulTable":
        """The same table restricted to some of its shapes and Ms (all must be present)."""
        s_index = [self.shapes.index((int(k), int(n))) for k, n in shapes]
        m_index = [self.ms.index(int(m)) for m in ms]
        return MatmulTable(
            [self.shapes[s] for s in s_index], [self.ms[j] for j in m_index],
            [[self.seconds[s][j] for j in m_index] for s in s_index], self.floor,
        )
