/* bfloat16 x @ W.T for few rows of x (decode steps): out[m, n] = bf16(sum_k x[m, k] * W[n, k] + bias[n]).
 *
 * A decode step multiplies one row per sequence by every weight matrix, so it is bound by reading the weights
 * from memory once; oneDNN's matmul on its prepacked copy ran well below that bound for one row. Here the plain
 * row-major [N, K] weight (the tensor the snapshot maps, or once prepacking has run its copy in huge pages:
 * runtime/models/huge_pages.py) is read once per call: each block of weight rows is loaded into registers and
 * multiplied by every row of x while it is in the L1 cache. Products of two bf16 values are exact in float32, sums
 * are float32 (in another order than F.linear's), and the result is rounded once to bfloat16 (round to nearest
 * even, bf16.h) after the bias is added, as F.linear does. Output rows are spread over OpenMP threads (torch's
 * libgomp, as cpu_attention.c).
 *
 * Three paths, chosen by isa_level (isa.h) in one place, ``path_for``: AVX512-BF16's dot-product instruction, and
 * for AVX-512 without BF16 and for AVX2 with FMA the bf16 weights widened to float32 in registers (a shift, or a
 * mask) and multiplied and added in float32, on 16 lanes or 8; the same products and float32 sums, so the paths
 * agree but for the order of the sums. Below AVX2 (and on other architectures) the entry points raise RuntimeError;
 * runtime/kernels/cpu_gemv.py falls back to the PyTorch path there. K need not be a multiple of the vector width, N
 * is any.
 *
 * decode_layers (below) runs every decoder layer of a decode step in one call on the same tiles.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "isa.h"
#include "decode_attention.h" /* vec256.h, vec512.h */

#define MAX_ROWS 8 /* rows of x per call: beyond a few, a matmul that reuses weights from cache wins */

/* ROWS (1 to 4) rows of x against weight rows [n0, n0 + count): out[m * out_stride + n] for m < ROWS. */
typedef void (*Stream)(uint16_t *out, int64_t out_stride, const uint16_t *x, int64_t x_stride, const uint16_t *w,
                       int64_t k, const uint16_t *bias, int64_t n0, int64_t count);
/* out[i] = bf16(bf16(silu(gate[i])) * up[i]) for i < n (vec512.h, vec256.h). */
typedef void (*SiluSpan)(uint16_t *out, const uint16_t *gate, const uint16_t *up, int64_t n);

typedef struct {
    Stream stream[4]; /* stream[r - 1] takes r rows of x in one pass */
    SiluSpan silu_and_mul;
} Path;

#if WARMSTART_X86

/* Every path reads each weight row from start to end before the next, for all ROWS rows of x at once: one
 * sequential stream is what the hardware prefetcher follows best (a tile that interleaved eight weight rows read
 * 18-20 GB/s where one row at a time reads 27-30, a plain read's speed, on the 2-core EPYC of docs/BENCHMARKS.md).
 * Each row of x has several accumulators, taking alternate steps of k, to hide the latency of the multiply-add. The
 * stream functions are macros, not functions with a size argument, so that the arrays have constant sizes, the
 * loops unroll and the accumulators stay in registers. */

/* ---- AVX512-BF16: two accumulators per row of x, each a dot product of 32 pairs per step; the tail of a row is a
 * masked load (zeros past the end). */

#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))

