"""The README's figures of the emulated network ("Which strategy for your network") are the
benchmark's: each is computed here from ``bench/results/plan_emulated.json`` (what
``bench/plan_emulated.py`` wrote) and must appear in the README as written."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")


@pytest.fixture(scope="module")
def section() -> str:
    """The README's section on the emulated network, with its lines joined (sentences wrap)."""
    text = (ROOT / "README.md").read_text()
    start = text.index("## Which strategy for your network")
    return re.sub(r"\s*\n\s*", " ", text[start:text.index("\n## ", start + 1)])


@pytest.fixture(scope="module")
def run() -> dict:
    return json.loads((ROOT / "bench" / "results" / "plan_emulated.json").read_text())


def _rows(run: dict, world: int, ratio: float) -> dict[str, dict]:
    return {r["strategy"]: r for r in run["rows"] if r["world"] == world and r["ratio"] == ratio}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}"


@pytest.mark.parametrize("ratio", [1.0, 2.0])
def test_the_table_is_the_benchmarks_world_4_steps(section: str, run: dict, ratio: float) -> None:
    rows = _rows(run, 4, ratio)
    inter = run["links"][f"4/{ratio}"][1]
    fastest = min(rows.values(), key=lambda r: r["measured_step_s"])["strategy"]
    cells = []
    for name in STRATEGIES:
        cell = f"{_ms(rows[name]['measured_step_s'])} ({_ms(rows[name]['predicted_step_s'])}) ms"
        cells.append(f"**{cell}**" if name == fastest else cell)
    assert f"| {inter / 1e6:.0f} MB/s, measured (predicted) | {' | '.join(cells)} |" in section


def test_the_strategies_compared_at_each_link(section: str, run: dict) -> None:
    slow, fast = _rows(run, 4, 2.0), _rows(run, 4, 1.0)

    def faster(rows: dict, name: str, key: str = "measured_step_s") -> str:
        return f"{rows['FULL_SHARD'][key] / rows[name][key]:.2f}x"

    assert (f"HYBRID_SHARD_ZERO2 and HYBRID_SHARD are {faster(slow, 'HYBRID_SHARD_ZERO2')} and "
            f"{faster(slow, 'HYBRID_SHARD')} faster than FULL_SHARD (predicted "
            f"{faster(slow, 'HYBRID_SHARD_ZERO2', 'predicted_step_s')} and "
            f"{faster(slow, 'HYBRID_SHARD', 'predicted_step_s')})") in section
    apart = abs(fast["SHARD_GRAD_OP"]["measured_step_s"] / fast["HYBRID_SHARD_ZERO2"]["measured_step_s"] - 1)
    assert apart < 0.01 and "SHARD_GRAD_OP and HYBRID_SHARD_ZERO2 are within 1% of each other" in section
    assert (f"{faster(fast, 'SHARD_GRAD_OP')} and {faster(fast, 'HYBRID_SHARD_ZERO2')} faster than FULL_SHARD"
            in section)
    predicted = sorted(fast.values(), key=lambda r: r["predicted_step_s"])
    ahead = predicted[1]["predicted_step_s"] / predicted[0]["predicted_step_s"] - 1
    assert (f"the planner puts {predicted[0]['strategy']} first, {ahead:.1%} ahead of "
            f"{predicted[1]['strategy']}") in section
    # gloo's own lateness beyond the modeled link, summed over a step's collectives
    late = slow["HYBRID_SHARD_ZERO2"]
    share = late["gloo_late_per_step_s"] / late["measured_step_s"]
    link = run["links"]["4/2.0"][1]
    assert f"(at {link / 1e6:.0f} MB/s, HYBRID_SHARD_ZERO2's by {share:.0%} of its step, summed over them)" in section
    # "in most collectives": over every world-4 job on an emulated link
    world_4 = [r["overruns"] for r in run["rows"] if r["world"] == 4 and r["ratio"]]
    assert sum(o["count"] for o in world_4) > sum(o["observed"] for o in world_4) / 2
    assert "gloo itself finished after the modeled link in most collectives" in section


def test_the_planners_targets_over_the_benchmark(section: str, run: dict) -> None:
    rows = run["rows"]
    errors = [r["step_error"] for r in rows]
    held = sum(abs(e) <= 0.15 for e in errors)
    assert f"within 15% of the measured ones in all {len(rows)} ({min(errors):+.1%} to {max(errors):+.1%})" in section
    assert held == len(rows)
    exposed = run["targets"]["exposed"]
    assert all(x["held"] for x in exposed) and f"(or 5% of the step) in all {len(exposed)};" in section
    ranking = run["targets"]["ranking"]
    assert all(x["agree"] for x in ranking) and f"on all {len(ranking)} pairs that differ by more than 10%" in section
    points = sorted({(r["world"], r["ratio"]) for r in rows})
    named, close = 0, []
    for point in points:
        here = sorted((r for r in rows if (r["world"], r["ratio"]) == point), key=lambda r: r["measured_step_s"])
        if min(here, key=lambda r: r["predicted_step_s"]) is here[0]:
            named += 1
        else:
            close.append(here[1]["measured_step_s"] / here[0]["measured_step_s"] - 1)
    assert f"names the measured winner at {named} of {len(points)} points" in section
    assert f"the first two measured within {max(close):.1%})" in section
