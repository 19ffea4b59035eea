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
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from vtllm.worker.attention import AttentionMetadata, paged_attention, write_kv_cache
from vtllm.worker.distributed import TPGroup, divide
from vtllm.worker.kv_cache_dtype import register_kv_scales
from vtllm.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from vtllm.worker.layers.linear import ColumnParallelLinear, RowParallelLinear
from vtllm.worker.layers.norm import RMSNorm
from vtllm.worker.layers.rotary import RotaryEmbedding, rope_parameters

if TYPE_CHECKING:
    from vtllm.worker.kernels.decode_prep import DecodePrep
    from vtllm.worker.layers.small_batch import FusedDecodeTiles

KVCache = tuple[torch.Tensor, torch.Tensor]  # K, V: [num_blocks, block_size, kv_heads, head_dim]

# HF ``hidden_act`` / ``hidden_activation`` names → (Triton kernel name in
# ``kernels/activation.py`` or None, plain-torch gate activation)
ACTIVATIONS: dict[str, tuple[str | None, Callable[[torch.Tensor], torch.Tensor]]] = {
    "silu": ("silu_and_mul", F.silu),
    "gelu_pytorch_tanh": ("gelu_tanh_and_mul", partial(F.gelu, approximate="tanh")),
    "gelu": (None, F.gelu),
}