BF16_TARGET static inline __m512bh load_bf16(const uint16_t *p, __mmask32 mask) {
    return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

#define DEFINE_STREAM_BF16(ROWS)                                                                                     \
    BF16_TARGET static void stream_bf16_##ROWS(uint16_t *out, int64_t out_stride, const uint16_t *x,                 \
                                               int64_t x_stride, const uint16_t *w, int64_t k, const uint16_t *bias,  \
                                               int64_t n0, int64_t count) {                                          \
        for (int64_t n = n0; n < n0 + count; n++) {                                                                  \
            const uint16_t *wr = w + n * k;                                                                          \
            __m512 acc[2][ROWS];                                                                                     \
            for (int m = 0; m < ROWS; m++) acc[0][m] = acc[1][m] = _mm512_setzero_ps();                              \
            int64_t k0 = 0;                                                                                          \
            for (; k0 + 64 <= k; k0 += 64) {                                                                         \
                const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wr + k0);                                          \
                const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wr + k0 + 32);                                     \
                for (int m = 0; m < ROWS; m++) {                                                                     \
                    const uint16_t *xm = x + m * x_stride + k0;                                                      \
                    acc[0][m] = _mm512_dpbf16_ps(acc[0][m], (__m512bh)_mm512_loadu_si512(xm), w0);                   \
                    acc[1][m] = _mm512_dpbf16_ps(acc[1][m], (__m512bh)_mm512_loadu_si512(xm + 32), w1);              \
                }                                                                                                    \
            }                                                                                                        \
            for (; k0 < k; k0 += 32) {                                                                               \
                const __mmask32 mask = k - k0 >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (k - k0)) - 1u);  \
                const __m512bh wv = load_bf16(wr + k0, mask);                                                        \
                for (int m = 0; m < ROWS; m++)                                                                       \
                    acc[0][m] = _mm512_dpbf16_ps(acc[0][m], load_bf16(x + m * x_stride + k0, mask), wv);             \
            }                                                                                                        \
            for (int m = 0; m < ROWS; m++) {                                                                         \
                float sum = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][m], acc[1][m]));                               \
                if (bias) sum += bf16_to_f32(bias[n]);                                                               \
                out[m * out_stride + n] = f32_to_bf16(sum);                                                          \
            }                                                                                                        \
        }                                                                                                            \
    }

DEFINE_STREAM_BF16(1)
DEFINE_STREAM_BF16(2)
DEFINE_STREAM_BF16(3)
DEFINE_STREAM_BF16(4)

VEC512 static void silu_and_mul_16(uint16_t *out, const uint16_t *gate, const uint16_t *up, int64_t n) {
    silu_and_mul_span(out, gate, up, n);
}

/* ---- AVX2 with FMA: 16 bf16 of a row per load, widened to float32 as two vectors with no shuffle: a bf16 is the
 * high half of its float32, so the even elements (0, 2, .., 14) are the 32-bit lanes shifted left by 16 and the
 * odd ones the lanes with their low half masked off. x is widened the same way, so even pairs with even and odd
 * with odd, each into its own accumulator: 2 * STEPS accumulators per row of x, STEPS loads of a weight row per
 * step (as many as the 16 registers hold for ROWS rows; at 1 row 4 steps measured 2% faster than 2 in whole decode
 * steps). The tail of a row goes through a zero-padded copy. */

VEC256 static inline __m256 bf16_even8(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }

VEC256 static inline __m256 bf16_odd8(__m256i v) {
    return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
}

/* 16 bf16 from p, of which the first ``left`` (1 to 16) are read and the rest are zero. */
VEC256 static inline __m256i load_bf16_16_tail(const uint16_t *p, int64_t left) {
    if (left >= 16) return _mm256_loadu_si256((const __m256i *)p);
    uint16_t padded[16] = {0};
    memcpy(padded, p, (size_t)left * sizeof(uint16_t));
    return _mm256_loadu_si256((const __m256i *)padded);
}

