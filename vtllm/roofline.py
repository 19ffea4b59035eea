"""The bytes a decode step must move, from a model's ``config.json``: the memory-bandwidth
roofline of ``vtllm bench``. Pure arithmetic on config keys (no torch).

What one batch-1 decode step reads::

    attention projections + dense MLPs + routers       every layer, whole
    experts                                            only top_k of num_experts per MoE layer
    LM head                                            whole (tied or not)
    input embedding                                    one row (a lookup, not a stream)
    KV cache                                           per layer: its context (sliding layers:
                                                       at most their window)

Families, by their config keys:

* dense Llama / Qwen / Mistral / Gemma 3: ``intermediate_size`` gated MLPs;
* Qwen3-MoE: experts (``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``) in
  place of the MLP, except ``mlp_only_layers`` and layers off ``decoder_sparse_step``;
* Mixtral: ``num_local_experts`` experts ``intermediate_size`` wide in every layer;
* Gemma 4 (``enable_moe_block``): ``num_experts`` / ``top_k_experts`` experts
  ``moe_intermediate_size`` wide *beside* the dense MLP; per layer type head dims and KV heads
  (``global_head_dim``, ``num_global_key_value_heads``, no ``v_proj`` under
  ``attention_k_eq_v``), double-wide MLPs on KV-shared layers, per-layer input embeddings.

Quantised weights (``linear_bytes``, e.g. 1 for FP8) apply to the attention projections, the
MLPs and the experts; embeddings, the LM head, routers and norms stay in ``dtype_bytes``; the
FP8 scales (1 value per 128x128 block or per channel) are left out. Norm vectors count as
two per layer, plus the q/k norms and Gemma's further norms where the family has them, so
the totals match ``transformers``' parameter counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_FULL = "full_attention"
# families whose attention RMS-norms q and k per head (a head_dim vector each)
_QK_NORM_TYPES = ("qwen3", "qwen3_moe", "gemma3_text", "gemma4_text")
_GEMMA_TYPES = ("gemma3_text", "gemma4_text")


@dataclass(frozen=True)
class KVLayer:
    """One layer's KV cache as the roofline sees it: bytes per token, and the most tokens
    a step attends (its sliding window; None: the whole context)."""

    bytes_per_token: int
    window: int | None


@dataclass(frozen=True)
class ModelBytes:
    """Weight bytes in all and as read by one batch-1 decode step; the KV per layer."""

    total_weight_bytes: int
    step_weight_bytes: int  # read by one batch-1 decode step
    expert_bytes: int  # every expert of every layer
    step_expert_bytes: int  # the top_k experts of each MoE layer
    kv_layers: tuple[KVLayer, ...]

    @property
    def step_weight_fraction(self) -> float:
        """The share of the weights one batch-1 decode step reads (1.0 for dense models)."""
        return self.step_weight_bytes / self.total_weight_bytes

    def kv_bytes(self, context: int) -> int:
        """KV bytes one sequence's decode step reads at ``context`` tokens."""
        return sum(
            layer.bytes_per_token
            * (context if layer.window is None else min(context, layer.window))
            for layer in self.kv_layers
        )

    def kv_bytes_while_decoding(self, prompt_len: int, num_output: int) -> int:
        """KV bytes read by the ``num_output`` decode steps after a ``prompt_len`` prompt
        (output token j attends ``prompt_len + j`` tokens)."""
        return sum(
            layer.bytes_per_token * _sum_capped(prompt_len, prompt_len + num_output, layer.window)
            for layer in self.kv_layers
        )


