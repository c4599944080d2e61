/* Decode attention over the paged KV pool for one (sequence, KV head) pair: the core of cpu_attention.c's
 * ``decode`` (its comment describes the layout), shared with cpu_gemv.c's whole-token decode, which runs it between
 * the layer's matmuls in one parallel region. Static functions in a header: each extension compiles its own copy. */
#ifndef WARMSTART_DECODE_ATTENTION_H
#define WARMSTART_DECODE_ATTENTION_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "isa.h"
#include "vec256.h"
#include "vec512.h"

#define MAX_HEAD_DIM 512
#define MAX_GROUP 16 /* query heads per KV head */

typedef struct {
    void *out;
    const void *q, *k, *v;
    const int64_t *tables, *key_start, *key_end;
    int64_t batch, heads, kv_heads, head_dim, block_size, table_width, head_stride;
    float scale;
    int bf16;
    int block_shift; /* log2(block_size), or -1 when it is not a power of two */
} DecodeArgs;

/* One pool row (a key or a value of one head) as float32. */
static inline void load_row(const DecodeArgs *a, const void *pool, int64_t offset, float *dst) {
    const int64_t d_len = a->head_dim;
    if (a->bf16) {
        const uint16_t *src = (const uint16_t *)pool + offset;
#pragma omp simd
        for (int64_t d = 0; d < d_len; d++) dst[d] = bf16_to_f32(src[d]);
    } else {
        memcpy(dst, (const float *)pool + offset, (size_t)d_len * sizeof(float));
    }
}

static inline int64_t pool_offset(const DecodeArgs *a, const int64_t *table, int64_t h, int64_t j) {
    return h * a->head_stride + (table[j / a->block_size] * a->block_size + j % a->block_size) * a->head_dim;
}

/* pool_offset without a division per key when block_size is a power of two (as the engine's always is). */
static inline int64_t row_offset(const DecodeArgs *a, const int64_t *table, int64_t h, int64_t j) {
    if (a->block_shift < 0) return pool_offset(a, table, h, j);
    const int64_t mask = ((int64_t)1 << a->block_shift) - 1;
    return h * a->head_stride + ((table[j >> a->block_shift] << a->block_shift) + (j & mask)) * a->head_dim;
}

/* The rows of a block that follows are far away in the pool: fetch them while this block is computed. */
static inline void prefetch_rows(const DecodeArgs *a, const void *pool, int64_t offset, int64_t rows) {
    const char *p = (const char *)pool + offset * (a->bf16 ? 2 : 4);
    const int64_t bytes = rows * a->head_dim * (a->bf16 ? 2 : 4);
    for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(p + line, 0, 3);
}

/* How many keys from key j on form one tile: at most ``most``, within j's block, within the ``left`` still to go. */
static inline int64_t tile_length(const DecodeArgs *a, int64_t j, int64_t left, int64_t most) {
    int64_t m = a->block_size - j % a->block_size;
    if (m > most) m = most;
    return m < left ? m : left;
}

#if WARMSTART_X86 /* the compiler's own AVX2 copy of the portable loop, where the CPU has AVX2 */
#define ATTEND_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define ATTEND_CLONES
#endif

/* Sequence b, KV head h: its query heads h*G .. h*G+G-1. ``scores`` holds G * (key_end - key_start) floats.
 * Portable C; attend_avx512 and attend_avx2 below are the same computation with AVX-512 or AVX2. */
