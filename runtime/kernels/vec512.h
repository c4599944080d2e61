/* AVX-512 pieces the CPU kernels share: exp on 16 lanes, bfloat16 <-> float32 on 16 lanes, SiLU-and-mul on 16 lanes.
 * Callers compile their own copies (static inline) inside functions whose target includes these features, and call
 * them only where the CPU has them (checked at run time). */
#ifndef WARMSTART_VEC512_H
#define WARMSTART_VEC512_H

#include "isa.h"

#if WARMSTART_X86

#include <immintrin.h>
#include <stdint.h>

#define VEC512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))

/* exp(x) to about 2 ulp: 2^n * p(r) with x = n ln2 + r, |r| <= ln2 / 2, p a degree-6 Taylor polynomial; values
 * below -104 flush to 0 through scalef's underflow, values above 88.7 overflow to infinity as expf does. */
VEC512 static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.f)), _mm512_set1_ps(89.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723212e-6f), r);
    __m512 p = _mm512_set1_ps(1.f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* f32_to_bf16 (bf16.h) on 16 lanes: round to nearest even, NaN stays NaN. */
VEC512 static inline __m256i f32_to_bf16_16(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(r);
}

/* 16 bfloat16 values as float32. */
VEC512 static inline __m512 bf16_16_to_f32(__m256i x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}

/* bf16(bf16(silu(g)) * u) on 16 lanes, rounded where runtime/layers/activation.py's bfloat16 reference rounds. The
 * exp is exp16's (about 2 ulp in float32, where expf is within 1), so a value within a few float32 ulps of a
 * bfloat16 rounding boundary may round the other way: one unit of the last place, rarely. */
VEC512 static inline __m256i silu_and_mul16(__m512 g, __m512 u) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
    const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    return f32_to_bf16_16(_mm512_mul_ps(bf16_16_to_f32(f32_to_bf16_16(silu)), u));
}

/* out[i] = bf16(bf16(silu(gate[i])) * up[i]) for i < n, all bfloat16. Whole vectors unmasked (a masked store is
 * many times slower than a plain one on AMD's Zen 4), the tail masked. */
VEC512 static inline void silu_and_mul_span(uint16_t *out, const uint16_t *gate, const uint16_t *up, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 g = bf16_16_to_f32(_mm256_loadu_si256((const __m256i *)(gate + i)));
        const __m512 u = bf16_16_to_f32(_mm256_loadu_si256((const __m256i *)(up + i)));
        _mm256_storeu_si256((__m256i *)(out + i), silu_and_mul16(g, u));
    }
    if (i < n) {
        const __mmask16 mask = (__mmask16)((1u << (n - i)) - 1u);
        const __m512 g = bf16_16_to_f32(_mm256_maskz_loadu_epi16(mask, gate + i));
        const __m512 u = bf16_16_to_f32(_mm256_maskz_loadu_epi16(mask, up + i));
        _mm256_mask_storeu_epi16(out + i, mask, silu_and_mul16(g, u));
    }
}

#endif /* WARMSTART_X86 */

#endif