#define DEFINE_STREAM_AVX2(ROWS, STEPS)                                                                              \
    VEC256 static void stream_avx2_##ROWS(uint16_t *out, int64_t out_stride, const uint16_t *x, int64_t x_stride,    \
                                          const uint16_t *w, int64_t k, const uint16_t *bias, int64_t n0,            \
                                          int64_t count) {                                                           \
        for (int64_t n = n0; n < n0 + count; n++) {                                                                  \
            const uint16_t *wr = w + n * k;                                                                          \
            __m256 acc[2 * STEPS][ROWS];                                                                             \
            for (int a = 0; a < 2 * STEPS; a++)                                                                      \
                for (int m = 0; m < ROWS; m++) acc[a][m] = _mm256_setzero_ps();                                      \
            int64_t k0 = 0;                                                                                          \
            for (; k0 + 16 * STEPS <= k; k0 += 16 * STEPS)                                                           \
                for (int s = 0; s < STEPS; s++) {                                                                    \
                    const __m256i wv = _mm256_loadu_si256((const __m256i *)(wr + k0 + 16 * s));                      \
                    const __m256 even = bf16_even8(wv), odd = bf16_odd8(wv);                                         \
                    for (int m = 0; m < ROWS; m++) {                                                                 \
                        const __m256i xv = _mm256_loadu_si256((const __m256i *)(x + m * x_stride + k0 + 16 * s));    \
                        acc[2 * s][m] = _mm256_fmadd_ps(bf16_even8(xv), even, acc[2 * s][m]);                        \
                        acc[2 * s + 1][m] = _mm256_fmadd_ps(bf16_odd8(xv), odd, acc[2 * s + 1][m]);                  \
                    }                                                                                                \
                }                                                                                                    \
            for (; k0 < k; k0 += 16) {                                                                               \
                const __m256i wv = load_bf16_16_tail(wr + k0, k - k0);                                               \
                const __m256 even = bf16_even8(wv), odd = bf16_odd8(wv);                                             \
                for (int m = 0; m < ROWS; m++) {                                                                     \
                    const __m256i xv = load_bf16_16_tail(x + m * x_stride + k0, k - k0);                             \
                    acc[0][m] = _mm256_fmadd_ps(bf16_even8(xv), even, acc[0][m]);                                    \
                    acc[1][m] = _mm256_fmadd_ps(bf16_odd8(xv), odd, acc[1][m]);                                      \
                }                                                                                                    \
            }                                                                                                        \
            for (int m = 0; m < ROWS; m++) {                                                                         \
                __m256 total = acc[0][m];                                                                            \
                for (int a = 1; a < 2 * STEPS; a++) total = _mm256_add_ps(total, acc[a][m]);                         \
                float sum = sum_lanes8(total);                                                                       \
                if (bias) sum += bf16_to_f32(bias[n]);                                                               \
                out[m * out_stride + n] = f32_to_bf16(sum);                                                          \
            }                                                                                                        \
        }                                                                                                            \
    }

DEFINE_STREAM_AVX2(1, 4)
DEFINE_STREAM_AVX2(2, 2)
DEFINE_STREAM_AVX2(3, 1)
DEFINE_STREAM_AVX2(4, 1)

VEC256 static void silu_and_mul_8(uint16_t *out, const uint16_t *gate, const uint16_t *up, int64_t n) {
    silu_and_mul_span8(out, gate, up, n);
}

/* ---- AVX-512 without BF16: the AVX2 path on 16 lanes, 32 bf16 of a row per load; the tail a masked load. Whole
 * decode steps of SmolLM2-135M at 1 row (2-core EPYC, side by side) measured 0.87-0.93x the AVX2 path's time, and
 * 0.94-0.97x the AVX512-BF16 path's. */

VEC512 static inline __m512 bf16_even16(__m512i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }

VEC512 static inline __m512 bf16_odd16(__m512i v) {
    return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u)));
}

