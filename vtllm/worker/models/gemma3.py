"""Gemma 3 text decoder (``Gemma3ForCausalLM``): only what differs from the Llama family.

* every RMSNorm scales by ``(1 + w)`` (``GemmaRMSNorm``), the q/k norms included;
* four norms per layer: each sub-block's output is normed before it joins the residual::

      x = x + post_attention_norm(attn(input_norm(x)))
      x = x + post_feedforward_norm(mlp(pre_feedforward_norm(x)))

  (each ``x + ...`` is fused into the norm that reads it: ``norm(h, residual)``);

* GeGLU MLP (``gelu_pytorch_tanh`` gate): the shared ``LlamaMLP`` with another activation;
* embeddings multiplied by ``sqrt(hidden_size)``, rounded to the weights' dtype first (as
  transformers does: in bf16 ``sqrt(640)`` becomes 25.25);
* local (sliding-window) layers alternate with global ones per ``layer_types`` (or the
  older ``sliding_window_pattern``: every n-th layer is global); local layers rotate with
  ``rope_local_base_freq``, global ones with ``rope_theta`` and its scaling;
* attention scale ``query_pre_attn_scalar ** -0.5`` instead of ``head_dim ** -0.5``;
* optional final logit soft-capping ``cap * tanh(logits / cap)``; tied embeddings.

Attention, MLP, embedding, LM head and rope are the shared layers of ``llama.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vtllm.worker.attention import AttentionMetadata
from vtllm.worker.distributed import TPGroup
from vtllm.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from vtllm.worker.layers.norm import GemmaRMSNorm
from vtllm.worker.layers.rotary import RotaryEmbedding, rope_parameters
from vtllm.worker.models.llama import (
    KVCache,
    LlamaArgs,
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    checked_activation,
    sliding_windows,
)

_SLIDING = "sliding_attention"


@dataclass(frozen=True)
class Gemma3Args(LlamaArgs):
    """``LlamaArgs`` plus Gemma 3's per-layer-type rope and logit soft-capping."""

    layer_types: tuple[str, ...]  # per layer: sliding_attention | full_attention
    local_rope: dict[str, Any]  # rope of the sliding layers; ``rope`` is the global one
    final_logit_softcapping: float | None

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> Gemma3Args:
        """Raises ValueError for missing keys, NotImplementedError for Gemma 3 options
        this decoder does not implement (bidirectional attention, attention soft-capping)."""
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
        missing = [key for key in required if key not in cfg]
        if missing:
            raise ValueError(f"config.json lacks {', '.join(missing)}")
        if cfg.get("use_bidirectional_attention"):
            raise NotImplementedError("Gemma 3 with use_bidirectional_attention")
        if cfg.get("attn_logit_softcapping") is not None:
            raise NotImplementedError("attn_logit_softcapping (Gemma 2 style) is not supported")
        num_layers = cfg["num_hidden_layers"]
        layer_types = cfg.get("layer_types") or [
            _SLIDING if (i + 1) % cfg.get("sliding_window_pattern", 6) else "full_attention"
            for i in range(num_layers)
        ]
        num_heads = cfg.get("num_attention_heads", 8)
        head_dim = cfg.get("head_dim", 256)
        attention_bias = bool(cfg.get("attention_bias", False))
        global_rope, local_rope = _rope_by_layer_type(cfg)
        activation = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope=global_rope,
            max_position_embeddings=cfg.get("max_position_embeddings", 131072),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            mlp_bias=False,
            qk_norm=True,
            hidden_act=checked_activation(activation),
            attention_scale=float(cfg.get("query_pre_attn_scalar", head_dim)) ** -0.5,
            sliding_windows=sliding_windows(cfg, layer_types),
            layer_types=tuple(layer_types),
            local_rope=local_rope,
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
        )


def _rope_by_layer_type(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(global, local) rope parameters from either config spelling: transformers 5 nests
    them by layer type; older files have ``rope_theta`` (+ ``rope_scaling``) for global
    layers and ``rope_local_base_freq`` for local ones."""
    nested = cfg.get("rope_parameters") or {}
    if _SLIDING in nested or "full_attention" in nested:
        full, local = nested.get("full_attention") or {}, nested.get(_SLIDING) or {}
    else:
        full, local = nested, {}
    global_rope = rope_parameters(
        {
            "rope_parameters": full,
            "rope_scaling": cfg.get("rope_scaling"),
            "rope_theta": cfg.get("rope_theta", 1_000_000.0),
        }
    )
    local_rope = rope_parameters(
        {"rope_parameters": local, "rope_theta": cfg.get("rope_local_base_freq", 10_000.0)}
    )
    return global_rope, local_rope


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, args: Gemma3Args, tp: TPGroup, layer_idx: int) -> None:
        super().__init__()
        hidden, eps = args.hidden_size, args.rms_norm_eps
        self.is_local = args.layer_types[layer_idx] == _SLIDING
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = LlamaAttention(args, tp, layer_idx, norm_cls=GemmaRMSNorm)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = LlamaMLP(args, tp)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]: the previous layer's normed MLP output
        residual: torch.Tensor | None,  # [num_tokens, hidden]; None before the first layer
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(normed mlp output, residual stream)``, summed inside the next norm."""
        h, residual = self.input_layernorm.add_and_norm(x, residual)
        h = self.self_attn(h, positions, rotary, kv_cache, metadata)
        h = self.post_attention_layernorm(h)
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class Gemma3Model(nn.Module):
    def __init__(self, args: Gemma3Args, tp: TPGroup) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(args.vocab_size, args.hidden_size, tp)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(args, tp, i) for i in range(args.num_layers))
        self.norm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps)


class Gemma3ForCausalLM(nn.Module):
    """``forward`` → final hidden states; ``compute_logits`` → full-vocab logits."""

    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping
    ignored_checkpoint_suffixes = LlamaForCausalLM.ignored_checkpoint_suffixes

    def __init__(self, args: Gemma3Args, tp: TPGroup) -> None:
        super().__init__()
        self.args = args
        self.model = Gemma3Model(args, tp)
        self.lm_head = ParallelLMHead(args.vocab_size, args.hidden_size, tp)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.embed_scale = args.hidden_size**0.5
        max_position = args.max_position_embeddings
        self.global_rotary = RotaryEmbedding(args.head_dim, max_position, args.rope)
        self.local_rotary = RotaryEmbedding(args.head_dim, max_position, args.local_rope)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[KVCache],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # [num_tokens, hidden]
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            rotary = self.local_rotary if layer.is_local else self.global_rotary
            x, residual = layer(x, residual, positions, rotary, kv_cache, metadata)
        return self.model.norm(x, residual)[0]  # [num_tokens, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.compute_logits(hidden).float()  # [num_rows, vocab]
        cap = self.args.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