def model_bytes(
    hf: dict[str, Any],
    dtype_bytes: int,
    linear_bytes: int | None = None,
    kv_bytes: int | None = None,
) -> ModelBytes:
    """The byte accounting of ``hf`` (a ``config.json`` dict) with weights of
    ``dtype_bytes``, quantised linears and experts of ``linear_bytes`` (default: the same)
    and a KV cache of ``kv_bytes`` per value (default: the same)."""
    linear_bytes = linear_bytes or dtype_bytes
    kv_bytes = kv_bytes or dtype_bytes
    h, vocab = hf["hidden_size"], hf["vocab_size"]
    num_layers, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    num_experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
    top_k = hf.get("top_k_experts") or hf.get("num_experts_per_tok") or 0
    expert_width = hf.get("moe_intermediate_size") or hf["intermediate_size"]
    dense_beside_experts = "enable_moe_block" in hf  # Gemma 4: dense MLP and experts
    layer_types = hf.get("layer_types") or [_default_layer_type(hf)] * num_layers
    first_kv_shared = num_layers - (hf.get("num_kv_shared_layers") or 0)
    per_layer_input = hf.get("hidden_size_per_layer_input") or 0

    total = step = experts = step_experts = 0
    kv_layers = []
    for i, layer_type in enumerate(layer_types):
        full = layer_type == _FULL
        head_dim = (full and hf.get("global_head_dim")) or hf.get("head_dim") or h // heads
        kv_heads = hf.get("num_key_value_heads") or heads
        if full and hf.get("num_global_key_value_heads"):
            kv_heads = hf["num_global_key_value_heads"]
        num_kv_projections = 1 if full and hf.get("attention_k_eq_v") else 2
        attention = h * heads * head_dim * 2 + h * kv_heads * head_dim * num_kv_projections
        dense_width = _dense_mlp_width(hf, i, num_experts, dense_beside_experts)
        if hf.get("use_double_wide_mlp") and i >= first_kv_shared:
            dense_width *= 2
        layer = (attention + 3 * h * dense_width + 2 * h * per_layer_input) * linear_bytes
        layer += 2 * h * dtype_bytes  # the layer's norms
        if hf.get("model_type") in _QK_NORM_TYPES:
            layer += 2 * head_dim * dtype_bytes
        if hf.get("model_type") in _GEMMA_TYPES:  # pre/post feed-forward norms
            layer += 2 * h * dtype_bytes
        if _is_moe_layer(hf, i, num_experts):
            layer += num_experts * h * dtype_bytes  # the router
            if dense_beside_experts:  # Gemma 4: 3 more norms, router scale, expert scales
                layer += (4 * h + num_experts) * dtype_bytes
            experts += num_experts * 3 * h * expert_width * linear_bytes
            step_experts += top_k * 3 * h * expert_width * linear_bytes
        total += layer
        step += layer
        window = None if full else _sliding_window(hf, layer_type)
        kv_layers.append(KVLayer(2 * kv_heads * head_dim * kv_bytes, window))

    table = vocab * h * dtype_bytes
    lm_head_and_embedding = table if hf.get("tie_word_embeddings") else 2 * table
    per_layer_tables = 0
    if per_layer_input:  # embed_per_layer [vocab_pl, L*P] and its [L*P, H] model projection
        vocab_per_layer = hf.get("vocab_size_per_layer_input") or vocab
        per_layer_tables = (vocab_per_layer + h) * num_layers * per_layer_input * dtype_bytes
    total += lm_head_and_embedding + per_layer_tables + h * dtype_bytes + experts
    # a step streams the LM head and the model projection; embeddings give it one row each
    step += table + h * num_layers * per_layer_input * dtype_bytes + h * dtype_bytes
    step += (h + num_layers * per_layer_input) * dtype_bytes + step_experts
    return ModelBytes(total, step, experts, step_experts, tuple(kv_layers))


def prefill_flops(hf: dict[str, Any], num_tokens: int) -> int:
    """The floating-point operations (multiply and add counted apart) of prefilling one
    ``num_tokens`` prompt with logits for its last token only: the linears every token
    runs (with experts: its top-k) plus causal attention (query ``i`` attends ``i + 1``
    keys, at most a sliding layer's window; scores and values 2 FLOP a multiply-add each).

    Query width per layer: ``num_attention_heads × head_dim`` (Gemma 4's wider full
    layers: ``global_head_dim``). Norm weights count as linear parameters (< 0.01 %)."""
    counted = model_bytes(hf, dtype_bytes=1)  # 1 byte a parameter: bytes are parameters
    h, vocab = hf["hidden_size"], hf["vocab_size"]
    # what one token's step touches, less the LM head and the embedding row it looks up
    linear_params = counted.step_weight_bytes - vocab * h - h
    flops = 2 * linear_params * num_tokens + 2 * vocab * h
    heads = hf["num_attention_heads"]
    layer_types = hf.get("layer_types") or [_default_layer_type(hf)] * len(counted.kv_layers)
    for layer_type, kv_layer in zip(layer_types, counted.kv_layers, strict=True):
        full = layer_type == _FULL
        head_dim = (full and hf.get("global_head_dim")) or hf.get("head_dim") or h // heads
        keys = _sum_capped(1, num_tokens + 1, kv_layer.window)
        flops += 4 * heads * head_dim * keys
    return flops


def _default_layer_type(hf: dict[str, Any]) -> str:
    """Without ``layer_types``: Mistral and Mixtral slide on every layer when
    ``sliding_window`` is set; Qwen2/3 only with ``use_sliding_window``."""
    if hf.get("sliding_window") and hf.get(
        "use_sliding_window", hf.get("model_type") in ("mistral", "mixtral")
    ):
        return "sliding_attention"
    return _FULL


def _sliding_window(hf: dict[str, Any], layer_type: str) -> int | None:
    return hf.get("sliding_window") if layer_type == "sliding_attention" else None


def _is_moe_layer(hf: dict[str, Any], layer_idx: int, num_experts: int) -> bool:
    if num_experts == 0 or ("enable_moe_block" in hf and not hf["enable_moe_block"]):
        return False
    if layer_idx in (hf.get("mlp_only_layers") or ()):
        return False
    return (layer_idx + 1) % (hf.get("decoder_sparse_step") or 1) == 0


def _dense_mlp_width(
    hf: dict[str, Any], layer_idx: int, num_experts: int, dense_beside_experts: bool
) -> int:
    """The layer's dense gated-MLP width: 0 where experts replace it (Qwen3-MoE, Mixtral)."""
    if dense_beside_experts or not _is_moe_layer(hf, layer_idx, num_experts):
        return hf["intermediate_size"]
    return 0


def _sum_capped(start: int, stop: int, cap: int | None) -> int:
    """``sum(min(c, cap) for c in range(start, stop))`` in closed form (no cap: plain sum)."""
    if stop <= start:
        return 0
    if cap is None or stop - 1 <= cap:
        return (start + stop - 1) * (stop - start) // 2
    below = _sum_capped(start, min(cap, stop), None) if start < cap else 0
    return below + cap * (stop - max(start, cap))
