/* Native CPU kernels of vtllm's workers (built at first use by worker/native_build.py,
   called through ctypes). Two entry points:

   vt_decode_attention_f32  one query token per request over its paged float32 KV cache
                            (worker/cpu_decode_kernel.py; the compiled decode step's
                            attention for 1-2 requests)
   vt_decode_step           a whole decode step of a Llama-family model whose linears are
                            int4 (GGUF Q4_1 layout) and whose LM head is int8: embedding,
                            every layer, final norm and logits in one call
                            (worker/cpu_native_decode.py, which holds the torch reference)

   The products are integer dot products, as llama.cpp's: each activation row is quantised
   per group of 32 to int8 with one float scale (``quantize_rows``), the int4 / int8
   weights are multiplied with it in int32 (AVX2 ``maddubs``/``madd`` where -march=native
   has it, plain C elsewhere: the same integers), and each group's integer sum is scaled
   in float32. OpenMP threads (torch's own libgomp: same soname, one runtime, torch's
   thread count) share out output rows. Every output element is reduced in a fixed order
   by one thread, whatever the batch size or thread count: a request's logits do not
   depend on what it is batched with. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "attention.h" /* attend; simd.h: VT_AVX2, VT_VNNI, exp8, silu_mul */

/* ---------------------------------------------------------------- attention */

/* q [R, H, D] (row stride q_stride), k_new / v_new [R, KVH, D] (row strides), caches
   [NB, BS, KVH, D] contiguous, slots [R], tables [R, table_stride], seq_lens [R],
   out [R, H, D] contiguous. Single-threaded. Returns 0, or -1 for a shape it does not
   take. */
int vt_decode_attention_f32(const float *q, int64_t q_stride, const float *k_new,
                            int64_t k_stride, const float *v_new, int64_t v_stride,
                            float *k_cache, float *v_cache, const int64_t *slots,
                            const int64_t *tables, int64_t table_stride,
                            const int64_t *seq_lens, float *out, int64_t R, int64_t H,
                            int64_t KVH, int64_t D, int64_t BS, float scale) {
    if (!attention_shape_ok(H, KVH, D, BS)) return -1;
    const int64_t G = H / KVH, token = KVH * D;
    for (int64_t r = 0; r < R; r++) { /* the step's keys and values into the cache */
        memcpy(k_cache + slots[r] * token, k_new + r * k_stride, token * sizeof(float));
        memcpy(v_cache + slots[r] * token, v_new + r * v_stride, token * sizeof(float));
    }
    const vt_attention a = {k_cache, v_cache, G, KVH, D, BS, scale};
    for (int64_t r = 0; r < R; r++)
        attend_request(&a, q + r * q_stride, tables + r * table_stride, seq_lens[r],
                       out + r * H * D);
    return 0;
}

/* ---------------------------------------------------------------- decode step */

typedef struct {
    const uint8_t *q;  /* [n / 8, k / 32, 4, 8, 4]: blocks of 8 rows (see q4_block); the
                          nibbles of GGUF Q4_1 groups, interleaved */
    const float *m8;   /* [n / 8, k / 32, 8]: m of each block of 8 rows, group-major
                          (element = nibble * d + m) */
    const float *d8;   /* [n / 8, k / 32, 8]: d of each block of 8 rows, group-major */
    const float *bias; /* [n] or NULL */
    int64_t n, k;      /* n a multiple of 8 */
} vt_q4;

typedef struct {
    vt_q4 qkv, o, gate_up, down;
    const float *input_norm, *post_norm; /* [hidden] */
    const float *q_norm, *k_norm;        /* [head_dim], or NULL (no q/k norm) */
    float *k_cache, *v_cache;            /* [blocks, block_size, kv_heads, head_dim] */
} vt_layer;

