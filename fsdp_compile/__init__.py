"""fsdp_compile: Fully Sharded Data Parallel training as a torch.compile backend.

    backend = fsdp_compile.backend(strategy="FULL_SHARD")
    model = torch.compile(backend.shard(model), backend=backend)
"""

from .backend import CompiledGraph, FSDPBackend, backend, compile
from .mixed_precision import MixedPrecision
from .strategy import ShardingStrategy

__all__ = ["CompiledGraph", "FSDPBackend", "MixedPrecision", "ShardingStrategy", "backend", "compile"]
__version__ = "0.1.0"
