"""Run test jobs over and over, to catch what fails once in many runs (a native abort).

    python tests/stress_jobs.py REPS [--fresh] MODULE:FUNCTION:WORLD[:JSON_ARGS] ...

Each repetition runs every job once, in order, through the suite's harness
(``distributed.run_workers``): in the processes it keeps between calls, as the suite runs them,
or with ``--fresh`` in new processes for every call. ``MODULE`` is a module of ``tests/`` and
``FUNCTION`` a worker of it; ``JSON_ARGS`` is the list of the worker's arguments after rank and
world. A job that fails is reported (the harness quotes a dead rank's fault report and native
stderr) and the repetitions go on; the last line counts the failures. While the file
``$STRESS_PAUSE`` (default ``/tmp/fsdp_compile_stress.pause``) exists, it waits between
repetitions.

The jobs that aborted before (docs/limits.md), with glibc's heap checks on::

    LD_PRELOAD=/lib/x86_64-linux-gnu/libc_malloc_debug.so.0 MALLOC_CHECK_=3 MALLOC_PERTURB_=165 \\
    python tests/stress_jobs.py 100 \\
      'test_training_loop:loop_worker:2:["FULL_SHARD", "/tmp/fsdp_compile_stress_checkpoints"]' \\
      'test_bucketing:policy_worker:4:["HYBRID_SHARD_ZERO2", ["param", "bytes", "classes", "callable"], 3]' \\
      'test_overlap:unscheduled_worker:4:["HYBRID_SHARD", 5]' \\
      'helpers:parity_worker:4:["HYBRID_SHARD", ["eager", "aot_eager", "inductor", "fsdp2"], 5]'
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import conftest  # noqa: F401  (the suite's environment: strict, Triton's interpreter)
from distributed import WorkerError, run_workers


def main(argv: list[str]) -> int:
    if not argv or not argv[0].isdigit():
        print(__doc__)
        return 2
    reps, fresh = int(argv[0]), "--fresh" in argv
    pause = os.environ.get("STRESS_PAUSE", "/tmp/fsdp_compile_stress.pause")
    jobs = []
    for spec in (a for a in argv[1:] if not a.startswith("--")):
        module, function, world, *rest = spec.split(":", 3)
        jobs.append((spec, getattr(importlib.import_module(module), function), int(world),
                     json.loads(rest[0]) if rest else []))
    failures, start = 0, time.monotonic()
    for rep in range(reps):
        while os.path.exists(pause):
            time.sleep(5)
        for spec, fn, world, args in jobs:
            try:
                run_workers(fn, world, *args, fresh=fresh, timeout_s=600)
            except WorkerError as exc:
                failures += 1
                print(f"repetition {rep}: {spec} failed:\n{str(exc)[-4000:]}", flush=True)
        print(f"repetition {rep} done: {failures} failures in {time.monotonic() - start:.0f} s", flush=True)
    print(f"{reps} repetitions of {len(jobs)} jobs: {failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
