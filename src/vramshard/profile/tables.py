"""Interpolation tables: measured times on a grid, read back in log space.

Between measured points the log of the time is interpolated linearly in the log of the
coordinate. Below the first point the time is clamped (small work is latency-bound, so the
smallest measured time is a floor). Beyond the last point the time grows in proportion to
the coordinate: the throughput of the last measured point is assumed to hold.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence


def interp_log(x: float, xs: Sequence[float], ys: Sequence[float]) -> float:
    """Time at ``x`` from points ``(xs, ys)`` (xs ascending, all positive).

    Log-log linear inside the range, clamped below, proportional (constant throughput) above.
    """
    if len(xs) == 0:
        raise ValueError("interp_log needs at least one point")
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1] * x / xs[-1]
    hi = bisect.bisect_right(xs, x)
    lo = hi - 1
    x0, x1 = math.log(xs[lo]), math.log(xs[hi])
    y0, y1 = math.log(ys[lo]), math.log(ys[hi])
    frac = (math.log(x) - x0) / (x1 - x0)
    return math.exp(y0 + frac * (y1 - y0))


class Curve:
    """Seconds by one coordinate (a transfer's bytes)."""

    def __init__(self, xs: Sequence[float], seconds: Sequence[float]):
        order = sorted(range(len(xs)), key=lambda i: xs[i])
        self.xs = [float(xs[i]) for i in order]
        self.seconds = [float(seconds[i]) for i in order]

    def __call__(self, x: float) -> float:
        return interp_log(x, self.xs, self.seconds)


class Grid2D:
    """Seconds on an outer × inner grid: ``values[i][j]`` at ``(outer[i], inner[j])``.

    Interpolates over ``inner`` within each outer row, then over ``outer``.
    """

    def __init__(self, outer: Sequence[float], inner: Sequence[float], values: Sequence[Sequence[float]]):
        o_order = sorted(range(len(outer)), key=lambda i: outer[i])
        i_order = sorted(range(len(inner)), key=lambda j: inner[j])
        self.outer = [float(outer[i]) for i in o_order]
        self.inner = [float(inner[j]) for j in i_order]
        self.values = [[float(values[i][j]) for j in i_order] for i in o_order]

    def __call__(self, outer: float, inner: float) -> float:
        row_times = [interp_log(inner, self.inner, row) for row in self.values]
        return interp_log(outer, self.outer, row_times)


class MatmulTable:
    """Seconds of ``[M, K] @ [K, N]`` for a list of ``(K, N)`` shapes × a list of M.

    ``seconds[s][j]`` is shape ``shapes[s]`` at ``ms[j]``. A query for a measured ``(K, N)``
    interpolates over M only; any other shape interpolates over the work size ``K * N``
    (shapes of equal ``K * N`` are averaged in log space).
    """

    def __init__(self, shapes: Sequence[Sequence[int]], ms: Sequence[int], seconds: Sequence[Sequence[float]]):
        self.shapes = [(int(k), int(n)) for k, n in shapes]
        self.ms = [int(m) for m in ms]
        self.seconds = [[float(t) for t in row] for row in seconds]
        m_order = sorted(range(len(self.ms)), key=lambda j: self.ms[j])
        sorted_ms = [float(self.ms[j]) for j in m_order]
        self._by_shape = {
            shape: Curve(sorted_ms, [row[j] for j in m_order]) for shape, row in zip(self.shapes, self.seconds)
        }
        by_work: dict[int, list[list[float]]] = {}
        for (k, n), row in zip(self.shapes, self.seconds):
            by_work.setdefault(k * n, []).append(row)
        works = sorted(by_work)
        merged = [
            [math.exp(sum(math.log(r[j]) for r in by_work[w]) / len(by_work[w])) for j in range(len(self.ms))]
            for w in works
        ]
        self._by_work = Grid2D(works, self.ms, merged)

    def __call__(self, m: int, k: int, n: int) -> float:
        curve = self._by_shape.get((int(k), int(n)))
        if curve is not None:
            return curve(m)
        return self._by_work(k * n, m)

    def subset(self, shapes: Sequence[Sequence[int]], ms: Sequence[int]) -> "MatmulTable":
        """The same table restricted to some of its shapes and Ms (all must be present)."""
        s_index = [self.shapes.index((int(k), int(n))) for k, n in shapes]
        m_index = [self.ms.index(int(m)) for m in ms]
        return MatmulTable(
            [self.shapes[s] for s in s_index], [self.ms[j] for j in m_index],
            [[self.seconds[s][j] for j in m_index] for s in s_index],
        )
