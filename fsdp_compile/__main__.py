"""``fsdp-compile inspect DUMP_DIR`` (report on a dump), ``plan`` (predict every strategy on a
cluster) and ``compare`` (under torchrun: run every strategy here, beside the plan); the same as
``python -m fsdp_compile ...``."""

from __future__ import annotations

import argparse
import difflib
import itertools
import json
import sys
from pathlib import Path

from .api import ConfigError
from .inspection.dump import DumpError, read_manifest, write_json
from .inspection.report import chrome_trace, plot_memory, render_report


def _rank_and_graph(graph_dir: Path) -> tuple[int, int]:
    return int(graph_dir.parent.name[4:]), int(graph_dir.name[5:])


def _summaries(root: Path, rank: int | None, graph: int | None) -> list[dict]:
    found = []
    for path in sorted(root.glob("rank*/graph*/summary.json"), key=lambda p: _rank_and_graph(p.parent)):
        summary = json.loads(path.read_text())
        if (rank is None or summary["rank"] == rank) and (graph is None or summary["graph"] == graph):
            found.append(summary)
    if not found:
        which = f" for rank {rank}" if rank is not None else ""
        which += f" graph {graph}" if graph is not None else ""
        raise DumpError(f"{root} holds no graph summaries{which}: did the run compile anything with dump_dir set?")
    return found


def _diff(root: Path, pass_name: str, rank: int | None, graph: int | None) -> str:
    """Unified diffs of the graphs each phase had before and after ``pass_name``."""
    out, known = [], set()
    for graph_dir in sorted(root.glob("rank*/graph*")):
        r, g = _rank_and_graph(graph_dir)
        if (rank is not None and r != rank) or (graph is not None and g != graph):
            continue
        pairs = [(graph_dir / "joint_before.py", graph_dir / "joint_after.py", "tag_reshard_policy")]
        for phase_dir in sorted(p for p in graph_dir.iterdir() if p.is_dir()):
            steps = sorted(phase_dir.glob("*.py"))
            pairs += [(a, b, b.stem.split("_", 1)[1]) for a, b in itertools.pairwise(steps)]
        for before, after, name in pairs:
            known.add(name)
            if name != pass_name or not (before.exists() and after.exists()):
                continue
            out.extend(difflib.unified_diff(
                before.read_text().splitlines(keepends=True), after.read_text().splitlines(keepends=True),
                fromfile=str(before.relative_to(root)), tofile=str(after.relative_to(root))))
    if not out:
        if pass_name not in known:
            known_list = ", ".join(sorted(known)) or "none"
            raise DumpError(f"--diff {pass_name}: no such pass in this dump; passes: {known_list}")
        return f"pass {pass_name} changed nothing in the selected graphs\n"
    return "".join(out)


def main(argv: list[str] | None = None) -> int:
    # Named as it was invoked: the console script, or the module.
    prog = "fsdp-compile" if Path(sys.argv[0]).name == "fsdp-compile" else "python -m fsdp_compile"
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    inspect = sub.add_parser("inspect", help="report on a dump written with dump_dir= / FSDP_COMPILE_DUMP=")
    inspect.add_argument("path", type=Path)
    inspect.add_argument("--rank", type=int, help="only this rank (default: all)")
    inspect.add_argument("--graph", type=int, help="only this graph (default: all)")
    inspect.add_argument("--diff", metavar="PASS", help="show what one pass changed, as a unified diff")
    inspect.add_argument("--timeline", metavar="FILE.json", type=Path,
                         help="write the schedule as a Chrome/Perfetto trace")
    inspect.add_argument("--plot", metavar="FILE.png", type=Path, help="draw the memory timeline (needs matplotlib)")
    from .planning.cli import add_compare_parser, add_plan_parser, run_compare, run_plan

    add_plan_parser(sub)
    add_compare_parser(sub)
    args = parser.parse_args(argv)
    if args.command in ("plan", "compare"):
        try:
            return run_plan(args) if args.command == "plan" else run_compare(args)
        except (ConfigError, ValueError, TypeError) as exc:
            print(f"fsdp_compile {args.command}: error: {exc}", file=sys.stderr)
            return 2
    try:
        manifest = read_manifest(args.path)
        if args.diff:
            sys.stdout.write(_diff(args.path, args.diff, args.rank, args.graph))
            return 0
        summaries = _summaries(args.path, args.rank, args.graph)
        sys.stdout.write(render_report(summaries, manifest))
        if args.timeline:
            write_json(args.timeline, chrome_trace(summaries))
            print(f"timeline written to {args.timeline} (open it in chrome://tracing or ui.perfetto.dev)")
        if args.plot:
            plot_memory(summaries, str(args.plot))
            print(f"memory plot written to {args.plot}")
    except (DumpError, RuntimeError, ValueError) as exc:
        print(f"fsdp_compile inspect: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
