/* Paged decode attention of one request over its float32 cache (part of cpu_kernels.c:
   vt_decode_attention_f32 and the decode step call attend).

   The cache is [blocks, block_size, kv_heads, head_dim]. A call takes KV heads [h0, h1)
   of one request (at most MAX_GROUP query heads) and walks the request's keys block by
   block through its table, every KV head of the range inside each block (a block's rows
   are read once, in order), with an online softmax rescaled once a block (one block's
   scores held, never the whole row). With AVX2 and a head dimension a multiple of 8:
   eight keys' dot products at a time (one 8 x 8 horizontal sum), the block's
   exponentials eight at a time (exp8), and the weighted sum of values with the output
   accumulator in registers, 64 elements at a time. Each output is reduced in a fixed
   order by one thread: it depends neither on the batch, the thread count, nor the range
   of heads a call takes. */
#ifndef VT_ATTENTION_H
#define VT_ATTENTION_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

#define MAX_GROUP 32 /* query heads one call holds */
#define MAX_HEAD_DIM 512
#define MAX_BLOCK 256

static int attention_shape_ok(int64_t H, int64_t KVH, int64_t D, int64_t BS) {
    return KVH > 0 && H % KVH == 0 && H / KVH <= MAX_GROUP && D <= MAX_HEAD_DIM &&
           BS <= MAX_BLOCK;
}

/* What every call shares: the cache, its shape, the softmax scale. */
typedef struct {
    const float *k_cache, *v_cache; /* [blocks, BS, KVH, D] */
    int64_t G, KVH, D, BS;          /* G = query heads per KV head */
    float scale;
} vt_attention;

/* The online softmax of `heads` query heads before any key: no maximum, no sum, no
   output. */
static void start_softmax(int64_t heads, int64_t D, float acc[][MAX_HEAD_DIM], float *m,
                          float *l) {
    for (int64_t i = 0; i < heads; i++) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
        memset(acc[i], 0, D * sizeof(float));
    }
}

/* Plain C. q [H, D]: the request's queries (query head i reads KV head i / G); out
   [H, D]; table: its block ids; seq_len keys. Heads [h0 G, h1 G) are written. */
static void attend_plain(const vt_attention *a, const float *q, const int64_t *table,
                         int64_t seq_len, int64_t h0, int64_t h1, float *out) {
    const int64_t G = a->G, D = a->D, BS = a->BS, token = a->KVH * D, heads = (h1 - h0) * G;
    float acc[MAX_GROUP][MAX_HEAD_DIM], m[MAX_GROUP], l[MAX_GROUP], s[MAX_BLOCK];
    start_softmax(heads, D, acc, m, l);
    for (int64_t first = 0; first < seq_len; first += BS) { /* one block */
        const int64_t n = seq_len - first < BS ? seq_len - first : BS;
        const int64_t block = table[first / BS] * BS * token;
        for (int64_t i = 0; i < heads; i++) {
            const int64_t h = h0 + i / G;
            const float *qi = q + (h0 * G + i) * D;
            const float *kb = a->k_cache + block + h * D, *vb = a->v_cache + block + h * D;
            float block_max = m[i];
            for (int64_t j = 0; j < n; j++) {
                const float *kt = kb + j * token;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < D; d++) dot += qi[d] * kt[d];
                s[j] = dot * a->scale;
                block_max = s[j] > block_max ? s[j] : block_max;
            }
            const float old = expf(m[i] - block_max); /* rescale once a block */
            m[i] = block_max;
            l[i] *= old;
            float *o = acc[i];
#pragma omp simd
            for (int64_t d = 0; d < D; d++) o[d] *= old;
            for (int64_t j = 0; j < n; j++) {
                const float p = expf(s[j] - block_max);
                const float *vt = vb + j * token;
                l[i] += p;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) o[d] += p * vt[d];
            }
        }
    }
    for (int64_t i = 0; i < heads; i++) {
        const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
        for (int64_t d = 0; d < D; d++) out[(h0 * G + i) * D + d] = acc[i][d] * inv;
    }
}

#ifdef VT_AVX2
/* acc[0 .. 8 W) = acc * old + sum_j p[j] v_j[0 .. 8 W) over n value rows (row stride
   `token`), the W accumulators held in registers. */
static inline __attribute__((always_inline)) void weighted_values(float *acc, float old,
                                                                  const float *p,
                                                                  const float *vb, int64_t n,
                                                                  int64_t token, int W) {
    __m256 r[8];
    for (int w = 0; w < W; w++)
        r[w] = _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * w), _mm256_set1_ps(old));
    for (int64_t j = 0; j < n; j++) {
        const __m256 pj = _mm256_set1_ps(p[j]);
        for (int w = 0; w < W; w++)
            r[w] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vb + j * token + 8 * w), r[w]);
    }
    for (int w = 0; w < W; w++) _mm256_storeu_ps(acc + 8 * w, r[w]);
}

