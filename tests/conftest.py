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

# Workers are spawned processes that import helpers from this folder by module name.
sys.path.insert(0, os.path.dirname(__file__))
