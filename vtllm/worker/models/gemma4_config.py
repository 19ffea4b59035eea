"""Gemma 4 text decoder's architecture facts from a Hugging Face config (``Gemma4Args``):
per-layer head dims, KV heads, KV sharing, MLP widths and ropes, with transformers'
``Gemma4TextConfig`` defaults; options ``gemma4.py`` does not implement are refused here
with a one-line message naming the field (see ``gemma4.py``'s docstring for the model)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from vtllm.worker.layers.rotary import rope_parameters
from vtllm.worker.models.llama import checked_activation

logger = logging.getLogger(__name__)

SLIDING, FULL = "sliding_attention", "full_attention"


def _value(cfg: dict[str, Any], key: str, default: Any) -> Any:
    """``cfg[key]``, or ``default`` (transformers' ``Gemma4TextConfig`` default) when the
    key is absent or null."""
    value = cfg.get(key)
    return default if value is None else value


@dataclass(frozen=True)
class Gemma4Args:
    """The architecture facts of a Gemma 4 text decoder, per layer where they vary."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    layer_types: tuple[str, ...]  # per layer: sliding_attention | full_attention
    head_dims: tuple[int, ...]  # per layer
    num_kv_heads: tuple[int, ...]  # per layer
    k_eq_v: tuple[bool, ...]  # per layer: values come from k_proj (no v_proj)
    kv_source_layers: tuple[int, ...]  # per layer: whose KV it attends (itself, or shared)
    intermediate_sizes: tuple[int, ...]  # per layer: the dense MLP's width
    sliding_window: int
    rms_norm_eps: float
    ropes: dict[str, dict[str, Any]]  # layer type -> rope parameters
    max_position_embeddings: int
    tie_word_embeddings: bool
    hidden_act: str
    final_logit_softcapping: float | None
    num_experts: int  # 0: no MoE block
    top_k_experts: int
    moe_intermediate_size: int
    per_layer_input_size: int  # hidden_size_per_layer_input; 0: no per-layer inputs
    per_layer_input_vocab_size: int

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> Gemma4Args:
        """Raises ValueError for missing or inconsistent keys, NotImplementedError (one
        line, naming the field) for Gemma 4 options this decoder does not implement."""
        missing = [key for key in ("vocab_size", "hidden_size") if key not in cfg]
        if missing:
            raise ValueError(f"config.json lacks {', '.join(missing)}")
        _refuse_unsupported(cfg)
        num_layers = _value(cfg, "num_hidden_layers", 30)
        layer_types = _layer_types(cfg, num_layers)
        head_dims, num_kv_heads = _attention_shapes(cfg, layer_types)
        num_shared = _value(cfg, "num_kv_shared_layers", 0)
        kv_sources = _kv_source_layers(layer_types, num_shared)
        k_eq_v = bool(cfg.get("attention_k_eq_v", False))
        intermediate = _value(cfg, "intermediate_size", 9216)
        double_wide = bool(cfg.get("use_double_wide_mlp", False))
        hidden_act = checked_activation(_value(cfg, "hidden_activation", "gelu_pytorch_tanh"))
        num_experts = _value(cfg, "num_experts", 0) if cfg.get("enable_moe_block") else 0
        top_k = _value(cfg, "top_k_experts", 0)
        moe_size = cfg.get("moe_intermediate_size") or cfg.get("expert_intermediate_size") or 0
        if num_experts and not (0 < top_k <= num_experts and moe_size > 0):
            raise ValueError(
                f"enable_moe_block needs top_k_experts in [1, num_experts={num_experts}] "
                f"(got {top_k}) and moe_intermediate_size > 0 (got {moe_size})"
            )
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            num_layers=num_layers,
            num_heads=_value(cfg, "num_attention_heads", 8),
            layer_types=layer_types,
            head_dims=head_dims,
            num_kv_heads=num_kv_heads,
            k_eq_v=tuple(k_eq_v and t == FULL for t in layer_types),
            kv_source_layers=kv_sources,
            intermediate_sizes=tuple(
                intermediate * (2 if double_wide and kv_sources[i] != i else 1)
                for i in range(num_layers)
            ),
            sliding_window=_value(cfg, "sliding_window", 512),
            rms_norm_eps=_value(cfg, "rms_norm_eps", 1e-6),
            ropes=_ropes(cfg, layer_types),
            max_position_embeddings=_value(cfg, "max_position_embeddings", 131072),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            hidden_act=hidden_act,
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
            num_experts=num_experts,
            top_k_experts=top_k,
            moe_intermediate_size=moe_size,
            # absent: transformers' default 256; null or 0: none
            per_layer_input_size=cfg.get("hidden_size_per_layer_input", 256) or 0,
            per_layer_input_vocab_size=_value(cfg, "vocab_size_per_layer_input", 262144),
        )


