"""fsdp_compile: Fully Sharded Data Parallel training as a torch.compile backend.

    backend = fsdp_compile.backend(strategy="FULL_SHARD")
    model = torch.compile(backend.shard(model), backend=backend)

    print(fsdp_compile.plan(model, inputs, cluster=fsdp_compile.Cluster.preset("h100-sxm", nodes=4)))
"""

from .agreement import AgreementError, GraphMismatchError
from .backend import FSDPBackend, backend, compile
from .compiler import CompiledGraph
from .checkpoint import CheckpointError, full_state_dict, load_checkpoint, load_full_state_dict, save_checkpoint
from .clip import clip_grad_norm_
from .errors import ConfigError
from .faults import RankFailure
from .memory import MemoryEstimate, estimate_memory
from .mixed_precision import MixedPrecision
from .offload import CPUOffload
from .planning import Cluster, Plan, PlanError, plan
from .strategy import ShardingStrategy

__all__ = ["AgreementError", "CPUOffload", "CheckpointError", "Cluster", "CompiledGraph", "ConfigError",
           "FSDPBackend", "GraphMismatchError", "MemoryEstimate", "MixedPrecision", "Plan", "PlanError",
           "RankFailure", "ShardingStrategy", "backend", "clip_grad_norm_", "compile", "estimate_memory",
           "full_state_dict", "load_checkpoint", "load_full_state_dict", "plan", "save_checkpoint"]
__version__ = "0.1.0"
