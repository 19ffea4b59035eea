"""A native decode-attention kernel for CPU workers: one query token per request over its
paged float32 KV cache, read in place through the block table.

The torch path (``cpu_compile.cpu_decode_attention``, the reference) writes the step's
K/V, gathers every block of each request into a fresh tensor and calls SDPA: ~20 torch
calls a layer (~55 us of Python and dispatch on two cores, ~1.7 ms a step of the embedded
model) plus a copy of the whole context every step (at 8k tokens, 12 MiB a layer). This
kernel does the write and the attention in one C call a layer: for each request and KV
head it walks the request's keys block by block through its table, for each query head
that shares them (grouped-query), with an online softmax rescaled once a block (scores of
one block held, never the whole row):

    for each block B:  s_gt = q_g . k_t * scale for t in B   (g: the query heads of this KV head)
                       m_g' = max(m_g, max_t s_gt);  c = e^(m_g - m_g')
                       l_g = l_g c + sum_t e^(s_gt - m_g');  acc_g = acc_g c + sum_t e^(s_gt - m_g') v_t
    out_g = acc_g / l_g

It is C compiled at first use with the system's C compiler (``cc -O3 -march=native``,
the compiler ``torch.compile`` needs anyway), cached under ``VT_CACHE_DIR/native``, and
called through ctypes; single-threaded (a decode step's attention is microseconds; no
second OpenMP runtime beside torch's). Where there is no compiler, the build fails, or the
tensors are not float32 with unit-stride heads, ``available()`` is False / the caller
falls back to the torch path. ``tests/worker/test_cpu_decode_kernel.py`` checks it
against that reference.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from vtllm import envs
from vtllm.worker.cpu_precision import cpu_flags

logger = logging.getLogger(__name__)

C_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_GROUP 32
#define MAX_HEAD_DIM 512
#define MAX_BLOCK 256

/* q [R, H, D] (row stride q_stride), k_new / v_new [R, KVH, D] (row strides), caches
   [NB, BS, KVH, D] contiguous, slots [R], tables [R, table_stride], seq_lens [R],
   out [R, H, D] contiguous. Returns 0, or -1 for a shape it does not take. */
int vt_decode_attention_f32(
    const float *q, int64_t q_stride,
    const float *k_new, int64_t k_stride, const float *v_new, int64_t v_stride,
    float *k_cache, float *v_cache,
    const int64_t *slots, const int64_t *tables, int64_t table_stride,
    const int64_t *seq_lens, float *out,
    int64_t R, int64_t H, int64_t KVH, int64_t D, int64_t BS, float scale)
{
    if (KVH <= 0 || H % KVH != 0 || H / KVH > MAX_GROUP || D > MAX_HEAD_DIM || BS > MAX_BLOCK)
        return -1;
    const int64_t G = H / KVH, token = KVH * D;
    for (int64_t r = 0; r < R; r++) {  /* the step's keys and values into the cache */
        memcpy(k_cache + slots[r] * token, k_new + r * k_stride, token * sizeof(float));
        memcpy(v_cache + slots[r] * token, v_new + r * v_stride, token * sizeof(float));
    }
    float acc[MAX_GROUP][MAX_HEAD_DIM], m[MAX_GROUP], l[MAX_GROUP], s[MAX_GROUP][MAX_BLOCK];
    for (int64_t r = 0; r < R; r++) {
        const int64_t *table = tables + r * table_stride;
        for (int64_t h = 0; h < KVH; h++) {
            const float *qh = q + r * q_stride + h * G * D;
            for (int64_t g = 0; g < G; g++) {
                m[g] = -INFINITY;
                l[g] = 0.0f;
                memset(acc[g], 0, D * sizeof(float));
            }
            for (int64_t first = 0; first < seq_lens[r]; first += BS) {  /* one block */
                const int64_t n = seq_lens[r] - first < BS ? seq_lens[r] - first : BS;
                const float *kb = k_cache + table[first / BS] * BS * token + h * D;
                const float *vb = v_cache + table[first / BS] * BS * token + h * D;
                for (int64_t g = 0; g < G; g++) {
                    const float *qg = qh + g * D;
                    float block_max = m[g];
                    for (int64_t j = 0; j < n; j++) {
                        const float *kt = kb + j * token;
                        float dot = 0.0f;
                        #pragma omp simd reduction(+:dot)
                        for (int64_t d = 0; d < D; d++) dot += qg[d] * kt[d];
                        s[g][j] = dot * scale;
                        block_max = s[g][j] > block_max ? s[g][j] : block_max;
                    }
                    const float old = expf(m[g] - block_max);  /* rescale once a block */
                    m[g] = block_max;
                    l[g] *= old;
                    float *a = acc[g];
                    #pragma omp simd
                    for (int64_t d = 0; d < D; d++) a[d] *= old;
                    for (int64_t j = 0; j < n; j++) {
                        const float p = expf(s[g][j] - block_max);
                        const float *vt = vb + j * token;
                        l[g] += p;
                        #pragma omp simd
                        for (int64_t d = 0; d < D; d++) a[d] += p * vt[d];
                    }
                }
            }
            for (int64_t g = 0; g < G; g++) {
                float *o = out + (r * H + h * G + g) * D;
                const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
                for (int64_t d = 0; d < D; d++) o[d] = acc[g][d] * inv;
            }
        }
    }
    return 0;
}
"""

