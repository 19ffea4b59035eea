/* What -march=native gives the native kernels (cpu_kernels.c, attention.h), and the few
   vector helpers they share. VT_AVX2: AVX2 and FMA; VT_VNNI: vpdpbusd on 256-bit
   vectors. Without AVX2 every kernel runs its plain-C path (the same integers, and float
   sums that differ only in their order). */
#ifndef VT_SIMD_H
#define VT_SIMD_H

#include <math.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VT_AVX2 1
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define VT_VNNI 1
#endif

/* exp(x) lane by lane, Cephes' expf: n = round(x log2 e), r = x - n ln 2 (in two parts),
   e^r by a degree-6 polynomial, times 2^n. Within 2 ulp of expf for x in [-87.3, 88.3];
   0 below (-inf included) and for NaN, x clamped to 88.3 above (finite: a caller that
   divides by 1 + exp(x) gets a tiny number, not NaN). */
static inline __m256 exp8(__m256 x) {
    const __m256 lowest = _mm256_set1_ps(-87.3f), highest = _mm256_set1_ps(88.3f);
    const __m256 keep = _mm256_cmp_ps(x, lowest, _CMP_GE_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lowest), highest);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i two_n = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(two_n)), keep);
}

/* Lane t of the result: the sum of a[t]'s eight lanes. */
static inline __m256 hsum8x8(const __m256 a[8]) {
    const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                         _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

/* The largest of a's eight lanes. */
static inline float hmax8(__m256 a) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

/* The sum of a's eight lanes. */
static inline float hsum8(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

/* silu(x) = x / (1 + e^-x). */
static inline float silu(float x) { return x / (1.0f + expf(-x)); }

/* out[i] = silu(gate[i]) * up[i] for i < n. */
static inline void silu_mul(const float *gate, const float *up, int64_t n, float *out) {
    int64_t i = 0;
#ifdef VT_AVX2
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 e = exp8(_mm256_sub_ps(zero, g));
        const __m256 s = _mm256_div_ps(g, _mm256_add_ps(one, e));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(s, _mm256_loadu_ps(up + i)));
    }
#endif
    for (; i < n; i++) out[i] = silu(gate[i]) * up[i];
}

#endif
