"""Benchmarks that measure in a torchrun job of their own script: the parent parses the options,
starts the job with ``--part FILE``, and reads back what rank 0 wrote there."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch import rank_env, torchrun_command

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def parser(doc: str, *, steps: int, warmup: int) -> argparse.ArgumentParser:
    """The options every such benchmark takes (``--part`` is the job's own, hidden)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--warmup", type=int, default=warmup)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--analysis", type=Path)
    p.add_argument("--part", help=argparse.SUPPRESS)
    return p


def run_part(script: str | Path, args: argparse.Namespace, world: int = 2, extra: tuple[str, ...] = ()) -> dict:
    """Run ``script`` as a fresh torchrun job of ``world`` processes (one intra-op thread each)
    with the parent's steps, warm-up and size, and ``extra`` arguments (a benchmark's point), and
    return what its rank 0 wrote."""
    with tempfile.TemporaryDirectory() as tmp:
        part = Path(tmp) / "part.json"
        cmd = torchrun_command(world, str(Path(script).resolve()), "--part", str(part), "--steps", str(args.steps),
                               "--warmup", str(args.warmup), *(["--smoke"] if args.smoke else []), *extra)
        print(" ".join(cmd), flush=True)
        subprocess.run(cmd, env=rank_env(), check=True)
        return json.loads(part.read_text())