ATTEND_CLONES
static void attend(const DecodeArgs *a, int64_t b, int64_t h, float *scores) {
    const int64_t d_len = a->head_dim, group = a->heads / a->kv_heads;
    const int64_t start = a->key_start[b], n = a->key_end[b] - start;
    const int64_t *table = a->tables + b * a->table_width;
    float q[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM], row[MAX_HEAD_DIM];
    float max[MAX_GROUP], sum[MAX_GROUP];

    for (int64_t g = 0; g < group; g++) {
        load_row(a, a->q, (b * a->heads + h * group + g) * d_len, q[g]);
        for (int64_t d = 0; d < d_len; d++) {
            q[g][d] *= a->scale;
            acc[g][d] = 0.f;
        }
        max[g] = -INFINITY;
        sum[g] = 0.f;
    }
    for (int64_t i = 0; i < n; i++) {
        load_row(a, a->k, row_offset(a, table, h, start + i), row);
        for (int64_t g = 0; g < group; g++) {
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < d_len; d++) s += q[g][d] * row[d];
            scores[g * n + i] = s;
            if (s > max[g]) max[g] = s;
        }
    }
    for (int64_t g = 0; g < group; g++) {
        float *sg = scores + g * n, total = 0.f;
        for (int64_t i = 0; i < n; i++) {
            sg[i] = expf(sg[i] - max[g]);
            total += sg[i];
        }
        sum[g] = total;
    }
    for (int64_t i = 0; i < n; i++) {
        load_row(a, a->v, row_offset(a, table, h, start + i), row);
        for (int64_t g = 0; g < group; g++) {
            const float p = scores[g * n + i];
#pragma omp simd
            for (int64_t d = 0; d < d_len; d++) acc[g][d] += p * row[d];
        }
    }
    for (int64_t g = 0; g < group; g++) {
        const int64_t offset = (b * a->heads + h * group + g) * d_len;
        const float inv = n > 0 ? 1.f / sum[g] : 0.f;
        for (int64_t d = 0; d < d_len; d++) {
            const float x = acc[g][d] * inv;
            if (a->bf16)
                ((uint16_t *)a->out)[offset + d] = f32_to_bf16(x);
            else
                ((float *)a->out)[offset + d] = x;
        }
    }
}

#if WARMSTART_X86

/* AVX-512: head_dim a multiple of 16, one zmm per 16 elements of a row. Written out by hand because the
 * compiler vectorizes the portable version poorly: a horizontal sum per dot product, expf one value at a time. */
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))

AVX512 static inline __m512 load16(const DecodeArgs *a, const void *base, int64_t offset) {
    if (a->bf16) {
        __m256i raw = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + offset));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    }
    return _mm512_loadu_ps((const float *)base + offset);
}

/* Lane j of the result is the sum of v[j]'s 16 lanes: a transpose-and-add tree, about 3 instructions per
 * vector where one horizontal sum each costs 8. */
AVX512 static inline __m512 sum_lanes16(const __m512 *v) {
    __m512 pairs[8], quads[4];
    for (int k = 0; k < 8; k++) /* per 128-bit segment: [v2k 0+2, v2k+1 0+2, v2k 1+3, v2k+1 1+3] */
        pairs[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]),
                                 _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
    for (int k = 0; k < 4; k++) { /* per segment: the segment's sum for each of v4k .. v4k+3 */
        const __m512d x = _mm512_castps_pd(pairs[2 * k]), y = _mm512_castps_pd(pairs[2 * k + 1]);
        quads[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    const __m512 q01 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88), _mm512_shuffle_f32x4(quads[0], quads[1], 0xdd));
    const __m512 q23 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88), _mm512_shuffle_f32x4(quads[2], quads[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(q01, q23, 0x88), _mm512_shuffle_f32x4(q01, q23, 0xdd));
}

/* Keys are taken in tiles of up to 16 that lie in one block (rows contiguous in the pool). Inlined with
 * ``chunks`` (head_dim / 16) a constant for the common head sizes, so that a row's vectors stay in registers. */