typedef struct {
    int64_t hidden, inter, heads, kv_heads, head_dim, vocab, block_size, num_layers;
    int64_t max_position;
    float eps, scale;
    const float *embed;      /* [vocab, hidden] */
    const float *final_norm; /* [hidden] */
    const int8_t *lm_q;      /* [vocab / 8 (rounded up), hidden / 32, 8, 8, 4]: q8_block's */
    const float *lm_scale;   /* [vocab]: logit = scale * (q . x) */
    const float *cos_sin;    /* [max_position, head_dim]: cos | sin */
    const vt_layer *layers;  /* [num_layers] */
} vt_model;

/* Activation rows quantised per group of 32: q = round(x / d) in -127..127 with
   d = max|x| / 127 (round half to even), and the group's float sum (for Q4_1's m). */
typedef struct {
    int8_t *q;  /* [R, k] */
    float *d;   /* [R, k / 32] */
    float *sum; /* [R, k / 32] */
} vt_qrows;

static vt_qrows alloc_qrows(int64_t R, int64_t k) {
    vt_qrows x = {malloc(R * k), malloc(sizeof(float) * R * k / 32),
                  malloc(sizeof(float) * R * k / 32)};
    return x;
}

static int qrows_ok(const vt_qrows *x) { return x->q && x->d && x->sum; }

static void free_qrows(vt_qrows *x) { free(x->q), free(x->d), free(x->sum); }

/* Row r of out from x [k] (any thread may quantise any row). */
static void quantize_row(const float *x, int64_t r, int64_t k, vt_qrows *out) {
    for (int64_t g = 0; g < k / 32; g++) {
        const float *xg = x + g * 32;
        float amax = 0.0f, sum = 0.0f;
        for (int j = 0; j < 32; j++) {
            amax = fabsf(xg[j]) > amax ? fabsf(xg[j]) : amax;
            sum += xg[j];
        }
        const float d = amax / 127.0f;
        int8_t *q = out->q + r * k + g * 32;
        for (int j = 0; j < 32; j++) q[j] = d > 0.0f ? (int8_t)nearbyintf(xg[j] / d) : 0;
        out->d[r * (k / 32) + g] = d;
        out->sum[r * (k / 32) + g] = sum;
    }
}

static void quantize_rows(const float *x, int64_t R, int64_t k, vt_qrows *out) {
    for (int64_t r = 0; r < R; r++) quantize_row(x + r * k, r, k, out);
}

#ifdef VT_AVX2
/* u8 x s8 products of 32 bytes, summed by fours into 8 int32 lanes: one VNNI instruction
   where -march=native has it (AVX-512 VNNI, AVX-VNNI), else maddubs + madd. The same
   integers either way: every caller keeps each pair of products within int16 (nibbles
   times int8, or |x| <= 127 times w <= 127), where maddubs does not saturate. */
#ifdef VT_VNNI
/* acc + the u8 x s8 products of 32 bytes summed by fours (one vpdpbusd). */
static inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#else
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#endif
}
#endif

