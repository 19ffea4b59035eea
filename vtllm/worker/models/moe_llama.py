"""Llama-family decoders whose MLPs are mixtures of experts: Qwen3-MoE and Mixtral.

Attention, norms, rope, embeddings and the residual wiring are ``llama.py``'s; a layer's
MLP is a ``SparseMoeBlock`` (router + fused experts) or, for Qwen3-MoE layers listed in
``mlp_only_layers`` or skipped by ``decoder_sparse_step``, the dense ``LlamaMLP``.

Family differences (transformers 5.24's modeling code):

* **Qwen3-MoE** (``qwen3_moe``): q/k RMSNorm per head; router softmax over all experts in
  fp32, top-k, divided by their sum only if ``norm_topk_prob``, then rounded to the
  activation dtype; experts ``mlp.experts.{e}.gate_proj|up_proj|down_proj``.
* **Mixtral** (``mixtral``): no q/k norm; router softmax, top-k, always renormalised (equal
  to a softmax over the top-k logits), weights kept fp32; a sliding window on every layer
  when ``sliding_window`` is set; checkpoint names ``block_sparse_moe.experts.{e}.w1|w3|w2``
  (gate, up, down), read here as ``mlp``.

Shared experts (Qwen2-MoE, DeepSeek) and grouped top-k routing are refused by name.

**The decode chain** (GPU, one rank, decode-sized steps: ``MoeLlamaForCausalLM.forward``).
A layer's input RMSNorm is a per-row scalar times a weight: ``W (w * s / rms(s))`` is
``(W (w * s)) / rms(s)``. So the experts' last kernel, which already writes each token's
weighted sum, adds the residual stream there and also stores ``stream * w_next`` (the
next layer's norm weight); q/k/v project that, and the q/k prep kernel, which reads q/k/v
anyway, computes ``1/rms`` of the stream row and applies it. A layer is then six launches
(qkv, prep, attention, o, the fused router with the post-attention norm, the two expert
kernels less one): the norm kernel's ~2 µs (and its gap) go, the arithmetic equal up to
rounding (the norm is finished after the projection, not before). ``VT_MOE_DECODE_CHAIN``
turns it off.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from vtllm import envs
from vtllm.worker.attention import AttentionMetadata
from vtllm.worker.distributed import TPGroup
from vtllm.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from vtllm.worker.layers.moe import RouterSpec, SparseMoeBlock, expert_checkpoint_name
from vtllm.worker.layers.moe_router import RouterTiles
from vtllm.worker.layers.norm import RMSNorm
from vtllm.worker.layers.rotary import RotaryEmbedding
from vtllm.worker.models.llama import (
    KVCache,
    LlamaArgs,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
)

logger = logging.getLogger(__name__)

# model_type → checkpoint projection names of one expert → gate / up / down
_EXPERT_PROJECTIONS = {
    "qwen3_moe": {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"},
    "mixtral": {"w1": "gate", "w3": "up", "w2": "down"},
}
# config keys of MoE variants this decoder does not implement
_UNSUPPORTED_KEYS = ("shared_expert_intermediate_size", "n_shared_experts", "topk_group")


@dataclass(frozen=True)
class MoeLlamaArgs(LlamaArgs):
    """``LlamaArgs`` plus the experts: count, width, routing, and which layers have them."""

    model_type: str
    num_experts: int
    moe_intermediate_size: int
    router: RouterSpec
    moe_layers: tuple[bool, ...]  # per layer: experts (True) or the dense LlamaMLP

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> MoeLlamaArgs:
        """Raises ValueError for missing keys, NotImplementedError for MoE variants (shared
        experts, grouped routing) and model types this decoder does not implement."""
        model_type = cfg.get("model_type")
        if model_type not in _EXPERT_PROJECTIONS:
            raise NotImplementedError(
                f"model_type {model_type!r} is not a supported MoE family "
                f"(supported: {', '.join(_EXPERT_PROJECTIONS)})"
            )
        unsupported = [key for key in _UNSUPPORTED_KEYS if cfg.get(key)]
        if unsupported:
            raise NotImplementedError(f"MoE config keys {unsupported} are not supported")
        base = {f.name: getattr(LlamaArgs.from_hf_config(cfg), f.name) for f in fields(LlamaArgs)}
        num_layers = base["num_layers"]
        attention_bias = bool(cfg.get("attention_bias", False))
        # released files say num_experts (Qwen3-MoE) or num_local_experts (Mixtral);
        # transformers 5 writes num_local_experts for both
        num_experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
        if model_type == "qwen3_moe":
            sparse_step = cfg.get("decoder_sparse_step", 1)
            dense_layers = set(cfg.get("mlp_only_layers") or [])
            moe_layers = tuple(
                i not in dense_layers and num_experts > 0 and (i + 1) % sparse_step == 0
                for i in range(num_layers)
            )
            window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
            router = RouterSpec(
                top_k=cfg.get("num_experts_per_tok", 8),
                renormalize=bool(cfg.get("norm_topk_prob", False)),
                round_weights=True,
            )
            base |= dict(
                qk_norm=True,
                qkv_bias=attention_bias,
                o_bias=attention_bias,
                sliding_windows=(window,) * num_layers,
            )
            width = cfg.get("moe_intermediate_size", 768)
        else:  # mixtral: every layer has experts as wide as intermediate_size
            moe_layers = (True,) * num_layers
            router = RouterSpec(top_k=cfg.get("num_experts_per_tok", 2), renormalize=True)
            width = cfg["intermediate_size"]
        if moe_layers and any(moe_layers) and not 0 < router.top_k <= num_experts:
            raise ValueError(
                f"num_experts_per_tok ({router.top_k}) must be in [1, {num_experts}] "
                "(the number of experts)"
            )
        return cls(
            **base,
            model_type=model_type,
            num_experts=num_experts,
            moe_intermediate_size=width,
            router=router,
            moe_layers=moe_layers,
        )


class MoeLlamaDecoderLayer(LlamaDecoderLayer):
    """``LlamaDecoderLayer`` (same forward) whose ``mlp`` may be a ``SparseMoeBlock``;
    built without the parent's ``__init__`` so no dense MLP is ever allocated for it."""

    def __init__(self, args: MoeLlamaArgs, tp: TPGroup, layer_idx: int) -> None:
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = LlamaAttention(args, tp, layer_idx)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        if args.moe_layers[layer_idx]:
            self.mlp = SparseMoeBlock(
                args.hidden_size,
                args.num_experts,
                args.moe_intermediate_size,
                args.router,
                tp,
                args.hidden_act,
            )
        else:
            self.mlp = LlamaMLP(args, tp)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]: the previous layer's output
        residual: torch.Tensor | None,  # [num_tokens, hidden]; None before the first layer
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``LlamaDecoderLayer.forward``; at decode on a GPU the post-attention norm runs
        inside the MoE router's kernel (``SparseMoeBlock.forward_after_norm``)."""
        mlp, norm = self.mlp, self.post_attention_layernorm
        tiles = mlp.fold_norm_tiles(x, norm) if isinstance(mlp, SparseMoeBlock) else None
        if tiles is None:
            return super().forward(x, residual, positions, rotary, kv_cache, metadata)
        h, residual = self.input_layernorm.add_and_norm(x, residual)
        h = self.self_attn(h, positions, rotary, kv_cache, metadata)
        return mlp.forward_after_norm(h, residual, norm, tiles)

    def forward_chained(
        self,
        stream: torch.Tensor,  # [num_tokens, hidden]: the residual stream into the layer
        scaled: torch.Tensor,  # [num_tokens, hidden]: stream * input_layernorm.weight
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        tiles: RouterTiles,  # the fused router's (SparseMoeBlock.fold_norm_tiles)
        next_norm_weight: torch.Tensor | None,  # [hidden]: the next layer's input norm's
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer in the decode chain (module docstring): ``(stream after the layer,
        that stream * next_norm_weight or None)``. Only where ``chain_eligible``."""
        attn = self.self_attn
        o = attn.prep_and_attend(
            attn.qkv_proj(scaled), positions, rotary, kv_cache, metadata, stream,
            self.input_layernorm.eps,
        )  # fmt: skip  # [num_tokens, heads, head_dim]
        o = attn.o_proj(o.reshape(stream.shape[0], -1))  # [num_tokens, hidden]
        return self.mlp.forward_into_stream(
            o, stream, self.post_attention_layernorm, tiles, next_norm_weight
        )

    def chain_eligible(self) -> str | None:
        """None where ``forward_chained`` computes what ``forward`` does (up to rounding),
        else why not: it needs experts on one rank, Llama-style norms and unbiased q/k/v
        (the bias would land before the norm's 1/rms)."""
        if not isinstance(self.mlp, SparseMoeBlock):
            return "dense MLP layers"
        if self.mlp.experts.tp.size > 1:
            return f"tensor parallel over {self.mlp.experts.tp.size} ranks"
        if any(
            type(norm) is not RMSNorm
            for norm in (self.input_layernorm, self.post_attention_layernorm)
        ):
            return "Gemma-style norms"
        if self.self_attn.qkv_proj.bias is not None:
            return "biased q/k/v projections"
        return None


class MoeLlamaModel(nn.Module):
    def __init__(self, args: MoeLlamaArgs, tp: TPGroup) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(args.vocab_size, args.hidden_size, tp)
        self.layers = nn.ModuleList(
            MoeLlamaDecoderLayer(args, tp, i) for i in range(args.num_layers)
        )
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class MoeLlamaForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM`` (same forward and logits) over ``MoeLlamaModel``."""

    def __init__(self, args: MoeLlamaArgs, tp: TPGroup) -> None:
        nn.Module.__init__(self)
        self.args = args
        self.fused_decode = None  # the parent's forward asks; MoE layers have no chain
        self._chain_why_not: str | None = None  # decided on the first GPU step (forward)
        self._chain_decided = False
        self.model = MoeLlamaModel(args, tp)
        self.lm_head = ParallelLMHead(args.vocab_size, args.hidden_size, tp)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(args.head_dim, args.max_position_embeddings, args.rope)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[KVCache],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """The final hidden states ``[num_tokens, hidden]``: decode-sized GPU steps
        through the decode chain (module docstring), the rest layer by layer."""
        x = self.model.embed_tokens(input_ids)  # [num_tokens, hidden]
        tiles = self._decode_chain_tiles(x)
        if tiles is None:
            return self.run_layers(x, positions, kv_caches, metadata)
        layers = self.model.layers
        stream, scaled = x, x * layers[0].input_layernorm.weight  # the first norm, less 1/rms
        for i, (layer, kv_cache) in enumerate(zip(layers, kv_caches, strict=True)):
            next_weight = layers[i + 1].input_layernorm.weight if i + 1 < len(layers) else None
            stream, scaled = layer.forward_chained(
                stream, scaled, positions, self.rotary, kv_cache, metadata, tiles, next_weight
            )
        return self.model.norm(stream)  # [num_tokens, hidden]

    def _decode_chain_tiles(self, x: torch.Tensor) -> RouterTiles | None:
        """The fused router's tiles where this step runs the decode chain, else None:
        off a GPU, with ``VT_MOE_DECODE_CHAIN=off``, where a layer is not
        ``chain_eligible``, past the experts' decode path (``num_tokens * top_k >
        num_experts``) or where the fused router does not run."""
        if not x.is_cuda:
            return None
        if not self._chain_decided:
            self._chain_decided = True
            why_not = "VT_MOE_DECODE_CHAIN=off" if envs.VT_MOE_DECODE_CHAIN == "off" else None
            for layer in self.model.layers:
                why_not = why_not or layer.chain_eligible()
            self._chain_why_not = why_not
            logger.info(
                "MoE decode chain (the input norm folded into the experts' last kernel and "
                "the q/k prep): %s", "on" if why_not is None else f"off ({why_not})",
            )  # fmt: skip
        if self._chain_why_not is not None:
            return None
        first = self.model.layers[0]
        if x.shape[0] * self.args.router.top_k > self.args.num_experts:
            return None
        return first.mlp.fold_norm_tiles(x, first.post_attention_layernorm)

    def map_checkpoint_name(self, name: str) -> tuple[str, tuple[int, str] | None] | None:
        """The loader's hook for names ``packed_modules_mapping`` cannot express: one
        expert's projection → ``(w13_weight | w2_weight, (expert, kind))``; Mixtral's
        ``block_sparse_moe.gate.weight`` → ``(mlp.gate.weight, None)``; None otherwise."""
        renamed = name.replace(".block_sparse_moe.", ".mlp.")
        expert = expert_checkpoint_name(renamed, _EXPERT_PROJECTIONS[self.args.model_type])
        if expert is not None:
            return expert
        return (renamed, None) if renamed != name else None
