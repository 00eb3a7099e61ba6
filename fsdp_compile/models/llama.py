"""A Llama-style decoder (Llama 2/3 architecture) in plain PyTorch, for planning and benchmarks.

RMSNorm, rotary embeddings, grouped-query attention (keys and values repeated to every query
head, as Meta's reference code and torchtitan do), SwiGLU, untied embedding and head; blocks in
``layers``. Every module with parameters or buffers has ``reset_parameters()``, so a model built
on the meta device can be materialized by ``backend.shard``. The presets follow the published
model cards (``LlamaConfig.llama3_8b()``, ``llama3_70b()``); no weights are involved.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_hidden: int = 160
    max_seq_len: int = 128
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    checkpoint_blocks: bool = False  # activation checkpointing: recompute each block in backward

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be a multiple of n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError("the head dimension d_model / n_heads must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @classmethod
    def llama3_8b(cls, **overrides) -> LlamaConfig:
        """Llama-3-8B's shape (Meta's model card: 32 layers, d_model 4096, 32 heads, 8 KV heads,
        FFN 14336, vocabulary 128256, RoPE theta 500000)."""
        return replace(cls(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                           ffn_hidden=14336, max_seq_len=8192), **overrides)

    @classmethod
    def llama3_70b(cls, **overrides) -> LlamaConfig:
        """Llama-3-70B's shape (80 layers, d_model 8192, 64 heads, 8 KV heads, FFN 28672,
        vocabulary 128256)."""
        return replace(cls(vocab_size=128256, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                           ffn_hidden=28672, max_seq_len=8192), **overrides)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on pairs of adjacent channels (real arithmetic, no complex tensors)."""
    b, t, h, d = x.shape
    pairs = x.float().reshape(b, t, h, d // 2, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[:t].view(1, t, 1, d // 2), sin[:t].view(1, t, 1, d // 2)
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.reshape(b, t, h, d).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism a rank holds n_heads / tp of them.
        q = _rotate(self.wq(x).view(b, t, -1, self.head_dim), cos, sin)
        k = _rotate(self.wk(x).view(b, t, -1, self.head_dim), cos, sin)
        v = self.wv(x).view(b, t, -1, self.head_dim)
        repeat = self.n_heads // self.n_kv_heads
        if repeat > 1:  # grouped-query attention: each KV head serves `repeat` query heads
            k = k.repeat_interleave(repeat, dim=2)
            v = v.repeat_interleave(repeat, dim=2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.w3 = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.register_buffer("rope_cos", torch.empty(cfg.max_seq_len, cfg.head_dim // 2), persistent=False)
        self.register_buffer("rope_sin", torch.empty(cfg.max_seq_len, cfg.head_dim // 2), persistent=False)
        self.reset_parameters()
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                self._init_weight(module)

    def reset_parameters(self) -> None:
        """The rotary tables (the root's own weights are initialized by their modules)."""
        cfg = self.cfg
        device = self.rope_cos.device
        if device.type == "meta":
            return
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=device).float() / cfg.head_dim)
        angles = torch.outer(torch.arange(cfg.max_seq_len, device=device).float(), inv_freq)
        with torch.no_grad():
            self.rope_cos.copy_(angles.cos())
            self.rope_sin.copy_(angles.sin())

    @staticmethod
    def _init_weight(module: nn.Module) -> None:
        nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            if self.cfg.checkpoint_blocks and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(layer, x, self.rope_cos, self.rope_sin, use_reentrant=False)
            else:
                x = layer(x, self.rope_cos, self.rope_sin)
        return self.output(self.norm(x))

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(tokens)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))

    def num_parameters(self) -> int:
        return sum(math.prod(p.shape) for p in self.parameters())


def apply_tp(model: Llama, tp_mesh: DeviceMesh) -> Llama:
    """torchtitan's Llama tensor-parallel plan on ``tp_mesh``, in place; returns ``model``.

    Column-wise input projections, row-wise output projections, sequence parallelism on the
    norms, the embedding row-wise and the head column-wise with a replicated output (without
    loss parallelism). Heads and KV heads must divide by the tp size.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    tp = tp_mesh.size()
    if model.cfg.n_heads % tp or model.cfg.n_kv_heads % tp:
        raise ValueError(f"tensor parallelism over {tp} ranks needs n_heads={model.cfg.n_heads} and "
                         f"n_kv_heads={model.cfg.n_kv_heads} to be multiples of {tp}")
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for block in model.layers:
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })
    return model
