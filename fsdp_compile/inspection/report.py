"""What the backend did to each graph, as data (a JSON-able summary) and as a readable report.

``graph_summary`` builds the summary from a compiled graph's record; the dump writes it as
``summary.json`` and ``python -m fsdp_compile inspect`` reads it back, so the report looks the
same from files (``render_report``) and from Python (``FSDPBackend.report()``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

import torch.fx as fx

from ..passes.graph import COMM_META, WAIT, decode_collective, is_compute
from ..runtime.collectives import padded_rows


# ----------------------------------------------------------------------------- building
def _bucket_summary(bucket) -> dict[str, Any]:
    params, seen = [], set()
    for marker in bucket.markers:
        if marker.fqn in seen:
            continue
        seen.add(marker.fqn)
        params.append({"fqn": marker.fqn, "shape": list(marker.full_value.shape),
                       "dtype": str(marker.comm_dtype).replace("torch.", ""), "bytes": marker.full_bytes})
    spec = bucket.spec
    return {"bucket": bucket.key, "kind": "gather" if bucket.kind == "unshard" else "reduce",
            "gathers": spec.gathers, "shard_size": spec.shard_size, "replicate_size": spec.replicate_size,
            "params": params, "bytes": sum(p["bytes"] for p in params)}


def _collectives(gm: fx.GraphModule) -> list[dict[str, Any]]:
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    compute_before = list(itertools.accumulate((is_compute(n) for n in nodes[:-1]), initial=0))
    found = []
    waits = {n.args[0]: n for n in nodes if n.target is WAIT}
    decoded = {n: c for n in nodes for c in [decode_collective(n)] if c is not None}
    gathers = [n for n, c in decoded.items() if c.kind == "all_gather"]
    use_rank = {n: i for i, n in enumerate(sorted(gathers, key=lambda n: index[waits.get(n, n)]))}
    for node, collective in decoded.items():
        kind = collective.kind
        tag = node.meta.get(COMM_META)
        wait = waits.get(node)
        issue_at, wait_at = index[node], index[wait] if wait is not None else index[node]
        overlapped = compute_before[wait_at] - compute_before[issue_at]
        # A collective without our tag is torch's own: tensor parallelism's (DTensor put it in
        # the graph). Shown apart, and not counted against the strategy's theory.
        entry = {"kind": kind, "origin": "fsdp" if tag else "torch", "bucket": tag.bucket if tag else None,
                 "group": collective.group, "group_size": collective.group_size,
                 "dtype": str(collective.dtype).replace("torch.", ""), "bytes": int(collective.buffer_bytes),
                 "issued_at": issue_at, "waited_at": wait_at, "issued_before": node.next.name,
                 "overlapped_compute": overlapped}
        if kind == "all_gather":
            # A gather waited at the same compute position as this issue (the scheduler issues a
            # prefetch just ahead of the wait it follows, so the link does not idle) is in use there.
            in_use = [use_rank[g] for g in decoded if g in waits and use_rank.get(g) is not None
                      and compute_before[index[waits[g]]] <= compute_before[issue_at] and g is not node]
            entry["prefetch"] = 0 if overlapped == 0 else use_rank[node] - (max(in_use) if in_use else -1)
        found.append(entry)
    return found


def _phase_summary(gm, buckets, schedule, memory, seconds) -> dict[str, Any] | None:
    if gm is None:
        return None
    summary = {
        "nodes": len(gm.graph.nodes),
        "buckets": [_bucket_summary(b) for kind in ("unshard", "reduce_grad") for b in buckets.get(kind, [])],
        "collectives": _collectives(gm),
        "schedule": None if schedule is None else {"budget": schedule.budget, "peak_inflight": schedule.peak_inflight},
        "passes": seconds or {},
    }
    if memory is not None:
        summary["memory"] = memory.summary()
        summary["timeline"] = {
            "nodes": [name for name, _ in memory.timeline],
            "live": [live for _, live in memory.timeline],
            "inflight": memory.inflight_timeline,
            "roles": {role: [r[role] for r in memory.role_timeline] for role in memory.peak_by_role},
            "compute": [is_compute(n) for n in gm.graph.nodes],
        }
    return summary


def graph_summary(record, strategy, state) -> dict[str, Any]:
    """Everything the report needs about one compiled graph (of a backend with ``strategy``,
    whose ``shard()`` filled in ``state``, a :class:`~fsdp_compile.sharding.backend_state.ShardingState`),
    JSON-able."""
    import torch.distributed as dist

    topo = state.topology
    return {
        "graph": record.index,
        "rank": dist.get_rank() if dist.is_initialized() else 0,
        "strategy": strategy.name,
        "reshard_after_forward": strategy.reshard_after_forward,
        "shard_size": topo.shard_size if topo else None,
        "replicate_size": topo.replicate_size if topo else None,
        "compiler": record.compiler,
        "inference": record.inference,
        "fallbacks": list(record.fallbacks),
        "oversized_buckets": dict(state.oversized_buckets),
        "dynamo_nodes": len(record.dynamo.graph.nodes),
        "cache": getattr(record, "cache", ""),
        "python_read": record.python_read,
        # Each unit's ranks it reshards to after forward (reshard_after_forward=).
        "reshard_to": dict(state.reshard_to),
        "reshard_choice": state.reshard_choice.summary() if state.reshard_choice is not None else None,
        # The block classes compiled inline, not as regions, and why (backend-wide, so far).
        "inline_regions": {c.name: c.reason for c in state.region_fallback.inlined()},
        **{name: _phase_summary(*record.phase(name), record.pass_seconds.get(name))
           for name in ("forward", "backward")},
    }


# ----------------------------------------------------------------------------- theory
def theoretical_bytes(summary: dict[str, Any]) -> dict[str, int]:
    """Collective buffer bytes one step needs under the strategy, from the buckets' parameters.

    Every gathered parameter is gathered in forward and, when the strategy reshards, again in
    backward; every gradient is reduce-scattered (all-reduced when not sharded); hybrid adds an
    all-reduce of the gradient shards across replicas.
    """
    theory = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    forward, backward = summary.get("forward") or {}, summary.get("backward") or {}
    gathers = 2 if summary["reshard_after_forward"] and backward else 1
    for bucket in forward.get("buckets", []):
        if bucket["kind"] == "gather" and bucket["gathers"]:
            theory["all_gather"] += gathers * _padded(bucket)
    for bucket in backward.get("buckets", []):
        if bucket["kind"] != "reduce":
            continue
        if bucket["gathers"]:
            theory["reduce_scatter"] += _padded(bucket)
            if bucket["replicate_size"] > 1:
                theory["all_reduce"] += _padded(bucket) // bucket["shard_size"]
        else:
            hybrid = bucket["shard_size"] > 1 and bucket["replicate_size"] > 1
            theory["all_reduce"] += bucket["bytes"] * (2 if hybrid else 1)
    return theory


def _padded(bucket: dict[str, Any]) -> int:
    world = bucket["shard_size"]
    return sum(padded_rows(rows, world) * world * (p["bytes"] // rows if rows else 0)
               for p in bucket["params"] for rows in [p["shape"][0]])


def measured_bytes(summary: dict[str, Any]) -> dict[str, int]:
    measured = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    for phase in ("forward", "backward"):
        for c in (summary.get(phase) or {}).get("collectives", []):
            if c.get("origin", "fsdp") == "fsdp":
                measured[c["kind"]] += c["bytes"]
    return measured


# ----------------------------------------------------------------------------- rendering
def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def render_report(summaries: Iterable[dict[str, Any]], manifest: dict[str, Any] | None = None) -> str:
    summaries = list(summaries)
    lines = []
    if manifest:
        lines.append(f"fsdp_compile {manifest.get('fsdp_compile')} (torch {manifest.get('torch')}): "
                     f"{manifest.get('strategy')}, world size {manifest.get('world_size')}")
    if not summaries:
        lines.append("no graph compiled yet")
    else:
        lines += _reshard_lines(summaries[-1])
    inline = {name: reason for s in summaries for name, reason in (s.get("inline_regions") or {}).items()}
    for name, reason in inline.items():
        lines.append(f"{name} blocks compile inline, not as one region: {reason}")
    for s in summaries:
        lines += _render_graph(s)
    return "\n".join(lines) + "\n"


def _reshard_lines(s: dict[str, Any]) -> list[str]:
    """The units whose reshard_after_forward setting is not the strategy's, one line each, and
    under memory_budget= what the choice predicted."""
    choice = s.get("reshard_choice")
    if choice:
        lines = [f"memory_budget={_mib(choice['budget'])}: predicted peak {_mib(choice['peak'])} (every unit "
                 f"resharded: {_mib(choice['strategy_peak'])}), exposed communication {choice['exposed'] * 1e3:.3g} "
                 f"ms per step (every unit resharded: {choice['strategy_exposed'] * 1e3:.3g} ms)"]
        if choice.get("compiled_peak") is not None:
            lines[0] += f"; the compiled graphs' estimate: {_mib(choice['compiled_peak'])}"
        for c in choice["units"]:
            what = ("keeps its gathered parameters" if c["reshard_to"] == 1
                    else f"keeps a shard over {c['reshard_to']} ranks")
            lines.append(f"  {c['unit'] or '<root>'}: {what}, {_mib(c['kept_bytes'])} kept, "
                         f"{c['saved_seconds'] * 1e3:.3g} ms saved")
        return lines
    shard_size = s["shard_size"] or 1
    default = shard_size if s["reshard_after_forward"] else 1
    lines = []
    for unit, ranks in sorted((s.get("reshard_to") or {}).items()):
        if ranks == default:
            continue
        what = ("keeps its gathered parameters" if ranks == 1 else "reshards to the shard" if ranks == shard_size
                else f"keeps a shard over {ranks} ranks")
        lines.append(f"reshard after forward: {unit or '<root>'} {what}")
    return lines


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2 ** 20:.3g} MiB"


def _render_graph(s: dict[str, Any]) -> list[str]:
    kind = "inference" if s["inference"] else ("training" if s.get("backward") else "forward only")
    lines = ["", f"rank {s['rank']}, graph {s['graph']} ({kind}, {s['compiler']}, {s['strategy']}, "
                 f"shard group {s['shard_size']}, replicas {s['replicate_size']})"]
    for fb in s["fallbacks"]:
        lines.append(f"  ! pass {fb['pass']} failed on the {fb['phase']} graph ({fb['error']}); "
                     "that graph runs its markers through the eager runtime")
    oversized, explained = s.get("oversized_buckets", {}), set()
    if s.get("python_read"):
        lines.append(f"  only reads {s['python_read']} (a frame of its own, after a graph break): runs as Python, "
                     "gathered with its bucket")
        return lines
    if s["compiler"] == "eager":
        lines.append(f"  runs as captured ({s['dynamo_nodes']} nodes), every marker through the eager runtime")
        return lines
    if s.get("cache") == "hit":
        lines.append("  loaded from the compile cache (cache_dir=): no passes ran in this process, so no "
                     "graphs to show here; the run that compiled it has them (dump_dir=)")
        return lines
    for phase in ("forward", "backward"):
        p = s.get(phase)
        if not p:
            continue
        lines.append(f"  {phase}: {p['nodes']} nodes")
        buckets = p["buckets"]
        if buckets:
            lines.append(f"    buckets: {sum(b['kind'] == 'gather' for b in buckets)} gathered, "
                         f"{sum(b['kind'] == 'reduce' for b in buckets)} reduced")
            for b in buckets:
                params = ", ".join(f"{q['fqn']}{q['shape']} {q['dtype']}" for q in b["params"][:4])
                more = f", +{len(b['params']) - 4} more" if len(b["params"]) > 4 else ""
                flag = oversized.get(b["bucket"]) if b["kind"] == "gather" else None
                mark = f"  ! {flag['share']:.0%} of all parameters" if flag else ""
                lines.append(f"      {b['kind']:6} {b['bucket']:<16} {len(b['params']):3} params "
                             f"{_size(b['bytes']):>10}{mark}  {params}{more}")
                if flag and b["bucket"] not in explained:
                    explained.add(b["bucket"])
                    lines.append(f"        ! {s['strategy']} gathers this bucket whole, so sharding saves "
                                 f"little of its memory. {flag['advice']}")
        counts: dict[str, int] = {}
        theirs: dict[tuple[str, str, int | None], list[int]] = {}
        for c in p["collectives"]:
            if c.get("origin", "fsdp") == "fsdp":
                counts[c["kind"]] = counts.get(c["kind"], 0) + 1
            else:
                theirs.setdefault((c["kind"], c["group"], c["group_size"]), []).append(c["bytes"])
        lines.append("    collectives: " + (", ".join(f"{k} x{v}" for k, v in counts.items()) or "none"))
        if theirs:
            lines.append("    torch's own collectives (tensor parallelism): " + ", ".join(
                f"{kind} x{len(sizes)} on group {group}" + (f" ({size} ranks)" if size else "")
                + f", {_size(sum(sizes))}" for (kind, group, size), sizes in theirs.items()))
        if p.get("schedule"):
            schedule = p["schedule"]
            lines.append(f"    schedule: budget {_size(schedule['budget'])} in flight, "
                         f"peak {_size(schedule['peak_inflight'])}")
            for c in p["collectives"]:
                extra = f", prefetch {c['prefetch']}" if "prefetch" in c else ""
                lines.append(f"      {c['kind']:<14} {c['bucket']!s:<16} {_size(c['bytes']):>10} issued before "
                             f"{c['issued_before']}, overlaps {c['overlapped_compute']} compute nodes{extra}")
        if "memory" in p:
            m = p["memory"]
            roles = ", ".join(f"{k} {_size(v)}" for k, v in m["peak_by_role"].items())
            lines.append(f"    memory estimate: peak {_size(m['peak_bytes'])} at {m['peak_node']} ({roles}); "
                         f"in flight at most {_size(m['peak_inflight_bytes'])}")
        if p["passes"]:
            lines.append("    passes: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in p["passes"].items()))
    if s.get("forward") and not s["inference"]:
        theory, measured = theoretical_bytes(s), measured_bytes(s)
        lines.append("  bytes per step (collective buffers), measured vs theory for the strategy:")
        for kind in theory:
            if theory[kind] or measured[kind]:
                note = ""
                if kind == "all_gather" and measured[kind] < theory[kind] and s["reshard_after_forward"]:
                    note = "  (backward re-gathers only the parameters it needs)"
                lines.append(f"    {kind:<15} {_size(measured[kind]):>10} vs {_size(theory[kind]):>10}{note}")
    return lines


# ----------------------------------------------------------------------------- timeline, plot
def chrome_trace(summaries: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The schedule as a Chrome/Perfetto trace: one time unit per graph node.

    Per rank and graph: a compute track (each compute node), a collectives track (each
    collective from its issue to its wait), and counters for live and in-flight bytes.
    """
    events: list[dict[str, Any]] = []
    for s in summaries:
        pid = f"rank {s['rank']} graph {s['graph']}"
        offset = 0
        for phase in ("forward", "backward"):
            p = s.get(phase)
            if not p or "timeline" not in p:
                continue
            t = p["timeline"]
            for i, (name, computes) in enumerate(zip(t["nodes"], t["compute"])):
                if computes:
                    events.append({"name": name, "ph": "X", "ts": offset + i, "dur": 1, "pid": pid,
                                   "tid": f"{phase} compute", "cat": "compute"})
                events.append({"name": "memory", "ph": "C", "ts": offset + i, "pid": pid,
                               "args": {"live bytes": t["live"][i], "in flight bytes": t["inflight"][i]}})
            for c in p["collectives"]:
                label = c["bucket"] if c.get("origin", "fsdp") == "fsdp" else "tensor parallel"
                events.append({"name": f"{c['kind']} {label}", "ph": "X", "ts": offset + c["issued_at"],
                               "dur": max(1, c["waited_at"] - c["issued_at"]), "pid": pid,
                               "tid": f"{phase} collectives", "cat": "collective",
                               "args": {"bytes": c["bytes"], "group": c["group"]}})
            offset += len(t["nodes"]) + 10
    return {"traceEvents": events, "displayTimeUnit": "ns", "otherData": {"time unit": "one graph node"}}


