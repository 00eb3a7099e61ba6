"""Attention as the target device runs it: the planner traces on CPU fake tensors, where
``scaled_dot_product_attention`` dispatches to the CPU's flash kernel; a CUDA run's FlashAttention
or memory-efficient kernel saves other tensors for backward. On a CUDA cluster this Dynamo-graph
pass calls the CUDA kernel's op, whose fake implementation gives what it returns and saves.
"""

from __future__ import annotations

import torch
from torch import fx

_SDPA_TARGETS = {torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention}


def _cuda_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        repeat = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(repeat, dim=-3)
        value = value.repeat_interleave(repeat, dim=-3)
    if attn_mask is None and query.dtype in (torch.float16, torch.bfloat16) and query.shape[-1] <= 256:
        return torch.ops.aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, False, scale=scale)[0]
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, attn_mask, True, dropout_p, is_causal, scale=scale)[0]


def use_cuda_attention(gm: fx.GraphModule) -> int:
    """Route every ``scaled_dot_product_attention`` of a Dynamo graph to the CUDA kernel it
    would dispatch to; returns how many were routed."""
    count = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _SDPA_TARGETS:
            node.target = _cuda_sdpa
            count += 1
    return count
