"""The plan as a table a person reads."""

from __future__ import annotations

from typing import Any

from .choice import DECIMAL, size
from .trace import describe_reshard
from .vocabulary import GiB


def _unit(plan: Any) -> tuple[str, float]:
    """GiB for real models; MiB for small ones (tests, the models of CPU runs)."""
    largest = max(r.peak_bytes for r in plan.rows)
    return ("GiB", GiB) if largest >= GiB else ("MiB", float(1 << 20))


def _time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    return f"{seconds * 1e3:.3g} ms"


def render_plan(plan: Any) -> str:
    """One line per candidate: fits?, peak and memory by role (GiB per device), bytes per step per link, step time,
    exposed communication, tokens/s per device, MFU; the chosen row marked, and why."""
    unit, scale = _unit(plan)

    def _gib(value: float) -> str:
        return f"{value / scale:.2f}"

    with_tp = len({row.tp for row in plan.rows}) > 1
    tp_column = ["tp"] if with_tp else []
    header = ["", "strategy", *tp_column, "bucket", "pf", "fits", f"peak {unit}", "params", "grads", "optim",
              "gathered", "activ", "buffers", "intra/step", "inter/step", "step", "exposed", "tok/s/dev", "MFU"]
    lines = []
    for row in plan.rows:
        m = row.memory
        lines.append([
            "*" if row.chosen else "", row.strategy + (f" {describe_reshard(row.reshard)}" if row.reshard else ""),
            *([str(row.tp)] if with_tp else []), row.bucket, str(row.prefetch), "yes" if row.fits else "NO",
            _gib(row.peak_bytes), _gib(m["params"]), _gib(m["grads"]), _gib(m["optimizer"]), _gib(m["gathered"]),
            _gib(m["activations"]), _gib(m["buffers"]),
            *(size(row.bytes_per_step.get(link, 0), DECIMAL, ".3g") for link in ("intra", "inter")),
            _time(row.step_seconds), _time(row.exposed_comm_seconds),
            f"{row.tokens_per_second:,.0f}" if row.tokens_per_second else "-",
            f"{row.mfu * 100:.1f}%" if row.mfu is not None else "-"])
    widths = [max(len(str(r[i])) for r in [header, *lines]) for i in range(len(header))]
    per = "data-parallel rank (a tp group shares them)" if with_tp else "device"
    out = [f"Plan for {plan.world_size} devices of {plan.cluster.describe()}",
           (f"memory budget {plan.budget_bytes / scale:.2f} {unit} per device (memory columns in {unit}); "
            f"{plan.tokens_per_step} tokens per {per} per step; predicted (roofline compute, ring "
            "collectives, one compute and one communication stream), not measured"),
           "  ".join(h.ljust(w) for h, w in zip(header, widths))]
    out += ["  ".join(str(c).ljust(w) for c, w in zip(line, widths)) for line in lines]
    notes = [f"{row.label()}: {row.note}" for row in plan.rows if row.note]
    if notes:
        out.append("notes: " + "\n       ".join(notes))
    mixed = [row for row in plan.rows if row.reshard]
    if mixed:
        out.append(
            f"kept: units that keep their gathered parameters from forward to backward (over n: a shard over n "
            f"ranks); backend(memory_budget={plan.budget_bytes:.0f}, cluster=) with this plan's cluster "
            "makes the same choice, or give the units yourself: reshard_after_forward=" + "; ".join(
                f"{row.reshard} for {row.strategy}" for row in mixed))
    if with_tp:
        out.append("tp: the tensor-parallel degree (FSDP shards over world / tp); its collectives are priced "
                   "on the intra-node link")
    out.append(f"chosen: {plan.best.label() if plan.best else 'none'} -- {plan.why}")
    return "\n".join(out) + "\n"