AVX512 static inline __attribute__((always_inline)) void attend_avx512_impl(const DecodeArgs *a, int64_t b, int64_t h,
                                                                             float *scores, const int64_t chunks) {
    const int64_t d_len = a->head_dim, group = a->heads / a->kv_heads;
    const int64_t start = a->key_start[b], n = a->key_end[b] - start;
    const int64_t *table = a->tables + b * a->table_width;
    /* Flat, so that a small group's vectors sit together. */
    __m512 q[MAX_GROUP * MAX_HEAD_DIM / 16], acc[MAX_GROUP * MAX_HEAD_DIM / 16], dots[MAX_GROUP * 16];
    __m512 row[MAX_HEAD_DIM / 16 > 16 ? MAX_HEAD_DIM / 16 : 16];
    __m512 max_v[MAX_GROUP];

    const __m512 scale = _mm512_set1_ps(a->scale);
    for (int64_t g = 0; g < group; g++) {
        const int64_t offset = (b * a->heads + h * group + g) * d_len;
        for (int64_t c = 0; c < chunks; c++) {
            q[g * chunks + c] = _mm512_mul_ps(load16(a, a->q, offset + 16 * c), scale);
            acc[g * chunks + c] = _mm512_setzero_ps();
        }
        max_v[g] = _mm512_set1_ps(-INFINITY);
    }
    for (int64_t i = 0, m; i < n; i += m) {
        const int64_t j = start + i, offset = row_offset(a, table, h, j);
        m = tile_length(a, j, n - i, 16);
        if (i + m < n) prefetch_rows(a, a->k, row_offset(a, table, h, j + m), m);
        for (int64_t t = 0; t < 16; t++) {
            if (t >= m) {
                for (int64_t g = 0; g < group; g++) dots[g * 16 + t] = _mm512_setzero_ps();
                continue;
            }
            for (int64_t c = 0; c < chunks; c++) row[c] = load16(a, a->k, offset + t * d_len + 16 * c);
            for (int64_t g = 0; g < group; g++) {
                __m512 dot = _mm512_mul_ps(q[g * chunks], row[0]);
                for (int64_t c = 1; c < chunks; c++) dot = _mm512_fmadd_ps(q[g * chunks + c], row[c], dot);
                dots[g * 16 + t] = dot;
            }
        }
        const __mmask16 valid = (__mmask16)((1u << m) - 1);
        for (int64_t g = 0; g < group; g++) {
            const __m512 s = sum_lanes16(dots + g * 16);
            _mm512_mask_storeu_ps(scores + g * n + i, valid, s);
            max_v[g] = _mm512_mask_max_ps(max_v[g], valid, max_v[g], s);
        }
    }
    float sum[MAX_GROUP];
    for (int64_t g = 0; g < group; g++) {
        float *sg = scores + g * n;
        const __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(max_v[g]));
        __m512 total = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; i += 16) {
            const __mmask16 valid = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
            const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(valid, sg + i), max));
            _mm512_mask_storeu_ps(sg + i, valid, e);
            total = _mm512_add_ps(total, _mm512_maskz_mov_ps(valid, e));
        }
        sum[g] = _mm512_reduce_add_ps(total);
    }
    for (int64_t i = 0, m; i < n; i += m) {
        const int64_t j = start + i, offset = row_offset(a, table, h, j);
        m = tile_length(a, j, n - i, 16);
        if (i + m < n) prefetch_rows(a, a->v, row_offset(a, table, h, j + m), m);
        for (int64_t c = 0; c < chunks; c++) {
            for (int64_t t = 0; t < m; t++) row[t] = load16(a, a->v, offset + t * d_len + 16 * c);
            for (int64_t g = 0; g < group; g++) {
                const float *p = scores + g * n + i;
                __m512 out = acc[g * chunks + c];
                for (int64_t t = 0; t < m; t++) out = _mm512_fmadd_ps(_mm512_set1_ps(p[t]), row[t], out);
                acc[g * chunks + c] = out;
            }
        }
    }
    for (int64_t g = 0; g < group; g++) {
        const int64_t offset = (b * a->heads + h * group + g) * d_len;
        const __m512 inv = _mm512_set1_ps(n > 0 ? 1.f / sum[g] : 0.f);
        float x[16];
        for (int64_t c = 0; c < chunks; c++) {
            _mm512_storeu_ps(x, _mm512_mul_ps(acc[g * chunks + c], inv));
            for (int d = 0; d < 16; d++) {
                if (a->bf16)
                    ((uint16_t *)a->out)[offset + 16 * c + d] = f32_to_bf16(x[d]);
                else
                    ((float *)a->out)[offset + 16 * c + d] = x[d];
            }
        }
    }
}

AVX512 static void attend_avx512(const DecodeArgs *a, int64_t b, int64_t h, float *scores) {
    switch (a->head_dim) {
    case 64: attend_avx512_impl(a, b, h, scores, 4); break;
    case 128: attend_avx512_impl(a, b, h, scores, 8); break;
    default: attend_avx512_impl(a, b, h, scores, a->head_dim / 16);
    }
}

