/* The small ops between the CPU path's matmuls, fused: RMSNorm (with the residual add), rotary in place, and
 * SiLU-and-mul (runtime/kernels/cpu_small_ops.py calls them; runtime/layers/{norm,rotary,activation}.py are
 * the PyTorch references they are tested against).
 *
 * In PyTorch each of these is several elementwise ops over the whole [tokens, hidden] batch, each one a pass
 * over memory and, in bfloat16, a round trip through float32; a prefill spent about half its time there. Here
 * each row is read once and written once, its arithmetic in float32, rounded to bfloat16 exactly where the
 * reference rounds (after each op), so the results equal the reference's bit for bit except where a reduction
 * (the norm's sum of squares) or expf adds in another order: at most one unit in the last place. bfloat16's
 * SiLU-and-mul on AVX2 and AVX-512 uses vec256.h's and vec512.h's exp (the same bits on either), which rounds the
 * other way near a boundary now and then.
 * Built with -ffp-contract=off: a fused multiply-add would round differently from the reference's mul + add.
 * Each row function is compiled once per instruction set (isa.h) from the same C, which the compiler vectorises for
 * that set's registers; ``paths`` picks the set's copies by isa_level. Rows are spread over OpenMP threads (torch's
 * libgomp, as cpu_attention.c).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "isa.h"
#include "vec256.h"
#include "vec512.h"

#define MAX_DIM 16384

/* Round a float32 to the model dtype and back: what storing an intermediate result in that dtype does. */
static inline float round_to(float f, int bf16) { return bf16 ? bf16_to_f32(f32_to_bf16(f)) : f; }

static inline void load(const void *src, int64_t i, int bf16, float *dst, int64_t n) {
    if (bf16) {
        const uint16_t *s = (const uint16_t *)src + i;
        for (int64_t d = 0; d < n; d++) dst[d] = bf16_to_f32(s[d]);
    } else {
        memcpy(dst, (const float *)src + i, (size_t)n * sizeof(float));
    }
}

static inline void store(void *dst, int64_t i, int bf16, const float *src, int64_t n) {
    if (bf16) {
        uint16_t *o = (uint16_t *)dst + i;
        for (int64_t d = 0; d < n; d++) o[d] = f32_to_bf16(src[d]);
    } else {
        memcpy((float *)dst + i, src, (size_t)n * sizeof(float));
    }
}

/* The row functions' bodies, inlined into each instruction set's copy below. */
#define ROW static inline __attribute__((always_inline))

/* s[0]^2 + ... + s[dim-1]^2 in 16 lanes, lane l summing the elements d = l (mod 16) in order, then the lanes
 * pairwise: one AVX-512 register, two AVX2 ones or four SSE ones add the same sums, so the instruction set changes
 * the speed, not the bits. */
ROW float sum_of_squares(const float *s, int64_t dim) {
    float lane[16] = {0};
    int64_t d = 0;
    for (; d + 16 <= dim; d += 16)
        for (int l = 0; l < 16; l++) lane[l] += s[d + l] * s[d + l];
    for (int l = 0; d < dim; d++, l++) lane[l] += s[d] * s[d];
    for (int w = 8; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) lane[l] += lane[l + w];
    return lane[0];
}

/* out = weight * to_dtype(s * rsqrt(mean(s^2) + eps)) for s = x (+ residual, rounded to the dtype, also written
 * to sum_out). One row. */
ROW void norm_row(void *out, void *sum_out, const void *x, const void *residual, const void *weight, int64_t row,
                  int64_t x_stride, int64_t dim, float eps, int bf16) {
    float s[MAX_DIM], w[MAX_DIM];
    load(x, row * x_stride, bf16, s, dim);
    if (residual) {
        float r[MAX_DIM];
        load(residual, row * dim, bf16, r, dim);
        for (int64_t d = 0; d < dim; d++) s[d] = round_to(r[d] + s[d], bf16);
        store(sum_out, row * dim, bf16, s, dim);
    }
    const float inv = 1.0f / sqrtf(sum_of_squares(s, dim) / (float)dim + eps);
    load(weight, 0, bf16, w, dim);
    for (int64_t d = 0; d < dim; d++) s[d] = w[d] * round_to(s[d] * inv, bf16);
    store(out, row * dim, bf16, s, dim);
}

