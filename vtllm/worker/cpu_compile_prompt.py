"""A compiled prompt step for CPU serving: each Llama layer's work before and after
attention as two ``torch.compile`` graphs over any number of tokens, attention eager
between them.

A prefill chunk is bound by its matrix products and its attention, but the eager ops
around them (RMSNorm, rotary, SiLU-and-multiply, residual adds, casts: ~100 per layer,
each a pass over ``[num_tokens, hidden]`` in memory) were a fifth of a 2,048-token
prefill of the embedded model on two cores. Inductor fuses them into a few loops a layer;
the products stay library calls (oneDNN, under ``cpu_precision.bf16_products`` when
that is on), and attention with its KV write stays the eager code of ``attention.py``
(prefix chunks, masks, windows: nothing there to fuse)::

    embed ─▶ [pre_attention]* ─▶ write KV, paged_attention ─▶ [post_attention]* ─▶ ... ─▶ norm
             * compiled, one graph each for every layer (their parameters are graph inputs)

The token count is dynamic (one graph for 2 or more tokens; a one-token prompt step
runs eagerly). Used for steps that compute prompt tokens (``StepBatch.has_prompt_tokens``),
where quantised CPU linears take their dense weights (``cpu_quant.prompt_step``), the
one setting the graphs are warmed up for. The same switch as the compiled decode step
(``cpu_compile.compile_reason``: ``VT_CPU_COMPILE``, ``--enforce-eager``) turns it on.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from vtllm import envs
from vtllm.worker.attention import AttentionMetadata, build_attention_metadata
from vtllm.worker.layers.cpu_quant import prompt_step
from vtllm.worker.layers.rotary import RotaryEmbedding
from vtllm.worker.models.llama import KVCache, LlamaDecoderLayer, LlamaForCausalLM

logger = logging.getLogger(__name__)

WARM_UP_TOKENS = 32  # any size >= 2 compiles the one dynamic graph


def _pre_attention(
    layer: LlamaDecoderLayer,
    x: torch.Tensor,  # [num_tokens, hidden]
    residual: torch.Tensor,  # [num_tokens, hidden]; zeros before the first layer
    positions: torch.Tensor,  # [num_tokens]
    rotary: RotaryEmbedding,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return layer.pre_attention(x, residual, positions, rotary)


def _post_attention(
    layer: LlamaDecoderLayer,
    o: torch.Tensor,  # [num_tokens, heads * head_dim]
    residual: torch.Tensor,  # [num_tokens, hidden]
) -> tuple[torch.Tensor, torch.Tensor]:
    return layer.post_attention(o, residual)


class CompiledPrompt:
    """The compiled prompt step of one ``LlamaForCausalLM``."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(envs.VT_CACHE_DIR / "inductor"))
        self.model = model
        self._pre = torch.compile(_pre_attention, dynamic=True)
        self._post = torch.compile(_post_attention, dynamic=True)

    def __call__(
        self,
        input_ids: torch.Tensor,  # [num_tokens], at least 2
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[KVCache],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Final hidden states ``[num_tokens, hidden]``, as ``model.forward`` gives them."""
        model = self.model
        num_tokens = input_ids.shape[0]
        x = model.model.embed_tokens(input_ids)  # [num_tokens, hidden]
        residual = torch.zeros_like(x)
        for layer, kv_cache in zip(model.model.layers, kv_caches, strict=True):
            q, k, v, residual = self._pre(layer, x, residual, positions, model.rotary)
            o = layer.self_attn.write_and_attend(q, k, v, kv_cache, metadata)
            x, residual = self._post(layer, o.reshape(num_tokens, -1), residual)
        return model.model.norm(x, residual)[0]  # [num_tokens, hidden]

    def warm_up(
        self, kv_caches: list[KVCache], block_size: int, chunk_dtype: torch.dtype | None
    ) -> None:
        """Compile both graphs: one prompt step of ``WARM_UP_TOKENS`` tokens in blocks
        0.. (which the engine overwrites before reading); raises what the compiler raises."""
        num_blocks = -(-WARM_UP_TOKENS // block_size)
        metadata = build_attention_metadata(
            [WARM_UP_TOKENS],
            [WARM_UP_TOKENS],
            [list(range(num_blocks))],
            block_size,
            torch.device("cpu"),
            chunk_dtype=chunk_dtype,
        )
        with torch.inference_mode(), prompt_step(True):
            tokens = torch.zeros(WARM_UP_TOKENS, dtype=torch.int64)
            self(tokens, torch.arange(WARM_UP_TOKENS), kv_caches, metadata)


def try_compile_prompt(
    model: LlamaForCausalLM,
    kv_caches: list[KVCache],
    block_size: int,
    chunk_dtype: torch.dtype | None,
) -> CompiledPrompt | None:
    """The compiled prompt step, warmed up (its time logged), or None (eager) when the
    compile fails (logged). The caller decides whether it is wanted
    (``cpu_compile.compile_reason``)."""
    started = time.monotonic()
    compiled = CompiledPrompt(model)
    try:
        compiled.warm_up(kv_caches, block_size, chunk_dtype)
    except Exception as e:  # noqa: BLE001 - whatever the compiler raises: serve eagerly
        first_line = str(e).splitlines()[0] if str(e) else ""
        logger.warning(
            "torch.compile of the CPU prompt step failed after %.1fs, prefilling eagerly: %s: %s",
            time.monotonic() - started,
            type(e).__name__,
            first_line,
        )
        return None
    logger.info("compiled the CPU prompt step in %.1fs", time.monotonic() - started)
    return compiled
