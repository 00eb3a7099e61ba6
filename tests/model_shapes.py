"""Models written the way other people write them, for correctness tests of the whole pipeline.

The project's own GPT (``fsdp_compile.models.gpt``) is one shape; graphs of other shapes take
other paths through AOTAutograd, the partitioner and Inductor's buffer planning. These models
reproduce the shapes that went wrong elsewhere, without depending on the libraries they come
from:

* :class:`GPT2Shaped`: Hugging Face GPT-2's layout. ``Conv1D`` layers (an ``addmm`` with an
  ``[in, out]`` weight), learned position embeddings read through ``position_ids``, a causal
  mask kept as a non-persistent buffer and applied with ``torch.where``, the tanh GELU, and a
  head tied to the token embedding or not.
* :class:`TiedFrozen`: a GPT with its head tied to the token embedding, the first of three
  blocks frozen, and sizes no world divides (vocabulary 67, 19 positions, width 20).

``MODEL_SHAPES`` names each case; ``make_model(name)`` builds it (seeded by the caller).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class Conv1D(nn.Module):
    """Hugging Face's ``Conv1D``: a linear layer whose weight is stored ``[in, out]``."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.n_out = n_out
        self.weight = nn.Parameter(torch.randn(n_in, n_out) * 0.02)
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (*x.shape[:-1], self.n_out)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(shape)


class GPT2Attention(nn.Module):
    def __init__(self, dim: int, heads: int, positions: int) -> None:
        super().__init__()
        self.heads, self.dim = heads, dim
        self.c_attn = Conv1D(dim, 3 * dim)
        self.c_proj = Conv1D(dim, dim)
        mask = torch.tril(torch.ones(positions, positions, dtype=torch.bool)).view(1, 1, positions, positions)
        self.register_buffer("bias", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(self.dim, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(c // self.heads)
        causal = self.bias[:, :, :t, :t]
        scores = torch.where(causal, scores, torch.full([], torch.finfo(scores.dtype).min, dtype=scores.dtype))
        y = torch.matmul(F.softmax(scores, dim=-1), v)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))


class GPT2MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.c_fc = Conv1D(dim, 4 * dim)
        self.c_proj = Conv1D(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class GPT2Block(nn.Module):
    def __init__(self, dim: int, heads: int, positions: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = GPT2Attention(dim, heads, positions)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = GPT2MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2Shaped(nn.Module):
    """GPT-2 as Hugging Face lays it out (``transformer.wte`` ... ``lm_head``), 2 blocks."""

    def __init__(self, tied: bool = True, vocab: int = 97, positions: int = 32, dim: int = 48, heads: int = 4,
                 layers: int = 2) -> None:
        super().__init__()
        self.transformer = nn.Module()
        self.transformer.wte = nn.Embedding(vocab, dim)
        self.transformer.wpe = nn.Embedding(positions, dim)
        self.transformer.h = nn.ModuleList(GPT2Block(dim, heads, positions) for _ in range(layers))
        self.transformer.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Embedding, nn.Linear)):
                nn.init.normal_(module.weight, std=0.02)
        if tied:
            self.lm_head.weight = self.transformer.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        position_ids = torch.arange(idx.shape[1], device=idx.device).unsqueeze(0)
        t = self.transformer
        x = t.wte(idx) + t.wpe(position_ids)
        for block in t.h:
            x = block(x)
        return self.lm_head(t.ln_f(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TiedFrozen(nn.Module):
    """Tied embeddings, three blocks of which the first is frozen, sizes no world divides."""

    def __init__(self, vocab: int = 67, positions: int = 19, dim: int = 20, heads: int = 2, layers: int = 3) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, dim)
        self.pos_emb = nn.Embedding(positions, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Embedding, nn.Linear)):
                nn.init.normal_(module.weight, std=0.02)
        self.head.weight = self.tok_emb.weight
        self.blocks[0].requires_grad_(False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# name -> (constructor, vocabulary, sequence length)
MODEL_SHAPES = {
    "gpt2_tied": (lambda: GPT2Shaped(tied=True), 97, 16),
    "gpt2_untied": (lambda: GPT2Shaped(tied=False), 97, 16),
    "tied_frozen": (TiedFrozen, 67, 16),
}


def make_model(name: str) -> nn.Module:
    return MODEL_SHAPES[name][0]()