/* AVX2 (with FMA and F16C): attend_avx512 on 8 lanes, for head_dim a multiple of 8. Tiles of up to 8 keys; a key's
 * row is held in registers 8 vectors at a time (AVX2 has 16), so head_dim 128 takes two passes over the group. */
VEC256 static inline __m256 load8(const DecodeArgs *a, const void *base, int64_t offset) {
    if (a->bf16) return load_bf16_8((const uint16_t *)base + offset);
    return _mm256_loadu_ps((const float *)base + offset);
}

/* Lane j of the result is the sum of v[j]'s 8 lanes: sum_lanes16's transpose-and-add tree on 8 lanes. */
VEC256 static inline __m256 sum_lanes8x8(const __m256 *v) {
    __m256 pairs[4], quads[2];
    for (int k = 0; k < 4; k++) /* per 128-bit half: [v2k 0+2, v2k+1 0+2, v2k 1+3, v2k+1 1+3] */
        pairs[k] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * k], v[2 * k + 1]),
                                 _mm256_unpackhi_ps(v[2 * k], v[2 * k + 1]));
    for (int k = 0; k < 2; k++) { /* per half: the half's sum for each of v4k .. v4k+3 */
        const __m256d x = _mm256_castps_pd(pairs[2 * k]), y = _mm256_castps_pd(pairs[2 * k + 1]);
        quads[k] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
    }
    return _mm256_add_ps(_mm256_permute2f128_ps(quads[0], quads[1], 0x20),
                         _mm256_permute2f128_ps(quads[0], quads[1], 0x31));
}

/* The largest of x's 8 lanes. */
VEC256 static inline float max_lanes8(__m256 x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* All ones in the lanes below m (0 <= m <= 8), zero above. */
VEC256 static inline __m256 first_lanes8(int64_t m) {
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)m), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

