"""Runs one rank's model over ``SchedulerOutput`` steps and samples (rank 0 reports).

Flow of ``execute``::

    SchedulerOutput ─ RequestStates.update (deltas into the persistent block table)
        ─ build_step (host arrays, vectorised)
        ─ to device ─ model.forward (writes KV, attends) ─ hidden[last tokens of samplers]
        ─ compute_logits ─ Sampler ─ ModelRunnerOutput

Async scheduling: the sampled ids of each step stay on the device for the next one
(``input_batch.py`` says where they go), and ``execute(step, defer_output=True)`` returns
a ``DeferredOutput`` at once: the ids are copied to the host without blocking (pinned
memory, an event after the copy), so nothing in the step waits for the device; the
worker loop resolves it when the event has passed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from vtllm import envs
from vtllm.protocol.limits import effective_temperature
from vtllm.protocol.messages import ModelRunnerOutput, SamplingParams, SchedulerOutput
from vtllm.worker.attention import (
    attention_metadata,
    build_attention_metadata,
)
from vtllm.worker.cpu_compile import has_quantised_linears
from vtllm.worker.cpu_precision import bf16_products, choose_bf16_prefill
from vtllm.worker.cpu_steps import CpuSteps, rows_to_split, split_mixed_step
from vtllm.worker.decode_graphs import DecodeGraphs, capture_sizes
from vtllm.worker.distributed import TPGroup
from vtllm.worker.grammar import GrammarCompilerService, StructuredOutputs
from vtllm.worker.input_batch import RequestStates, StepBatch
from vtllm.worker.layers.cpu_quant import QUANTIZATIONS as CPU_QUANTIZATIONS
from vtllm.worker.layers.cpu_quant import prompt_step, quantize_for_cpu
from vtllm.worker.layers.fp8 import finish_fp8, prepare_fp8_checkpoint
from vtllm.worker.loader.hf_config import eos_token_ids as read_eos_token_ids
from vtllm.worker.loader.hf_config import load_hf_config
from vtllm.worker.loader.host_memory import HostPeak, HostPeakWindow
from vtllm.worker.loader.quant_config import resolve_quantization
from vtllm.worker.loader.safetensors_loader import LoadStats, load_safetensors
from vtllm.worker.models import build_model
from vtllm.worker.models.llama import KVCache
from vtllm.worker.platform import Platform, platform_of
from vtllm.worker.pooling import Pooler
from vtllm.worker.runner_output import DeferredOutput, make_output
from vtllm.worker.sampler import (
    Sampler,
    SamplingBatch,
    TokenHistory,
    advance_generator,
    to_device,
)

logger = logging.getLogger(__name__)


class ModelRunner:
    """Owns the model, the KV cache, per-request state and the sampler of one rank."""

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        dtype: torch.dtype,
        vocab_size: int,
        seed: int,
        is_driver: bool = True,
        eos_token_ids: Sequence[int] = (),
        tokenizer_dir: str | Path | None = None,
        kv_cache_dtype: torch.dtype | None = None,
    ) -> None:
        """``is_driver`` (rank 0) samples and builds outputs; other ranks only compute.
        ``eos_token_ids`` (the model's) are held back while a request is under
        ``min_tokens``. ``tokenizer_dir`` (its ``tokenizer.json``) gives structured
        outputs their vocabulary; None = requests with a grammar fail.
        ``kv_cache_dtype``: the cache's element type (``kv_cache_dtype.py``; default
        ``dtype``)."""
        self.model = model
        self.device = device
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype or dtype
        self.vocab_size = vocab_size
        self.is_driver = is_driver
        self.sampler = Sampler(seed, device)
        self.eos_token_ids = list(eos_token_ids)
        self.token_history = TokenHistory(vocab_size, device)  # for penalties
        self.states = RequestStates(self._make_generator)
        self.pooler = Pooler()  # embeddings (pooling requests)
        self.kv_caches: list[KVCache] = []
        self.block_size = 0
        self.attention_backend = attention_backend(device)
        self.decode_graphs: DecodeGraphs | None = None  # set by capture_decode_graphs
        # native / compiled CPU steps: set by use_native_decode and compile_cpu_steps
        self.cpu_steps = CpuSteps()
        self.tokenizer_dir = tokenizer_dir
        self.structured: StructuredOutputs | None = None  # on the driver, at first use
        self.platform = platform_of(device)
        # CPU steps that prefill and decode run as two (cpu_steps.split_mixed_step)
        self.split_mixed_steps = not self.platform.is_gpu and has_quantised_linears(model)
        # prompt steps of a float32 model in bf16 arithmetic (cpu_precision.py)
        self.bf16_prefill = choose_bf16_prefill(self.platform.is_gpu, dtype)
        # the last step's sampled ids, kept on the device for the next step's inputs
        # (async scheduling), and each sampled request's row in it
        self._last_sampled: torch.Tensor | None = None  # [num_sampled] int64
        self._last_sampled_rows: dict[str, int] = {}
        self.tp = TPGroup()  # this rank's group; set by from_model_dir
        # async scheduling under TP: rank 0 broadcasts each step's sampled ids, so that
        # every rank feeds the same ids into the next step (set by the worker)
        self.share_sampled_ids = False
        # set by from_model_dir: host RSS while building + loading, and what was read
        self.load_host_peak: HostPeak | None = None
        self.load_stats: LoadStats | None = None  # None for random (dummy) weights

    @classmethod
    def from_model_dir(
        cls,
        model_dir: str | Path,
        device: torch.device,
        dtype: torch.dtype,
        seed: int,
        tp: TPGroup | None = None,
        load_format: str = "auto",
        max_model_len: int | None = None,
        quantization: str | None = None,
        kv_cache_dtype: torch.dtype | None = None,
        cpu_quantization: str = "none",
    ) -> ModelRunner:
        """Build the model from ``config.json`` and load its safetensors (``load_format``
        ``dummy``: random weights instead, seeded by ``seed``); rank 0 drives.
        ``max_model_len`` beyond the model's ``max_position_embeddings`` (allowed by
        VT_ALLOW_LONG_MAX_MODEL_LEN): the position tables cover it. ``quantization``
        (``--quantization``; None: the checkpoint's own) makes the linears and experts FP8
        (``layers/fp8.py``); ValueError for a method or checkpoint format not supported.
        The runner records the host RSS peak over building and loading
        (``load_host_peak``). ``cpu_quantization`` "int8" / "int4": the CPU weight-only
        formats of ``layers/cpu_quant.py``."""
        tp = tp or TPGroup()
        hf_config = load_hf_config(model_dir)
        if max_model_len and max_model_len > hf_config.get("max_position_embeddings", 0):
            hf_config = {**hf_config, "max_position_embeddings": max_model_len}
        quant = resolve_quantization(hf_config, quantization)
        host_window = HostPeakWindow()
        model = build_model(hf_config, device, dtype, tp)  # parameters allocated on device
        stats = None
        if load_format == "dummy":
            init_dummy_weights(model, seed)  # quantised below, in the checkpoint's layout
        else:
            if quant is not None and quant.checkpoint_fp8:
                prepare_fp8_checkpoint(model, quant)
            stats = load_safetensors(model, model_dir)
        if quant is not None:
            finish_fp8(model, quant, platform_of(device))
        if cpu_quantization in CPU_QUANTIZATIONS:
            counts = quantize_for_cpu(model, cpu_quantization)
            logger.info("quantised for the CPU: %s", counts)
        host_peak = host_window.close()
        eos_ids = read_eos_token_ids(model_dir, hf_config)
        vocab_size = hf_config["vocab_size"]
        runner = cls(
            model, device, dtype, vocab_size, seed, tp.rank == 0, eos_ids, model_dir, kv_cache_dtype
        )
        runner.load_host_peak, runner.load_stats = host_peak, stats
        runner.tp = tp
        return runner

    def weight_bytes(self) -> int:
        """Bytes of this rank's parameters and buffers (tied ones once), on its device."""
        tensors = {id(t): t for t in (*self.model.parameters(), *self.model.buffers())}
        return sum(t.numel() * t.element_size() for t in tensors.values())

    # -- KV cache -------------------------------------------------------------------

    def kv_cache_specs(self) -> list[tuple[int, int]]:
        """``(num_kv_heads on this rank, head_dim)`` of each KV cache: one per layer, all
        alike, unless the model lists its own (``model.kv_cache_specs()``: Gemma 4, whose
        full-attention layers have other head shapes and whose KV-sharing layers own none)."""
        specs = getattr(self.model, "kv_cache_specs", None)
        if specs is not None:
            return specs()
        attn = self.model.model.layers[0].self_attn
        return [(attn.num_kv_heads, attn.head_dim)] * len(self.model.model.layers)

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """Allocate K and V ``[num_blocks, block_size, kv_heads, head_dim]`` per entry of
        ``kv_cache_specs()``, in ``kv_cache_dtype``."""
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device),
                torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device),
            )
            for shape in (
                (num_blocks, block_size, num_kv_heads, head_dim)
                for num_kv_heads, head_dim in self.kv_cache_specs()
            )
        ]
        self.block_size = block_size
        self.decode_graphs = None  # they point into the old cache
        self.cpu_steps = CpuSteps()

    def kv_cache_bytes(self) -> int:
        """Bytes of the KV cache this rank holds now (0 before ``init_kv_cache``)."""
        return sum(t.numel() * t.element_size() for pair in self.kv_caches for t in pair)

    def capture_decode_graphs(
        self,
        platform: Platform,
        max_num_seqs: int,
        max_model_len: int,
        use_graphs: bool = True,
        sizes: Sequence[int] | None = None,
    ) -> DecodeGraphs:
        """Route decode-only steps of up to ``max_num_seqs`` requests and ``max_model_len``
        tokens through persistent padded inputs, replayed as device graphs (captured
        here, with a progress log) or, with ``use_graphs=False``, run eagerly. ``sizes``:
        the padded batch sizes (default ``capture_sizes(max_num_seqs)``)."""
        if not self.kv_caches:
            raise RuntimeError("capture_decode_graphs() needs a KV cache")
        num_kv_heads = self.model.model.layers[0].self_attn.num_kv_heads
        blocks_per_seq = -(-max_model_len // self.block_size)

        def split_rule(size: int, max_seq_len: int) -> int:
            from vtllm.worker.kernels.kv_splits import choose_num_kv_splits

            return choose_num_kv_splits(size, size, num_kv_heads, max_seq_len)

        graphs = DecodeGraphs(
            self.model,
            self.kv_caches,
            platform,
            sizes or capture_sizes(max_num_seqs),
            blocks_per_seq,
            self.block_size,
            split_rule,
            use_graphs,
        )
        with torch.inference_mode():
            graphs.capture()
        self.decode_graphs = graphs
        return graphs

    def use_native_decode(self) -> bool:
        """On a CPU, route decode-only steps of up to ``MAX_NATIVE_ROWS`` requests through
        the native step (``cpu_native_decode.py``) where it applies (logged either way).
        True when it does. Call before ``compile_cpu_steps``, which then compiles no
        decode graph for those batch sizes."""
        if not self.kv_caches:
            raise RuntimeError("use_native_decode() needs a KV cache")
        return self.cpu_steps.use_native_decode(
            self.model, self.kv_caches, self.block_size, self.platform.is_gpu
        )

    def compile_cpu_steps(self, max_num_seqs: int, enforce_eager: bool = False) -> bool:
        """On a CPU, route decode-only steps through the compiled forward of
        ``cpu_compile.py`` and prompt steps through ``cpu_compile_prompt.py`` (compiled
        and warmed up here, their times logged), unless they do not apply or fail
        (logged; those steps stay eager). True when the decode step is compiled."""
        if not self.kv_caches:
            raise RuntimeError("compile_cpu_steps() needs a KV cache")
        return self.cpu_steps.compile(
            self.model, self.kv_caches, self.block_size, max_num_seqs,
            self.platform.is_gpu, enforce_eager, self._chunk_dtype(True),
        )  # fmt: skip

    def _chunk_dtype(self, prompt: bool) -> torch.dtype | None:
        """The dtype prefill chunks are attended in (``cpu_precision.py``)."""
        return torch.bfloat16 if prompt and self.bf16_prefill else None

    # -- steps ----------------------------------------------------------------------

    @torch.inference_mode()
    def execute(
        self, step: SchedulerOutput, defer_output: bool = False
    ) -> ModelRunnerOutput | DeferredOutput | None:
        """Compute one step. Returns the output on the driver rank, None elsewhere;
        ``defer_output``: a ``DeferredOutput``, without waiting for the device."""
        if not self.kv_caches:
            raise RuntimeError("execute() before init_kv_cache()")
        errors = self.states.update(step)
        batch = self.states.build_step(step, self.block_size, self._last_sampled_rows)
        errors.update(batch.errors)
        for request_id in errors:
            self.states.drop(request_id)
        self.token_history.retain(self.states)
        self._track_grammars(step)
        self.pooler.on_step(step)
        sampled: dict[str, Any] = {}
        sampled_ids: torch.Tensor | None = None  # [num_sampling] int64 on the device
        invalid: set[str] = set()  # requests whose output format failed (their own input)
        embeddings: dict[str, list[float]] = {}
        if batch.num_tokens:
            logits, hidden = self._forward_logits(batch)  # [num_sampling, vocab]
            if self.is_driver and self.pooler.wanted(batch, self.states):
                embeddings = self.pooler.pool(batch, hidden, self.states)
            if self.is_driver and batch.sample_rows:
                sampled_ids, sampled = self._sample(batch, logits, errors, invalid)
            if self.share_sampled_ids and self.tp.size > 1 and batch.sample_rows:
                if sampled_ids is None:  # [num_sampling] int64, rank 0's ids after this
                    num = len(batch.sample_rows)
                    sampled_ids = torch.empty(num, dtype=torch.int64, device=self.device)
                self.tp.broadcast(sampled_ids)
        self._last_sampled = sampled_ids
        self._last_sampled_rows = (
            {batch.request_ids[row]: i for i, row in enumerate(batch.sample_rows)}
            if sampled_ids is not None
            else {}
        )
        if not self.is_driver:
            return None
        output = make_output(step.step_id, batch, sampled, errors)
        output.embeddings = embeddings
        output.invalid_request_ids = sorted(invalid)
        if sampled_ids is None:
            return DeferredOutput(output, None, None) if defer_output else output
        if not defer_output:
            output.sampled_token_ids = sampled_ids.tolist()
            return output
        if self.platform.is_gpu:
            host = torch.empty(sampled_ids.shape, dtype=sampled_ids.dtype, pin_memory=True)
            host.copy_(sampled_ids, non_blocking=True)
            return DeferredOutput(output, host, self.platform.record_event())
        return DeferredOutput(output, sampled_ids, None)

    def _feed_previous_tokens(self, input_ids: torch.Tensor, batch: StepBatch) -> None:
        """Write the previous step's sampled ids into ``input_ids`` (``[num_tokens]``, on
        the device) where ``batch`` wants them, without leaving the device."""
        num_fed = len(batch.prev_token_dst)
        if not num_fed:
            return
        assert self._last_sampled is not None
        dst, src = batch.prev_token_dst, batch.prev_token_src
        # decode batches in an unchanged order: tokens 0..k-1 from rows 0..k-1
        in_order = dst[-1] == num_fed - 1 and src[-1] == num_fed - 1
        if in_order and (dst == np.arange(num_fed)).all() and (src == dst).all():
            input_ids[:num_fed].copy_(self._last_sampled[:num_fed])
            return
        dst_t = to_device(dst.tolist(), torch.int64, self.device)
        src_t = to_device(src.tolist(), torch.int64, self.device)
        input_ids.index_copy_(
            0, dst_t, self._last_sampled.index_select(0, src_t).to(input_ids.dtype)
        )

    def _forward_logits(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits of the sampling rows, the final hidden states of every computed token:
        ``[num_tokens, hidden]``, or ``[num_reqs (padded), hidden]`` from decode graphs)."""
        if self.decode_graphs is not None and self.decode_graphs.can_run(batch):
            feed = (
                (lambda ids: self._feed_previous_tokens(ids, batch))
                if len(batch.prev_token_dst)
                else None
            )
            hidden = self.decode_graphs.run(batch, feed)  # [num_reqs, hidden]
            if len(batch.sample_rows) == len(batch.request_ids):
                return self.model.compute_logits(hidden), hidden
            rows = self._to_device(batch.logits_indices)
            return self.model.compute_logits(hidden.index_select(0, rows)), hidden
        prompt = batch.has_prompt_tokens  # quantised CPU layers use their dense weights
        native = self.cpu_steps.native_decode is not None
        quantised_rows = rows_to_split(batch, self.split_mixed_steps, native)
        if quantised_rows is not None and quantised_rows.all():  # decodes, short chunks
            input_ids = torch.from_numpy(batch.input_ids)  # [num_tokens]; shares memory
            self._feed_previous_tokens(input_ids, batch)
            return self.cpu_steps.native_rows(batch, input_ids)
        if quantised_rows is not None:
            self._feed_previous_tokens(torch.from_numpy(batch.input_ids), batch)  # shared
            return split_mixed_step(batch, quantised_rows, self._forward_logits)
        if batch.num_tokens == batch.num_reqs and not prompt and not self.platform.is_gpu:
            input_ids = torch.from_numpy(batch.input_ids)  # [num_reqs]; shares memory
            self._feed_previous_tokens(input_ids, batch)
            decoded = self.cpu_steps.decode(self.model, batch, input_ids)
            if decoded is not None:
                return decoded
        metadata = attention_metadata(
            batch.query_lens,
            batch.seq_lens,
            batch.query_start_loc,
            batch.block_tables(),
            batch.slot_mapping,
            self.block_size,
            self.device,
            self.attention_backend,
            chunk_dtype=self._chunk_dtype(prompt),
        )
        input_ids = self._to_device(batch.input_ids)
        self._feed_previous_tokens(input_ids, batch)
        positions = self._to_device(batch.positions)
        logits_indices = self._to_device(batch.logits_indices)
        with prompt_step(prompt), bf16_products(prompt and self.bf16_prefill):
            hidden = None
            if prompt:
                hidden = self.cpu_steps.prompt(input_ids, positions, self.kv_caches, metadata)
            if hidden is None:
                hidden = self.model(input_ids, positions, self.kv_caches, metadata)  # [T, hidden]
            return self.model.compute_logits(hidden.index_select(0, logits_indices)), hidden

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """A host array on the device without waiting for the device: through pinned
        memory, non-blocking, on a GPU (a blocking copy waits for the step before, which
        async scheduling queues this one behind); the array itself, shared, on a CPU."""
        host = torch.from_numpy(array)
        if not self.platform.is_gpu:
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def grammars(self) -> StructuredOutputs:
        """The driver's grammar state, created (compiler threads started) at first use."""
        if self.structured is None:
            compilers = GrammarCompilerService(
                self.tokenizer_dir or "", self.vocab_size, self.eos_token_ids
            )
            self.structured = StructuredOutputs(compilers)
        return self.structured

    def _track_grammars(self, step: SchedulerOutput) -> None:
        """A fresh matcher for each new (or resumed) request with a grammar (compiled by
        then when the engine core sent ``CompileGrammar``); forget the rest."""
        if not self.is_driver:
            return
        for new in step.new_requests:
            spec = new.sampling_params.structured_output
            if spec is not None and new.request_id in self.states:
                self.grammars().add(new.request_id, spec)
        if self.structured is not None:
            self.structured.retain(self.states)

    def _sample(
        self,
        batch: StepBatch,
        logits: torch.Tensor,
        errors: dict[str, str],
        invalid: set[str],
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """Sample every row: ``([num_rows] int64 sampled ids on the device, logprobs as
        lists if asked)``. A row whose grammar fails gets its error in ``errors`` and its
        id in ``invalid`` (the request's output format is at fault, not the model)."""
        states = [self.states.get(batch.request_ids[row]) for row in batch.sample_rows]
        generators = {i: s.generator for i, s in enumerate(states) if s.generator is not None}
        sampling_batch = SamplingBatch.from_requests(
            states, generators, self.vocab_size, self.device, self.eos_token_ids, self.token_history
        )
        if self.structured is not None and len(self.structured):
            rows = [(s.request_id, s.token_ids, s.num_prompt_tokens) for s in states]
            grammar, grammar_errors = self.structured.bitmask(rows)
            if grammar is not None:
                index = torch.tensor(grammar.rows, dtype=torch.int64).to(self.device)
                bitmask = grammar.bitmask.to(self.device, non_blocking=True)
                sampling_batch.grammar_mask = (index, bitmask)
            for request_id in grammar_errors:
                self.states.drop(request_id)
            errors.update(grammar_errors)
            invalid.update(grammar_errors)
        out = self.sampler(logits, sampling_batch)
        result: dict[str, Any] = {}
        if out.logprobs is not None:
            result["logprobs"] = out.logprobs.tolist()
            result["top_ids"] = out.top_ids.tolist()
            result["top_logprobs"] = out.top_logprobs.tolist()
            result["num_top"] = [s.sampling_params.logprobs for s in states]
        return out.sampled, result

    def _make_generator(self, params: SamplingParams, num_outputs: int) -> torch.Generator | None:
        if params.seed is None or not self.is_driver:
            return None
        generator = torch.Generator(device=self.device)
        generator.manual_seed(params.seed)
        if effective_temperature(params.temperature) > 0.0:  # greedy draws nothing
            advance_generator(generator, self.vocab_size, num_outputs)
        return generator

    # -- start-up -------------------------------------------------------------------

    @torch.inference_mode()
    def dummy_run(self, num_tokens: int, num_sampling_rows: int = 1) -> None:
        """One forward of a single ``num_tokens`` prefill plus logits and sampling of
        ``num_sampling_rows`` rows, writing KV only into block 0.. of the cache (which
        the engine overwrites before reading). Used for memory profiling and warm-up."""
        if not self.kv_caches:
            raise RuntimeError("dummy_run() needs a KV cache")
        num_blocks = -(-num_tokens // self.block_size)
        metadata = build_attention_metadata(
            [num_tokens],
            [num_tokens],
            [list(range(num_blocks))],
            self.block_size,
            self.device,
            self.attention_backend,
            chunk_dtype=self._chunk_dtype(True),
        )
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        positions = torch.arange(num_tokens, device=self.device)
        with bf16_products(self.bf16_prefill):
            hidden = self.model(input_ids, positions, self.kv_caches, metadata)
            rows = hidden[-1:].expand(num_sampling_rows, -1)
            logits = self.model.compute_logits(rows)
        greedy = SamplingParams(temperature=0.0)
        params = [greedy] * num_sampling_rows
        self.sampler(logits, SamplingBatch.from_params(params, {}, self.vocab_size, self.device))


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Random weights of the right shapes: N(0, std) for matrices, 1 for norm weights and
    scales, 0 for biases (so activations stay in range and benchmarks exercise realistic
    numerics). Filled in place where the parameters live (on the GPU: a device generator;
    the host holds nothing)."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if param.dim() == 1:  # norm weights and scales (Gemma 4's router, layer_scalar): 1
            param.fill_(1.0 if "norm" in name or name.endswith(("scale", "scalar")) else 0.0)
            continue
        if param.device not in generators:
            generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
        param.normal_(0.0, std, generator=generators[param.device])


def attention_backend(device: torch.device) -> str:
    """``VT_ATTENTION_BACKEND`` if set, else the Triton kernels on a GPU (CUDA or ROCm)
    and the torch reference elsewhere."""
    choice = envs.VT_ATTENTION_BACKEND
    if choice == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return choice
