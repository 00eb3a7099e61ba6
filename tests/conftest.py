import os
import sys

# Without a GPU, Triton kernels run in Triton's interpreter. Triton reads this when a kernel is
# defined, so it is set before fsdp_compile is imported (workers inherit it).
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:
    pass

# No test of a compiled path passes through a fallback: every backend the suite builds raises
# where it would fall back after an error fsdp_compile does not expect (a pass that fails, a
# region retried inline after an Inductor error), unless the test says it expects a fallback by
# passing strict=False itself. Forced, not defaulted: a 0 inherited from the shell would turn the
# guard off without a word. Spawned ranks and torchrun jobs inherit it.
os.environ["FSDP_COMPILE_STRICT"] = "1"


def guard_dynamo() -> None:
    """Dynamo's recompile limit, once reached, raises instead of running the frame uncompiled: a
    test of a compiled path would otherwise pass on eager code, with a warning only. Dynamo reads
    this from no environment variable, so every rank calls this as it starts
    (tests/distributed.py), after torch is imported."""
    import torch.compiler

    torch.compiler.config.fail_on_recompile_limit_hit = True


guard_dynamo()

# Workers are spawned processes that import helpers from this folder by module name.
sys.path.insert(0, os.path.dirname(__file__))

# The measuring lab (lab/fsdp_compile_lab: the host-CPU model the CPU figures are predicted with)
# is not installed with the package: the tests import it from the repository, and so do the
# processes they start (torchrun jobs, benchmarks run as scripts) through PYTHONPATH.
LAB = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lab")
sys.path.insert(0, LAB)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (LAB, os.environ.get("PYTHONPATH")) if p)
