"""Gemma 4 text decoder, dense and mixture-of-experts: ``Gemma4ForCausalLM`` and the text
part of ``Gemma4ForConditionalGeneration`` (vision and audio towers are skipped), as
transformers 5.24's ``modeling_gemma4`` computes it.

One layer, ``x`` the residual stream::

    x = x + post_attention_norm(attn(input_norm(x)))
    m = mlp(pre_feedforward_norm(x))
    MoE layers:  m = post_feedforward_norm_1(m)
                     + post_feedforward_norm_2(experts(pre_feedforward_norm_2(x), router(x)))
    x = x + post_feedforward_norm(m)
    per-layer inputs:  x = x + post_per_layer_input_norm(projection(gelu(gate(x)) * ple[layer]))
    x = x * layer_scalar

What is new since Gemma 3 (``gemma3.py``):

* norms scale by ``w`` itself (not ``1 + w``), in fp32 before the cast; values are
  RMS-normed with no weight; the attention scale is 1 (the q/k norms set the scale);
* per layer type: sliding layers use ``head_dim``, ``num_key_value_heads`` and the default
  rope; full layers use ``global_head_dim``, ``num_global_key_value_heads`` (under
  ``attention_k_eq_v``) and proportional rope (only the first ``partial_rotary_factor`` of
  the frequencies turn). The KV cache therefore has per-layer shapes (``kv_cache_specs``);
* ``attention_k_eq_v``: full layers have no ``v_proj``; ``v = v_norm(k_proj(x))`` and
  ``k = rope(k_norm(k_proj(x)))``;
* MoE (``enable_moe_block``): the dense MLP and ``num_experts`` experts side by side. The
  router RMS-norms ``x`` (no weight), multiplies by ``scale * hidden_size ** -0.5``,
  projects, takes a fp32 softmax, the top ``top_k_experts``, renormalises them to sum 1
  and multiplies each by ``per_expert_scale[expert]``. Checkpoints stack the experts:
  ``experts.gate_up_proj [E, 2I, H]`` (gate rows first), ``experts.down_proj [E, H, I]``;
* KV sharing: the last ``num_kv_shared_layers`` layers compute only q and attend the KV
  cache of the last earlier layer of their type (they own no cache); with
  ``use_double_wide_mlp`` their MLP is twice ``intermediate_size``;
* per-layer inputs (``hidden_size_per_layer_input`` > 0)::

      ple = (norm(per_layer_model_projection(x0) / sqrt(H)) + embed_per_layer(ids) * sqrt(P))
            / sqrt(2)                                       # [tokens, layers, P]

  with ``x0`` the scaled token embeddings;
* a learned ``layer_scalar`` per layer; embeddings times ``sqrt(hidden_size)`` rounded to
  the weights' dtype; final logit soft-capping; tied embeddings.

Refused with a one-line message naming the field: bidirectional text attention
(``use_bidirectional_attention: "all"``; ``"vision"`` only concerns image tokens, so text is
causal), ``attention_bias``, ``attn_logit_softcapping``, rope types other than default and
proportional, ``per_layer_config`` keys other than ``head_dim`` / ``num_key_value_heads``.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from vtllm.worker.attention import AttentionMetadata, paged_attention, write_kv_cache
from vtllm.worker.distributed import TPGroup, divide
from vtllm.worker.kv_cache_dtype import register_kv_scales
from vtllm.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from vtllm.worker.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    default_weight_loader,
)
from vtllm.worker.layers.moe import (
    ExpertShardId,
    FusedMoE,
    Router,
    RouterSpec,
    expert_checkpoint_name,
    route_tokens,
)
from vtllm.worker.layers.norm import Gemma4RMSNorm, ScalelessRMSNorm
from vtllm.worker.layers.rotary import RotaryEmbedding
from vtllm.worker.models.gemma4_config import FULL, SLIDING, Gemma4Args
from vtllm.worker.models.llama import (
    ACTIVATIONS,
    KVCache,
    LlamaForCausalLM,
    act_and_mul,
)

# checkpoint tensors of a Gemma4ForConditionalGeneration that are not the text decoder
_NON_TEXT_PREFIXES = (
    "model.vision_tower.",
    "model.embed_vision.",
    "model.audio_tower.",
    "model.embed_audio.",
)
_STACKED_EXPERTS = re.compile(
    r"^(?P<prefix>model\.layers\.\d+\.experts)\.(?P<proj>gate_up_proj|down_proj)$"
)
# one expert's projections, as FP8 exports (llm-compressor, vLLM's layout) write them
_EXPERT_PROJECTIONS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
_SHARED_KV_TENSOR = re.compile(
    r"^model\.layers\.(?P<layer>\d+)\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\."
)


class ReplicatedLinear(nn.Module):
    """``y = x W^T``, the whole weight on every rank (the small per-layer-input linears)."""

    def __init__(self, input_size: int, output_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)  # [num_tokens, output_size]


def _scalar_param(size: int) -> nn.Parameter:
    param = nn.Parameter(torch.empty(size), requires_grad=False)
    param.weight_loader = default_weight_loader
    return param


class Gemma4Attention(nn.Module):
    """q (+ k, + v unless ``k_eq_v``, unless the layer shares KV) projection, per-head
    norms, rope, paged attention at scale 1 (windowed on sliding layers), output."""

    def __init__(self, args: Gemma4Args, tp: TPGroup, layer_idx: int) -> None:
        super().__init__()
        self.head_dim = head_dim = args.head_dims[layer_idx]
        self.num_heads = divide(args.num_heads, tp.size, "num_attention_heads")
        self.num_kv_heads = divide(
            args.num_kv_heads[layer_idx], tp.size, f"layer {layer_idx}'s num_key_value_heads"
        )
        self.owns_kv = args.kv_source_layers[layer_idx] == layer_idx
        self.k_eq_v = args.k_eq_v[layer_idx]
        is_sliding = args.layer_types[layer_idx] == SLIDING
        self.sliding_window = args.sliding_window if is_sliding else None
        shards = {"q": args.num_heads * head_dim}
        if self.owns_kv:
            shards["k"] = args.num_kv_heads[layer_idx] * head_dim
            if not self.k_eq_v:
                shards["v"] = shards["k"]
        self.qkv_proj = ColumnParallelLinear(
            args.hidden_size, list(shards.values()), False, tp, list(shards)
        )
        self.o_proj = RowParallelLinear(shards["q"], args.hidden_size, False, tp)
        eps = args.rms_norm_eps
        self.q_norm = Gemma4RMSNorm(head_dim, eps)
        if self.owns_kv:
            self.k_norm = Gemma4RMSNorm(head_dim, eps)
            self.v_norm = ScalelessRMSNorm(head_dim, eps)
        # a KV-sharing layer reads with its source layer's scales (Gemma4ForCausalLM ties them)
        register_kv_scales(self)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        positions: torch.Tensor,  # [num_tokens]
        rotary: RotaryEmbedding,
        kv_cache: KVCache,  # this layer's, or the shared source layer's (already written)
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens, head_dim = x.shape[0], self.head_dim
        q_size, kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        qkv = self.qkv_proj(x)  # [num_tokens, q_size (+ kv_size (+ kv_size))]
        q = self.q_norm(qkv[:, :q_size].view(num_tokens, self.num_heads, head_dim))
        if self.owns_kv:
            k = qkv[:, q_size : q_size + kv_size].view(num_tokens, self.num_kv_heads, head_dim)
            v = k if self.k_eq_v else qkv[:, q_size + kv_size :].view(k.shape)
            v = self.v_norm(v)  # [num_tokens, kv_heads, head_dim], from the raw projection
            k = self.k_norm(k)
            rotary(positions, q, k)  # in place
            write_kv_cache(
                k, v, kv_cache[0], kv_cache[1], metadata.slot_mapping, self.k_scale, self.v_scale
            )
        else:  # rotate q alone: a one-head scratch k takes the kernel's k side
            rotary(positions, q, q.new_empty(num_tokens, 1, head_dim))
        o = paged_attention(
            q,
            kv_cache[0],
            kv_cache[1],
            metadata,
            1.0,
            self.sliding_window,
            self.k_scale,
            self.v_scale,
        )  # [num_tokens, heads, head_dim]
        return self.o_proj(o.reshape(num_tokens, q_size))  # [num_tokens, hidden]


class Gemma4MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, act: str, tp: TPGroup) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], False, tp
        )
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, False, tp)
        self.hidden_act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * inter / tp]
        return self.down_proj(act_and_mul(self.hidden_act, gate_up))


class Gemma4Router(nn.Module):
    """Top-k experts and their weights (fp32) from the residual stream (module docstring)."""

    def __init__(
        self, hidden_size: int, num_experts: int, top_k: int, eps: float, single_rank: bool
    ) -> None:
        super().__init__()
        self.single_rank = single_rank  # route_tokens: the fused router on one rank only
        self.norm = ScalelessRMSNorm(hidden_size, eps)
        self.proj = Router(hidden_size, num_experts)
        self.scale = _scalar_param(hidden_size)
        self.per_expert_scale = _scalar_param(num_experts)
        self.spec = RouterSpec(top_k=top_k, scoring="softmax", renormalize=True)
        self.root_size = hidden_size**-0.5

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.norm(x) * self.scale * self.root_size  # [num_tokens, hidden]
        # [num_tokens, k] each
        return route_tokens(
            h, self.proj, self.spec, self.per_expert_scale, single_rank=self.single_rank
        )


class StackedExperts(FusedMoE):
    """``FusedMoE`` that also loads stacked checkpoint tensors: ``experts.gate_up_proj``
    ``[E, 2I, H]`` (gate rows, then up rows) and ``experts.down_proj`` ``[E, H, I]``, each
    loaded whole (shard id ``"stacked"``) and split per expert and rank. Per-expert tensors
    (``experts.{e}.gate_proj.weight`` and FP8 scales, as FP8 exports write them) load as in
    ``FusedMoE``."""

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ExpertShardId | str
    ) -> list[ExpertShardId] | None:
        """Per-expert shard ids: ``FusedMoE``'s; ``"stacked"``: every expert's, returned
        (the shards this one tensor filled)."""
        if shard_id != "stacked":
            return super().weight_loader(param, loaded, shard_id)
        if loaded.dim() != 3 or loaded.shape[0] != self.num_experts:
            raise ValueError(
                f"stacked experts: checkpoint shape {tuple(loaded.shape)}, expected "
                f"{self.num_experts} experts first"
            )
        if param.element_size() == 1 and loaded.element_size() > 1:
            param = self._unquantized(param, loaded.dtype)
        full = self.local_size * self.tp.size
        filled: list[ExpertShardId] = []
        for expert in range(self.num_experts):
            if param is self.w2_weight:
                parts = [("down", loaded[expert])]
            else:
                parts = [("gate", loaded[expert, :full]), ("up", loaded[expert, full:])]
            for kind, part in parts:
                super().weight_loader(param, part, (expert, kind))
                filled.append((expert, kind))
        return filled

    def _unquantized(self, param: nn.Parameter, dtype: torch.dtype) -> nn.Parameter:
        """An FP8 checkpoint that leaves the stacked experts unquantised (exporters that
        quantise only ``nn.Linear`` modules skip Gemma 4's 3-D expert tensors): this
        parameter goes back to ``dtype`` and loses its checkpoint scales, so that
        ``layers/fp8.finish_fp8`` quantises it per row after loading, as under
        ``--quantization fp8``."""
        prefix = "w2_" if param is self.w2_weight else "w13_"
        fresh = nn.Parameter(torch.empty(param.shape, dtype=dtype, device=param.device), False)
        fresh.shard_ids, fresh.weight_loader = param.shard_ids, param.weight_loader
        setattr(self, f"{prefix}weight", fresh)
        for suffix in ("weight_scale", "weight_scale_inv"):
            if hasattr(self, prefix + suffix):
                delattr(self, prefix + suffix)
        return fresh


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, args: Gemma4Args, tp: TPGroup, layer_idx: int) -> None:
        super().__init__()
        hidden, eps = args.hidden_size, args.rms_norm_eps
        self.is_sliding = args.layer_types[layer_idx] == SLIDING
        self.input_layernorm = Gemma4RMSNorm(hidden, eps)
        self.self_attn = Gemma4Attention(args, tp, layer_idx)
        self.post_attention_layernorm = Gemma4RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(hidden, eps)
        self.mlp = Gemma4MLP(hidden, args.intermediate_sizes[layer_idx], args.hidden_act, tp)
        self.post_feedforward_layernorm = Gemma4RMSNorm(hidden, eps)
        self.has_experts = args.num_experts > 0
        if self.has_experts:
            self.router = Gemma4Router(
                hidden, args.num_experts, args.top_k_experts, eps, single_rank=tp.size == 1
            )
            self.experts = StackedExperts(
                args.num_experts, hidden, args.moe_intermediate_size, tp, args.hidden_act
            )
            self.post_feedforward_layernorm_1 = Gemma4RMSNorm(hidden, eps)
            self.pre_feedforward_layernorm_2 = Gemma4RMSNorm(hidden, eps)
            self.post_feedforward_layernorm_2 = Gemma4RMSNorm(hidden, eps)
        self.has_per_layer_input = args.per_layer_input_size > 0
        if self.has_per_layer_input:
            self.hidden_act = args.hidden_act
            size = args.per_layer_input_size
            self.per_layer_input_gate = ReplicatedLinear(hidden, size)
            self.per_layer_projection = ReplicatedLinear(size, hidden)
            self.post_per_layer_input_norm = Gemma4RMSNorm(hidden, eps)
        self.layer_scalar = _scalar_param(1)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]: the residual stream
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        per_layer_input: torch.Tensor | None,  # [num_tokens, per_layer_input_size]
    ) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), positions, rotary, kv_cache, metadata)
        h = self.post_attention_layernorm(h)
        h, x = self.pre_feedforward_layernorm(h, x)  # x += attention output; h = norm(x)
        h = self.mlp(h)
        if self.has_experts:
            topk_weights, topk_ids = self.router(x)
            experts_out = self.experts(self.pre_feedforward_layernorm_2(x), topk_weights, topk_ids)
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(
                experts_out
            )
        x = x + self.post_feedforward_layernorm(h)
        if self.has_per_layer_input:
            gate = self.per_layer_input_gate(x)  # [num_tokens, per_layer_input_size]
            gated = ACTIVATIONS[self.hidden_act][1](gate) * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return x * self.layer_scalar


class Gemma4Model(nn.Module):
    def __init__(self, args: Gemma4Args, tp: TPGroup) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(args.vocab_size, args.hidden_size, tp)
        self.layers = nn.ModuleList(Gemma4DecoderLayer(args, tp, i) for i in range(args.num_layers))
        self.norm = Gemma4RMSNorm(args.hidden_size, args.rms_norm_eps)
        if args.per_layer_input_size:
            packed = args.num_layers * args.per_layer_input_size
            self.embed_tokens_per_layer = VocabParallelEmbedding(
                args.per_layer_input_vocab_size, packed, tp
            )
            self.per_layer_model_projection = ReplicatedLinear(args.hidden_size, packed)
            self.per_layer_projection_norm = Gemma4RMSNorm(
                args.per_layer_input_size, args.rms_norm_eps
            )


class Gemma4ForCausalLM(nn.Module):
    """``forward`` → final hidden states; ``compute_logits`` → full-vocab logits (soft-capped).

    The KV cache has one (K, V) pair per layer that computes KV (``kv_cache_specs``, in
    layer order); a KV-sharing layer attends its source layer's pair.
    """

    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping
    ignored_checkpoint_suffixes = LlamaForCausalLM.ignored_checkpoint_suffixes

    def __init__(self, args: Gemma4Args, tp: TPGroup) -> None:
        super().__init__()
        self.args = args
        self.model = Gemma4Model(args, tp)
        self.lm_head = ParallelLMHead(args.vocab_size, args.hidden_size, tp)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        max_position = args.max_position_embeddings
        head_dim = {t: d for t, d in zip(args.layer_types, args.head_dims, strict=True)}
        self.rotaries = nn.ModuleDict(
            {t: RotaryEmbedding(head_dim[t], max_position, args.ropes[t]) for t in args.ropes}
        )
        owners = [i for i in range(args.num_layers) if args.kv_source_layers[i] == i]
        self.cache_index = [owners.index(source) for source in args.kv_source_layers]
        for layer, source in zip(self.model.layers, args.kv_source_layers, strict=True):
            if not layer.self_attn.owns_kv:  # read the cache with the scales it was written with
                layer.self_attn.k_scale = self.model.layers[source].self_attn.k_scale
                layer.self_attn.v_scale = self.model.layers[source].self_attn.v_scale

    def kv_cache_specs(self) -> list[tuple[int, int]]:
        """``(num_kv_heads on this rank, head_dim)`` of each KV cache to allocate, one per
        layer that computes KV, in layer order (``forward`` takes them in that order)."""
        return [
            (layer.self_attn.num_kv_heads, layer.self_attn.head_dim)
            for layer in self.model.layers
            if layer.self_attn.owns_kv
        ]

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[KVCache],  # as kv_cache_specs()
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # [num_tokens, hidden]
        x = x * torch.tensor(self.args.hidden_size**0.5, dtype=x.dtype)
        per_layer_inputs = self._per_layer_inputs(input_ids, x)  # [num_tokens, layers, P]
        for i, layer in enumerate(self.model.layers):
            rotary = self.rotaries[SLIDING if layer.is_sliding else FULL]
            per_layer_input = None if per_layer_inputs is None else per_layer_inputs[:, i]
            kv_cache = kv_caches[self.cache_index[i]]
            x = layer(x, positions, rotary, kv_cache, metadata, per_layer_input)
        return self.model.norm(x)  # [num_tokens, hidden]

    def _per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        size = self.args.per_layer_input_size
        if not size:
            return None
        shape = (x.shape[0], self.args.num_layers, size)
        by_token = self.model.embed_tokens_per_layer(input_ids)  # [num_tokens, layers * P]
        by_token = by_token * torch.tensor(size**0.5, dtype=x.dtype)
        projected = self.model.per_layer_model_projection(x) * self.args.hidden_size**-0.5
        projected = self.model.per_layer_projection_norm(projected.view(shape))
        return (projected + by_token.view(shape)) * 2.0**-0.5  # [num_tokens, layers, P]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.compute_logits(hidden).float()  # [num_rows, vocab]
        cap = self.args.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    # -- checkpoint names ---------------------------------------------------------------

    def checkpoint_text_name(self, name: str) -> str:
        """The loader's first hook: a ``Gemma4ForConditionalGeneration`` tensor name as the
        text model's (``model.language_model.X`` → ``model.X``); others unchanged."""
        prefix = "model.language_model."
        return "model." + name[len(prefix) :] if name.startswith(prefix) else name

    def skips_checkpoint_tensor(self, name: str) -> bool:
        """True for tensors that carry no weights of this decoder: a multimodal wrapper's
        vision / audio towers, and k/v projections and norms that transformers writes for
        KV-sharing layers (which never use them)."""
        if name.startswith(_NON_TEXT_PREFIXES):
            return True
        match = _SHARED_KV_TENSOR.match(name)
        return match is not None and not self.model.layers[int(match["layer"])].self_attn.owns_kv

    def map_checkpoint_name(self, name: str) -> tuple[str, str | int | None]:
        """The loader's hook: checkpoint name (after ``checkpoint_text_name``) →
        ``(parameter name, shard id)``."""
        match = _STACKED_EXPERTS.match(name)
        if match is not None:
            param = "w13_weight" if match["proj"] == "gate_up_proj" else "w2_weight"
            return f"{match['prefix']}.{param}", "stacked"
        expert = expert_checkpoint_name(name, _EXPERT_PROJECTIONS)
        if expert is not None:
            return expert
        for checkpoint_part, (param_part, shard_id) in self.packed_modules_mapping.items():
            marker = f".{checkpoint_part}."
            if marker in name:
                param_name = name.replace(marker, f".{param_part}.")
                try:
                    module = self.get_submodule(param_name.rsplit(".", 1)[0])
                except AttributeError:  # the loader reports it as unexpected
                    return param_name, shard_id
                # a q-only projection (KV-sharing layer) is a single, unnamed shard
                return param_name, shard_id if len(module.shard_ids) > 1 else None
        return name, None
