"""A CPU worker's faster steps, chosen per step by the model runner: the native decode step
(``cpu_native_decode.py``) for decode-only batches of up to ``MAX_NATIVE_ROWS``
requests, the compiled decode step (``cpu_compile.py``) for the other decode-only
batches, the compiled prompt step (``cpu_compile_prompt.py``) for steps that compute
prompt tokens. Each is None where it does not apply; a compiled step that raises is
logged once and dropped (eager from then on).

A step that both prefills and decodes, on a model with quantised linears, is split in two
(``split_mixed_step``): its decode rows run as a decode-only step would (the quantised
weights, the native step), its prompt rows through the prompt path (the dense weights).
A token's numbers then depend on whether it decodes, not on what shares its step: a
seeded request repeats its output whether its first decode meets another request's
prompt or not (in one step, the dense weights read for the prompt would decode it).

Short prompt chunks run on the native step too, one row a token (``short_chunks``): a
chunk of at most ``NATIVE_PROMPT_TOKENS`` tokens whose attention work (tokens x keys)
stays within ``NATIVE_PROMPT_WORK``, while the step's native rows stay within
``MAX_NATIVE_TOKENS``. At a few dozen rows the int4 product runs ~2.5x the dense float32
one (docs/BENCHMARKS.md), so a chat turn's new tokens after a cached system prompt, or
eight users' short prompts, prefill at the decode step's speed; the rows' attention
walks the cache row by row, which is why long chunks (and long contexts) stay on the
dense prompt path. Such a chunk's numbers are the native decode's (int8 activations);
whether a chunk is short depends on how the scheduler cut the prompt, which a busy step
can change (docs/USAGE.md, "Seeds").
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from vtllm.worker.attention import AttentionMetadata
from vtllm.worker.block_table import token_layout
from vtllm.worker.cpu_compile import CompiledDecode, compile_reason, try_compile
from vtllm.worker.cpu_compile_prompt import CompiledPrompt, try_compile_prompt
from vtllm.worker.cpu_native_decode import (
    MAX_NATIVE_ROWS,
    MAX_NATIVE_TOKENS,
    NativeDecode,
    try_native_decode,
)
from vtllm.worker.input_batch import StepBatch
from vtllm.worker.layers.cpu_quant import MAX_QUANTIZED_ROWS
from vtllm.worker.models.llama import KVCache

logger = logging.getLogger(__name__)

Forward = Callable[[StepBatch], tuple[torch.Tensor, torch.Tensor]]


NATIVE_PROMPT_TOKENS = 64  # the longest prompt chunk the native step takes
NATIVE_PROMPT_WORK = 32768  # its most tokens x keys (e.g. 64 tokens after 448 cached)


def short_chunks(batch: StepBatch) -> np.ndarray:
    """``[num_reqs] bool``: prompt chunks the native step takes (see the module
    docstring)."""
    return (
        batch.prompt_rows
        & (batch.query_lens <= NATIVE_PROMPT_TOKENS)
        & (batch.query_lens * batch.seq_lens <= NATIVE_PROMPT_WORK)
    )


def rows_to_split(batch: StepBatch, quantised: bool, native: bool = False) -> np.ndarray | None:
    """``[num_reqs] bool``, the rows of a step that also computes prompt tokens that run on
    the quantised weights — its decodes, and with ``native`` (the native step is set up)
    its short prompt chunks — when they should run apart from the rest (``quantised``:
    the model's linears are; see the module docstring); else None. All True: the whole
    step runs on the native step. More than ``MAX_QUANTIZED_ROWS`` decode rows read the
    dense weights in any step: no split."""
    if not quantised or not batch.has_prompt_tokens:
        return None
    decoding = ~batch.prompt_rows & (batch.query_lens == 1)
    if int(decoding.sum()) > MAX_QUANTIZED_ROWS:
        return None
    rows = decoding
    if native:
        with_chunks = decoding | short_chunks(batch)
        if int(batch.query_lens[with_chunks].sum()) <= MAX_NATIVE_TOKENS:
            rows = with_chunks
    return rows if rows.any() else None


def split_mixed_step(
    batch: StepBatch, decoding: np.ndarray, forward: Forward
) -> tuple[torch.Tensor, torch.Tensor]:
    """``forward`` (the model runner's step) on the rows where ``decoding [num_reqs]`` holds
    and then on the rest, joined back: (logits ``[num_sampling, vocab]`` in the step's
    sampling order, hidden ``[num_tokens, hidden]`` in its token order). The previous
    step's ids must already be fed into ``batch.input_ids``."""
    decode_part, decode_tokens = batch.subset(decoding)
    prompt_part, prompt_tokens = batch.subset(~decoding)
    decode_logits, decode_hidden = forward(decode_part)  # [k, vocab], [k, hidden]
    prompt_logits, prompt_hidden = forward(prompt_part)
    sampled_by_decode = torch.from_numpy(decoding[np.array(batch.sample_rows, dtype=np.int64)])
    logits = prompt_logits.new_empty((len(batch.sample_rows), prompt_logits.shape[1]))
    logits[sampled_by_decode] = decode_logits.to(logits.dtype)
    logits[~sampled_by_decode] = prompt_logits
    hidden = prompt_hidden.new_empty((batch.num_tokens, prompt_hidden.shape[1]))
    hidden[torch.from_numpy(decode_tokens)] = decode_hidden[: len(decode_tokens)].to(hidden.dtype)
    hidden[torch.from_numpy(prompt_tokens)] = prompt_hidden
    return logits, hidden


class CpuSteps:
    """The native and compiled steps of one model over its KV cache (set up after
    ``ModelRunner.init_kv_cache``, dropped by the next)."""

    def __init__(self) -> None:
        self.native_decode: NativeDecode | None = None
        self.compiled_decode: CompiledDecode | None = None
        self.compiled_prompt: CompiledPrompt | None = None

    def use_native_decode(
        self, model: nn.Module, kv_caches: list[KVCache], block_size: int, is_gpu: bool
    ) -> bool:
        """Set up the native decode step where it applies (logged either way)."""
        self.native_decode = try_native_decode(model, kv_caches, block_size, is_gpu)
        return self.native_decode is not None

    def compile(
        self,
        model: nn.Module,
        kv_caches: list[KVCache],
        block_size: int,
        max_num_seqs: int,
        is_gpu: bool,
        enforce_eager: bool,
        chunk_dtype: torch.dtype | None,
    ) -> bool:
        """Compile and warm up the decode step (the batch sizes the native step does not
        serve) and the prompt step, unless they do not apply or fail (logged). True when
        the decode step is compiled."""
        self.compiled_decode = try_compile(
            model, kv_caches, block_size, max_num_seqs, is_gpu, enforce_eager,
            native_rows=MAX_NATIVE_ROWS if self.native_decode is not None else 0,
        )  # fmt: skip
        if compile_reason(model, is_gpu, enforce_eager) is None:
            self.compiled_prompt = try_compile_prompt(model, kv_caches, block_size, chunk_dtype)
        return self.compiled_decode is not None

    def native_rows(
        self, batch: StepBatch, input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits of the sampling rows, hidden [num_tokens, hidden])`` of a step of
        decodes and short prompt chunks (``rows_to_split`` gave all its rows) through the
        native step, one row a token. ``input_ids [num_tokens]``: the previous step's
        tokens fed in."""
        assert self.native_decode is not None
        _, token_reqs, _ = token_layout(batch.query_lens, batch.seq_lens, batch.num_tokens)
        return self.native_decode(
            input_ids, batch.positions, batch.positions + 1,
            batch.block_tables()[token_reqs], batch.slot_mapping, batch.logits_indices,
        )  # fmt: skip

    def decode(
        self,
        model: nn.Module,
        batch: StepBatch,
        input_ids: torch.Tensor,  # [num_reqs], the previous step's tokens fed in
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(logits of the sampling rows, hidden [num_reqs, hidden])`` of a decode-only
        batch through the native or the compiled step; None when neither takes it."""
        rows = None
        if len(batch.sample_rows) != batch.num_reqs:
            rows = torch.from_numpy(batch.logits_indices)
        if self.native_decode is not None and batch.num_reqs <= MAX_NATIVE_ROWS:
            logits, hidden = self.native_decode(
                input_ids, batch.positions, batch.seq_lens, batch.block_tables(),
                batch.slot_mapping,
            )  # fmt: skip
            return (logits if rows is None else logits.index_select(0, rows)), hidden
        if self.compiled_decode is None:
            return None
        try:
            hidden = self.compiled_decode(
                input_ids,
                torch.from_numpy(batch.positions),
                batch.seq_lens,
                batch.block_tables(),
                batch.slot_mapping,
            )  # [num_reqs, hidden]
        except Exception:  # the eager forward rewrites the same KV slots with its own values
            logger.exception("the compiled CPU decode step failed; serving eagerly from now on")
            self.compiled_decode = None
            return None
        return model.compute_logits(
            hidden if rows is None else hidden.index_select(0, rows)
        ), hidden

    def prompt(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[KVCache],
        metadata: AttentionMetadata,
    ) -> torch.Tensor | None:
        """Hidden states ``[num_tokens, hidden]`` of a step of at least two prompt tokens
        through the compiled prompt step; None when there is none (or it just failed)."""
        if self.compiled_prompt is None or input_ids.shape[0] < 2:
            return None
        try:
            return self.compiled_prompt(input_ids, positions, kv_caches, metadata)
        except Exception:
            logger.exception("the compiled CPU prompt step failed; prefilling eagerly from now on")
            self.compiled_prompt = None
            return None
