"""A compiled decode step for CPU serving: the whole Llama forward of a decode-only batch
as one ``torch.compile`` graph.

An eager CPU decode step of a small model is thousands of tiny ops (norms, rotary, casts,
residual adds, views), each a Python call and a dispatcher trip; on two cores they cost
about as much as the matrix products. Inductor fuses them into a few C++ loops per layer,
and one compiled call per step replaces ~100 Python-level calls per layer. (A compiled
region costs ~0.1 ms to enter on this class of CPU: one region per layer cost the
embedded model ~3 ms a step, a quarter of its batch-1 token. So ``decode_layers`` runs a
group of layers, Dynamo unrolling the loop, and the same graph serves every group
(``layers_per_region``: the embedded model's 30 layers as 5 groups of 6). The group's size
buys entry cost with compile time: on two cores, one region of all 30 layers was as fast
a step as 5 of 6 but took ~80 s to compile at the first start against ~25 s.)

Attention is an opaque custom op inside the graph (``vtllm::cpu_decode_attention``): it
writes the step's K/V into the paged cache and attends over each request's blocks, taking
the step's metadata as tensors::

    block_tables  [num_reqs, max_blocks] int64 (at least 2 columns: see below)
    seq_lens      [num_reqs] int64, keys of each request after this step
    mask          [num_reqs, 1, 1, max_blocks * block_size]: 0 visible, -inf past a sequence

Shapes that vary per step are dynamic: one graph for one request, one for ``2..16``
requests and, where quantised linears switch to their dense weight above
``MAX_QUANTIZED_ROWS`` rows, one beyond. (Dynamo specialises sizes 0 and 1, so block
tables are padded to at least two columns: a one-block table would compile another
graph.) ``warm_up`` compiles them all at start-up, so no step compiles while serving;
Inductor keeps its artifacts under ``VT_CACHE_DIR/inductor`` and a restart loads them.

Prefill and mixed steps run the eager forward (they are bound by the matrix products).

Numerics: the fused kernels reduce in another order than eager torch (RMSNorm's mean), so
float32 decode logits move by rounding; greedy output of the embedded model is unchanged
(``tests/worker/test_cpu_compile.py``). ``VT_CPU_COMPILE`` chooses (``compile_reason``):
``auto`` compiles models with quantised linears, ``on`` any supported model, ``off`` none
(nor does ``--enforce-eager``); a compile that fails falls back to eager with a warning, and so does a step
whose compiled forward raises.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import torch
import torch.nn.functional as F

from vtllm import envs
from vtllm.worker import cpu_decode_kernel
from vtllm.worker.attention import _gather_blocks
from vtllm.worker.layers.cpu_quant import MAX_QUANTIZED_ROWS
from vtllm.worker.layers.rotary import RotaryEmbedding
from vtllm.worker.models.llama import KVCache, LlamaDecoderLayer, LlamaForCausalLM

logger = logging.getLogger(__name__)

MIN_TABLE_BLOCKS = 2  # see the module docstring: no size-1 dimension, no extra graph
# The native decode-attention kernel is single-threaded: for up to this many requests and
# keys in a step's (padded) tables it beats the torch path's gather and two-thread SDPA
# on two cores (1 request over 70 / 1,000 keys: 27 / 175 us against 87 / 259; 2 over 70:
# 36 against 85). At 8 requests whole steps were no faster with it (37.7-46 against
# 36.7-41 ms, the rest of the step's ops sharing the cores).
NATIVE_MAX_REQS = 2
NATIVE_MAX_KEYS = 2048


def cpu_decode_attention(
    q: torch.Tensor,  # [num_reqs, num_heads, head_dim]
    k: torch.Tensor,  # [num_reqs, num_kv_heads, head_dim]: this step's keys
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_reqs] int64
    block_tables: torch.Tensor,  # [num_reqs, max_blocks] int64
    seq_lens: torch.Tensor,  # [num_reqs] int64
    mask: torch.Tensor,  # [num_reqs, 1, 1, max_blocks * block_size]
    scale: float,
) -> torch.Tensor:
    """Write K/V at ``slot_mapping``, then one query token per request over its cached
    keys (grouped-query): ``[num_reqs, num_heads * head_dim]``. Up to
    ``NATIVE_MAX_REQS`` requests and ``NATIVE_MAX_KEYS`` keys in the step's tables, one
    call of the native kernel
    (``cpu_decode_kernel.py``); beyond (or without it), the arithmetic of
    ``attention._attend_decodes`` (the eager reference): the same gather and SDPA call."""
    num_reqs, num_heads, head_dim = q.shape
    keys = num_reqs * block_tables.shape[1] * k_cache.shape[1]
    if num_reqs <= NATIVE_MAX_REQS and keys <= NATIVE_MAX_KEYS:
        out = cpu_decode_kernel.decode_attention(
            q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq_lens, scale
        )
        if out is not None:
            return out
    num_kv_heads = k_cache.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
    keys = _gather_blocks(k_cache, block_tables)  # [R, KVH, Lk, D]
    values = _gather_blocks(v_cache, block_tables)
    attn_mask: torch.Tensor | None = mask
    if num_reqs == 1:  # keys past the sequence cut off, no mask (as the reference does)
        seq_len = int(seq_lens[0])
        keys, values, attn_mask = keys[:, :, :seq_len], values[:, :, :seq_len], None
    grouped = q.view(num_reqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    o = F.scaled_dot_product_attention(
        grouped, keys.to(q.dtype), values.to(q.dtype), attn_mask, scale=scale
    )
    return o.reshape(num_reqs, num_heads * head_dim)


def _cpu_decode_attention_fake(
    q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq_lens, mask, scale
):
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


# Registered through torch.library.Library rather than the torch.library.custom_op
# decorator: its Python wrapper costs ~0.1 ms a call (30 calls a step), measured.
_LIBRARY = torch.library.Library("vtllm", "FRAGMENT")
_LIBRARY.define(
    "cpu_decode_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
    "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, Tensor mask, float scale) -> Tensor"
)
_LIBRARY.impl("cpu_decode_attention", cpu_decode_attention, "CPU")
torch.library.register_fake("vtllm::cpu_decode_attention", _cpu_decode_attention_fake, lib=_LIBRARY)


def decode_layer(
    layer: LlamaDecoderLayer,
    x: torch.Tensor,  # [num_reqs, hidden]: the previous layer's output
    residual: torch.Tensor,  # [num_reqs, hidden]; zeros before the first layer
    positions: torch.Tensor,  # [num_reqs]
    rotary: RotaryEmbedding,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_reqs] int64
    block_tables: torch.Tensor,  # [num_reqs, max_blocks] int64
    seq_lens: torch.Tensor,  # [num_reqs] int64
    mask: torch.Tensor,  # [num_reqs, 1, 1, max_blocks * block_size]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``layer.forward`` of a decode-only step: ``(mlp output, residual stream)``, traced
    for each layer inside ``decode_layers``."""
    q, k, v, residual = layer.pre_attention(x, residual, positions, rotary)
    o = torch.ops.vtllm.cpu_decode_attention(
        q,
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        block_tables,
        seq_lens,
        mask,
        layer.self_attn.scale,
    )  # [num_reqs, heads * head_dim]
    return layer.post_attention(o, residual)


