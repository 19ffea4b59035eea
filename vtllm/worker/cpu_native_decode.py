"""A whole CPU decode step in one native call: ``vt_decode_step`` of
``worker/native/cpu_kernels.c``, with ``reference_step`` (plain torch) beside it.

A decode step of the embedded model on two cores is ~15 ms through torch (compiled
regions, the int4 and int8 kernels, the native attention): of it, the weights' bytes at
memory bandwidth are ~6 ms; the rest is per-op work (dispatch, Dynamo guards, casts to
bf16 and back, ~200 kernel launches). The native step runs the same model as a C loop:

    x = embed[ids]; residual = 0
    per layer:  residual += x;  h = rms_norm(residual) * w_in
                qkv = h @ Wqkv^T (int4);  q/k norm (Qwen3);  rotary;  K/V → paged cache
                attn = paged decode attention (per request, grouped query; native/attention.h)
                x = attn @ Wo^T;  residual += x;  h = rms_norm(residual) * w_post
                x = (silu(h @ Wg^T) * (h @ Wu^T)) @ Wd^T
    hidden = rms_norm(residual + x) * w_final;  logits = hidden @ Wlm^T (int8)

with OpenMP threads (torch's runtime) splitting each product's output rows. Weights: the
int4 of ``layers/cpu_quant.py`` (``quantize_int4``: per group of 32 inputs,
``w = (q - 8) * scale + zero``) repacked as GGUF ``Q4_1`` groups (``w = nibble * d + m``
with ``d = scale``, ``m = zero - 8 scale``, float32; the nibbles of 8 rows interleaved,
``Q4Weight``), and the LM
head's int8 rows with their scales; activations stay float32 (the torch int4 kernel rounds
them to bf16), so the native step is closer to the float32 model than the torch int4 path.
Each output element is reduced by one thread in a fixed order: logits do not depend on the
batch or the thread count.

Which steps: decode-only batches of up to ``MAX_NATIVE_ROWS`` requests (more, and the
quantised layers use their dense weights anyway: ``cpu_quant.MAX_QUANTIZED_ROWS``) of a
``LlamaForCausalLM`` whose linears are all int4 without bias on the MLP and output, SiLU,
no sliding window, float32 weights and KV cache (``native_reason`` says why not).
``VT_CPU_NATIVE_DECODE``: ``auto`` (default) uses it where it applies, ``off`` never.
The extra memory: the repacked weights (5 bits a weight: ~70 MB for SmolLM2-135M) and the
LM head's int8 rows interleaved in blocks of 8 (`interleave_q8`, ~28 MB).
"""

from __future__ import annotations

import ctypes
import logging
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from vtllm import envs
from vtllm.worker import native_build
from vtllm.worker.layers.cpu_quant import (
    INT4_GROUP_SIZE,
    MAX_QUANTIZED_ROWS,
    CpuInt4Method,
    CpuInt8Method,
    quantize_int4,
)
from vtllm.worker.models.llama import KVCache, LlamaForCausalLM

logger = logging.getLogger(__name__)

MAX_NATIVE_ROWS = MAX_QUANTIZED_ROWS
MAX_NATIVE_TOKENS = 256  # the most rows of one native step with prompt rows (cpu_steps.py)
_P = ctypes.c_void_p
_I = ctypes.c_int64


class _Q4(ctypes.Structure):
    _fields_ = [("q", _P), ("m8", _P), ("d8", _P), ("bias", _P), ("n", _I), ("k", _I)]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("qkv", _Q4), ("o", _Q4), ("gate_up", _Q4), ("down", _Q4),
        ("input_norm", _P), ("post_norm", _P), ("q_norm", _P), ("k_norm", _P),
        ("k_cache", _P), ("v_cache", _P),
    ]  # fmt: skip


class _Model(ctypes.Structure):
    _fields_ = [
        ("hidden", _I), ("inter", _I), ("heads", _I), ("kv_heads", _I), ("head_dim", _I),
        ("vocab", _I), ("block_size", _I), ("num_layers", _I), ("max_position", _I),
        ("eps", ctypes.c_float), ("scale", ctypes.c_float),
        ("embed", _P), ("final_norm", _P), ("lm_q", _P), ("lm_scale", _P), ("cos_sin", _P),
        ("layers", ctypes.POINTER(_Layer)),
    ]  # fmt: skip