#define DEFINE_STREAM_AVX512(ROWS, STEPS)                                                                            \
    VEC512 static void stream_avx512_##ROWS(uint16_t *out, int64_t out_stride, const uint16_t *x, int64_t x_stride,  \
                                            const uint16_t *w, int64_t k, const uint16_t *bias, int64_t n0,          \
                                            int64_t count) {                                                         \
        for (int64_t n = n0; n < n0 + count; n++) {                                                                  \
            const uint16_t *wr = w + n * k;                                                                          \
            __m512 acc[2 * STEPS][ROWS];                                                                             \
            for (int a = 0; a < 2 * STEPS; a++)                                                                      \
                for (int m = 0; m < ROWS; m++) acc[a][m] = _mm512_setzero_ps();                                      \
            int64_t k0 = 0;                                                                                          \
            for (; k0 + 32 * STEPS <= k; k0 += 32 * STEPS)                                                           \
                for (int s = 0; s < STEPS; s++) {                                                                    \
                    const __m512i wv = _mm512_loadu_si512(wr + k0 + 32 * s);                                         \
                    const __m512 even = bf16_even16(wv), odd = bf16_odd16(wv);                                       \
                    for (int m = 0; m < ROWS; m++) {                                                                 \
                        const __m512i xv = _mm512_loadu_si512(x + m * x_stride + k0 + 32 * s);                       \
                        acc[2 * s][m] = _mm512_fmadd_ps(bf16_even16(xv), even, acc[2 * s][m]);                       \
                        acc[2 * s + 1][m] = _mm512_fmadd_ps(bf16_odd16(xv), odd, acc[2 * s + 1][m]);                 \
                    }                                                                                                \
                }                                                                                                    \
            for (; k0 < k; k0 += 32) {                                                                               \
                const __mmask32 mask = k - k0 >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (k - k0)) - 1u);  \
                const __m512i wv = _mm512_maskz_loadu_epi16(mask, wr + k0);                                          \
                const __m512 even = bf16_even16(wv), odd = bf16_odd16(wv);                                           \
                for (int m = 0; m < ROWS; m++) {                                                                     \
                    const __m512i xv = _mm512_maskz_loadu_epi16(mask, x + m * x_stride + k0);                        \
                    acc[0][m] = _mm512_fmadd_ps(bf16_even16(xv), even, acc[0][m]);                                   \
                    acc[1][m] = _mm512_fmadd_ps(bf16_odd16(xv), odd, acc[1][m]);                                     \
                }                                                                                                    \
            }                                                                                                        \
            for (int m = 0; m < ROWS; m++) {                                                                         \
                __m512 total = acc[0][m];                                                                            \
                for (int a = 1; a < 2 * STEPS; a++) total = _mm512_add_ps(total, acc[a][m]);                         \
                float sum = _mm512_reduce_add_ps(total);                                                             \
                if (bias) sum += bf16_to_f32(bias[n]);                                                               \
                out[m * out_stride + n] = f32_to_bf16(sum);                                                          \
            }                                                                                                        \
        }                                                                                                            \
    }

DEFINE_STREAM_AVX512(1, 2)
DEFINE_STREAM_AVX512(2, 2)
DEFINE_STREAM_AVX512(3, 1)
DEFINE_STREAM_AVX512(4, 1)

static const Path path_bf16 = {{stream_bf16_1, stream_bf16_2, stream_bf16_3, stream_bf16_4}, silu_and_mul_16};
static const Path path_avx512 = {{stream_avx512_1, stream_avx512_2, stream_avx512_3, stream_avx512_4}, silu_and_mul_16};
static const Path path_avx2 = {{stream_avx2_1, stream_avx2_2, stream_avx2_3, stream_avx2_4}, silu_and_mul_8};

#endif /* WARMSTART_X86 */

/* The path isa_level allows, or NULL below AVX2 (with a RuntimeError set that names ``what`` was refused). */
static const Path *path_for(const char *what) {
#if WARMSTART_X86
    if (isa_level >= ISA_AVX512_BF16) return &path_bf16;
    if (isa_level >= ISA_AVX512) return &path_avx512;
    if (isa_level >= ISA_AVX2) return &path_avx2;
#endif
    PyErr_Format(PyExc_RuntimeError,
                 "%s: the kernel needs AVX2 with FMA and F16C, and the kernels run at '%s' here (this CPU, or "
                 "WARMSTART_CPU_ISA): use the PyTorch path (runtime/kernels/cpu_gemv.py's cpu_supported() says which)",
                 what, isa_names[isa_level]);
    return NULL;
}

#define ROW_BLOCK 8 /* weight rows per block: read from memory by the first pass, from L1 by the others */

/* Weight rows [n_begin, n_end) for all rows of x: over each block of weight rows, the rows of x in passes of up to 4
 * (more rows in one pass would need more accumulators than there are registers). */
static void gemv_range(const Path *path, uint16_t *out, const uint16_t *x, int64_t x_stride, const uint16_t *w,
                       const uint16_t *bias, int64_t rows, int64_t n, int64_t k, int64_t n_begin, int64_t n_end) {
    for (int64_t n0 = n_begin; n0 < n_end; n0 += ROW_BLOCK) {
        const int64_t count = n_end - n0 < ROW_BLOCK ? n_end - n0 : ROW_BLOCK;
        for (int64_t m = 0; m < rows; m += 4) {
            const int64_t pass = rows - m < 4 ? rows - m : 4;
            path->stream[pass - 1](out + m * n, n, x + m * x_stride, x_stride, w, k, bias, n0, count);
        }
    }
}

