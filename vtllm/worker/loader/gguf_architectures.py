"""How each GGUF ``general.architecture`` maps onto a transformers model directory.

One :class:`ArchitectureSpec` per architecture: its ``config.json`` builder (from the GGUF
metadata, plus the facts llama.cpp hard-codes instead of storing), its tensor-name map and
its per-tensor fix-ups. numpy only: the frontend converts before any torch is loaded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

Metadata = dict[str, Any]


@dataclass(frozen=True)
class ArchitectureSpec:
    """How one ``general.architecture`` maps onto a transformers model directory."""

    # (metadata, has `output.weight`) -> config.json contents
    build_config: Callable[[Metadata, bool], dict[str, Any]]
    # GGUF tensor name -> HF name, or None to drop it; raises on an unknown name
    hf_tensor_name: Callable[[str], str | None]
    # (HF name, float32 weight in HF orientation, config) -> weight as transformers expects it
    fix_tensor: Callable[[str, np.ndarray, dict[str, Any]], np.ndarray]


def float32_as_decimal(value: float) -> float:
    """The shortest decimal that round-trips the float32 GGUF stores (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def _field_reader(architecture: str, metadata: Metadata) -> Callable[..., Any]:
    def field(key: str, default: Any = None) -> Any:
        value = metadata.get(f"{architecture}.{key}", default)
        if value is None:
            raise ValueError(
                f"GGUF metadata lacks {architecture}.{key}, which a {architecture} config needs"
            )
        return value

    return field


def _token_ids(metadata: Metadata) -> dict[str, Any]:
    return {
        "bos_token_id": int(metadata["tokenizer.ggml.bos_token_id"]),
        "eos_token_id": int(metadata["tokenizer.ggml.eos_token_id"]),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
    }


def _layer_tensor_name(
    gguf_name: str, global_names: dict[str, str | None], layer_names: dict[str, str], arch: str
) -> str | None:
    if gguf_name in global_names:
        return global_names[gguf_name]
    prefix, _, rest = gguf_name.partition(".")
    layer_idx, _, suffix = rest.partition(".")
    if prefix == "blk" and layer_idx.isdigit() and suffix in layer_names:
        return f"model.layers.{layer_idx}.{layer_names[suffix]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no {arch} equivalent in this converter")


# ---------------------------------------------------------------------------------------------
# llama (Llama 2/3, SmolLM2)


