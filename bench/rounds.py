"""Interleaved rounds shared by the step benchmarks: the rotation of what runs first, the spread of
a figure over rounds, and how a spread or a ratio is written in a table."""

from __future__ import annotations

import statistics


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "rounds": values}


def rotated(items: list, round_index: int) -> list:
    shift = round_index % len(items)
    return items[shift:] + items[:shift]


def fmt_spread(s: dict, digits: int = 1) -> str:
    if round(s["min"], digits) == round(s["max"], digits):
        return f"{s['median']:.{digits}f}"
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def fmt_ratio(c: dict | None) -> str:
    if c is None:
        return ""
    return f"{c['median']:.2f}x ({c['min']:.2f}-{c['max']:.2f})"