/* One head of one token, in place: x * cos + rotate_half(x) * sin, each product and the sum rounded. */
ROW void rotate_head(void *x, int64_t offset, const float *c, const float *s, int64_t head_dim, int bf16) {
    float v[MAX_DIM], o[MAX_DIM];
    const int64_t half = head_dim / 2;
    load(x, offset, bf16, v, head_dim);
    for (int64_t d = 0; d < half; d++)
        o[d] = round_to(round_to(v[d] * c[d], bf16) + round_to(-v[d + half] * s[d], bf16), bf16);
    for (int64_t d = half; d < head_dim; d++)
        o[d] = round_to(round_to(v[d] * c[d], bf16) + round_to(v[d - half] * s[d], bf16), bf16);
    store(x, offset, bf16, o, head_dim);
}

/* out[row] = to_dtype(silu(gate)) * up, the product rounded, for x[row] = [gate | up]; expf per element. */
ROW void silu_mul_row(void *out, const void *x, int64_t row, int64_t width, int bf16) {
    float g[MAX_DIM], u[MAX_DIM];
    load(x, row * 2 * width, bf16, g, width);
    load(x, row * 2 * width + width, bf16, u, width);
    for (int64_t d = 0; d < width; d++) g[d] = round_to(g[d] / (1.0f + expf(-g[d])), bf16) * u[d];
    store(out, row * width, bf16, g, width);
}

typedef void NormRow(void *, void *, const void *, const void *, const void *, int64_t, int64_t, int64_t, float, int);
typedef void RotateHead(void *, int64_t, const float *, const float *, int64_t, int);
typedef void SiluRow(void *, const void *, int64_t, int64_t, int);
typedef void SiluRowBf16(uint16_t *, const uint16_t *, int64_t, int64_t);

/* One instruction set's copies of the row functions, named with LEVEL and compiled under TARGET. */
#define ROW_FUNCTIONS(LEVEL, TARGET)                                                                                 \
    TARGET static void norm_row_##LEVEL(void *out, void *sum_out, const void *x, const void *residual,               \
                                        const void *weight, int64_t row, int64_t x_stride, int64_t dim, float eps,   \
                                        int bf16) {                                                                  \
        norm_row(out, sum_out, x, residual, weight, row, x_stride, dim, eps, bf16);                                  \
    }                                                                                                                \
    TARGET static void rotate_head_##LEVEL(void *x, int64_t offset, const float *c, const float *s,                 \
                                           int64_t head_dim, int bf16) {                                             \
        rotate_head(x, offset, c, s, head_dim, bf16);                                                                \
    }                                                                                                                \
    TARGET static void silu_mul_row_##LEVEL(void *out, const void *x, int64_t row, int64_t width, int bf16) {       \
        silu_mul_row(out, x, row, width, bf16);                                                                      \
    }

ROW_FUNCTIONS(portable, )

/* bfloat16's SiLU-and-mul without vectors: expf. */
static void silu_mul_row_bf16_portable(uint16_t *out, const uint16_t *x, int64_t row, int64_t width) {
    silu_mul_row_portable(out, x, row, width, 1);
}

#if WARMSTART_X86
ROW_FUNCTIONS(avx2, VEC256)
ROW_FUNCTIONS(avx512, VEC512)

/* bfloat16's SiLU-and-mul 8 or 16 lanes at a time, exp8 or exp16 in place of expf (a prefill spent 15 % of its
 * time in the scalar expf here; see vec512.h for the rounding). */
VEC256 static void silu_mul_row_bf16_avx2(uint16_t *out, const uint16_t *x, int64_t row, int64_t width) {
    const uint16_t *gate = x + row * 2 * width;
    silu_and_mul_span8(out + row * width, gate, gate + width, width);
}

VEC512 static void silu_mul_row_bf16_avx512(uint16_t *out, const uint16_t *x, int64_t row, int64_t width) {
    const uint16_t *gate = x + row * 2 * width;
    silu_and_mul_span(out + row * width, gate, gate + width, width);
}
#endif

typedef struct {
    NormRow *norm_row;
    RotateHead *rotate_head;
    SiluRow *silu_mul_row;
    SiluRowBf16 *silu_mul_row_bf16;
} Paths;

/* The copies isa_level allows, chosen here only. AVX512-BF16 has nothing more for these ops than AVX-512. */
static Paths paths(void) {
#if WARMSTART_X86
    if (isa_level >= ISA_AVX512)
        return (Paths){norm_row_avx512, rotate_head_avx512, silu_mul_row_avx512, silu_mul_row_bf16_avx512};
    if (isa_level >= ISA_AVX2)
        return (Paths){norm_row_avx2, rotate_head_avx2, silu_mul_row_avx2, silu_mul_row_bf16_avx2};
#endif
    return (Paths){norm_row_portable, rotate_head_portable, silu_mul_row_portable, silu_mul_row_bf16_portable};
}