/* Too little work is not worth waking the other threads for (about 64 KiB of weights each). */
static int threads_for(int64_t n, int64_t k, int num_threads) {
    const int64_t by_size = (n * k * 2) / 65536;
    if (by_size < 1) return 1;
    return by_size < num_threads ? (int)by_size : num_threads;
}

static PyObject *gemv(PyObject *self, PyObject *args) {
    unsigned long long out, x, w, bias;
    long long rows, n, k, x_stride;
    int num_threads;
    if (!PyArg_ParseTuple(args, "KKKKLLLLi", &out, &x, &w, &bias, &rows, &n, &k, &x_stride, &num_threads))
        return NULL;
    const Path *path = path_for("gemv");
    if (path == NULL) return NULL;
    if (rows < 0 || rows > MAX_ROWS || n < 0 || k < 0 || x_stride < k)
        return PyErr_Format(PyExc_ValueError, "gemv: rows %lld (at most %d), n %lld, k %lld, x_stride %lld", rows,
                            MAX_ROWS, n, k, x_stride);
    const int threads = threads_for(n, k, num_threads);
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        /* contiguous ranges of whole blocks: each thread streams its own part of the matrix */
        const int64_t blocks = (n + ROW_BLOCK - 1) / ROW_BLOCK;
        const int64_t begin = blocks * t / nt * ROW_BLOCK, end = blocks * (t + 1) / nt * ROW_BLOCK;
        gemv_range(path, (uint16_t *)out, (const uint16_t *)x, x_stride, (const uint16_t *)w, (const uint16_t *)bias,
                   rows, n, k, begin, end < n ? end : n);
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* ---- A decode step's decoder layers in one call (runtime/models/fused_decode.py): for every layer, the rows of
 * the step through [RMSNorm, qkv, rotary, KV write], attention over the pool (decode_attention.h, as cpu_attention.c's
 * decode runs it) and [o, residual add + RMSNorm, gate_up, SiLU-and-mul, down, residual add], all in one OpenMP
 * parallel region with a barrier where a phase needs all of the one before. Per layer that replaces about fifteen
 * PyTorch ops, or three C calls with their Python, each of which cost more than its work at one row. Each phase
 * rounds to bf16 where its PyTorch reference does (runtime/layers/norm.py, rotary.py, activation.py): only the
 * matmuls' sums differ in order. */

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* Weight rows [begin, end) of n for thread t of nt, in whole blocks. */
static inline void thread_range(int64_t n, int t, int nt, int64_t *begin, int64_t *end) {
    const int64_t blocks = (n + ROW_BLOCK - 1) / ROW_BLOCK;
    *begin = blocks * t / nt * ROW_BLOCK;
    *end = blocks * (t + 1) / nt * ROW_BLOCK;
    if (*end > n) *end = n;
}

/* out = bf16(w * bf16(s * rsqrt(mean(s^2) + eps))), s one row of dim. */
static void norm_row(uint16_t *out, const uint16_t *s, const uint16_t *w, int64_t dim, float eps) {
    float sq = 0.0f;
    for (int64_t d = 0; d < dim; d++) {
        const float v = bf16_to_f32(s[d]);
        sq += v * v;
    }
    const float inv = 1.0f / sqrtf(sq / (float)dim + eps);
    for (int64_t d = 0; d < dim; d++)
        out[d] = f32_to_bf16(bf16_to_f32(w[d]) * round_bf16(bf16_to_f32(s[d]) * inv));
}

/* x * cos + rotate_half(x) * sin for one head, each product and the sum rounded, into out. */
static void rotate_head(uint16_t *out, const uint16_t *x, const uint16_t *c, const uint16_t *s, int64_t head_dim) {
    const int64_t half = head_dim / 2;
    for (int64_t d = 0; d < head_dim; d++) {
        const float v = bf16_to_f32(x[d]);
        const float other = d < half ? -bf16_to_f32(x[d + half]) : bf16_to_f32(x[d - half]);
        out[d] = f32_to_bf16(round_bf16(v * bf16_to_f32(c[d])) + round_bf16(other * bf16_to_f32(s[d])));
    }
}

/* One layer's tensors: a row of int64 per layer, laid out by runtime/models/fused_decode.py (LAYER_FIELDS). */
enum { L_INPUT_NORM, L_QKV, L_QKV_BIAS, L_O, L_POST_NORM, L_GATE_UP, L_DOWN, L_K_CACHE, L_V_CACHE, L_WINDOW, L_FIELDS };

typedef struct {
    int64_t rows, hidden, heads, kv_heads, head_dim, inter, n_qkv;
    const uint16_t *cos, *sin;
    const int64_t *positions, *slots;
    DecodeArgs attention; /* per layer: k, v, key_start and out/q filled in */
    const int64_t *key_starts; /* [windows, rows]: a layer's row is its L_WINDOW */
    float eps;
    /* shared between the threads */
    uint16_t *qkv, *q, *attn, *o, *gu, *act;
} Step;

/* Thread t's part of one layer; every thread runs it, the caller's region holds them all. ``h`` and ``summed`` are
 * the thread's own (each computes the norms in full rather than wait for one thread to), ``scores`` too. The
 * matmuls and SiLU-and-mul on ``path``, attention on the path isa_level allows (attend_dispatch), the norms and
 * rotary in plain C. */
static void decode_layer(const Path *path, Step *st, const int64_t *layer, uint16_t *x, uint16_t *h,
                         uint16_t *summed, float *scores, int t, int nt) {
    const int64_t rows = st->rows, hidden = st->hidden, inter = st->inter, n_qkv = st->n_qkv;
    const int64_t heads = st->heads, kv_heads = st->kv_heads, head_dim = st->head_dim;
    const uint16_t *qkv_bias = (const uint16_t *)(uintptr_t)layer[L_QKV_BIAS];
    uint16_t *k_cache = (uint16_t *)(uintptr_t)layer[L_K_CACHE], *v_cache = (uint16_t *)(uintptr_t)layer[L_V_CACHE];
    int64_t begin, end;

    for (int64_t m = 0; m < rows; m++)
        norm_row(h + m * hidden, x + m * hidden, (const uint16_t *)(uintptr_t)layer[L_INPUT_NORM], hidden, st->eps);
    thread_range(n_qkv, t, nt, &begin, &end);
    gemv_range(path, st->qkv, h, hidden, (const uint16_t *)(uintptr_t)layer[L_QKV], qkv_bias, rows, n_qkv, hidden,
               begin, end);
#pragma omp barrier
#pragma omp for schedule(static)
    for (int64_t j = 0; j < rows * (heads + 2 * kv_heads); j++) { /* rotary into q; k rotated, v as is, to the pool */
        const int64_t m = j / (heads + 2 * kv_heads), head = j % (heads + 2 * kv_heads);
        const int64_t pos = st->positions[m], slot = st->slots[m];
        const uint16_t *src = st->qkv + m * n_qkv + head * head_dim;
        const uint16_t *c = st->cos + pos * head_dim, *s = st->sin + pos * head_dim;
        const int64_t head_stride = st->attention.head_stride;
        if (head < heads)
            rotate_head(st->q + (m * heads + head) * head_dim, src, c, s, head_dim);
        else if (head < heads + kv_heads) {
            if (slot >= 0) rotate_head(k_cache + (head - heads) * head_stride + slot * head_dim, src, c, s, head_dim);
        } else if (slot >= 0)
            memcpy(v_cache + (head - heads - kv_heads) * head_stride + slot * head_dim, src, (size_t)head_dim * 2);
    }
    DecodeArgs a = st->attention;
    a.k = k_cache;
    a.v = v_cache;
    a.key_start = st->key_starts + layer[L_WINDOW] * rows;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < rows * kv_heads; i++) attend_dispatch(&a, i / kv_heads, i % kv_heads, scores);
    const int64_t attn_width = heads * head_dim;
    thread_range(hidden, t, nt, &begin, &end);
    gemv_range(path, st->o, st->attn, attn_width, (const uint16_t *)(uintptr_t)layer[L_O], NULL, rows, hidden,
               attn_width, begin, end);
#pragma omp barrier
    for (int64_t m = 0; m < rows; m++) { /* summed = bf16(x + o), h = norm(summed) */
        for (int64_t d = 0; d < hidden; d++)
            summed[m * hidden + d] = f32_to_bf16(bf16_to_f32(x[m * hidden + d]) + bf16_to_f32(st->o[m * hidden + d]));
        norm_row(h + m * hidden, summed + m * hidden, (const uint16_t *)(uintptr_t)layer[L_POST_NORM], hidden,
                 st->eps);
    }
    /* each thread its gate rows and the matching up rows, so SiLU-and-mul needs no barrier */
    const uint16_t *gate_up = (const uint16_t *)(uintptr_t)layer[L_GATE_UP];
    thread_range(inter, t, nt, &begin, &end);
    gemv_range(path, st->gu, h, hidden, gate_up, NULL, rows, 2 * inter, hidden, begin, end);
    gemv_range(path, st->gu, h, hidden, gate_up, NULL, rows, 2 * inter, hidden, inter + begin, inter + end);
    for (int64_t m = 0; m < rows; m++)
        path->silu_and_mul(st->act + m * inter + begin, st->gu + m * 2 * inter + begin,
                          st->gu + m * 2 * inter + inter + begin, end - begin);
#pragma omp barrier
    /* down, then the residual add for this thread's columns (o is free again: every thread has read it) */
    thread_range(hidden, t, nt, &begin, &end);
    gemv_range(path, st->o, st->act, inter, (const uint16_t *)(uintptr_t)layer[L_DOWN], NULL, rows, hidden, inter,
               begin, end);
    for (int64_t m = 0; m < rows; m++)
        for (int64_t d = begin; d < end; d++)
            x[m * hidden + d] = f32_to_bf16(bf16_to_f32(summed[m * hidden + d]) + bf16_to_f32(st->o[m * hidden + d]));
#pragma omp barrier
}

