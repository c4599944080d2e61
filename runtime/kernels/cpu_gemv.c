/* bfloat16 x @ W.T for few rows of x (decode steps): out[m, n] = bf16(sum_k x[m, k] * W[n, k] + bias[n]).
 *
 * A decode step multiplies one row per sequence by every weight matrix, so it is bound by reading the weights
 * from memory once; oneDNN's matmul on its prepacked copy ran well below that bound for one row. Here the plain
 * row-major [N, K] weight (the tensor the snapshot maps, no second copy) is read once per call: each block of
 * weight rows is loaded into registers and multiplied, with AVX512-BF16's dot-product instruction, by every row
 * of x while it is in the L1 cache. Products are exact in float32, sums are float32 (in another order than
 * F.linear's), and the result is rounded once to bfloat16 (round to nearest even, bf16.h) after the bias is added,
 * as F.linear does. Output rows are spread over OpenMP threads (torch's libgomp, as cpu_attention.c).
 *
 * decode_attention_in and decode_mlp (below) run a decode layer's two halves around attention on the same tiles.
 *
 * Only CPUs with AVX512-BF16 run it (``has_avx512_bf16``, checked at run time); runtime/kernels/cpu_gemv.py falls
 * back to the PyTorch path elsewhere. K need not be a multiple of 32 (masked loads), N is any.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define MAX_ROWS 8 /* rows of x per call: beyond a few, a matmul that reuses weights from cache wins */

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

TARGET static inline __m512bh load_bf16(const uint16_t *p, __mmask32 mask) {
    return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

/* ROWS rows of x against BLOCK consecutive weight rows starting at w (the first ``valid`` of them real; the others
 * repeat the first, their sums dropped), with SPLIT accumulators per pair taking alternate 32-element steps of k:
 * ROWS * BLOCK * SPLIT independent chains of dot products hide the instruction's latency. A macro, not a function
 * with size arguments, so that the arrays have constant sizes, the loops unroll and the accumulators stay in
 * registers. The tail of a row is a masked load (zeros past the end). The next rows are prefetched: a block's rows
 * are BLOCK short interleaved streams, which the hardware prefetcher follows late. */
#define PREFETCH_ROWS 8

#define DEFINE_TILE(ROWS, BLOCK, SPLIT)                                                                              \
    TARGET static void tile_##ROWS##x##BLOCK(uint16_t *out, int64_t out_stride, const uint16_t *x, int64_t x_stride, \
                                            const uint16_t *w, int64_t k, const uint16_t *bias, int64_t n0,          \
                                            int64_t valid) {                                                         \
        __m512 acc[SPLIT][ROWS][BLOCK];                                                                              \
        const uint16_t *wr[BLOCK];                                                                                   \
        for (int r = 0; r < BLOCK; r++) wr[r] = w + (r < valid ? r : 0) * k;                                         \
        for (int s = 0; s < SPLIT; s++)                                                                              \
            for (int m = 0; m < ROWS; m++)                                                                           \
                for (int r = 0; r < BLOCK; r++) acc[s][m][r] = _mm512_setzero_ps();                                  \
        int64_t k0 = 0;                                                                                              \
        for (; k0 + 32 * SPLIT <= k; k0 += 32 * SPLIT)                                                               \
            for (int s = 0; s < SPLIT; s++) {                                                                        \
                __m512bh wv[BLOCK];                                                                                  \
                for (int r = 0; r < BLOCK; r++) {                                                                    \
                    _mm_prefetch((const char *)(wr[r] + PREFETCH_ROWS * k + k0 + 32 * s), _MM_HINT_T0);              \
                    wv[r] = (__m512bh)_mm512_loadu_si512(wr[r] + k0 + 32 * s);                                       \
                }                                                                                                    \
                for (int m = 0; m < ROWS; m++) {                                                                     \
                    const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * x_stride + k0 + 32 * s);                \
                    for (int r = 0; r < BLOCK; r++) acc[s][m][r] = _mm512_dpbf16_ps(acc[s][m][r], xv, wv[r]);        \
                }                                                                                                    \
            }                                                                                                        \
        for (; k0 < k; k0 += 32) {                                                                                   \
            const __mmask32 mask = k - k0 >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (k - k0)) - 1u);      \
            __m512bh wv[BLOCK];                                                                                      \
            for (int r = 0; r < BLOCK; r++) wv[r] = load_bf16(wr[r] + k0, mask);                                     \
            for (int m = 0; m < ROWS; m++) {                                                                         \
                const __m512bh xv = load_bf16(x + m * x_stride + k0, mask);                                          \
                for (int r = 0; r < BLOCK; r++) acc[0][m][r] = _mm512_dpbf16_ps(acc[0][m][r], xv, wv[r]);            \
            }                                                                                                        \
        }                                                                                                            \
        for (int s = 1; s < SPLIT; s++)                                                                              \
            for (int m = 0; m < ROWS; m++)                                                                           \
                for (int r = 0; r < BLOCK; r++) acc[0][m][r] = _mm512_add_ps(acc[0][m][r], acc[s][m][r]);            \
        for (int m = 0; m < ROWS; m++)                                                                               \
            for (int r = 0; r < BLOCK && r < valid; r++) {                                                           \
                float sum = _mm512_reduce_add_ps(acc[0][m][r]);                                                      \
                if (bias) sum += bf16_to_f32(bias[n0 + r]);                                                          \
                out[m * out_stride + n0 + r] = f32_to_bf16(sum);                                                     \
            }                                                                                                        \
    }