static inline __m256i dot_u8s8(__m256i u, __m256i s) {
#ifdef VT_VNNI
    return dpbusd(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
#endif

#ifdef VT_AVX2
/* Four activation bytes (elements 4s..4s+3 of a row) in every 32-bit lane. */
static inline __m256i broadcast4(const int8_t *x) {
    int32_t word;
    memcpy(&word, x, 4);
    return _mm256_set1_epi32(word);
}

/* The 8 outputs of weight rows o0..o0+7 (lane j: row o0 + j) for T activation rows (T a
   constant where inlined), group after group, without a horizontal add: each group of a
   block is 128 bytes, four of 32 (p = 0..3), byte 4j + b holding row j's element 8p + b
   in its low nibble and 8p + 4 + b in its high one. A masked load gives eight rows' four
   nibbles of one step of 4 elements, multiplied by that step's 4 activation bytes
   broadcast (maddubs: u8 x s8, pairs summed to int16, |.| <= 3,810); the eight steps of a
   group are summed in int16 (|.| <= 30,480) and widened once (madd); with VNNI, vpdpbusd
   accumulates in int32 instead. Each lane then takes float(dot) * (d_w * d_x): one
   rounding a group, the same arithmetic for every (row, activation row) pair whatever T,
   so a request's outputs do not depend on its batch. */
static inline __attribute__((always_inline)) void q4_block(const uint8_t *wq, const float *d8,
                                                           const float *m8, int64_t G,
                                                           const vt_qrows *x, int64_t r0,
                                                           int T, __m256 *acc, __m256 *mins) {
    const int64_t k = G * 32;
    const __m256i low = _mm256_set1_epi8(15);
    for (int t = 0; t < T; t++) acc[t] = mins[t] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m256i dot[4];
        for (int t = 0; t < T; t++) dot[t] = _mm256_setzero_si256();
#pragma GCC unroll 1
        for (int p = 0; p < 4; p++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(wq + g * 128 + p * 32));
            const __m256i w0 = _mm256_and_si256(v, low);
            const __m256i w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            for (int t = 0; t < T; t++) {
                const int8_t *xs = x->q + (r0 + t) * k + g * 32 + p * 8;
#ifdef VT_VNNI
                dot[t] = dpbusd(dot[t], w0, broadcast4(xs));
                dot[t] = dpbusd(dot[t], w1, broadcast4(xs + 4));
#else
                dot[t] = _mm256_add_epi16(dot[t], _mm256_maddubs_epi16(w0, broadcast4(xs)));
                dot[t] = _mm256_add_epi16(dot[t], _mm256_maddubs_epi16(w1, broadcast4(xs + 4)));
#endif
            }
        }
        const __m256 dw = _mm256_loadu_ps(d8 + g * 8), mw = _mm256_loadu_ps(m8 + g * 8);
        for (int t = 0; t < T; t++) { /* + m * sum(x) of the group, in its own accumulator */
            mins[t] = _mm256_fmadd_ps(mw, _mm256_set1_ps(x->sum[(r0 + t) * G + g]), mins[t]);
#ifndef VT_VNNI
            dot[t] = _mm256_madd_epi16(dot[t], _mm256_set1_epi16(1));
#endif
            const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(x->d[(r0 + t) * G + g]));
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[t]), scale, acc[t]);
        }
    }
}
#endif

/* Row j of block wq's element e of group g (the layout of q4_block). */
static inline int q4_nibble(const uint8_t *wq, int64_t g, int j, int e) {
    const uint8_t byte = wq[g * 128 + (e / 8) * 32 + j * 4 + e % 4];
    return e % 8 < 4 ? byte & 15 : byte >> 4;
}

/* One output row j of block wq against one activation row, in plain C (CPUs without
   AVX2): the sum over groups of float(integer dot) * (d * d_x), group after group, one
   rounding each, as q4_block's lanes. */
static inline float q4_dot_row(const uint8_t *wq, const float *d8, const float *m8, int64_t G,
                               int j, const int8_t *xq, const float *xd, const float *xsum) {
    float acc = 0.0f, mins = 0.0f;
    for (int64_t g = 0; g < G; g++) {
        int32_t dot = 0;
        for (int e = 0; e < 32; e++) dot += q4_nibble(wq, g, j, e) * xq[g * 32 + e];
        acc = fmaf((float)dot, d8[g * 8 + j] * xd[g], acc);
        mins = fmaf(m8[g * 8 + j], xsum[g], mins);
    }
    return acc + mins;
}

/* y[r, o] = x[r] . W[o] (+ bias[o]) for r < R, o < n: W int4 (Q4_1 groups in q4_block's
   layout), x quantised; called inside a parallel region, blocks of 8 output rows shared
   out among its threads, activation rows four at a time (then one at a time), each
   (o, r) reduced the same way whatever R. */
