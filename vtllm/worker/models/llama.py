"""One decoder for the Llama family: Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3.

Differences are flags read from the HF ``config.json`` dict (``LlamaArgs``):
``qkv_bias`` (Qwen2, Llama ``attention_bias``), ``o_bias``, ``qk_norm`` (Qwen3),
``tie_word_embeddings``, ``head_dim``, rope scaling, and a per-layer sliding window
(Mistral's ``sliding_window``; Qwen2/3 ``use_sliding_window`` with ``layer_types`` or
``max_window_layers``). ``LlamaAttention`` and ``LlamaMLP`` are shared with Gemma 3.

Checkpoint names map one to one onto module names, except the packed projections listed
in ``packed_modules_mapping`` (q/k/v → ``qkv_proj``, gate/up → ``gate_up_proj``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vtllm.worker.attention import AttentionMetadata, paged_attention, write_kv_cache
from vtllm.worker.distributed import TPGroup, divide
from vtllm.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from vtllm.worker.layers.linear import ColumnParallelLinear, RowParallelLinear
from vtllm.worker.layers.norm import RMSNorm
from vtllm.worker.layers.rotary import (
    apply_rope,
    inverse_frequencies,
    rope_cos_sin,
    rope_parameters,
)

KVCache = tuple[torch.Tensor, torch.Tensor]  # K, V: [num_blocks, block_size, kv_heads, head_dim]

# HF ``hidden_act`` / ``hidden_activation`` names → the gate activation of the MLP
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "gelu": F.gelu,
}


def checked_activation(name: str) -> str:
    if name not in ACTIVATIONS:
        raise NotImplementedError(
            f"hidden activation {name!r} is not supported (supported: {', '.join(ACTIVATIONS)})"
        )
    return name


def sliding_windows(
    cfg: dict[str, Any], layer_types: Sequence[str] | None = None
) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention), as transformers decides it.

    ``layer_types`` (default: the config's own) marks layers ``sliding_attention`` or
    ``full_attention``; without it, Qwen2-style configs slide from ``max_window_layers``
    on and Mistral-style configs slide on every layer.
    """
    num_layers = cfg["num_hidden_layers"]
    window = cfg.get("sliding_window")
    if not window or cfg.get("use_sliding_window") is False:
        return (None,) * num_layers
    layer_types = layer_types or cfg.get("layer_types")
    if layer_types:
        unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
        if unknown or len(layer_types) != num_layers:
            raise NotImplementedError(
                f"layer_types {list(layer_types)} (need {num_layers} of sliding_attention / "
                "full_attention)"
            )
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if "max_window_layers" in cfg:
        return tuple(window if i >= cfg["max_window_layers"] else None for i in range(num_layers))
    return (int(window),) * num_layers


@dataclass(frozen=True)
class LlamaArgs:
    """The architecture facts the decoder needs, from a HF config dict."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: dict[str, Any]
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    hidden_act: str
    attention_scale: float  # multiplies q·k
    sliding_windows: tuple[int | None, ...]  # per layer

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> LlamaArgs:
        """Raises ValueError naming the config.json keys a Llama-family model needs."""
        required = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        )
        missing = [key for key in required if key not in cfg]
        if missing:
            raise ValueError(f"config.json lacks {', '.join(missing)}")
        model_type = cfg.get("model_type", "llama")
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope=rope_parameters(cfg),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias or model_type == "qwen2",
            o_bias=attention_bias and model_type != "qwen3",
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            hidden_act=checked_activation(cfg.get("hidden_act", "silu")),
            attention_scale=head_dim**-0.5,
            sliding_windows=sliding_windows(cfg),
        )


class LlamaAttention(nn.Module):
    """q/k/v projection, optional per-head q/k norm (``norm_cls``), rope, paged attention
    (windowed when this layer slides), output projection."""

    def __init__(
        self, args: LlamaArgs, tp: TPGroup, layer_idx: int, norm_cls: type[RMSNorm] = RMSNorm
    ) -> None:
        super().__init__()
        self.num_heads = divide(args.num_heads, tp.size, "num_attention_heads")
        self.num_kv_heads = divide(args.num_kv_heads, tp.size, "num_key_value_heads")
        self.head_dim = args.head_dim
        self.scale = args.attention_scale
        self.sliding_window = args.sliding_windows[layer_idx]
        q_size, kv_size = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        self.qkv_proj = ColumnParallelLinear(
            args.hidden_size, [q_size, kv_size, kv_size], args.qkv_bias, tp, ["q", "k", "v"]
        )
        self.o_proj = RowParallelLinear(q_size, args.hidden_size, args.o_bias, tp)
        self.q_norm = norm_cls(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = norm_cls(args.head_dim, args.rms_norm_eps) if args.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [num_tokens, heads, head_dim]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [num_tokens, kv_heads, hd]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *cos_sin), apply_rope(k, *cos_sin)
        write_kv_cache(k, v, kv_cache[0], kv_cache[1], metadata.slot_mapping)
        o = paged_attention(
            q, kv_cache[0], kv_cache[1], metadata, self.scale, self.sliding_window
        )  # [num_tokens, heads, head_dim]
        return self.o_proj(o.reshape(num_tokens, q_size))  # [num_tokens, hidden]


class LlamaMLP(nn.Module):
    def __init__(self, args: LlamaArgs, tp: TPGroup) -> None:
        super().__init__()
        size = args.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(args.hidden_size, [size, size], args.mlp_bias, tp)
        self.down_proj = RowParallelLinear(size, args.hidden_size, args.mlp_bias, tp)
        self.act = ACTIVATIONS[args.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # each [num_tokens, inter / tp]
        return self.down_proj(self.act(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, args: LlamaArgs, tp: TPGroup, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = LlamaAttention(args, tp, layer_idx)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = LlamaMLP(args, tp)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, metadata)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, args: LlamaArgs, tp: TPGroup) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(args.vocab_size, args.hidden_size, tp)
        self.layers = nn.ModuleList(LlamaDecoderLayer(args, tp, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """``forward`` → final hidden states; ``compute_logits`` → full-vocab logits."""

    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # checkpoint tensors that carry no weights of ours
    ignored_checkpoint_suffixes = ("rotary_emb.inv_freq",)

    def __init__(self, args: LlamaArgs, tp: TPGroup) -> None:
        super().__init__()
        self.args = args
        self.model = LlamaModel(args, tp)
        self.lm_head = ParallelLMHead(args.vocab_size, args.hidden_size, tp)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer(
            "inv_freq", inverse_frequencies(args.head_dim, args.rope), persistent=False
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[KVCache],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # [num_tokens, hidden]
        cos_sin = rope_cos_sin(positions, self.inv_freq, x.dtype)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, cos_sin, kv_cache, metadata)
        return self.model.norm(x)  # [num_tokens, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden).float()  # [num_rows, vocab]