/* p[j] = (q . k_j) * scale for the n keys of kb (row stride `token`), eight at a time. */
static inline void block_scores(const float *q, const float *kb, int64_t n, int64_t token,
                                int64_t D, float scale, float *p) {
    const __m256 scale8 = _mm256_set1_ps(scale);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 dots[8];
        for (int t = 0; t < 8; t++) dots[t] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
            const __m256 q8 = _mm256_loadu_ps(q + d);
            for (int t = 0; t < 8; t++)
                dots[t] = _mm256_fmadd_ps(q8, _mm256_loadu_ps(kb + (j + t) * token + d), dots[t]);
        }
        _mm256_storeu_ps(p + j, _mm256_mul_ps(hsum8x8(dots), scale8));
    }
    for (; j < n; j++) { /* the last keys of a partial block, one at a time */
        __m256 dot = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8)
            dot = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(kb + j * token + d),
                                  dot);
        p[j] = hsum8(dot) * scale;
    }
}

/* attend_plain with vectors, for D a multiple of 8. */
static void attend_avx2(const vt_attention *a, const float *q, const int64_t *table,
                        int64_t seq_len, int64_t h0, int64_t h1, float *out) {
    const int64_t G = a->G, D = a->D, BS = a->BS, token = a->KVH * D, heads = (h1 - h0) * G;
    float acc[MAX_GROUP][MAX_HEAD_DIM], m[MAX_GROUP], l[MAX_GROUP];
    float p[MAX_BLOCK + 8]; /* one block's scores, then their exponentials */
    start_softmax(heads, D, acc, m, l);
    for (int64_t first = 0; first < seq_len; first += BS) { /* one block */
        const int64_t n = seq_len - first < BS ? seq_len - first : BS;
        const int64_t block = table[first / BS] * BS * token;
        for (int64_t i = 0; i < heads; i++) {
            const int64_t h = h0 + i / G;
            const float *kb = a->k_cache + block + h * D, *vb = a->v_cache + block + h * D;
            block_scores(q + (h0 * G + i) * D, kb, n, token, D, a->scale, p);
            int64_t j = n;
            for (; j % 8; j++) p[j] = -INFINITY; /* exp8 gives 0 */
            __m256 top = _mm256_set1_ps(m[i]);
            for (j = 0; j < n; j += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(p + j));
            const float block_max = hmax8(top);
            const float old = expf(m[i] - block_max); /* rescale once a block */
            m[i] = block_max;
            __m256 sum = _mm256_setzero_ps();
            for (j = 0; j < n; j += 8) {
                const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + j),
                                                    _mm256_set1_ps(block_max)));
                _mm256_storeu_ps(p + j, e);
                sum = _mm256_add_ps(sum, e);
            }
            l[i] = l[i] * old + hsum8(sum);
            int64_t d = 0;
            for (; d + 64 <= D; d += 64) weighted_values(acc[i] + d, old, p, vb + d, n, token, 8);
            for (; d < D; d += 8) weighted_values(acc[i] + d, old, p, vb + d, n, token, 1);
        }
    }
    for (int64_t i = 0; i < heads; i++) {
        const __m256 inv = _mm256_set1_ps(l[i] > 0.0f ? 1.0f / l[i] : 0.0f);
        float *o = out + (h0 * G + i) * D;
        for (int64_t d = 0; d < D; d += 8)
            _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(acc[i] + d), inv));
    }
}
#endif

/* out[i] = softmax(q_i . K^T * scale) V for the query heads i of KV heads [h0, h1) of one
   request (q, out [H, D]; (h1 - h0) G <= MAX_GROUP), over its seq_len keys. */
static void attend(const vt_attention *a, const float *q, const int64_t *table,
                   int64_t seq_len, int64_t h0, int64_t h1, float *out) {
#ifdef VT_AVX2
    if (a->D % 8 == 0) {
        attend_avx2(a, q, table, seq_len, h0, h1, out);
        return;
    }
#endif
    attend_plain(a, q, table, seq_len, h0, h1, out);
}

/* attend over every KV head of one request, as many a call as MAX_GROUP query heads
   allow. */
static void attend_request(const vt_attention *a, const float *q, const int64_t *table,
                           int64_t seq_len, float *out) {
    const int64_t per_call = MAX_GROUP / a->G < a->KVH ? MAX_GROUP / a->G : a->KVH;
    for (int64_t h = 0; h < a->KVH; h += per_call)
        attend(a, q, table, seq_len, h, h + per_call < a->KVH ? h + per_call : a->KVH, out);
}

#endif