static void q4_linear(const vt_q4 *w, const vt_qrows *x, int64_t R, float *y) {
    const int64_t G = w->k / 32, n = w->n;
#pragma omp for schedule(static)
    for (int64_t o0 = 0; o0 < n; o0 += 8) {
        const uint8_t *wq = w->q + o0 * G * 16; /* [G, 4, 8, 4] */
        const float *d8 = w->d8 + o0 * G, *m8 = w->m8 + o0 * G; /* [G, 8] each */
        for (int64_t r0 = 0; r0 < R;) {
            const int64_t rows = R - r0 >= 4 ? 4 : 1;
            float out[4][8]; /* [activation row t][weight row j] */
#ifdef VT_AVX2
            __m256 acc[4], mins[4];
            if (rows == 4)
                q4_block(wq, d8, m8, G, x, r0, 4, acc, mins);
            else
                q4_block(wq, d8, m8, G, x, r0, 1, acc, mins);
            for (int64_t t = 0; t < rows; t++)
                _mm256_storeu_ps(out[t], _mm256_add_ps(acc[t], mins[t]));
#else
            for (int64_t t = 0; t < rows; t++)
                for (int j = 0; j < 8; j++)
                    out[t][j] = q4_dot_row(wq, d8, m8, G, j, x->q + (r0 + t) * G * 32,
                                           x->d + (r0 + t) * G, x->sum + (r0 + t) * G);
#endif
            for (int64_t t = 0; t < rows; t++)
                for (int j = 0; j < 8; j++)
                    y[(r0 + t) * n + o0 + j] = out[t][j] + (w->bias ? w->bias[o0 + j] : 0.0f);
            r0 += rows;
        }
    }
}

#ifdef VT_AVX2
/* The 8 logits of LM-head rows o0..o0+7 (lane j: row o0 + j) for T activation rows, as
   q4_block does it for int4: each group of a block is 256 bytes, eight of 32 (p = 0..7),
   byte 4j + b holding row j's element 4p + b (int8, -127..127). A load gives eight rows'
   four weights of one step, multiplied by that step's 4 activation bytes broadcast;
   maddubs wants an unsigned operand, so |w| times x carrying w's sign (pairs within
   +-32,258: no saturation), widened every step (madd; vpdpbusd with VNNI). Each lane
   then takes float(dot) * d_x, one rounding a group, the same for every (row, activation
   row) pair whatever T: batch-invariant. */
static inline __attribute__((always_inline)) void q8_block(const int8_t *wq, int64_t G,
                                                           const vt_qrows *x, int64_t r0,
                                                           int T, __m256 *acc) {
    const int64_t k = G * 32;
    for (int t = 0; t < T; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m256i dot[4];
        for (int t = 0; t < T; t++) dot[t] = _mm256_setzero_si256();
#pragma GCC unroll 1
        for (int p = 0; p < 8; p++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(wq + g * 256 + p * 32));
            const __m256i magnitude = _mm256_sign_epi8(w, w);
            for (int t = 0; t < T; t++) {
                const __m256i xs = _mm256_sign_epi8(
                    broadcast4(x->q + (r0 + t) * k + g * 32 + p * 4), w);
#ifdef VT_VNNI
                dot[t] = dpbusd(dot[t], magnitude, xs);
#else
                dot[t] = _mm256_add_epi32(dot[t], dot_u8s8(magnitude, xs));
#endif
            }
        }
        for (int t = 0; t < T; t++)
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[t]),
                                     _mm256_set1_ps(x->d[(r0 + t) * G + g]), acc[t]);
    }
}
#endif

/* One LM-head row j of block wq against one activation row, in plain C (CPUs without
   AVX2): the sum over groups of float(integer dot) * d_x, one rounding each, as
   q8_block's lanes. */
static inline float q8_dot_row(const int8_t *wq, int64_t G, int j, const int8_t *xq,
                               const float *xd) {
    float acc = 0.0f;
    for (int64_t g = 0; g < G; g++) {
        int32_t dot = 0;
        for (int e = 0; e < 32; e++)
            dot += wq[g * 256 + (e / 4) * 32 + j * 4 + e % 4] * xq[g * 32 + e];
        acc = fmaf((float)dot, xd[g], acc);
    }
    return acc;
}