VEC256 static inline __attribute__((always_inline)) void attend_avx2_impl(const DecodeArgs *a, int64_t b, int64_t h,
                                                                           float *scores, const int64_t chunks) {
    const int64_t d_len = a->head_dim, group = a->heads / a->kv_heads;
    const int64_t start = a->key_start[b], n = a->key_end[b] - start;
    const int64_t *table = a->tables + b * a->table_width;
    __m256 q[MAX_GROUP * MAX_HEAD_DIM / 8], acc[MAX_GROUP * MAX_HEAD_DIM / 8], dots[MAX_GROUP * 8], row[8];
    __m256 max_v[MAX_GROUP];

    const __m256 scale = _mm256_set1_ps(a->scale), minus_inf = _mm256_set1_ps(-INFINITY);
    for (int64_t g = 0; g < group; g++) {
        const int64_t offset = (b * a->heads + h * group + g) * d_len;
        for (int64_t c = 0; c < chunks; c++) {
            q[g * chunks + c] = _mm256_mul_ps(load8(a, a->q, offset + 8 * c), scale);
            acc[g * chunks + c] = _mm256_setzero_ps();
        }
        max_v[g] = minus_inf;
    }
    for (int64_t i = 0, m; i < n; i += m) {
        const int64_t j = start + i, offset = row_offset(a, table, h, j);
        m = tile_length(a, j, n - i, 8);
        if (i + m < n) prefetch_rows(a, a->k, row_offset(a, table, h, j + m), m);
        for (int64_t t = 0; t < 8; t++) {
            if (t >= m) {
                for (int64_t g = 0; g < group; g++) dots[g * 8 + t] = _mm256_setzero_ps();
                continue;
            }
            for (int64_t c0 = 0; c0 < chunks; c0 += 8) { /* the dot products summed in order of c either way */
                const int64_t width = chunks - c0 < 8 ? chunks - c0 : 8;
                for (int64_t c = 0; c < width; c++) row[c] = load8(a, a->k, offset + t * d_len + 8 * (c0 + c));
                for (int64_t g = 0; g < group; g++) {
                    const __m256 *qg = q + g * chunks + c0;
                    __m256 dot = c0 == 0 ? _mm256_mul_ps(qg[0], row[0]) : _mm256_fmadd_ps(qg[0], row[0], dots[g * 8 + t]);
                    for (int64_t c = 1; c < width; c++) dot = _mm256_fmadd_ps(qg[c], row[c], dot);
                    dots[g * 8 + t] = dot;
                }
            }
        }
        const __m256 valid = first_lanes8(m);
        for (int64_t g = 0; g < group; g++) {
            const __m256 s = sum_lanes8x8(dots + g * 8);
            if (m == 8) {
                _mm256_storeu_ps(scores + g * n + i, s);
            } else {
                float x[8];
                _mm256_storeu_ps(x, s);
                memcpy(scores + g * n + i, x, sizeof(float) * (size_t)m);
            }
            max_v[g] = _mm256_max_ps(max_v[g], _mm256_blendv_ps(minus_inf, s, valid));
        }
    }
    float sum[MAX_GROUP];
    for (int64_t g = 0; g < group; g++) {
        float *sg = scores + g * n;
        const __m256 max = _mm256_set1_ps(max_lanes8(max_v[g]));
        __m256 total = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + i), max));
            _mm256_storeu_ps(sg + i, e);
            total = _mm256_add_ps(total, e);
        }
        if (i < n) {
            float x[8] = {0};
            memcpy(x, sg + i, sizeof(float) * (size_t)(n - i));
            const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(x), max)), first_lanes8(n - i));
            _mm256_storeu_ps(x, e);
            memcpy(sg + i, x, sizeof(float) * (size_t)(n - i));
            total = _mm256_add_ps(total, e);
        }
        sum[g] = sum_lanes8(total);
    }
    for (int64_t i = 0, m; i < n; i += m) {
        const int64_t j = start + i, offset = row_offset(a, table, h, j);
        m = tile_length(a, j, n - i, 8);
        if (i + m < n) prefetch_rows(a, a->v, row_offset(a, table, h, j + m), m);
        for (int64_t c = 0; c < chunks; c++) {
            for (int64_t t = 0; t < m; t++) row[t] = load8(a, a->v, offset + t * d_len + 8 * c);
            for (int64_t g = 0; g < group; g++) {
                const float *p = scores + g * n + i;
                __m256 out = acc[g * chunks + c];
                for (int64_t t = 0; t < m; t++) out = _mm256_fmadd_ps(_mm256_set1_ps(p[t]), row[t], out);
                acc[g * chunks + c] = out;
            }
        }
    }
    for (int64_t g = 0; g < group; g++) {
        const int64_t offset = (b * a->heads + h * group + g) * d_len;
        const __m256 inv = _mm256_set1_ps(n > 0 ? 1.f / sum[g] : 0.f);
        for (int64_t c = 0; c < chunks; c++) {
            const __m256 x = _mm256_mul_ps(acc[g * chunks + c], inv);
            if (a->bf16)
                _mm_storeu_si128((__m128i *)((uint16_t *)a->out + offset + 8 * c), f32_to_bf16_8(x));
            else
                _mm256_storeu_ps((float *)a->out + offset + 8 * c, x);
        }
    }
}

VEC256 static void attend_avx2(const DecodeArgs *a, int64_t b, int64_t h, float *scores) {
    switch (a->head_dim) {
    case 64: attend_avx2_impl(a, b, h, scores, 8); break;
    case 128: attend_avx2_impl(a, b, h, scores, 16); break;
    default: attend_avx2_impl(a, b, h, scores, a->head_dim / 8);
    }
}

#endif /* WARMSTART_X86 */

/* The pair (b, h) on the best path isa_level allows: AVX-512 for head_dim a multiple of 16, AVX2 for one of 8. */
static void attend_dispatch(const DecodeArgs *a, int64_t b, int64_t h, float *scores) {
#if WARMSTART_X86
    if (isa_level >= ISA_AVX512 && a->head_dim % 16 == 0) {
        attend_avx512(a, b, h, scores);
        return;
    }
    if (isa_level >= ISA_AVX2 && a->head_dim % 8 == 0) {
        attend_avx2(a, b, h, scores);
        return;
    }
#endif
    attend(a, b, h, scores);
}

#endif