DEFINE_TILE(1, 8, 2)
DEFINE_TILE(2, 4, 2)
DEFINE_TILE(4, 4, 1)

#define ROW_BLOCK 8 /* weight rows per block: tiles of 8 rows for one row of x, of 4 for 2 or 4 */

/* Weight rows [n_begin, n_end) for all rows of x, the rows of x in passes of 4, 2 and 1 over each block of
 * weight rows while it is in L1. */
TARGET static void gemv_range(uint16_t *out, const uint16_t *x, int64_t x_stride, const uint16_t *w,
                              const uint16_t *bias, int64_t rows, int64_t n, int64_t k, int64_t n_begin,
                              int64_t n_end) {
    for (int64_t n0 = n_begin; n0 < n_end; n0 += ROW_BLOCK) {
        const int64_t valid = n_end - n0 < ROW_BLOCK ? n_end - n0 : ROW_BLOCK;
        for (int64_t half = 0; half < valid; half += 4) { /* the block as two tiles of 4 weight rows */
            const int64_t n1 = n0 + half, valid4 = valid - half < 4 ? valid - half : 4;
            int64_t m = 0;
            for (; m + 4 <= rows; m += 4)
                tile_4x4(out + m * n, n, x + m * x_stride, x_stride, w + n1 * k, k, bias, n1, valid4);
            if (m + 2 <= rows) {
                tile_2x4(out + m * n, n, x + m * x_stride, x_stride, w + n1 * k, k, bias, n1, valid4);
                m += 2;
            }
        }
        if (rows % 2) {
            const int64_t m = rows - 1;
            tile_1x8(out + m * n, n, x + m * x_stride, x_stride, w + n0 * k, k, bias, n0, valid);
        }
    }
}

/* Too little work is not worth waking the other threads for (about 64 KiB of weights each). */
static int threads_for(int64_t n, int64_t k, int num_threads) {
    const int64_t by_size = (n * k * 2) / 65536;
    if (by_size < 1) return 1;
    return by_size < num_threads ? (int)by_size : num_threads;
}

static int cpu_has_avx512_bf16(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
}

