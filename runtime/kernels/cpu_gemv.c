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
 * Only CPUs with AVX512-BF16 run it (``has_avx512_bf16``, checked at run time); runtime/kernels/cpu_gemv.py falls
 * back to the PyTorch path elsewhere. K need not be a multiple of 32 (masked loads), N is any.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

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

static PyObject *has_avx512_bf16(PyObject *self, PyObject *args) { return PyBool_FromLong(cpu_has_avx512_bf16()); }

static PyMethodDef methods[] = {
    {"gemv", gemv, METH_VARARGS,
     "gemv(out, x, weight, bias, rows, n, k, x_stride, num_threads): out [rows, n] = x [rows, k] @ weight.T + bias, "
     "all bfloat16, weight [n, k] row-major; bias 0: none"},
    {"has_avx512_bf16", has_avx512_bf16, METH_NOARGS, "whether this CPU runs gemv"},
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