def _refuse_unsupported(cfg: dict[str, Any]) -> None:
    if cfg.get("use_bidirectional_attention") not in (None, "vision"):
        raise NotImplementedError(
            "Gemma 4 use_bidirectional_attention="
            f"{cfg['use_bidirectional_attention']!r} is not supported (null and 'vision' are)"
        )
    if cfg.get("attention_bias"):
        raise NotImplementedError("Gemma 4 with attention_bias=true is not supported")
    if cfg.get("attn_logit_softcapping") is not None:
        raise NotImplementedError("Gemma 4 with attn_logit_softcapping is not supported")


def _layer_types(cfg: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    """``layer_types`` (default: every 6th layer full), the last layer forced to full
    attention as transformers does."""
    layer_types = list(
        cfg.get("layer_types") or [SLIDING if (i + 1) % 6 else FULL for i in range(num_layers)]
    )
    unknown = sorted(set(layer_types) - {SLIDING, FULL})
    if unknown or len(layer_types) != num_layers:
        raise NotImplementedError(
            f"Gemma 4 layer_types {layer_types} (need {num_layers} of {SLIDING} / {FULL})"
        )
    if layer_types[-1] != FULL:
        logger.warning(
            "Gemma 4: the last layer must use full_attention; forcing it (as transformers does)"
        )
        layer_types[-1] = FULL
    return tuple(layer_types)


def _attention_shapes(
    cfg: dict[str, Any], layer_types: tuple[str, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per layer ``(head_dims, num_kv_heads)``: released files give ``global_head_dim`` and
    ``num_global_key_value_heads`` (the latter only under ``attention_k_eq_v``) for full
    layers; files saved by transformers 5.24 give ``per_layer_config`` instead."""
    head_dim = _value(cfg, "head_dim", 256)
    num_kv_heads = _value(cfg, "num_key_value_heads", 4)
    per_layer = cfg.get("per_layer_config")
    if per_layer is None:
        full = {"head_dim": _value(cfg, "global_head_dim", 512)}
        global_kv_heads = cfg.get("num_global_key_value_heads")
        if cfg.get("attention_k_eq_v") and global_kv_heads is not None:
            full["num_key_value_heads"] = global_kv_heads
        per_layer = {i: full for i, t in enumerate(layer_types) if t == FULL}
    overrides = {int(i): dict(v) for i, v in per_layer.items()}
    for layer_idx, override in overrides.items():
        unknown = sorted(set(override) - {"head_dim", "num_key_value_heads"})
        if unknown:
            raise NotImplementedError(f"Gemma 4 per_layer_config[{layer_idx}] keys {unknown}")
    head_dims = tuple(
        overrides.get(i, {}).get("head_dim", head_dim) for i in range(len(layer_types))
    )
    kv_heads = tuple(
        overrides.get(i, {}).get("num_key_value_heads", num_kv_heads)
        for i in range(len(layer_types))
    )
    for kind in set(layer_types):
        dims = {d for d, t in zip(head_dims, layer_types, strict=True) if t == kind}
        if len(dims) > 1:
            raise NotImplementedError(f"Gemma 4 {kind} layers with head dims {sorted(dims)}")
    return head_dims, kv_heads


def _kv_source_layers(layer_types: tuple[str, ...], num_shared: int) -> tuple[int, ...]:
    """Per layer, the layer whose KV cache it attends: itself, or for the last
    ``num_shared`` layers the last earlier non-shared layer of the same type."""
    num_layers = len(layer_types)
    first_shared = num_layers - num_shared
    if not 0 <= num_shared < num_layers:
        raise NotImplementedError(
            f"Gemma 4 num_kv_shared_layers={num_shared} with {num_layers} layers "
            "(some layer must compute its own KV)"
        )
    last_of_type: dict[str, int] = {}
    for i in range(first_shared):
        last_of_type[layer_types[i]] = i
    sources = list(range(first_shared))
    for i in range(first_shared, num_layers):
        if layer_types[i] not in last_of_type:
            raise ValueError(
                f"Gemma 4 layer {i} ({layer_types[i]}) shares KV but no earlier layer of "
                f"that type computes it (num_kv_shared_layers={num_shared})"
            )
        sources.append(last_of_type[layer_types[i]])
    return tuple(sources)


def _ropes(cfg: dict[str, Any], layer_types: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    nested = cfg.get("rope_parameters") or {
        SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
        FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
    }
    ropes = {}
    for kind in sorted(set(layer_types)):
        if not nested.get(kind):
            raise ValueError(f"Gemma 4 rope_parameters has no entry for {kind} layers")
        params = rope_parameters({"rope_parameters": nested[kind]})
        if params["rope_type"] not in ("default", "proportional"):
            raise NotImplementedError(
                f"Gemma 4 rope_parameters[{kind!r}].rope_type {params['rope_type']!r} is not "
                "supported (default, proportional are)"
            )
        if params["rope_type"] == "default":  # transformers ignores the rest for Gemma 4
            params = {"rope_type": "default", "rope_theta": params["rope_theta"]}
        ropes[kind] = params
    return ropes
