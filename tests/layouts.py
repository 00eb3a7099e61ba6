"""Small language models in the layouts people write, for the default bucket policy's tests.

Each layout holds the same kind of transformer block in a different place: an ``nn.ModuleList``
(GPT-2, Llama), an ``nn.ModuleDict`` keyed "0", "1", ... (torchtitan), plain attributes
(``self.block0``), blocks of experts in a list (mixture of experts; with attention beside the
experts, and with only a norm and a router beside them), stages of blocks in an
``nn.Sequential``, an encoder and a decoder with blocks of two classes (BART), stacks of one
class for encoder and decoder that share the embedding (T5), and no repeated block at all.
``EXPECTED_UNITS`` is what ``bucket="module"`` must choose for each.

Vocabulary 23 and position table 17 are prime, so shards are padded at world 2.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, POSITIONS, HEADS, EXPERTS = 23, 16, 17, 2, 4


class Attention(nn.Module):
    """Self-attention (causal) or, given ``memory``, cross-attention; q/k/v/o are leaf siblings."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM) for _ in range(4))

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        source = x if memory is None else memory
        b, t, c = x.shape

        def heads(z: torch.Tensor) -> torch.Tensor:
            return z.view(b, -1, HEADS, c // HEADS).transpose(1, 2)

        y = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(source)), heads(self.v(source)),
                                           is_causal=memory is None)
        return self.o(y.transpose(1, 2).reshape(b, t, c))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, 2 * DIM)
        self.proj = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(DIM), Attention()
        self.ln2, self.ff = nn.LayerNorm(DIM), FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.ff(self.ln2(x))


class MoE(nn.Module):
    """Experts mixed by a softmax router (dense, so every expert trains every step)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS)
        self.experts = nn.ModuleList(FeedForward() for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = F.softmax(self.router(x), dim=-1)
        return sum(weights[..., i:i + 1] * expert(x) for i, expert in enumerate(self.experts))


class MoEBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(DIM), Attention()
        self.ln2, self.moe = nn.LayerNorm(DIM), MoE()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.moe(self.ln2(x))


class RoutedExperts(nn.Module):
    """A block that is a mixture of experts and nothing else: beside its list of experts only
    leaf layers (a norm and a router), as a stack's blocks sit beside an embedding and a norm."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.router = nn.Linear(DIM, EXPERTS)
        self.experts = nn.ModuleList(FeedForward() for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        weights = F.softmax(self.router(h), dim=-1)
        return x + sum(weights[..., i:i + 1] * expert(h) for i, expert in enumerate(self.experts))


class DecoderLayer(nn.Module):
    """Self- and cross-attention of one class side by side, and beside them only leaf layers
    (BART's and Whisper's layers hold fc1/fc2 directly): the layer is the block, not them."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.self_attn = nn.LayerNorm(DIM), Attention()
        self.ln2, self.cross_attn = nn.LayerNorm(DIM), Attention()
        self.ln3, self.fc1, self.fc2 = nn.LayerNorm(DIM), nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.ln1(x))
        x = x + self.cross_attn(self.ln2(x), memory)
        return x + self.fc2(F.gelu(self.fc1(self.ln3(x))))


class LM(nn.Module):
    """Token and position embeddings (two leaf siblings of one class), a body, a norm and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, DIM)
        self.pos_emb = nn.Embedding(POSITIONS, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        return self.head(self.norm(self.body(x)))

    def body(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class ListLM(LM):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(3))

    def body(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class DictLM(LM):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): Block() for i in range(3)})

    def body(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return x


class AttributeLM(LM):
    def __init__(self) -> None:
        super().__init__()
        self.block0, self.block1, self.block2 = Block(), Block(), Block()

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return self.block2(self.block1(self.block0(x)))


class MoELM(LM):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MoEBlock() for _ in range(2))

    def body(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class ExpertBlocksLM(LM):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(RoutedExperts() for _ in range(4))

    def body(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class StagedLM(LM):
    def __init__(self) -> None:
        super().__init__()
        self.stages = nn.Sequential(nn.Sequential(Block(), Block()), nn.Sequential(Block(), Block()))

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return self.stages(x)


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.LayerNorm(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer() for _ in range(2))

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, memory)
        return x


class EncoderDecoderLM(LM):
    def __init__(self) -> None:
        super().__init__()
        self.encoder, self.decoder = Encoder(), Decoder()

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(x, self.encoder(x))


class Stack(nn.Module):
    """T5's stack: the shared embedding (registered again here), a list of blocks and a norm."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.embed = embedding
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.LayerNorm(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class TwinStackLM(LM):
    def __init__(self) -> None:
        super().__init__()
        self.encoder, self.decoder = Stack(self.tok_emb), Stack(self.tok_emb)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(x + self.encoder(x))


class NoRepeatLM(LM):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


def _blocks(prefix: str, count: int) -> list[str]:
    return [f"{prefix}.{i}" for i in range(count)]


LAYOUTS: dict[str, type[LM]] = {
    "module_list": ListLM, "module_dict": DictLM, "attributes": AttributeLM, "nested_moe": MoELM,
    "expert_blocks": ExpertBlocksLM, "staged_sequential": StagedLM, "encoder_decoder": EncoderDecoderLM, "twin_stacks": TwinStackLM,
    "no_repeats": NoRepeatLM,
}
EXPECTED_UNITS: dict[str, list[str]] = {
    "module_list": _blocks("layers", 3),
    "module_dict": _blocks("layers", 3),
    "attributes": ["block0", "block1", "block2"],
    "nested_moe": _blocks("layers", 2),
    "expert_blocks": _blocks("layers", 4),
    "staged_sequential": _blocks("stages.0", 2) + _blocks("stages.1", 2),
    "encoder_decoder": _blocks("encoder.layers", 2) + _blocks("decoder.layers", 2),
    "twin_stacks": _blocks("encoder.layers", 2) + _blocks("decoder.layers", 2),
    "no_repeats": [],
}