_P = ctypes.c_void_p
_I = ctypes.c_int64
_ARGTYPES = [_P, _I, _P, _I, _P, _I, _P, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, ctypes.c_float]
_state: dict[str, object] = {}  # "lib": the loaded function, or None once a build failed


def _build() -> ctypes._CFuncPtr | None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.info("no C compiler: CPU decode attention stays on the torch path")
        return None
    flags = ["-O3", "-march=native", "-fopenmp-simd", "-fPIC", "-shared"]
    # -march=native: a cache directory shared between machines must not hand one CPU's
    # build to another, so the CPU's flags are part of the name
    cpu = " ".join(sorted(cpu_flags()))
    key = hashlib.sha256((C_SOURCE + " ".join(flags) + cpu).encode()).hexdigest()[:16]
    directory = envs.VT_CACHE_DIR / "native"
    library = directory / f"decode_attention_{key}.so"
    if not library.exists():
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=directory) as scratch:
            source = Path(scratch) / "decode_attention.c"
            source.write_text(C_SOURCE)
            built = Path(scratch) / library.name
            result = subprocess.run(
                [compiler, *flags, str(source), "-o", str(built), "-lm"],
                capture_output=True,
                text=True,
                timeout=120,
            )
            if result.returncode != 0:
                logger.warning(
                    "building the CPU decode-attention kernel failed (torch path instead): %s",
                    result.stderr.strip().splitlines()[-1:] or result.returncode,
                )
                return None
            os.replace(built, library)  # atomic: a concurrent worker sees all or nothing
    function = ctypes.CDLL(str(library)).vt_decode_attention_f32
    function.argtypes = _ARGTYPES
    function.restype = ctypes.c_int
    return function


def available() -> bool:
    """Whether the kernel is built and loaded here (built on the first call)."""
    if "lib" not in _state:
        try:
            _state["lib"] = _build()
        except (OSError, subprocess.SubprocessError) as e:
            logger.warning("the CPU decode-attention kernel is unavailable (%s): torch path", e)
            _state["lib"] = None
    return _state["lib"] is not None


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
) -> torch.Tensor | None:
    """``cpu_compile.cpu_decode_attention`` in one native call: the step's K/V written,
    then ``[num_reqs, num_heads * head_dim]``. None when the kernel cannot take these
    tensors (the caller runs the torch path)."""
    if not available() or q.dtype != torch.float32 or k_cache.dtype != torch.float32:
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
    status = _state["lib"](  # type: ignore[operator]
        q.data_ptr(), q_stride, k.data_ptr(), k_stride, v.data_ptr(), v_stride,
        k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), tables.data_ptr(),
        tables.stride(0), lens.data_ptr(), out.data_ptr(),
        num_reqs, num_heads, num_kv_heads, head_dim, k_cache.shape[1], scale,
    )  # fmt: skip
    return out if status == 0 else None