static PyObject *gemv(PyObject *self, PyObject *args) {
    unsigned long long out, x, w, bias;
    long long rows, n, k, x_stride;
    int num_threads;
    if (!PyArg_ParseTuple(args, "KKKKLLLLi", &out, &x, &w, &bias, &rows, &n, &k, &x_stride, &num_threads))
        return NULL;
    if (!cpu_has_avx512_bf16()) return PyErr_Format(PyExc_RuntimeError, "gemv: this CPU has no AVX512-BF16");
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
        gemv_range((uint16_t *)out, (const uint16_t *)x, x_stride, (const uint16_t *)w, (const uint16_t *)bias,
                   rows, n, k, begin, end < n ? end : n);
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* ---- A decode layer in two calls (runtime/layers/fused_decode.py): the rows of a decode step through
 * [RMSNorm, qkv, rotary, KV write] and [o, residual add + RMSNorm, gate_up, SiLU-and-mul, down, residual add], each
 * in one OpenMP parallel region, instead of about a dozen PyTorch ops. Each step rounds to bf16 where its PyTorch
 * reference does (runtime/layers/norm.py, rotary.py, activation.py): only the matmuls' sums differ in order. */

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

static PyObject *decode_attention_in(PyObject *self, PyObject *args) {
    unsigned long long x, norm_w, qkv_w, qkv_bias, cos_t, sin_t, positions, slots, k_cache, v_cache, q_out, h, qkv;
    long long rows, hidden, heads, kv_heads, head_dim, head_stride;
    float eps;
    int num_threads;
    if (!PyArg_ParseTuple(args, "KKKKKKKKKKKKKLLLLLLfi", &x, &norm_w, &qkv_w, &qkv_bias, &cos_t, &sin_t, &positions,
                          &slots, &k_cache, &v_cache, &q_out, &h, &qkv, &rows, &hidden, &heads, &kv_heads, &head_dim,
                          &head_stride, &eps, &num_threads))
        return NULL;
    if (!cpu_has_avx512_bf16()) return PyErr_Format(PyExc_RuntimeError, "decode_attention_in: no AVX512-BF16");
    if (rows < 1 || rows > MAX_ROWS || head_dim % 2)
        return PyErr_Format(PyExc_ValueError, "decode_attention_in: rows %lld, head_dim %lld", rows, head_dim);
    const int64_t n_qkv = (heads + 2 * kv_heads) * head_dim;
    const int threads = threads_for(n_qkv, hidden, num_threads);
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
#pragma omp single
        for (int64_t m = 0; m < rows; m++)
            norm_row((uint16_t *)h + m * hidden, (const uint16_t *)x + m * hidden, (const uint16_t *)norm_w, hidden,
                     eps);
        int64_t begin, end;
        thread_range(n_qkv, t, nt, &begin, &end);
        gemv_range((uint16_t *)qkv, (const uint16_t *)h, hidden, (const uint16_t *)qkv_w,
                   (const uint16_t *)qkv_bias, rows, n_qkv, hidden, begin, end);
#pragma omp barrier
        /* rotary into q_out, and k rotated / v as is into their slots of the pool */
#pragma omp for schedule(static)
        for (int64_t j = 0; j < rows * (heads + 2 * kv_heads); j++) {
            const int64_t m = j / (heads + 2 * kv_heads), head = j % (heads + 2 * kv_heads);
            const int64_t pos = ((const int64_t *)positions)[m], slot = ((const int64_t *)slots)[m];
            const uint16_t *src = (const uint16_t *)qkv + m * n_qkv + head * head_dim;
            const uint16_t *c = (const uint16_t *)cos_t + pos * head_dim, *s = (const uint16_t *)sin_t + pos * head_dim;
            if (head < heads) {
                rotate_head((uint16_t *)q_out + (m * heads + head) * head_dim, src, c, s, head_dim);
            } else if (head < heads + kv_heads) {
                if (slot >= 0)
                    rotate_head((uint16_t *)k_cache + (head - heads) * head_stride + slot * head_dim, src, c, s,
                                head_dim);
            } else if (slot >= 0) {
                memcpy((uint16_t *)v_cache + (head - heads - kv_heads) * head_stride + slot * head_dim, src,
                       (size_t)head_dim * 2);
            }
        }
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *decode_mlp(PyObject *self, PyObject *args) {
    unsigned long long attn, o_w, x, post_w, gate_up_w, down_w, x_out, o, h, gu, act;
    long long rows, hidden, attn_width, inter;
    float eps;
    int num_threads;
    if (!PyArg_ParseTuple(args, "KKKKKKKKKKKLLLLfi", &attn, &o_w, &x, &post_w, &gate_up_w, &down_w, &x_out, &o, &h,
                          &gu, &act, &rows, &hidden, &attn_width, &inter, &eps, &num_threads))
        return NULL;
    if (!cpu_has_avx512_bf16()) return PyErr_Format(PyExc_RuntimeError, "decode_mlp: no AVX512-BF16");
    if (rows < 1 || rows > MAX_ROWS) return PyErr_Format(PyExc_ValueError, "decode_mlp: rows %lld", rows);
    const int threads = threads_for(2 * inter, hidden, num_threads);
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t begin, end;
        thread_range(hidden, t, nt, &begin, &end);
        gemv_range((uint16_t *)o, (const uint16_t *)attn, attn_width, (const uint16_t *)o_w, NULL, rows, hidden,
                   attn_width, begin, end);
#pragma omp barrier
#pragma omp single
        for (int64_t m = 0; m < rows; m++) { /* summed = bf16(x + o), h = norm(summed) */
            uint16_t *summed = (uint16_t *)x_out + m * hidden;
            for (int64_t d = 0; d < hidden; d++)
                summed[d] = f32_to_bf16(bf16_to_f32(((const uint16_t *)x)[m * hidden + d]) +
                                        bf16_to_f32(((const uint16_t *)o)[m * hidden + d]));
            norm_row((uint16_t *)h + m * hidden, summed, (const uint16_t *)post_w, hidden, eps);
        }
        /* each thread its gate rows and the matching up rows, so SiLU-and-mul needs no barrier */
        thread_range(inter, t, nt, &begin, &end);
        gemv_range((uint16_t *)gu, (const uint16_t *)h, hidden, (const uint16_t *)gate_up_w, NULL, rows, 2 * inter,
                   hidden, begin, end);
        gemv_range((uint16_t *)gu, (const uint16_t *)h, hidden, (const uint16_t *)gate_up_w, NULL, rows, 2 * inter,
                   hidden, inter + begin, inter + end);
        for (int64_t m = 0; m < rows; m++)
            for (int64_t f = begin; f < end; f++) {
                const float g = bf16_to_f32(((const uint16_t *)gu)[m * 2 * inter + f]);
                const float u = bf16_to_f32(((const uint16_t *)gu)[m * 2 * inter + inter + f]);
                ((uint16_t *)act)[m * inter + f] = f32_to_bf16(round_bf16(g / (1.0f + expf(-g))) * u);
            }
#pragma omp barrier
        /* down, then the residual add for this thread's columns */
        thread_range(hidden, t, nt, &begin, &end);
        gemv_range((uint16_t *)o, (const uint16_t *)act, inter, (const uint16_t *)down_w, NULL, rows, hidden, inter,
                   begin, end);
        for (int64_t m = 0; m < rows; m++)
            for (int64_t d = begin; d < end; d++) {
                uint16_t *xo = (uint16_t *)x_out + m * hidden + d;
                *xo = f32_to_bf16(bf16_to_f32(*xo) + bf16_to_f32(((const uint16_t *)o)[m * hidden + d]));
            }
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *has_avx512_bf16(PyObject *self, PyObject *args) { return PyBool_FromLong(cpu_has_avx512_bf16()); }

static PyMethodDef methods[] = {
    {"gemv", gemv, METH_VARARGS,
     "gemv(out, x, weight, bias, rows, n, k, x_stride, num_threads): out [rows, n] = x [rows, k] @ weight.T + bias, "
     "all bfloat16, weight [n, k] row-major; bias 0: none"},
    {"has_avx512_bf16", has_avx512_bf16, METH_NOARGS, "whether this CPU runs gemv"},
    {"decode_attention_in", decode_attention_in, METH_VARARGS,
     "decode_attention_in(x, norm_w, qkv_w, qkv_bias, cos, sin, positions, slots, k_cache, v_cache, q_out, h, qkv, "
     "rows, hidden, heads, kv_heads, head_dim, head_stride, eps, num_threads)"},
    {"decode_mlp", decode_mlp, METH_VARARGS,
     "decode_mlp(attn, o_w, x, post_w, gate_up_w, down_w, x_out, o, h, gu, act, rows, hidden, attn_width, inter, "
     "eps, num_threads)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_gemv", NULL, -1, methods};

PyMODINIT_FUNC PyInit__cpu_gemv(void) {
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "MAX_ROWS", MAX_ROWS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
