"""Models nobody here wrote, tiny, for training under the backend's default options.

Hugging Face architectures of every family (decoder-only, encoder-only, encoder-decoder,
mixture of experts), randomly initialized from small configurations with dropout off, and three
blocks written the way other people write them that torch cannot compile as one region: one
holding a BatchNorm (running statistics updated in training), one updating a buffer in place,
one with a graph break inside its forward. ``ZOO`` names each; ``build(name)`` builds one
(seeded by the caller) and ``loss_of(name, model, tokens)`` is its training loss.

What each model is expected to do with regions is part of its entry: ``"regions"`` (its blocks
compile as regions), or the class its fallback warning names (it compiles inline, saying why).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 64
SEQ = 12
WIDTH = 32


@dataclass(frozen=True)
class Entry:
    family: str  # decoder, encoder, encoder-decoder, moe, block
    make: Callable[[], nn.Module]
    kind: str  # how the loss is taken: "causal", "masked", "seq2seq", "stack"
    inline: str | None = None  # the block class the fallback compiles inline, if any


@dataclass(frozen=True)
class HFModel:
    """A Hugging Face model class and its config class, by name, built from ``config``."""

    config_name: str
    model_name: str
    config: dict

    def classes(self) -> tuple[str, str]:
        return self.config_name, self.model_name

    def __call__(self) -> nn.Module:
        import transformers

        return getattr(transformers, self.model_name)(getattr(transformers, self.config_name)(**self.config))


def _hf(config_name: str, model_name: str, **config) -> HFModel:
    return HFModel(config_name, model_name, config)


_DECODER = dict(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=3,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)


class BatchNormBlock(nn.Module):
    """A residual MLP block whose BatchNorm updates its running statistics in training."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.norm = nn.BatchNorm1d(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return x + torch.relu(self.norm(h.reshape(-1, h.shape[-1])).reshape(h.shape))


class CountingBlock(nn.Module):
    """A block that counts its calls in a buffer updated in place (``self.calls += 1``)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + torch.tanh(self.fc(x))


@torch.compiler.disable
def _scaled_outside_the_graph(x: torch.Tensor) -> torch.Tensor:
    return x * 0.5


class GraphBreakBlock(nn.Module):
    """A block whose forward breaks the graph twice: a call torch.compile is told to skip, and a
    branch on a value read with ``.item()``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _scaled_outside_the_graph(torch.tanh(self.fc(x)))
        if h.abs().sum().item() > 0:
            h = h * 2.0
        return x + h


class BlockStack(nn.Module):
    """Embedding, three blocks of one class, a norm and a head: blocks written elsewhere in a
    model of the usual shape."""

    def __init__(self, block: type[nn.Module]) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(block(WIDTH) for _ in range(3))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


ZOO: dict[str, Entry] = {
    "gpt2": Entry("decoder", _hf("GPT2Config", "GPT2LMHeadModel", vocab_size=VOCAB, n_positions=64, n_embd=WIDTH,
                                 n_layer=3, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), "causal"),
    "llama": Entry("decoder", _hf("LlamaConfig", "LlamaForCausalLM", **_DECODER), "causal"),
    # A sliding window makes the model build a KV cache that each layer writes into (use_cache
    # is on by default, in training too), storing a tensor that aliases the layer's input.
    "mistral": Entry("decoder", _hf("MistralConfig", "MistralForCausalLM", sliding_window=8, **_DECODER), "causal",
                     inline="MistralDecoderLayer"),
    "qwen2": Entry("decoder", _hf("Qwen2Config", "Qwen2ForCausalLM", **_DECODER), "causal"),
    "gemma": Entry("decoder", _hf("GemmaConfig", "GemmaForCausalLM", head_dim=16, **_DECODER), "causal"),
    "phi": Entry("decoder", _hf("PhiConfig", "PhiForCausalLM", vocab_size=VOCAB, hidden_size=WIDTH,
                                intermediate_size=2 * WIDTH, num_hidden_layers=3, num_attention_heads=2,
                                max_position_embeddings=64, resid_pdrop=0.0, embd_pdrop=0.0), "causal"),
    "gpt_neox": Entry("decoder", _hf("GPTNeoXConfig", "GPTNeoXForCausalLM", vocab_size=VOCAB, hidden_size=WIDTH,
                                     intermediate_size=2 * WIDTH, num_hidden_layers=3, num_attention_heads=2,
                                     max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0),
                      "causal"),
    "opt": Entry("decoder", _hf("OPTConfig", "OPTForCausalLM", vocab_size=VOCAB, hidden_size=WIDTH, ffn_dim=2 * WIDTH,
                                num_hidden_layers=3, num_attention_heads=2, max_position_embeddings=64,
                                word_embed_proj_dim=WIDTH, dropout=0.0, attention_dropout=0.0), "causal"),
    "bert": Entry("encoder", _hf("BertConfig", "BertForMaskedLM", vocab_size=VOCAB, hidden_size=WIDTH,
                                 intermediate_size=2 * WIDTH, num_hidden_layers=3, num_attention_heads=2,
                                 max_position_embeddings=64, hidden_dropout_prob=0.0,
                                 attention_probs_dropout_prob=0.0), "masked"),
    # T5's blocks after the first return the position bias they were given: a region returns a
    # reference to that input instead (sharding/compile_regions.py), so they stay regions.
    "t5": Entry("encoder-decoder", _hf("T5Config", "T5ForConditionalGeneration", vocab_size=VOCAB, d_model=WIDTH,
                                       d_kv=16, d_ff=2 * WIDTH, num_layers=3, num_decoder_layers=3, num_heads=2,
                                       dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0), "seq2seq"),
    "bart": Entry("encoder-decoder", _hf("BartConfig", "BartForConditionalGeneration", vocab_size=VOCAB,
                                         d_model=WIDTH, encoder_layers=3, decoder_layers=3, encoder_attention_heads=2,
                                         decoder_attention_heads=2, encoder_ffn_dim=2 * WIDTH,
                                         decoder_ffn_dim=2 * WIDTH, max_position_embeddings=64, dropout=0.0,
                                         attention_dropout=0.0, activation_dropout=0.0), "seq2seq"),
    "mixtral": Entry("moe", _hf("MixtralConfig", "MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2,
                                **_DECODER), "causal"),
    "batchnorm_block": Entry("block", lambda: BlockStack(BatchNormBlock), "stack", inline="BatchNormBlock"),
    "buffer_update_block": Entry("block", lambda: BlockStack(CountingBlock), "stack", inline="CountingBlock"),
    "graph_break_block": Entry("block", lambda: BlockStack(GraphBreakBlock), "stack", inline="GraphBreakBlock"),
}


def build(name: str) -> nn.Module:
    return ZOO[name].make()


def loss_of(name: str, model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The training loss of ``model`` on ``tokens`` ([batch, SEQ] token ids)."""
    kind = ZOO[name].kind
    if kind == "causal":
        return model(input_ids=tokens, labels=tokens).loss
    if kind == "masked":
        return model(input_ids=tokens, labels=tokens.flip(-1)).loss
    if kind == "seq2seq":
        return model(input_ids=tokens, labels=tokens.flip(-1)).loss
    logits = model(tokens)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