def act_and_mul(name: str, x: torch.Tensor) -> torch.Tensor:
    """``act(x[:, :d]) * x[:, d:]`` for a fused gate|up output ``[num_tokens, 2 * d]``:
    one Triton kernel on a GPU, its reference elsewhere (both fp32, rounded once)."""
    kernel_name, torch_act = ACTIVATIONS[name]
    if kernel_name is None:
        gate, up = x.chunk(2, dim=-1)
        return torch_act(gate) * up
    from vtllm.worker.kernels import activation as kernels

    kernel = getattr(kernels, kernel_name if x.is_cuda else kernel_name + "_ref")
    return kernel(x)  # [num_tokens, d]


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
        register_kv_scales(self)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        positions: torch.Tensor,  # [num_tokens]
        rotary: RotaryEmbedding,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q_size = self.num_heads * self.head_dim
        qkv = self.qkv_proj(x)  # [num_tokens, q_size + 2 * kv_size]
        if qkv.is_cuda:  # q/k norm, rope and the cache write in one kernel (or in attention's)
            o = self.prep_and_attend(qkv, positions, rotary, kv_cache, metadata)
        else:
            q, k, v = self.split_and_rotate(qkv, positions, rotary)
            o = self.write_and_attend(q, k, v, kv_cache, metadata)  # [num_tokens, heads, hd]
        return self.o_proj(o.reshape(num_tokens, q_size))  # [num_tokens, hidden]

    def prep_and_attend(
        self,
        qkv: torch.Tensor,  # [num_tokens, q_size + 2 * kv_size]
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        input_stream: torch.Tensor | None = None,  # [num_tokens, hidden]
        input_eps: float = 1e-6,
    ) -> torch.Tensor:
        """On a GPU, from the projection to attention's output ``[num_tokens, heads,
        head_dim]``: q/k norm, rope and the cache write (``kernels/qkv_prep.py``'s work,
        inside the attention kernel on decode-only steps: ``worker/attention.py``).
        ``input_stream``: qkv is the projection of that stream times the input norm's
        weight, and the norm's 1/rms is applied here (``models/moe_llama.py``)."""
        prep = self._decode_prep(positions, rotary, metadata, input_stream, input_eps)
        return self.write_and_attend(qkv, None, None, kv_cache, metadata, prep)

    def write_and_attend(
        self,
        q: torch.Tensor,  # [num_tokens, heads, head_dim]
        k: torch.Tensor | None,  # [num_tokens, kv_heads, head_dim]; None: already written
        v: torch.Tensor | None,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        prep: DecodePrep | None = None,  # q is the projection (``prep_and_attend``)
    ) -> torch.Tensor:
        """The step's k and v into the cache at its slots, then paged attention of q:
        ``[num_tokens, heads, head_dim]``. Also the middle of the compiled CPU prompt
        step (``cpu_compile_prompt.py``)."""
        k_cache, v_cache = kv_cache
        if k is not None and v is not None:
            write_kv_cache(
                k, v, k_cache, v_cache, metadata.slot_mapping, self.k_scale, self.v_scale
            )
        return paged_attention(
            q,
            k_cache,
            v_cache,
            metadata,
            self.scale,
            self.sliding_window,
            self.k_scale,
            self.v_scale,
            prep,
        )

    def split_and_rotate(
        self,
        qkv: torch.Tensor,  # [num_tokens, q_size + 2 * kv_size]: qkv_proj's output
        positions: torch.Tensor,  # [num_tokens]
        rotary: RotaryEmbedding,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``[num_tokens, heads, head_dim]``, k and v ``[num_tokens, kv_heads, head_dim]``:
        q/k normed (Qwen3) and rotated (views of ``qkv``, rotated in place). The CPU
        path's prologue; also traced by the compiled CPU decode step (``cpu_compile.py``)."""
        num_tokens = qkv.shape[0]
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [num_tokens, heads, hd]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [num_tokens, kv_heads, hd]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        rotary(positions, q, k)  # in place
        return q, k, v

    def _decode_prep(
        self,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        metadata: AttentionMetadata,
        input_stream: torch.Tensor | None = None,
        input_eps: float = 1e-6,
    ) -> DecodePrep:
        """This layer's ``kernels/qkv_prep.py`` inputs besides qkv and the caches."""
        from vtllm.worker.kernels.decode_prep import DecodePrep

        norm = self.q_norm
        return DecodePrep(
            self.num_heads, positions, rotary.cos_sin_cache, metadata.slot_mapping,
            q_norm=None if norm is None else norm.weight,
            k_norm=None if norm is None else self.k_norm.weight,
            eps=1e-6 if norm is None else norm.eps,
            gemma_norm=norm is not None and norm.gemma,
            weight_offset=1.0 if norm is None else norm.weight_offset,
            input_stream=input_stream, input_eps=input_eps,
        )  # fmt: skip


class LlamaMLP(nn.Module):
    def __init__(self, args: LlamaArgs, tp: TPGroup) -> None:
        super().__init__()
        size = args.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(args.hidden_size, [size, size], args.mlp_bias, tp)
        self.down_proj = RowParallelLinear(size, args.hidden_size, args.mlp_bias, tp)
        self.hidden_act = args.hidden_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * inter / tp]
        return self.down_proj(act_and_mul(self.hidden_act, gate_up))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, args: LlamaArgs, tp: TPGroup, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = LlamaAttention(args, tp, layer_idx)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
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
        """``(mlp output, residual stream)``: their sum is the layer's output, added
        inside the next norm (one fused kernel on a GPU)."""
        h, residual = self.input_layernorm.add_and_norm(x, residual)
        h = self.self_attn(h, positions, rotary, kv_cache, metadata)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual

    def pre_attention(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]: the previous layer's output
        residual: torch.Tensor,  # [num_tokens, hidden]; zeros before the first layer
        positions: torch.Tensor,  # [num_tokens]
        rotary: RotaryEmbedding,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``forward`` up to attention on a CPU: ``(q, k, v, residual stream)``. With
        ``residual`` zeros (exactly ``x + 0 = x``) the first layer needs no branch."""
        h, residual = self.input_layernorm(x, residual)
        attn = self.self_attn
        q, k, v = attn.split_and_rotate(attn.qkv_proj(h), positions, rotary)
        return q, k, v, residual

    def post_attention(
        self,
        o: torch.Tensor,  # [num_tokens, heads * head_dim]: attention's output
        residual: torch.Tensor,  # [num_tokens, hidden]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` after attention: ``(mlp output, residual stream)``."""
        h, residual = self.post_attention_layernorm(self.self_attn.o_proj(o), residual)
        return self.mlp(h), residual

    def forward_fused(
        self,
        x: torch.Tensor,  # [num_tokens <= 4, hidden]: the residual stream, whole
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        tiles: FusedDecodeTiles,
    ) -> torch.Tensor:
        """``forward`` for a few tokens in six kernels, the norms, the activation and the
        residual adds folded into the GEMVs (``kernels/gemv.py``): returns the layer's
        output already added to the stream, ``[num_tokens, hidden]``. Only where
        ``fused_decode_eligible`` and start-up timing chose it (``layers/small_batch.py``)."""
        attn = self.self_attn
        o = attn.prep_and_attend(self.fused_qkv(x, tiles), positions, rotary, kv_cache, metadata)
        return self.fused_post_attention(o.reshape(x.shape[0], -1), x, tiles)

    def fused_qkv(self, x: torch.Tensor, tiles: FusedDecodeTiles) -> torch.Tensor:
        """``qkv_proj(input_layernorm(x))`` in one GEMV: ``[num_tokens, q_size + 2 * kv_size]``."""
        from vtllm.worker.kernels.gemv import gemv

        norm = self.input_layernorm
        weight = self.self_attn.qkv_proj.weight
        return gemv(x, weight, tiles.qkv, norm_weight=norm.weight, norm_eps=norm.eps, pdl=tiles.pdl)

    def fused_post_attention(
        self,
        o: torch.Tensor,  # [num_tokens, heads * head_dim]: attention's output
        x: torch.Tensor,  # [num_tokens, hidden]: the stream the layer started from
        tiles: FusedDecodeTiles,
    ) -> torch.Tensor:
        """o projection + residual, norm + gate/up, SwiGLU + down + residual: three GEMVs,
        the stream after the layer ``[num_tokens, hidden]``."""
        from vtllm.worker.kernels.gemv import gemv

        norm, mlp = self.post_attention_layernorm, self.mlp
        h = gemv(o, self.self_attn.o_proj.weight, tiles.o, residual=x, pdl=tiles.pdl)
        gate_up = gemv(
            h, mlp.gate_up_proj.weight, tiles.gate_up, norm_weight=norm.weight,
            norm_eps=norm.eps, pdl=tiles.pdl,
        )  # fmt: skip
        return gemv(
            gate_up, mlp.down_proj.weight, tiles.down, silu_and_mul=True, residual=h,
            pdl=tiles.pdl,
        )  # fmt: skip

    def fused_decode_eligible(self) -> str | None:
        """None when ``forward_fused`` computes exactly what ``forward`` does here, else
        why not: it needs one rank (no all-reduce between a projection and its residual),
        no biases, SwiGLU, Llama-style norms and plain 16-bit weights on a GPU."""
        from vtllm.worker.layers.small_batch import GemvMethod

        attn, mlp = self.self_attn, self.mlp
        if type(mlp) is not LlamaMLP:
            return f"{type(mlp).__name__} layers"
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if attn.o_proj.tp.size > 1:
            return f"tensor parallel over {attn.o_proj.tp.size} ranks"
        if any(linear.bias is not None for linear in linears):
            return "biased projections"
        if mlp.hidden_act != "silu":
            return f"activation {mlp.hidden_act}"
        if any(
            type(norm) is not RMSNorm
            for norm in (self.input_layernorm, self.post_attention_layernorm)
        ):
            return "Gemma-style norms"
        for linear in linears:
            weight = linear.weight
            if weight.dtype not in (torch.bfloat16, torch.float16) or not weight.is_cuda:
                return f"{str(weight.dtype).removeprefix('torch.')} weights on {weight.device.type}"
            if linear.linear_method is not None and not isinstance(
                linear.linear_method, GemvMethod
            ):
                return f"{type(linear.linear_method).__name__} layers"
        return None


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
        # steps of up to 4 tokens through LlamaDecoderLayer.forward_fused (set at start-up
        # by layers/small_batch.py where timing says it pays)
        self.fused_decode: FusedDecodeTiles | None = None
        self.model = LlamaModel(args, tp)
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
        x = self.model.embed_tokens(input_ids)  # [num_tokens, hidden]
        tiles = self.fused_decode
        if tiles is not None and x.shape[0] <= tiles.max_rows:
            for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
                x = layer.forward_fused(x, positions, self.rotary, kv_cache, metadata, tiles)
            return self.model.norm(x)  # [num_tokens, hidden]
        return self.run_layers(x, positions, kv_caches, metadata)

    def run_layers(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]: the embeddings
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """The decoder layers, each through its ``forward``, and the final norm:
        ``[num_tokens, hidden]``."""
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, positions, self.rotary, kv_cache, metadata)
        return self.model.norm(x, residual)[0]  # [num_tokens, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden).float()  # [num_rows, vocab]
