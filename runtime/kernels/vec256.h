/* AVX2 (with FMA and F16C) pieces the CPU kernels share, vec512.h's counterparts on 8 lanes: exp, bfloat16 <->
 * float32, SiLU-and-mul, a horizontal sum. Same contract: callers compile their own copies inside functions whose
 * target includes VEC256's features, and call them only at ISA_AVX2 or above (isa.h). x86 only. */
#ifndef WARMSTART_VEC256_H
#define WARMSTART_VEC256_H

#include "isa.h"

#if WARMSTART_X86

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define VEC256 __attribute__((target("avx2,fma,f16c")))

/* exp(x) as exp16 computes it (vec512.h): 2^n * p(r), the same polynomial, so both paths agree to the bit,
 * subnormal results and the overflow to infinity above 88.72 included. AVX2 has no scalef: 2^n is built in the
 * exponent field as 2^b * 2^a, a = n clamped to the normal exponents [-126, 127], p * 2^b exact and the second
 * multiply rounding once, as scalef does. NaN stays NaN (exp16 gives 0 there). */
VEC256 static inline __m256 exp8(__m256 x) {
    /* constant first: max and min return their second operand where one is NaN */
    x = _mm256_min_ps(_mm256_set1_ps(89.f), _mm256_max_ps(_mm256_set1_ps(-104.f), x));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860682030941723212e-6f), r);
    __m256 p = _mm256_set1_ps(1.f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    /* n in [-150, 128]: b = n - a in [-24, 1] */
    const __m256i ni = _mm256_cvtps_epi32(n);
    const __m256i a = _mm256_min_epi32(_mm256_max_epi32(ni, _mm256_set1_epi32(-126)), _mm256_set1_epi32(127));
    const __m256i b = _mm256_sub_epi32(ni, a);
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 pb = _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(b, bias), 23)));
    return _mm256_mul_ps(pb, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(a, bias), 23)));
}

/* f32_to_bf16 (bf16.h) on 8 lanes: round to nearest even, NaN stays NaN. */
VEC256 static inline __m128i f32_to_bf16_8(__m256 x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
    /* r's lanes hold 16-bit values: pack them (packus works per 128-bit half, so reorder the halves first) */
    const __m256i packed = _mm256_packus_epi32(r, r);
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

/* 8 bfloat16 values as float32. */
VEC256 static inline __m256 bf16_8_to_f32(__m128i x) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16));
}

VEC256 static inline __m256 load_bf16_8(const uint16_t *p) {
    return bf16_8_to_f32(_mm_loadu_si128((const __m128i *)p));
}

/* The sum of x's 8 lanes. */
VEC256 static inline float sum_lanes8(__m256 x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* bf16(bf16(silu(g)) * u) on 8 lanes, as silu_and_mul16 (vec512.h). */
VEC256 static inline __m128i silu_and_mul8(__m256 g, __m256 u) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
    return f32_to_bf16_8(_mm256_mul_ps(bf16_8_to_f32(f32_to_bf16_8(silu)), u));
}

/* out[i] = bf16(bf16(silu(gate[i])) * up[i]) for i < n, all bfloat16; the tail through a zero-padded copy. */
VEC256 static inline void silu_and_mul_span8(uint16_t *out, const uint16_t *gate, const uint16_t *up, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(out + i), silu_and_mul8(load_bf16_8(gate + i), load_bf16_8(up + i)));
    if (i < n) {
        uint16_t g[8] = {0}, u[8] = {0}, o[8];
        for (int64_t j = i; j < n; j++) {
            g[j - i] = gate[j];
            u[j - i] = up[j];
        }
        _mm_storeu_si128((__m128i *)o, silu_and_mul8(load_bf16_8(g), load_bf16_8(u)));
        for (int64_t j = i; j < n; j++) out[j] = o[j - i];
    }
}

#endif /* WARMSTART_X86 */

#endif