/* Few rows are not worth waking the other threads for. */
static int threads_for(int64_t rows, int64_t row_elems, int num_threads) {
    return rows * row_elems < 32768 ? 1 : num_threads;
}

static PyObject *rms_norm(PyObject *self, PyObject *args) {
    unsigned long long out, sum_out, x, residual, weight;
    long long rows, x_stride, dim;
    float eps;
    int bf16, num_threads;
    if (!PyArg_ParseTuple(args, "KKKKKLLLfii", &out, &sum_out, &x, &residual, &weight, &rows, &x_stride, &dim,
                          &eps, &bf16, &num_threads))
        return NULL;
    if (dim > MAX_DIM) return PyErr_Format(PyExc_ValueError, "rms_norm: dim %lld > %d", dim, MAX_DIM);
    NormRow *const norm_row = paths().norm_row;
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for schedule(static) num_threads(threads_for(rows, dim, num_threads))
    for (int64_t r = 0; r < rows; r++)
        norm_row((void *)out, (void *)sum_out, (const void *)x, (const void *)residual, (const void *)weight, r,
                 x_stride, dim, eps, bf16);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *rotary(PyObject *self, PyObject *args) {
    unsigned long long q, k, cos_table, sin_table, positions;
    long long tokens, q_stride, k_stride, q_heads, k_heads, head_dim;
    int bf16, num_threads;
    if (!PyArg_ParseTuple(args, "KKKKKLLLLLLii", &q, &k, &cos_table, &sin_table, &positions, &tokens, &q_stride,
                          &k_stride, &q_heads, &k_heads, &head_dim, &bf16, &num_threads))
        return NULL;
    if (head_dim > MAX_DIM || head_dim % 2) return PyErr_Format(PyExc_ValueError, "rotary: head_dim %lld", head_dim);
    RotateHead *const rotate_head = paths().rotate_head;
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for schedule(static) num_threads(threads_for(tokens, (q_heads + k_heads) * head_dim, num_threads))
    for (int64_t t = 0; t < tokens; t++) {
        float c[MAX_DIM], s[MAX_DIM];
        const int64_t p = ((const int64_t *)positions)[t];
        load((const void *)cos_table, p * head_dim, bf16, c, head_dim);
        load((const void *)sin_table, p * head_dim, bf16, s, head_dim);
        for (int64_t h = 0; h < q_heads; h++) rotate_head((void *)q, t * q_stride + h * head_dim, c, s, head_dim, bf16);
        for (int64_t h = 0; h < k_heads; h++) rotate_head((void *)k, t * k_stride + h * head_dim, c, s, head_dim, bf16);
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *silu_and_mul(PyObject *self, PyObject *args) {
    unsigned long long out, x;
    long long rows, width;
    int bf16, num_threads;
    if (!PyArg_ParseTuple(args, "KKLLii", &out, &x, &rows, &width, &bf16, &num_threads)) return NULL;
    if (width > MAX_DIM) return PyErr_Format(PyExc_ValueError, "silu_and_mul: width %lld > %d", width, MAX_DIM);
    const Paths p = paths();
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for schedule(static) num_threads(threads_for(rows, width, num_threads))
    for (int64_t r = 0; r < rows; r++)
        if (bf16)
            p.silu_mul_row_bf16((uint16_t *)out, (const uint16_t *)x, r, width);
        else
            p.silu_mul_row((void *)out, (const void *)x, r, width, 0);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"rms_norm", rms_norm, METH_VARARGS,
     "rms_norm(out, sum_out, x, residual, weight, rows, x_stride, dim, eps, bf16, num_threads); residual 0: none"},
    {"rotary", rotary, METH_VARARGS,
     "rotary(q, k, cos, sin, positions, tokens, q_stride, k_stride, q_heads, k_heads, head_dim, bf16, num_threads)"},
    {"silu_and_mul", silu_and_mul, METH_VARARGS, "silu_and_mul(out, x, rows, width, bf16, num_threads)"},
    ISA_METHODS,
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_small_ops", NULL, -1, methods};

PyMODINIT_FUNC PyInit__cpu_small_ops(void) {
    isa_init();
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "MAX_DIM", MAX_DIM) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