def decode_layers(
    layers: torch.nn.ModuleList,  # a group of the model's LlamaDecoderLayers
    x: torch.Tensor,  # [num_reqs, hidden]: the embedded tokens
    residual: torch.Tensor,  # [num_reqs, hidden] zeros
    positions: torch.Tensor,  # [num_reqs]
    rotary: RotaryEmbedding,
    kv_caches: list[KVCache],
    slot_mapping: torch.Tensor,  # [num_reqs] int64
    block_tables: torch.Tensor,  # [num_reqs, max_blocks] int64
    seq_lens: torch.Tensor,  # [num_reqs] int64
    mask: torch.Tensor,  # [num_reqs, 1, 1, max_blocks * block_size]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``decode_layer`` of each of ``layers`` in turn: what is compiled, one graph for a
    group of layers (Dynamo unrolls the loop; see the module docstring)."""
    for layer, (k_cache, v_cache) in zip(layers, kv_caches, strict=True):
        x, residual = decode_layer(
            layer, x, residual, positions, rotary, k_cache, v_cache,
            slot_mapping, block_tables, seq_lens, mask,
        )  # fmt: skip
    return x, residual


MAX_LAYERS_PER_REGION = 8


def layers_per_region(num_layers: int) -> int:
    """The most layers one compiled region runs: the largest divisor of ``num_layers`` up
    to ``MAX_LAYERS_PER_REGION`` (equal groups: one graph serves them all)."""
    return max(d for d in range(1, MAX_LAYERS_PER_REGION + 1) if num_layers % d == 0)


def decode_inputs(
    seq_lens: np.ndarray,  # [num_reqs] int64
    block_tables: np.ndarray,  # [num_reqs, max_num_blocks] int32, 0-padded
    slot_mapping: np.ndarray,  # [num_reqs] int64
    block_size: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(slot_mapping, block_tables, seq_lens, mask)`` tensors of a decode-only step
    (each request computes its token at position ``seq_len - 1``): tables int64 and at
    least ``MIN_TABLE_BLOCKS`` wide, the mask hiding keys past each sequence."""
    num_reqs, width = block_tables.shape
    tables = np.zeros((num_reqs, max(MIN_TABLE_BLOCKS, width)), dtype=np.int64)
    tables[:, :width] = block_tables
    lens = np.asarray(seq_lens, dtype=np.int64)
    key_pos = np.arange(tables.shape[1] * block_size)[None, :]
    hidden = torch.from_numpy(key_pos >= lens[:, None])  # [num_reqs, num_keys]
    mask = torch.zeros(hidden.shape, dtype=dtype).masked_fill_(hidden, float("-inf"))
    return (
        torch.from_numpy(np.asarray(slot_mapping, dtype=np.int64)),
        torch.from_numpy(tables),
        torch.from_numpy(lens),
        mask[:, None, None, :],
    )


def has_quantised_linears(model: torch.nn.Module) -> bool:
    """Whether some linear layer multiplies through a ``LinearMethod`` (CPU int8/int4)."""
    return any(getattr(m, "linear_method", None) is not None for m in model.modules())


def compile_reason(model: torch.nn.Module, is_gpu: bool, enforce_eager: bool) -> str | None:
    """None when ``model`` gets the compiled CPU decode step; else why not (for the log).

    ``VT_CPU_COMPILE=auto`` compiles only a model whose linears are quantised (int4/int8):
    there the per-op overhead is a large share of a decode step. A float32 model's decode
    step is bound by reading its weights (measured: no gain through HTTP, and 35 s more
    start-up), so ``auto`` leaves it eager and ``on`` compiles it anyway."""
    if is_gpu:
        return "not on a CPU"
    if enforce_eager:
        return "--enforce-eager"
    choice = envs.VT_CPU_COMPILE
    if choice == "off":
        return "VT_CPU_COMPILE=off"
    if type(model) is not LlamaForCausalLM:  # MoE / Gemma layers: not split yet
        return f"{type(model).__name__} has no compiled CPU decode step"
    if any(model.args.sliding_windows):
        return "sliding-window layers have no compiled CPU decode step"
    if choice == "auto" and not has_quantised_linears(model):
        return "weights not quantised (VT_CPU_COMPILE=on compiles anyway)"
    return None


class CompiledDecode:
    """The compiled decode step of one ``LlamaForCausalLM`` over its KV cache."""

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[KVCache], block_size: int) -> None:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(envs.VT_CACHE_DIR / "inductor"))
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.dtype = model.model.norm.weight.dtype
        self._layers = torch.compile(decode_layers, dynamic=False)  # dims marked per call
        self.group_size = layers_per_region(len(model.model.layers))
        self.warmed_up = False

    def __call__(
        self,
        input_ids: torch.Tensor,  # [num_reqs]
        positions: torch.Tensor,  # [num_reqs]
        seq_lens: np.ndarray,  # [num_reqs] int64: tokens after this step
        block_tables: np.ndarray,  # [num_reqs, max_num_blocks] int32, 0-padded
        slot_mapping: np.ndarray,  # [num_reqs] int64
    ) -> torch.Tensor:
        """Hidden states ``[num_reqs, hidden]`` of a decode-only step."""
        slots, tables, lens, mask = decode_inputs(
            seq_lens, block_tables, slot_mapping, self.block_size, self.dtype
        )
        model = self.model
        x = model.model.embed_tokens(input_ids)  # [num_reqs, hidden]
        residual = torch.zeros_like(x)
        for tensor, dims in ((slots, (0,)), (tables, (0, 1)), (lens, (0,)), (mask, (0, 3))):
            for dim in dims:
                torch._dynamo.maybe_mark_dynamic(tensor, dim)
        for tensor in (positions, x, residual):
            torch._dynamo.maybe_mark_dynamic(tensor, 0)
        # no duck sizing: equal sizes by chance (2 requests, 2 blocks) must not become a
        # guard that the next step breaks. Once warmed up, every graph a step can need
        # exists: evaluate only the guards that tell them apart (the batch size class),
        # not the ~600 parameter guards of the layers (~0.1 ms a layer).
        # Sound because a worker serves one model: Dynamo's cache of ``decode_layers`` is
        # per process, so a second warmed-up model of other shapes in the same process
        # could be handed the first one's graphs (tests reset Dynamo between models).
        with (
            torch.fx.experimental._config.patch(use_duck_shape=False),
            torch.compiler.set_stance("default", skip_guard_eval_unsafe=self.warmed_up),
        ):
            layers, group = model.model.layers, self.group_size
            for first in range(0, len(layers), group):
                x, residual = self._layers(
                    layers[first : first + group],
                    x,
                    residual,
                    positions,
                    model.rotary,
                    self.kv_caches[first : first + group],
                    slots,
                    tables,
                    lens,
                    mask,
                )
        return model.model.norm(x, residual)[0]  # [num_reqs, hidden]

    def warm_up(self, max_num_seqs: int, native_rows: int = 0) -> list[int]:
        """Compile every graph serving will need: decode batches of 1, 2 and, with
        quantised linears and room for it, ``MAX_QUANTIZED_ROWS + 1`` requests, each at
        position 0 in block 0 (which the engine overwrites before reading), leaving out
        sizes up to ``native_rows`` (the native step's). Returns the batch sizes run;
        raises what the compiler raises."""
        sizes = compiled_sizes(self.model, max_num_seqs, native_rows)
        self.warmed_up = False
        with torch.inference_mode():
            for num_reqs in sizes:
                input_ids = torch.zeros(num_reqs, dtype=torch.int64)
                positions = torch.zeros(num_reqs, dtype=torch.int64)
                seq_lens = np.ones(num_reqs, dtype=np.int64)
                tables = np.zeros((num_reqs, 1), dtype=np.int32)
                slots = np.zeros(num_reqs, dtype=np.int64)
                self(input_ids, positions, seq_lens, tables, slots)
        self.warmed_up = True
        return sizes


