"""Generation throughput over time: snapshots the run's ``Tally`` records as rows stream out.

A snapshot is ``{"t": seconds since generation started, "done": rows finished, "tokens": tokens
generated, "served": {source: samples it generated}}`` (cumulative, this attempt). The report keeps
them under ``throughput.series``; ``report.html`` draws rates from them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

EVERY_S = 1.0
MAX_POINTS = 300


def record(series: list[dict[str, Any]], t: float, done: int, tokens: int, served: Mapping[str, int], *,
           final: bool = False, every_s: float = EVERY_S, max_points: int = MAX_POINTS) -> None:
    """Append a snapshot, at most one per ``max(every_s, t / max_points)`` seconds (the final one always).

    The gap grows with the run, and past ``2 * max_points`` snapshots every other one is dropped (the first
    and last stay), so a day-long run keeps a few hundred points, not one per batch."""
    if series and not final and t - series[-1]["t"] < max(every_s, t / max_points):
        return
    point = {"t": round(t, 2), "done": done, "tokens": tokens, "served": {k: v for k, v in served.items() if v}}
    if series and series[-1]["t"] == point["t"]:
        series[-1] = point
    else:
        series.append(point)
    if len(series) > 2 * max_points:
        series[:] = series[:-1:2] + series[-1:]


def windowed_rates(points: list[tuple[float, float]], window_s: float) -> list[tuple[float, float]]:
    """(t, rate) from cumulative (t, count) points: the count's growth over the last ``window_s`` seconds
    (or since the first point, early on), per second. Points must be sorted by t."""
    out, j = [], 0
    for t, c in points[1:]:
        while j + 1 < len(points) and points[j + 1][0] <= t - window_s:
            j += 1
        t0, c0 = points[j]
        if t > t0:
            out.append((t, (c - c0) / (t - t0)))
    return out
