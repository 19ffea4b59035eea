"""A native decode-attention kernel for CPU workers: one query token per request over its
paged float32 KV cache, read in place through the block table.

The torch path (``cpu_compile.cpu_decode_attention``, the reference) writes the step's
K/V, gathers every block of each request into a fresh tensor and calls SDPA: ~20 torch
calls a layer (~55 us of Python and dispatch on two cores, ~1.7 ms a step of the embedded
model) plus a copy of the whole context every step (at 8k tokens, 12 MiB a layer). This
kernel does the write and the attention in one C call a layer: for each request it walks
the request's keys block by block through its table, for every query head of every KV
head inside each block (grouped-query; a block's rows read once, in order), with an
online softmax rescaled once a block (scores of one block held, never the whole row; with
AVX2 eight keys and eight exponentials at a time, ``native/attention.h``):

    for each block B:  s_gt = q_g . k_t * scale for t in B   (g: the query heads of this KV head)
                       m_g' = max(m_g, max_t s_gt);  c = e^(m_g - m_g')
                       l_g = l_g c + sum_t e^(s_gt - m_g');  acc_g = acc_g c + sum_t e^(s_gt - m_g') v_t
    out_g = acc_g / l_g

It is ``vt_decode_attention_f32`` of ``worker/native/cpu_kernels.c`` (built and loaded by
``native_build.py``); single-threaded (a decode step's attention for one or two requests
is microseconds). Where there is no compiler, the build fails, or the tensors are not
float32 with unit-stride heads, ``available()`` is False / the caller falls back to the
torch path. ``tests/worker/test_cpu_decode_kernel.py`` checks it against that reference.
"""

from __future__ import annotations

import ctypes

import torch

from vtllm.worker import native_build

_P = ctypes.c_void_p
_I = ctypes.c_int64
_ARGTYPES = [_P, _I, _P, _I, _P, _I, _P, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, ctypes.c_float]
_state: dict[str, object] = {}  # "fn": the loaded function, or None


def _load(lib: ctypes.CDLL | None) -> ctypes._CFuncPtr | None:
    if lib is None:
        return None
    function = lib.vt_decode_attention_f32
    function.argtypes = _ARGTYPES
    function.restype = ctypes.c_int
    return function


def _function() -> ctypes._CFuncPtr | None:
    if "fn" not in _state:
        _state["fn"] = _load(native_build.library())
    return _state["fn"]  # type: ignore[return-value]


def available() -> bool:
    """Whether the kernel is built and loaded here (built on the first call)."""
    return _function() is not None


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``x [R, heads, D]`` with unit-stride, packed heads (a copy when not) and its row
    stride in elements."""
    if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        x = x.contiguous()
    return x, x.stride(0)


def decode_attention(
    q: torch.Tensor,  # [num_reqs, num_heads, head_dim] float32
    k: torch.Tensor,  # [num_reqs, num_kv_heads, head_dim]: this step's keys
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] float32
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_reqs] int64
    block_tables: torch.Tensor,  # [num_reqs, max_blocks] int64
    seq_lens: torch.Tensor,  # [num_reqs] int64
    scale: float,
    library: ctypes.CDLL | None = None,
) -> torch.Tensor | None:
    """``cpu_compile.cpu_decode_attention`` in one native call: the step's K/V written,
    then ``[num_reqs, num_heads * head_dim]``. None when the kernel cannot take these
    tensors (the caller runs the torch path). ``library``: another build of the kernels
    (tests: the plain-C one); by default ``native_build.library()``."""
    function = _function() if library is None else _load(library)
    if function is None or q.dtype != torch.float32 or k_cache.dtype != torch.float32:
        return None
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return None
    num_reqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    q, q_stride = _rows(q)
    k, k_stride = _rows(k.to(torch.float32))
    v, v_stride = _rows(v.to(torch.float32))
    slots = slot_mapping.to(torch.int64).contiguous()
    tables = block_tables.to(torch.int64).contiguous()
    lens = seq_lens.to(torch.int64).contiguous()
    out = torch.empty(num_reqs, num_heads * head_dim, dtype=torch.float32)
    status = function(
        q.data_ptr(), q_stride, k.data_ptr(), k_stride, v.data_ptr(), v_stride,
        k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), tables.data_ptr(),
        tables.stride(0), lens.data_ptr(), out.data_ptr(),
        num_reqs, num_heads, num_kv_heads, head_dim, k_cache.shape[1], scale,
    )  # fmt: skip
    return out if status == 0 else None