ROLE_COLORS = {"param": "tab:blue", "gathered": "tab:orange", "grad": "tab:green", "activation": "tab:red",
               "tp_comm": "tab:purple"}


def plot_memory(summaries: Iterable[dict[str, Any]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib (or fsdp_compile[plot])") from exc
    summaries = [s for s in summaries if (s.get("forward") or {}).get("timeline")]
    if not summaries:
        raise ValueError("nothing to plot: no graph in this dump has a memory estimate")
    fig, axes = plt.subplots(len(summaries), 1, figsize=(10, 3.2 * len(summaries)), squeeze=False)
    for ax, s in zip(axes[:, 0], summaries):
        x0 = 0
        for phase in ("forward", "backward"):
            p = s.get(phase)
            if not p or "timeline" not in p:
                continue
            t = p["timeline"]
            xs = range(x0, x0 + len(t["nodes"]))
            roles = t["roles"]
            ax.stackplot(xs, *[[v / 2**20 for v in roles[r]] for r in roles],
                         labels=list(roles) if x0 == 0 else [], alpha=0.8,
                         colors=[ROLE_COLORS.get(r, "tab:gray") for r in roles])
            ax.plot(xs, [v / 2**20 for v in t["inflight"]], color="black", linewidth=1,
                    label="in flight" if x0 == 0 else None)
            ax.axvline(x0, color="grey", linestyle=":")
            ax.text(x0, ax.get_ylim()[1] * 0.95, phase, fontsize=8)
            x0 += len(t["nodes"]) + 10
        ax.set_title(f"rank {s['rank']} graph {s['graph']} ({s['strategy']}): estimated live memory")
        ax.set_xlabel("graph node")
        ax.set_ylabel("MiB")
        ax.legend(loc="upper right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