/* logits[m] = float(bf16(head . bf16(norm(x[m])))) for this thread's rows of the head, as runtime/models/model.py's
 * _logits computes them (its rms_norm, the gemv, float()); ``h`` the thread's own, ``scratch`` [rows, vocab] shared. */
static void final_logits(const Path *path, const Step *st, const uint16_t *x, const uint16_t *norm,
                         const uint16_t *head, int64_t vocab, uint16_t *scratch, float *logits, uint16_t *h, int t,
                         int nt) {
    const int64_t rows = st->rows, hidden = st->hidden;
    int64_t begin, end;
    for (int64_t m = 0; m < rows; m++) norm_row(h + m * hidden, x + m * hidden, norm, hidden, st->eps);
    thread_range(vocab, t, nt, &begin, &end);
    gemv_range(path, scratch, h, hidden, head, NULL, rows, vocab, hidden, begin, end);
    for (int64_t m = 0; m < rows; m++)
        for (int64_t d = begin; d < end; d++) logits[m * vocab + d] = bf16_to_f32(scratch[m * vocab + d]);
}

static PyObject *decode_layers(PyObject *self, PyObject *args) {
    unsigned long long x, layer_table, cos_t, sin_t, positions, slots, tables, key_starts, key_ends, final_norm, head,
        logits;
    long long rows, num_layers, hidden, heads, kv_heads, head_dim, inter, block_size, table_width, head_stride, vocab;
    float eps;
    int num_threads;
    if (!PyArg_ParseTuple(args, "KKKKKKKKKLLLLLLLLLLfiKKLK", &x, &layer_table, &cos_t, &sin_t, &positions, &slots,
                          &tables, &key_starts, &key_ends, &rows, &num_layers, &hidden, &heads, &kv_heads, &head_dim,
                          &inter, &block_size, &table_width, &head_stride, &eps, &num_threads, &final_norm, &head,
                          &vocab, &logits))
        return NULL;
    const Path *path = path_for("decode_layers");
    if (path == NULL) return NULL;
    if (rows < 1 || rows > MAX_ROWS || head_dim % 2 || head_dim > MAX_HEAD_DIM || kv_heads < 1 || heads % kv_heads ||
        heads / kv_heads > MAX_GROUP || block_size < 1 || num_threads < 1 || (head && (vocab < 1 || !logits || !final_norm)))
        return PyErr_Format(PyExc_ValueError,
                            "decode_layers: rows %lld (at most %d), heads %lld, kv_heads %lld, head_dim %lld, block "
                            "size %lld",
                            rows, MAX_ROWS, heads, kv_heads, head_dim, block_size);
    Step st = {.rows = rows, .hidden = hidden, .heads = heads, .kv_heads = kv_heads, .head_dim = head_dim,
               .inter = inter, .n_qkv = (heads + 2 * kv_heads) * head_dim, .eps = eps,
               .cos = (const uint16_t *)(uintptr_t)cos_t, .sin = (const uint16_t *)(uintptr_t)sin_t,
               .positions = (const int64_t *)(uintptr_t)positions, .slots = (const int64_t *)(uintptr_t)slots,
               .key_starts = (const int64_t *)(uintptr_t)key_starts};
    const int64_t q_size = heads * head_dim;
    DecodeArgs *a = &st.attention;
    a->tables = (const int64_t *)(uintptr_t)tables;
    a->key_end = (const int64_t *)(uintptr_t)key_ends;
    a->batch = rows;
    a->heads = heads;
    a->kv_heads = kv_heads;
    a->head_dim = head_dim;
    a->block_size = block_size;
    a->table_width = table_width;
    a->head_stride = head_stride;
    a->scale = 1.0f / sqrtf((float)head_dim);
    a->bf16 = 1;
    a->block_shift = -1;
    for (int shift = 0; shift < 31; shift++)
        if (((int64_t)1 << shift) == block_size) a->block_shift = shift;
    int64_t longest = 1;
    for (int64_t m = 0; m < rows; m++)
        if (a->key_end[m] > longest) longest = a->key_end[m]; /* key_start >= 0: no window attends more */
    /* shared buffers, then each thread's own: h and summed, and attention scores */
    const int64_t shared = rows * (st.n_qkv + 3 * q_size + hidden + 3 * inter + (head ? vocab : 0)),
                  own = 2 * rows * hidden;
    const int64_t score_floats = heads / kv_heads * longest;
    uint16_t *buffer = malloc(sizeof(uint16_t) * (size_t)(shared + num_threads * own));
    float *scores = malloc(sizeof(float) * (size_t)(num_threads * score_floats));
    if (buffer == NULL || scores == NULL) {
        free(buffer);
        free(scores);
        return PyErr_NoMemory();
    }
    st.qkv = buffer;
    st.q = st.qkv + rows * st.n_qkv;
    st.attn = st.q + rows * q_size;
    st.o = st.attn + rows * q_size;
    st.gu = st.o + rows * hidden;
    st.act = st.gu + rows * 2 * inter;
    a->q = st.q;
    a->out = st.attn;
    const int64_t *layers = (const int64_t *)(uintptr_t)layer_table;
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel num_threads(num_threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        uint16_t *mine = buffer + shared + t * own;
        for (int64_t i = 0; i < num_layers; i++)
            decode_layer(path, &st, layers + i * L_FIELDS, (uint16_t *)(uintptr_t)x, mine, mine + rows * hidden,
                         scores + t * score_floats, t, nt);
        if (head) /* the final norm and the LM head over this thread's part of the vocabulary, as float32 logits */
            final_logits(path, &st, (const uint16_t *)(uintptr_t)x, (const uint16_t *)(uintptr_t)final_norm,
                         (const uint16_t *)(uintptr_t)head, vocab, st.act + rows * inter, (float *)(uintptr_t)logits,
                         mine, t, nt);
    }
    Py_END_ALLOW_THREADS
    free(buffer);
    free(scores);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"gemv", gemv, METH_VARARGS,
     "gemv(out, x, weight, bias, rows, n, k, x_stride, num_threads): out [rows, n] = x [rows, k] @ weight.T + bias, "
     "all bfloat16, weight [n, k] row-major; bias 0: none"},
    {"decode_layers", decode_layers, METH_VARARGS,
     "decode_layers(x, layer_table, cos, sin, positions, slots, tables, key_starts, key_ends, rows, layers, hidden, "
     "heads, kv_heads, head_dim, inter, block_size, table_width, head_stride, eps, num_threads, final_norm, head, vocab, "
     "logits): x [rows, hidden] through every layer, in place; with a head (not 0), float32 logits [rows, vocab]"},
    ISA_METHODS,
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_gemv", NULL, -1, methods};

PyMODINIT_FUNC PyInit__cpu_gemv(void) {
    isa_init();
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "MAX_ROWS", MAX_ROWS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
