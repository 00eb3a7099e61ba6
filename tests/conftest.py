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

# No test of a compiled path passes through a fallback to the eager runtime: every backend the
# suite builds raises when a pass fails (spawned ranks and torchrun jobs inherit this), unless
# the test says it expects a fallback by passing strict=False itself.
os.environ.setdefault("FSDP_COMPILE_STRICT", "1")

# Workers are spawned processes that import helpers from this folder by module name.
sys.path.insert(0, os.path.dirname(__file__))
