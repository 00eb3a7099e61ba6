"""What ``import fsdp_compile`` costs, and which of its parts it loads.

    python bench/import_time.py                       # this checkout, 15 runs
    python bench/import_time.py --against ae53381     # beside another commit, runs interleaved

Each run is a fresh ``python -X importtime -c "import fsdp_compile"`` with the checkout first on
``PYTHONPATH``; the figures are medians over runs: the whole import (what Python reports for
``fsdp_compile``, torch included), and for the parts a training job needs or not (the planner,
its host model and calibration, the emulated network) the time of their own modules, each
module's self time summed, and how many modules were loaded. ``--against`` measures a ``git worktree`` of that
commit in the same runs, alternating, so both sides see the same machine. Writes
``import_time.json`` and ``import_time.md`` (``--out``, default ``bench/results``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from report_files import ROOT, run_facts, write_report

PARTS = ("fsdp_compile", "fsdp_compile.planning", "fsdp_compile.planning.calibration", "fsdp_compile.network")


def import_times(tree: Path) -> dict[str, tuple[int, int]]:
    """One fresh import of ``tree``'s package: per part, (microseconds, modules loaded); the whole
    package's time is its cumulative one, a part's the self times of its modules."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", "import fsdp_compile"], cwd=tree, env=env,
                          capture_output=True, text=True, check=True)
    found = dict.fromkeys(PARTS, (0, 0))
    for line in done.stderr.splitlines():
        fields = line.split("|")
        if len(fields) != 3 or not fields[0].startswith("import time:") or not fields[1].strip().isdigit():
            continue
        own, cumulative, name = int(fields[0].split(":")[1]), int(fields[1]), fields[2].strip()
        if name == "fsdp_compile":
            found[name] = (cumulative, found[name][1] + 1)
        for part in PARTS[1:]:
            if name == part or name.startswith(part + "."):
                found[part] = (found[part][0] + own, found[part][1] + 1)
    return found


def render(report: dict) -> str:
    sides = list(report["trees"])
    lines = ["# Import time", "",
             f"Run {report['when']} on {report['machine']}, torch {report['torch']}, commit {report['commit']}; "
             f"median of {report['runs']} fresh `python -X importtime -c \"import fsdp_compile\"` runs per side"
             + (", alternating" if len(sides) > 1 else "") + f", load average {report['load_average']:.1f}. "
             "Produced by `python bench/import_time.py`.", "",
             "| part | " + " | ".join(sides) + " |", "| --- |" + " --- |" * len(sides)]
    for part in PARTS:
        cells = []
        for side in sides:
            ms, modules = report["trees"][side][part]
            if part == PARTS[0]:
                cells.append(f"{ms:.0f} ms")
            else:
                cells.append(f"{ms:.1f} ms ({modules:.0f} modules)" if modules else "not loaded")
        lines.append(f"| `{part}` | " + " | ".join(cells) + " |")
    lines += ["", "The whole import includes torch's; each part's time is its own modules' alone."]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=15)
    p.add_argument("--against", metavar="COMMIT", help="also measure this commit, in a git worktree")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = p.parse_args()
    if args.runs < 1:
        p.error("--runs must be at least 1")
    trees = {"this checkout": ROOT}
    with tempfile.TemporaryDirectory(prefix="fsdp_compile_import_") as tmp:
        if args.against:
            other = Path(tmp) / "tree"
            subprocess.run(["git", "worktree", "add", "--detach", str(other), args.against], cwd=ROOT, check=True,
                           capture_output=True)
            trees = {args.against: other, **trees}
        try:
            samples: dict[str, list[dict[str, int]]] = {name: [] for name in trees}
            for _ in range(args.runs):
                for name, tree in trees.items():
                    samples[name].append(import_times(tree))
        finally:
            if args.against:
                subprocess.run(["git", "worktree", "remove", "--force", str(other)], cwd=ROOT, check=False,
                               capture_output=True)
    medians = {name: {part: (statistics.median(s[part][0] for s in runs) / 1e3,
                             statistics.median(s[part][1] for s in runs)) for part in PARTS}
               for name, runs in samples.items()}
    report = {**run_facts(), "runs": args.runs, "load_average": os.getloadavg()[0], "trees": medians}
    table = render(report)
    print(table)
    write_report(args.out, "import_time", report, table)


if __name__ == "__main__":
    main()