/* logits[r, o] = scale[o] * (q[o] . x[r]): the int8 LM head (q in q8_block's layout, rows
   past n zero), x quantised, inside a parallel region; blocks of 8 rows shared out among
   its threads, activation rows four at a time, then one at a time. */
static void q8_linear(const int8_t *q, const float *scale, int64_t n, int64_t k,
                      const vt_qrows *x, int64_t R, float *y) {
    const int64_t G = k / 32;
#pragma omp for schedule(static)
    for (int64_t o0 = 0; o0 < n; o0 += 8) {
        const int8_t *wq = q + o0 * k; /* [G, 8, 8, 4] */
        const int width = n - o0 < 8 ? (int)(n - o0) : 8;
        for (int64_t r0 = 0; r0 < R;) {
            const int64_t rows = R - r0 >= 4 ? 4 : 1;
            float out[4][8]; /* [activation row t][weight row j] */
#ifdef VT_AVX2
            __m256 acc[4];
            if (rows == 4)
                q8_block(wq, G, x, r0, 4, acc);
            else
                q8_block(wq, G, x, r0, 1, acc);
            for (int64_t t = 0; t < rows; t++) _mm256_storeu_ps(out[t], acc[t]);
#else
            for (int64_t t = 0; t < rows; t++)
                for (int j = 0; j < 8; j++)
                    out[t][j] = q8_dot_row(wq, G, j, x->q + (r0 + t) * k, x->d + (r0 + t) * G);
#endif
            for (int64_t t = 0; t < rows; t++)
                for (int j = 0; j < width; j++)
                    y[(r0 + t) * n + o0 + j] = out[t][j] * scale[o0 + j];
            r0 += rows;
        }
    }
}

/* y [R, n] = x [R, k] times one int4 weight, as inside the step (quantised x, all threads):
   the product alone, for tests and benchmarks. Returns -2 when out of memory. */
int vt_q4_linear(const vt_q4 *w, const float *x, int64_t R, float *y) {
    vt_qrows xq = alloc_qrows(R, w->k);
    int status = qrows_ok(&xq) ? 0 : -2;
    if (status == 0) {
        quantize_rows(x, R, w->k, &xq);
#pragma omp parallel
        q4_linear(w, &xq, R, y);
    }
    free_qrows(&xq);
    return status;
}

/* logits [R, n] of the int8 LM head for hidden states x [R, k], as inside the step. */
int vt_q8_linear(const int8_t *q, const float *scale, int64_t n, int64_t k, const float *x,
                 int64_t R, float *y) {
    vt_qrows xq = alloc_qrows(R, k);
    int status = qrows_ok(&xq) ? 0 : -2;
    if (status == 0) {
        quantize_rows(x, R, k, &xq);
#pragma omp parallel
        q8_linear(q, scale, n, k, &xq, R, y);
    }
    free_qrows(&xq);
    return status;
}

/* out = rms_norm(x) * w over n elements (the torch reference's order: float32, mean of
   squares, rsqrt, then the weight). */
static void rms_norm(const float *x, const float *w, int64_t n, float eps, float *out) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    const float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * inv * w[i];
}

/* Rotate-half (NeoX) rotary of one head in place by the table row cos | sin. */
static void rotate(float *x, const float *cos_sin, int64_t D) {
    const int64_t half = D / 2;
    for (int64_t i = 0; i < half; i++) {
        const float c = cos_sin[i], s = cos_sin[half + i], x1 = x[i], x2 = x[half + i];
        x[i] = x1 * c - x2 * s;
        x[half + i] = x2 * c + x1 * s;
    }
}

/* The step's buffers for R rows, carved in order from one workspace (64-byte aligned
   pieces): x, residual [R, hidden]; h [R, max(hidden, heads * head_dim)]; qkv; attn;
   gate_up [R, 2 inter]; act [R, inter]; the quantised rows (int8 [R, k_max], d and sum
   [R, k_max / 32]). With `base` NULL, only the total is computed. */
