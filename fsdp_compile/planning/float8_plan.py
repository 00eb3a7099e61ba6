"""``plan(float8=True)``: plan the model as torchao's float8 training would run it.

The linears are converted with torchao as torchtitan does (float8 all-gather, dynamic tensorwise
scaling; the output head and layers whose features are not multiples of 16 left out). The traced
step holds ``torch._scaled_mm`` matmuls priced at the float8 peak and float8 gathers priced by
their bytes; on a CPU cluster torchao emulates the matmuls in the compute dtype.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from ..sharding.sharded_param import require_torchao
from .cluster import Cluster, ClusterError

# Layers torchtitan's float8 converter leaves out by name: the output head.
HEAD_NAMES = ("output", "head", "lm_head")


def _converts(module: nn.Module, fqn: str) -> bool:
    if not isinstance(module, nn.Linear):
        return True  # torchao asks for every module on its way down
    if fqn.rsplit(".", 1)[-1] in HEAD_NAMES:
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def float8_training_model(model: nn.Module, cluster: Cluster) -> nn.Module:
    """A copy of ``model`` converted to torchao float8 training with float8 all-gather."""
    require_torchao("plan(float8=True)")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    on_gpu = cluster.device_type == "cuda"
    if on_gpu:
        try:
            cluster.flops_for(torch.float8_e4m3fn)
        except ClusterError as exc:
            raise ClusterError(f"plan(float8=True): {exc}; float8 training needs float8 tensor cores "
                               "(H100, H200, B200, L40S, L4, MI300X presets have them)") from None
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=not on_gpu)
    converted = convert_to_float8_training(copy.deepcopy(model), config=config, module_filter_fn=_converts)
    if not any(type(m).__name__ == "Float8Linear" for m in converted.modules()):
        raise ValueError("plan(float8=True): no linear layer of the model can train in float8 (torchao needs "
                         "features in multiples of 16; the output head is left out)")
    return converted