def compiled_sizes(model: torch.nn.Module, max_num_seqs: int, native_rows: int) -> list[int]:
    """The decode batch sizes whose graphs ``CompiledDecode.warm_up`` compiles (see there)."""
    sizes = [n for n in (1, 2) if n <= max_num_seqs]
    if has_quantised_linears(model) and max_num_seqs > MAX_QUANTIZED_ROWS:
        sizes.append(MAX_QUANTIZED_ROWS + 1)
    return [n for n in sizes if n > native_rows]


def try_compile(
    model: torch.nn.Module,
    kv_caches: list[KVCache],
    block_size: int,
    max_num_seqs: int,
    is_gpu: bool,
    enforce_eager: bool,
    native_rows: int = 0,
) -> CompiledDecode | None:
    """The compiled decode step, warmed up (compile time logged), or None (eager) with a
    log line saying why: not wanted here, the native step (``native_rows``) serves every
    batch it would, or the compile failed."""
    reason = compile_reason(model, is_gpu, enforce_eager)
    if reason is None and not compiled_sizes(model, max_num_seqs, native_rows):
        reason = f"the native step serves every decode batch (up to {native_rows} requests)"
    if reason is not None:
        logger.info("CPU decode steps run eagerly: %s", reason)
        return None
    assert isinstance(model, LlamaForCausalLM)
    started = time.monotonic()
    compiled = CompiledDecode(model, kv_caches, block_size)
    try:
        sizes = compiled.warm_up(max_num_seqs, native_rows)
    except Exception as e:  # noqa: BLE001 - whatever the compiler raises: serve eagerly
        first_line = str(e).splitlines()[0] if str(e) else ""
        logger.warning(
            "torch.compile of the CPU decode step failed after %.1fs, serving eagerly "
            "(VT_CPU_COMPILE=off skips the attempt): %s: %s",
            time.monotonic() - started,
            type(e).__name__,
            first_line,
        )
        return None
    logger.info(
        "compiled the CPU decode step (torch.compile, batch sizes %s warmed up) in %.1fs; "
        "VT_CPU_COMPILE=off or --enforce-eager serve eagerly",
        sizes,
        time.monotonic() - started,
    )
    return compiled