def _unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (rotary halves -> interleaved pairs).

    llama.cpp writes ``w.reshape(H, 2, R // H // 2, C).swapaxes(1, 2)``; the inverse reshapes
    to ``(H, R // H // 2, 2, C)`` and swaps the same axes back.
    """
    num_rows = weight.shape[0]
    # [num_heads, head_dim // 2, 2, in_features] -> [num_heads, 2, head_dim // 2, in_features]
    split = weight.reshape(num_heads, num_rows // num_heads // 2, 2, *weight.shape[1:])
    return split.swapaxes(1, 2).reshape(weight.shape)


def _llama_config(metadata: Metadata, has_output_weight: bool) -> dict[str, Any]:
    field = _field_reader("llama", metadata)
    hidden_size = int(field("embedding_length"))
    num_heads = int(field("attention.head_count"))
    rope_scaling_type = metadata.get("llama.rope.scaling.type", "none")
    if rope_scaling_type not in ("none", None):
        raise ValueError(
            f"GGUF rope scaling {rope_scaling_type!r} is not supported by this converter"
        )
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden_size,
        "intermediate_size": int(field("feed_forward_length")),
        "num_hidden_layers": int(field("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(field("attention.head_count_kv", num_heads)),
        "head_dim": int(field("attention.key_length", hidden_size // num_heads)),
        "rms_norm_eps": float32_as_decimal(field("attention.layer_norm_rms_epsilon")),
        "rope_theta": float32_as_decimal(field("rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "max_position_embeddings": int(field("context_length")),
        "vocab_size": int(field("vocab_size", len(metadata["tokenizer.ggml.tokens"]))),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "tie_word_embeddings": not has_output_weight,
        **_token_ids(metadata),
        "use_cache": True,
        "torch_dtype": "bfloat16",
    }


_LLAMA_GLOBAL_TENSORS: dict[str, str | None] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": None,  # llama3 rope factors; recomputed from config, not a parameter
}
_LLAMA_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def _llama_tensor_name(gguf_name: str) -> str | None:
    return _layer_tensor_name(gguf_name, _LLAMA_GLOBAL_TENSORS, _LLAMA_LAYER_TENSORS, "llama")


def _llama_fix_tensor(hf_name: str, weight: np.ndarray, config: dict[str, Any]) -> np.ndarray:
    if hf_name.endswith("self_attn.q_proj.weight"):
        return _unpermute_rows(weight, config["num_attention_heads"])
    if hf_name.endswith("self_attn.k_proj.weight"):
        return _unpermute_rows(weight, config["num_key_value_heads"])
    return weight


# ---------------------------------------------------------------------------------------------
# gemma3 (text only)

# llama.cpp hard-codes these for every Gemma 3 instead of storing them (llama-model.cpp,
# LLM_ARCH_GEMMA3): every 6th layer is global, the others slide; local layers use rope base
# 10000; the query scale is 1/sqrt(head_dim), except 27B (62 layers): 1/sqrt(hidden / heads).
_GEMMA3_SLIDING_WINDOW_PATTERN = 6
_GEMMA3_LOCAL_ROPE_THETA = 10000.0
_GEMMA3_27B_NUM_LAYERS = 62


def _gemma3_config(metadata: Metadata, has_output_weight: bool) -> dict[str, Any]:
    field = _field_reader("gemma3", metadata)
    hidden_size = int(field("embedding_length"))
    num_heads = int(field("attention.head_count"))
    num_layers = int(field("block_count"))
    head_dim = int(field("attention.key_length", 256))
    rope_scaling = None
    scaling_type = metadata.get("gemma3.rope.scaling.type", "none")
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(field("rope.scaling.factor"))}
    elif scaling_type not in ("none", None):
        raise ValueError(f"GGUF rope scaling {scaling_type!r} is not supported for gemma3")
    pattern = _GEMMA3_SLIDING_WINDOW_PATTERN
    softcap = metadata.get("gemma3.final_logit_softcapping")
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": hidden_size,
        "intermediate_size": int(field("feed_forward_length")),
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(field("attention.head_count_kv", num_heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float32_as_decimal(field("attention.layer_norm_rms_epsilon")),
        "rope_theta": float32_as_decimal(field("rope.freq_base", 1_000_000.0)),
        "rope_local_base_freq": _GEMMA3_LOCAL_ROPE_THETA,
        "rope_scaling": rope_scaling,
        "sliding_window": int(field("attention.sliding_window")),
        "sliding_window_pattern": pattern,
        "layer_types": [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(num_layers)
        ],
        "query_pre_attn_scalar": (
            hidden_size // num_heads if num_layers == _GEMMA3_27B_NUM_LAYERS else head_dim
        ),
        "final_logit_softcapping": None if softcap is None else float(softcap),
        "attn_logit_softcapping": None,
        "max_position_embeddings": int(field("context_length")),
        "vocab_size": int(field("vocab_size", len(metadata["tokenizer.ggml.tokens"]))),
        "hidden_activation": "gelu_pytorch_tanh",
        "attention_bias": False,
        "initializer_range": 0.02,
        "tie_word_embeddings": not has_output_weight,
        **_token_ids(metadata),
        "use_cache": True,
        "torch_dtype": "bfloat16",
    }


_GEMMA3_GLOBAL_TENSORS: dict[str, str | None] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GEMMA3_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}


def _gemma3_tensor_name(gguf_name: str) -> str | None:
    return _layer_tensor_name(gguf_name, _GEMMA3_GLOBAL_TENSORS, _GEMMA3_LAYER_TENSORS, "gemma3")


def _gemma3_fix_tensor(hf_name: str, weight: np.ndarray, config: dict[str, Any]) -> np.ndarray:
    # llama.cpp stores Gemma's zero-centred norm weights as ``w + 1`` (ggml multiplies by the
    # weight directly); transformers' Gemma3RMSNorm adds the 1 itself. q/k are not permuted:
    # llama.cpp runs Gemma's rope in the NeoX (rotate-half) layout that transformers uses.
    if hf_name.endswith("norm.weight"):
        return weight - np.float32(1.0)
    return weight


ARCHITECTURES: dict[str, ArchitectureSpec] = {
    "llama": ArchitectureSpec(_llama_config, _llama_tensor_name, _llama_fix_tensor),
    "gemma3": ArchitectureSpec(_gemma3_config, _gemma3_tensor_name, _gemma3_fix_tensor),
}


def architecture_spec(architecture: str) -> ArchitectureSpec:
    spec = ARCHITECTURES.get(architecture)
    if spec is None:
        raise ValueError(
            f"GGUF architecture {architecture!r} is not supported yet; supported: "
            f"{sorted(ARCHITECTURES)}. Convert it to a Hugging Face directory and pass that instead."
        )
    return spec
