"""How every benchmark starts its ranks: one torchrun job on this machine.

Each rank runs one intra-op thread (``OMP_NUM_THREADS``, 1 unless given: ranks share the
machine's cores, and a rank that spins up a thread per core competes with its peers), imports
``fsdp_compile``, the lab (``lab/fsdp_compile_lab``, not installed) and the benchmark's sibling
modules from this checkout, and has Python's fault
handler on: a rank that native code aborts (a heap corruption, a C++ exception in a
communication thread) prints every thread's Python stack before it dies, so the job's failure
names where it happened rather than only "exited with signal 6".
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def torchrun_command(world: int, *target: str) -> list[str]:
    """The command that runs ``target`` (a script and its arguments, or ``-m module ...``) on
    ``world`` local ranks."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}", *target]


def rank_env(omp_threads: str = "1") -> dict[str, str]:
    """The environment of a benchmark's ranks: this process's, plus the settings above."""
    path = [str(ROOT), str(ROOT / "bench"), str(ROOT / "lab"), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "OMP_NUM_THREADS": omp_threads, "PYTHONFAULTHANDLER": "1",
            "PYTHONPATH": os.pathsep.join(path)}