typedef struct {
    float *x, *residual, *h, *qkv, *attn, *gate_up, *act;
    vt_qrows xq;
} vt_step_buffers;

static int64_t carve(char *base, int64_t *offset, int64_t bytes, void **out) {
    *out = base ? base + *offset : NULL;
    *offset += (bytes + 63) / 64 * 64;
    return *offset;
}

static int64_t step_buffers(const vt_model *model, int64_t R, char *base, vt_step_buffers *b) {
    const int64_t Hd = model->hidden, I = model->inter, HD = model->heads * model->head_dim;
    const int64_t qkv_width = (model->heads + 2 * model->kv_heads) * model->head_dim;
    const int64_t k_max = I > Hd ? (I > HD ? I : HD) : (Hd > HD ? Hd : HD);
    const int64_t f = sizeof(float);
    int64_t offset = 0;
    carve(base, &offset, f * R * Hd, (void **)&b->x);
    carve(base, &offset, f * R * Hd, (void **)&b->residual);
    carve(base, &offset, f * R * (Hd > HD ? Hd : HD), (void **)&b->h);
    carve(base, &offset, f * R * qkv_width, (void **)&b->qkv);
    carve(base, &offset, f * R * HD, (void **)&b->attn);
    carve(base, &offset, f * R * 2 * I, (void **)&b->gate_up);
    carve(base, &offset, f * R * I, (void **)&b->act);
    carve(base, &offset, R * k_max, (void **)&b->xq.q);
    carve(base, &offset, f * R * k_max / 32, (void **)&b->xq.d);
    return carve(base, &offset, f * R * k_max / 32, (void **)&b->xq.sum);
}

/* Bytes of the workspace vt_decode_step needs for R rows (the caller keeps one, so a
   step allocates nothing: steps of changing sizes do not fragment the heap). */
int64_t vt_decode_step_workspace(const vt_model *model, int64_t R) {
    vt_step_buffers unused;
    return step_buffers(model, R, NULL, &unused);
}

/* One step of R rows, each one token: token ids [R] at positions [R], each written at
   slots[r] and attending over seq_lens[r] keys through tables [R, table_stride]. A row is
   a request's decode or one token of its prompt chunk (the chunk's rows share the table,
   seq_lens[r] = positions[r] + 1: every row's K/V is written before any row of the layer
   attends, so a chunk attends causally). Writes the final normed hidden states [R, hidden]
   and logits [L, vocab] of rows logit_rows [L]. `work`: vt_decode_step_workspace(model, R)
   bytes, 64-byte aligned. Returns 0, or -1 for a shape or row it does not take. */
