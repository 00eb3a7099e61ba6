"""Choosing among a plan's rows: the fastest that fits, why, and what to change when none fits."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .vocabulary import PlanError

if TYPE_CHECKING:
    from .plan import Plan, PlanRow


def rank(row: PlanRow) -> tuple:
    """Fitting rows first, then the fastest, then the smallest."""
    return (not row.fits, row.step_seconds if row.step_seconds is not None else math.inf, row.peak_bytes)


def choose(rows: list[PlanRow], budget: float, skipped: Sequence[str] = ()) -> tuple[PlanRow | None, str]:
    """The fastest row that fits; ties (within 1%) go to the one needing less memory."""
    fitting = [r for r in rows if r.fits and r.step_seconds is not None]
    notes = ("; skipped " + "; ".join(skipped)) if skipped else ""
    if not fitting:
        return None, _nothing_fits(rows, budget) + notes
    fastest = min(r.step_seconds for r in fitting)
    close = [r for r in fitting if r.step_seconds <= fastest * 1.01]
    best = min(close, key=lambda r: (r.peak_bytes, r.step_seconds))
    best.chosen = True
    others = sorted((r for r in fitting if r is not best), key=lambda r: r.step_seconds)
    why = (f"fastest (a tie within 1% goes to less memory) of the {len(fitting)} configurations that fit in "
           f"{size(budget)} per device "
           f"({best.step_seconds * 1e3:.4g} ms per step, peak {size(best.peak_bytes)})")
    if others:
        runner = others[0]
        change = (runner.step_seconds / best.step_seconds - 1) * 100
        label = runner.label()
        if change < 0:
            why += (f"; {label} is {-change:.1f}% faster, within 1%, but needs "
                    f"{size(runner.peak_bytes - best.peak_bytes)} more memory")
        else:
            why += f"; next: {label}, {change:.1f}% slower"
    not_fitting = sorted({_name(r) for r in rows} - {_name(r) for r in fitting})
    if not_fitting:
        why += f"; does not fit: {', '.join(not_fitting)}"
    return best, why + notes


def _name(row: PlanRow) -> str:
    return f"{row.strategy} tp={row.tp}" if row.tp > 1 else row.strategy


BINARY, DECIMAL = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)), (("GB", 1e9), ("MB", 1e6), ("kB", 1e3))


def size(value: float, units: tuple = BINARY, digits: str = ".2f") -> str:
    """Bytes for people: GiB, MiB or KiB (``DECIMAL``: GB, MB or kB, as the table's bytes on a link)."""
    for unit, scale in units:
        if abs(value) >= scale:
            return f"{value / scale:{digits}} {unit}"
    return f"{value:.0f} B"


def _nothing_fits(rows: list[PlanRow], budget: float) -> str:
    traced = [r for r in rows if r.traced] or rows  # untraced rows hold lower bounds only
    least = min(traced, key=lambda r: r.peak_bytes)
    need = least.peak_bytes
    m = least.memory
    states = m.get("params", 0) + m.get("grads", 0) + m.get("optimizer", 0)
    act = m.get("activations", 0) + m.get("gathered", 0)
    advice = []
    if act > 0:
        advice.append(f"activation checkpointing (torch.utils.checkpoint per block: most of the {size(act)} of "
                      "activations and gathered parameters at the peak is recomputed instead of kept)")
    advice.append(f"more devices (they shrink only the {size(states)} of parameters, gradients and optimizer "
                  "state, which FSDP shards" + (f", not the {size(act)} of activations)" if act else ")"))
    if states > 0:
        advice.append(f"CPU offload (fsdp_compile.CPUOffload moves the {size(states)} of shards, gradients and "
                      "optimizer state to host memory)")
    advice.append("a smaller batch or sequence (activations shrink with them)")
    return (f"no strategy fits in {size(budget)} per device: the least memory is {size(need)} "
            f"({_name(least)}, at its {least.phase} peak); what would make it fit: " + "; ".join(advice))


def require_fit(result: Plan) -> PlanRow:
    """``result.best``, or a :class:`PlanError` saying how much memory is needed and what would help."""
    if result.best is None:
        raise PlanError(result.why)
    return result.best