class Q4Weight:
    """One linear layer's int4 weight in the kernel's layout: ``interleaved [n / 8, k / 32,
    4, 8, 4] uint8``, blocks of 8 rows: byte ``[block, g, p, j, b]`` holds row ``8 block +
    j``'s element ``8 p + b`` of group ``g`` in its low nibble and ``8 p + 4 + b`` in its
    high one (a 32-byte load is four elements of eight rows); ``d`` and ``m`` ``[n, k /
    32]`` float32 (``w = nibble * d + m``), ``d8`` and ``m8 [n / 8, k / 32, 8]`` (``d``,
    ``m`` of each block of 8 rows, group-major), ``bias [n]`` float32 or None; ``n`` a
    multiple of 8 (``cpu_quant.int4_supported``: of 16)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        n, k = weight.shape
        q, scale_zero, _ = quantize_int4(weight)  # q [n, k] 0..15, [k / 32, n, 2] bf16
        groups = k // INT4_GROUP_SIZE
        # [block, j, g, p, half, b] -> [block, g, p, half, j, b]
        q = q.to(torch.uint8).view(n // 8, 8, groups, 4, 2, 4).permute(0, 2, 3, 4, 1, 5)
        self.interleaved = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).contiguous()
        scale, zero = scale_zero.float().transpose(0, 1).unbind(-1)  # [n, k / 32] each
        self.d = scale.contiguous()
        self.m = (zero - 8.0 * scale).contiguous()
        self.d8 = self.d.view(n // 8, 8, groups).transpose(1, 2).contiguous()
        self.m8 = self.m.view(n // 8, 8, groups).transpose(1, 2).contiguous()
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.n, self.k = n, k

    def nibbles(self) -> torch.Tensor:
        """``[n, k / 32, 32]`` uint8: each group's nibbles in element order."""
        halves = torch.stack((self.interleaved & 15, self.interleaved >> 4), dim=3)
        # [block, g, p, half, j, b] -> [block, j, g, p, half, b]
        return halves.permute(0, 4, 1, 2, 3, 5).reshape(self.n, self.k // INT4_GROUP_SIZE, -1)

    def dequantised(self) -> torch.Tensor:
        """``[n, k]`` float32: the weight the kernel multiplies by."""
        w = self.nibbles().float() * self.d[..., None] + self.m[..., None]
        return w.reshape(self.n, self.k)

    def struct(self) -> _Q4:
        bias = 0 if self.bias is None else self.bias.data_ptr()
        return _Q4(
            self.interleaved.data_ptr(), self.m8.data_ptr(), self.d8.data_ptr(),
            bias, self.n, self.k,
        )  # fmt: skip


def q4_linear(
    weight: Q4Weight, x: torch.Tensor, library: ctypes.CDLL | None = None
) -> torch.Tensor:
    """``x [R, k]`` float32 times an int4 weight through the kernel (``vt_q4_linear`` of
    ``library``, by default ``native_build.library()``): ``[R, n]``. For tests and
    benchmarks; the step calls it inside."""
    x = x.float().contiguous()
    y = torch.empty(x.shape[0], weight.n, dtype=torch.float32)
    function = (library or native_build.library()).vt_q4_linear  # type: ignore[union-attr]
    function.argtypes = [_P, _P, _I, _P]
    struct = weight.struct()
    if function(ctypes.addressof(struct), x.data_ptr(), x.shape[0], y.data_ptr()) != 0:
        raise MemoryError("vt_q4_linear: out of memory")
    return y


def interleave_q8(q_weight: torch.Tensor) -> torch.Tensor:
    """``q_weight [n, k]`` int8 in the kernel's LM-head layout: ``[ceil(n / 8), k / 32, 8,
    8, 4]``, blocks of 8 rows, byte ``[block, g, p, j, b]`` holding row ``8 block + j``'s
    element ``4 p + b`` of group ``g`` (a 32-byte load is four elements of eight rows; rows
    past ``n`` are zero)."""
    n, k = q_weight.shape
    if n % 8:
        q_weight = torch.cat([q_weight, q_weight.new_zeros(-n % 8, k)])
    blocks = q_weight.view(-1, 8, k // INT4_GROUP_SIZE, 8, 4)  # [block, j, g, p, b]
    return blocks.permute(0, 2, 3, 1, 4).contiguous()


def q8_linear(
    q_weight: torch.Tensor,
    scale: torch.Tensor,
    x: torch.Tensor,
    library: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """``x [R, k]`` float32 times an int8 weight ``[n, k]`` with row scales ``[n]``
    float32 through the kernel (``vt_q8_linear`` of ``library``, by default
    ``native_build.library()``): ``[R, n]``. For tests: it repacks the weight every call
    (the step keeps ``NativeDecode.lm_interleaved``)."""
    x = x.float().contiguous()
    n, k = q_weight.shape
    interleaved = interleave_q8(q_weight)
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    function = (library or native_build.library()).vt_q8_linear  # type: ignore[union-attr]
    function.argtypes = [_P, _P, _I, _I, _P, _I, _P]
    status = function(
        interleaved.data_ptr(), scale.data_ptr(), n, k, x.data_ptr(), x.shape[0], y.data_ptr()
    )
    if status != 0:
        raise MemoryError("vt_q8_linear: out of memory")
    return y


def native_reason(model: torch.nn.Module, kv_caches: list[KVCache]) -> str | None:
    """None when ``model`` can decode through the native step; else why not (for the log)."""
    if envs.VT_CPU_NATIVE_DECODE == "off":
        return "VT_CPU_NATIVE_DECODE=off"
    if type(model) is not LlamaForCausalLM:
        return f"{type(model).__name__} has no native CPU decode step"
    args = model.args
    if model.lm_head.tp.size > 1:
        return "tensor parallelism (the native step runs one whole model)"
    if any(args.sliding_windows) or args.hidden_act != "silu" or args.o_bias or args.mlp_bias:
        return "sliding windows, a non-SiLU activation or output/MLP biases"
    if model.model.norm.weight.dtype != torch.float32:
        return f"weights in {model.model.norm.weight.dtype}, not float32"
    if any(cache.dtype != torch.float32 for pair in kv_caches for cache in pair):
        return "the KV cache is not float32"
    for layer in model.model.layers:
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                       layer.mlp.gate_up_proj, layer.mlp.down_proj):  # fmt: skip
            if not isinstance(getattr(linear, "linear_method", None), CpuInt4Method):
                return "its linears are not all int4 (--quantization int4)"
    if not isinstance(model.lm_head.linear_method, CpuInt8Method):
        return "the LM head is not int8"
    if args.hidden_size % 32 or args.intermediate_size % 32 or args.head_dim % 2:
        return "hidden or intermediate sizes not multiples of 32"
    if native_build.library() is None:
        return "the native kernels could not be built (no C compiler?)"
    return None


class NativeDecode:
    """The native decode step of one ``LlamaForCausalLM`` (int4 linears) over its KV cache."""

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[KVCache], block_size: int) -> None:
        args = model.args
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.layers: list[dict[str, Any]] = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(
                {
                    "qkv": Q4Weight(attn.qkv_proj.weight.data, attn.qkv_proj.bias),
                    "o": Q4Weight(attn.o_proj.weight.data, None),
                    "gate_up": Q4Weight(mlp.gate_up_proj.weight.data, None),
                    "down": Q4Weight(mlp.down_proj.weight.data, None),
                    "input_norm": layer.input_layernorm.weight.data.contiguous(),
                    "post_norm": layer.post_attention_layernorm.weight.data.contiguous(),
                    "q_norm": None if attn.q_norm is None else attn.q_norm.weight.data,
                    "k_norm": None if attn.k_norm is None else attn.k_norm.weight.data,
                }
            )
        head = model.lm_head
        self.lm_q = head.qweight.contiguous()  # [vocab, hidden] int8 (the reference's)
        self.lm_interleaved = interleave_q8(self.lm_q)  # the kernel's layout
        self.lm_scale = head.qscale.float().contiguous()  # [vocab]
        self.embed = model.model.embed_tokens.weight.data.contiguous()  # [vocab, hidden]
        self.cos_sin = model.rotary.cos_sin_cache.contiguous()  # [max_position, head_dim]
        self.vocab, self.hidden = args.vocab_size, args.hidden_size
        self._layer_structs = (_Layer * len(self.layers))()
        for i, (weights, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            norms = [weights[name] for name in ("input_norm", "post_norm", "q_norm", "k_norm")]
            self._layer_structs[i] = _Layer(
                *(weights[name].struct() for name in ("qkv", "o", "gate_up", "down")),
                *(0 if t is None else t.data_ptr() for t in norms),
                k_cache.data_ptr(),
                v_cache.data_ptr(),
            )
        self._struct = _Model(
            args.hidden_size, args.intermediate_size, model.model.layers[0].self_attn.num_heads,
            model.model.layers[0].self_attn.num_kv_heads, args.head_dim, args.vocab_size,
            block_size, len(self.layers), self.cos_sin.shape[0],
            args.rms_norm_eps, args.attention_scale,
            self.embed.data_ptr(), model.model.norm.weight.data.data_ptr(),
            self.lm_interleaved.data_ptr(), self.lm_scale.data_ptr(), self.cos_sin.data_ptr(),
            self._layer_structs,
        )  # fmt: skip
        library = native_build.library()
        function = library.vt_decode_step  # type: ignore[union-attr]
        function.argtypes = [_P, _I, _P, _P, _P, _P, _I, _P, _P, _I, _P, _P, _P]
        function.restype = ctypes.c_int
        self._step = function
        self._workspace_bytes = library.vt_decode_step_workspace  # type: ignore[union-attr]
        self._workspace_bytes.argtypes = [_P, _I]
        self._workspace_bytes.restype = _I
        # the step's buffers, sized and touched once for the most rows the runner sends
        # (grown only for callers that send more): steps of changing sizes then allocate
        # nothing, and the resident size does not creep up as larger steps come
        self._workspace = torch.empty(0, dtype=torch.uint8)
        self._work(max(MAX_NATIVE_ROWS, MAX_NATIVE_TOKENS))

    def _work(self, num_rows: int) -> int:
        """The address of a 64-byte aligned workspace for ``num_rows`` rows."""
        needed = self._workspace_bytes(ctypes.addressof(self._struct), num_rows) + 64
        if self._workspace.numel() < needed:
            self._workspace = torch.zeros(needed, dtype=torch.uint8)
        address = self._workspace.data_ptr()
        return address + (-address % 64)

    def __call__(
        self,
        input_ids: np.ndarray | torch.Tensor,  # [rows] int
        positions: np.ndarray,  # [rows]
        seq_lens: np.ndarray,  # [rows]: keys each row attends over (its position + 1)
        block_tables: np.ndarray,  # [rows, max_num_blocks] 0-padded: each row's request's
        slot_mapping: np.ndarray,  # [rows]
        logit_rows: np.ndarray | None = None,  # [L] rows that want logits; None: all
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits [L, vocab] float32, hidden [rows, hidden])`` of a step whose rows are
        one token each: decodes, or the tokens of prompt chunks (a chunk's rows in
        position order, sharing their request's table), their K/V written. Raises
        ValueError for what the kernel refuses."""
        ids = torch.as_tensor(input_ids).to(torch.int64).contiguous()
        num_rows = ids.shape[0]
        pos = np.ascontiguousarray(positions, dtype=np.int64)
        lens = np.ascontiguousarray(seq_lens, dtype=np.int64)
        tables = np.ascontiguousarray(block_tables, dtype=np.int64)
        slots = np.ascontiguousarray(slot_mapping, dtype=np.int64)
        if logit_rows is None:
            logit_rows = np.arange(num_rows, dtype=np.int64)
        wanted = np.ascontiguousarray(logit_rows, dtype=np.int64)
        logits = torch.empty(len(wanted), self.vocab, dtype=torch.float32)
        hidden = torch.empty(num_rows, self.hidden, dtype=torch.float32)
        status = self._step(
            ctypes.addressof(self._struct), num_rows, ids.data_ptr(), pos.ctypes.data,
            slots.ctypes.data, tables.ctypes.data, tables.shape[1], lens.ctypes.data,
            wanted.ctypes.data, len(wanted), logits.data_ptr(), hidden.data_ptr(),
            self._work(num_rows),
        )  # fmt: skip
        if status != 0:
            raise ValueError(
                f"the native decode step refused {num_rows} rows (status {status}: a token "
                "id, position or logit row out of range or a shape it does not take)"
            )
        return logits, hidden


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's activation quantisation of ``x [R, k]`` float32, per group of 32:
    ``(q [R, k / 32, 32] in -127..127 (as float32), d [R, k / 32], sum [R, k / 32])`` with
    ``q = round(x / d)`` (half to even), ``d = max|x| / 127``, ``sum`` of the float x."""
    groups = x.reshape(x.shape[0], -1, INT4_GROUP_SIZE)
    d = groups.abs().amax(dim=-1) / 127.0  # [R, k / 32]
    q = torch.where(d[..., None] > 0, torch.round(groups / d[..., None]), 0.0)
    return q, d, groups.sum(dim=-1)


def q4_linear_reference(weight: Q4Weight, x: torch.Tensor) -> torch.Tensor:
    """``x [R, k]`` times an int4 weight as the kernel computes it: ``[R, n]``; integer
    group dot products (exact in float32) scaled by both groups' scales, plus ``m`` times
    each group's sum of x."""
    q, d, sums = quantize_rows(x)
    nibbles = weight.nibbles().float()  # [n, k / 32, 32]
    dots = torch.einsum("rgj,ogj->rog", q, nibbles)  # [R, n, k / 32] integers
    y = (dots * weight.d[None] * d[:, None]).sum(-1) + sums @ weight.m.T
    return y if weight.bias is None else y + weight.bias


def q8_linear_reference(
    q_weight: torch.Tensor, scale: torch.Tensor, x: torch.Tensor
) -> torch.Tensor:
    """The int8 LM head as the kernel computes it: ``[R, n]``."""
    q, d, _ = quantize_rows(x)
    w = q_weight.float().reshape(q_weight.shape[0], -1, INT4_GROUP_SIZE)  # [n, k / 32, 32]
    dots = torch.einsum("rgj,ogj->rog", q, w)
    return (dots * d[:, None]).sum(-1) * scale


def reference_step(
    native: NativeDecode,
    kv_caches: list[KVCache],  # written as the kernel writes its own
    input_ids: torch.Tensor,  # [num_reqs]
    positions: torch.Tensor,  # [num_reqs]
    seq_lens: torch.Tensor,  # [num_reqs]
    block_tables: torch.Tensor,  # [num_reqs, max_num_blocks]
    slot_mapping: torch.Tensor,  # [num_reqs]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``NativeDecode.__call__`` in plain torch from the same repacked weights and the
    same activation quantisation: the kernel's reference."""
    args = native.model.args
    heads = native.model.model.layers[0].self_attn.num_heads
    kv_heads = native.model.model.layers[0].self_attn.num_kv_heads
    head_dim, eps, num_reqs = args.head_dim, args.rms_norm_eps, input_ids.shape[0]

    def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def rotate(x: torch.Tensor) -> torch.Tensor:  # [num_reqs, heads, head_dim]
        cos, sin = native.cos_sin[positions].chunk(2, dim=-1)  # [num_reqs, head_dim / 2]
        x1, x2 = x.chunk(2, dim=-1)
        cos, sin = cos[:, None], sin[:, None]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    x = native.embed[input_ids]  # [num_reqs, hidden]
    residual = torch.zeros_like(x)
    for weights, (k_cache, v_cache) in zip(native.layers, kv_caches, strict=True):
        residual = residual + x
        qkv = q4_linear_reference(weights["qkv"], norm(residual, weights["input_norm"]))
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
        q = q.reshape(num_reqs, heads, head_dim)
        k = k.reshape(num_reqs, kv_heads, head_dim)
        if weights["q_norm"] is not None:
            q, k = norm(q, weights["q_norm"]), norm(k, weights["k_norm"])
        q, k = rotate(q), rotate(k)
        k_cache.view(-1, kv_heads, head_dim)[slot_mapping] = k
        v_cache.view(-1, kv_heads, head_dim)[slot_mapping] = v.reshape(num_reqs, kv_heads, -1)
        outs = []
        for r in range(num_reqs):
            length = int(seq_lens[r])
            blocks = block_tables[r, : (length + native.block_size - 1) // native.block_size]
            keys = k_cache[blocks].flatten(0, 1)[:length]  # [len, kv_heads, head_dim]
            values = v_cache[blocks].flatten(0, 1)[:length]
            keys = keys.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
            values = values.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
            scores = (q[r][:, None] @ keys.transpose(1, 2)) * args.attention_scale
            outs.append((scores.softmax(-1) @ values).reshape(-1))  # [heads * head_dim]
        x = q4_linear_reference(weights["o"], torch.stack(outs))
        residual = residual + x
        gate_up = q4_linear_reference(weights["gate_up"], norm(residual, weights["post_norm"]))
        gate, up = gate_up.chunk(2, dim=-1)
        x = q4_linear_reference(weights["down"], F.silu(gate) * up)
    hidden = norm(residual + x, native.model.model.norm.weight)
    return q8_linear_reference(native.lm_q, native.lm_scale, hidden), hidden


def try_native_decode(
    model: torch.nn.Module, kv_caches: list[KVCache], block_size: int, is_gpu: bool
) -> NativeDecode | None:
    """The native decode step, or None with a log line saying why not."""
    if is_gpu:
        return None
    reason = native_reason(model, kv_caches)
    if reason is not None:
        logger.info("CPU decode steps without the native step: %s", reason)
        return None
    started = time.monotonic()
    native = NativeDecode(model, kv_caches, block_size)  # type: ignore[arg-type]
    logger.info(
        "native CPU decode step for 1-%d requests (worker/cpu_native_decode.py; "
        "VT_CPU_NATIVE_DECODE=off turns it off), weights repacked in %.1fs",
        MAX_NATIVE_ROWS,
        time.monotonic() - started,
    )
    return native