int vt_decode_step(const vt_model *model, int64_t R, const int64_t *ids,
                   const int64_t *positions, const int64_t *slots, const int64_t *tables,
                   int64_t table_stride, const int64_t *seq_lens, const int64_t *logit_rows,
                   int64_t L, float *logits, float *hidden_out, void *work) {
    const int64_t Hd = model->hidden, I = model->inter, H = model->heads;
    const int64_t KVH = model->kv_heads, D = model->head_dim, BS = model->block_size;
    if (!attention_shape_ok(H, KVH, D, BS) || Hd % 32 || I % 32 || (H * D) % 32 || D % 2)
        return -1;
    for (int64_t r = 0; r < R; r++)
        if (ids[r] < 0 || ids[r] >= model->vocab || positions[r] < 0 ||
            positions[r] >= model->max_position || seq_lens[r] < 1)
            return -1;
    if (L > R || ((uintptr_t)work) % 64) return -1;
    for (int64_t i = 0; i < L; i++)
        if (logit_rows[i] < 0 || logit_rows[i] >= R) return -1;
    const int64_t G = H / KVH, qkv_width = (H + 2 * KVH) * D, token = KVH * D;
    vt_step_buffers b;
    step_buffers(model, R, work, &b);
    float *x = b.x, *residual = b.residual, *h = b.h, *qkv = b.qkv, *attn = b.attn;
    float *gate_up = b.gate_up, *act = b.act;
    vt_qrows xq = b.xq;
    for (int64_t r = 0; r < R; r++) {
        memcpy(x + r * Hd, model->embed + ids[r] * Hd, sizeof(float) * Hd);
        memset(residual + r * Hd, 0, sizeof(float) * Hd);
    }
    const int whole_requests = R >= 2 * omp_get_max_threads();
#pragma omp parallel
    for (int64_t li = 0; li < model->num_layers; li++) {
        const vt_layer *L = model->layers + li;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < R; r++) { /* residual += x; h = norm(residual) */
            for (int64_t i = 0; i < Hd; i++) residual[r * Hd + i] += x[r * Hd + i];
            rms_norm(residual + r * Hd, L->input_norm, Hd, model->eps, h + r * Hd);
            quantize_row(h + r * Hd, r, Hd, &xq);
        }
        q4_linear(&L->qkv, &xq, R, qkv);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < R; r++) { /* q/k norm, rotary, the K/V write */
            float *row = qkv + r * qkv_width;
            const float *cs = model->cos_sin + positions[r] * D;
            for (int64_t head = 0; head < H + KVH; head++) {
                float *v = row + head * D;
                const float *w = head < H ? L->q_norm : L->k_norm;
                if (w) rms_norm(v, w, D, model->eps, v);
                rotate(v, cs, D);
            }
            memcpy(L->k_cache + slots[r] * token, row + H * D, sizeof(float) * token);
            memcpy(L->v_cache + slots[r] * token, row + (H + KVH) * D, sizeof(float) * token);
        }
        const vt_attention a = {L->k_cache, L->v_cache, G, KVH, D, BS, model->scale};
        if (whole_requests) { /* a request's KV heads together: its blocks read once */
#pragma omp for schedule(dynamic, 1)
            for (int64_t r = 0; r < R; r++)
                attend_request(&a, qkv + r * qkv_width, tables + r * table_stride, seq_lens[r],
                               attn + r * H * D);
        } else { /* fewer requests than twice the threads: one KV head each */
#pragma omp for collapse(2) schedule(dynamic, 1)
            for (int64_t r = 0; r < R; r++)
                for (int64_t h = 0; h < KVH; h++)
                    attend(&a, qkv + r * qkv_width, tables + r * table_stride, seq_lens[r], h,
                           h + 1, attn + r * H * D);
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < R; r++) quantize_row(attn + r * H * D, r, H * D, &xq);
        q4_linear(&L->o, &xq, R, x);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < R; r++) {
            for (int64_t i = 0; i < Hd; i++) residual[r * Hd + i] += x[r * Hd + i];
            rms_norm(residual + r * Hd, L->post_norm, Hd, model->eps, h + r * Hd);
            quantize_row(h + r * Hd, r, Hd, &xq);
        }
        q4_linear(&L->gate_up, &xq, R, gate_up);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < R; r++) {
            silu_mul(gate_up + r * 2 * I, gate_up + r * 2 * I + I, I, act + r * I);
            quantize_row(act + r * I, r, I, &xq);
        }
        q4_linear(&L->down, &xq, R, x);
    }
    for (int64_t r = 0; r < R; r++) {
        for (int64_t i = 0; i < Hd; i++) residual[r * Hd + i] += x[r * Hd + i];
        rms_norm(residual + r * Hd, model->final_norm, Hd, model->eps, hidden_out + r * Hd);
    }
    for (int64_t i = 0; i < L; i++) /* the rows that want logits, gathered */
        memcpy(x + i * Hd, hidden_out + logit_rows[i] * Hd, sizeof(float) * Hd);
    quantize_rows(x, L, Hd, &xq);
#pragma omp parallel
    q8_linear(model->lm_q, model->lm_scale, model->vocab, Hd, &xq, L, logits);
    return 0;
}
