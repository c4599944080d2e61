/* Many LoRA adapters over one step's flat batch of bfloat16 rows, for one fused linear, in one call (Punica's SGMV
 * on the CPU): y[row] += x[row] @ Aᵀ[slot] @ Bᵀ[slot] for every row that carries an adapter slot, in place.
 *
 * The operands are the stacks runtime/layers/lora.py keeps (LoraSlots): Aᵀ [slots, in, slices, max_rank] and
 * Bᵀ [slots, max_rank, out], where the output columns of slice s (q, k, v or gate, up) take slice s's rank
 * columns of the shrunk product. The rows come as the step's segments (LoraStep's tiles): ``rows`` sorted by slot,
 * segment i being rows[starts[i]:ends[i]] of slot seg_slots[i]. Each slot's own rank for this module (0: its
 * adapter leaves the module out) bounds the work, not max_rank.
 *
 * Shrink: each group of up to 4 rows of one segment against its slot's Aᵀ, AVX512-BF16 dot products (exact
 * products, float32 sums), rounded to bf16 into a scratch [rows, slices * max_rank], as the PyTorch path's bmm
 * rounds its output. Expand: per group of rows and block of 64 output columns of one slice, the shrunk values times
 * the slot's Bᵀ rows summed in float32, added to y in float32 and rounded once to bfloat16 (round to nearest
 * even). Here the rounding differs from the PyTorch path, which rounds the delta to bf16 (its bmm output) before
 * the add: results differ by up to a bf16 unit of the result (tests/runtime/test_cpu_lora.py states the bound).
 * One OpenMP region (torch's libgomp) runs both phases, each spread over the threads.
 *
 * Only CPUs with AVX512-BF16 run it (``has_avx512_bf16``, checked at run time);
 * runtime/kernels/cpu_lora.py falls back to the PyTorch path elsewhere. Any sizes (masked loads at the edges).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

#define GROUP 4        /* rows of one slot per work item: each weight vector loaded is used by 4 rows */
#define CHUNKS 4       /* 16-column vectors per pass: GROUP * CHUNKS float32 accumulators in registers */
#define BLOCK 64       /* output columns per expand work item (CHUNKS * 16) */
#define MAX_SLICES 3
#define MAX_RANK 128 /* slot rank: up to 8 vectors of 16 columns per slice */

TARGET static inline __m512 load_bf16x16(const uint16_t *p, __mmask16 mask) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}

static inline __mmask16 mask_of(int64_t count) {
    return count >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << count) - 1u);
}

/* Both products below sum over pairs (k, k + 1) with _mm512_dpbf16_ps, whose operand pairs are adjacent bf16
 * elements: the scalar side (two x values, two shrunk values) is one 32-bit broadcast, and the matrix side needs
 * 16 columns of two consecutive rows interleaved, row0[0], row1[0], row0[1], row1[1], ... (one permute, shared by
 * the group's rows). ``next`` NULL: the odd last row, paired with zeros. */
TARGET static inline __m512bh pair_rows(const uint16_t *row0, const uint16_t *next, __mmask16 mask) {
    const __m512i interleave = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7,
                                                38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i r0 = _mm512_castsi256_si512(_mm256_maskz_loadu_epi16(mask, row0));
    const __m512i r1 = next ? _mm512_castsi256_si512(_mm256_maskz_loadu_epi16(mask, next)) : _mm512_setzero_si512();
    return (__m512bh)_mm512_permutex2var_epi16(r0, interleave, r1);
}

TARGET static inline __m512bh pair_scalar(const uint16_t *p, int both) {
    uint32_t two = p[0];
    if (both) memcpy(&two, p, sizeof two);
    return (__m512bh)_mm512_set1_epi32((int)two);
}

/* A group's rows (x_rows, the last repeated up to GROUP) against NC 16-column vectors of one slot's Aᵀ
 * (a: the slot's [in, slices * max_rank], columns col[c] masked by mask[c]): float32 sums of exact products,
 * rounded to bf16 into the first ``valid`` rows of the scratch (the PyTorch path's bmm rounds there too). A macro
 * so that the accumulators' sizes are constants and stay in registers. */
#define DEFINE_SHRINK(NC)                                                                                            \
    TARGET static void shrink_##NC(uint16_t *const *out, const uint16_t *const *x_rows, int valid,                  \
                                   const uint16_t *a, int64_t a_stride, int64_t in, const int64_t *col,              \
                                   const __mmask16 *mask) {                                                          \
        __m512 acc[GROUP][NC];                                                                                       \
        for (int m = 0; m < GROUP; m++)                                                                              \
            for (int c = 0; c < NC; c++) acc[m][c] = _mm512_setzero_ps();                                            \
        for (int64_t k = 0; k < in; k += 2) {                                                                        \
            const int both = k + 1 < in;                                                                             \
            const uint16_t *ak = a + k * a_stride;                                                                   \
            __m512bh av[NC];                                                                                         \
            for (int c = 0; c < NC; c++) av[c] = pair_rows(ak + col[c], both ? ak + a_stride + col[c] : NULL, mask[c]); \
            for (int m = 0; m < GROUP; m++) {                                                                        \
                const __m512bh xv = pair_scalar(x_rows[m] + k, both);                                                \
                for (int c = 0; c < NC; c++) acc[m][c] = _mm512_dpbf16_ps(acc[m][c], xv, av[c]);                     \
            }                                                                                                        \
        }                                                                                                            \
        for (int m = 0; m < valid; m++)                                                                              \
            for (int c = 0; c < NC; c++)                                                                             \
                _mm256_mask_storeu_epi16(out[m] + col[c], mask[c], (__m256i)_mm512_cvtneps_pbh(acc[m][c]));          \
    }

DEFINE_SHRINK(1)
DEFINE_SHRINK(2)
DEFINE_SHRINK(3)
DEFINE_SHRINK(4)

/* One group's shrink: every rank column of every slice of its slot, in passes of up to CHUNKS vectors. */
TARGET static void shrink_group(uint16_t *const *out, const uint16_t *const *x_rows, int valid, const uint16_t *a,
                                int64_t in, int64_t slices, int64_t max_rank, int64_t rank) {
    int64_t col[MAX_SLICES * MAX_RANK / 16];
    __mmask16 mask[MAX_SLICES * MAX_RANK / 16];
    int n = 0;
    for (int64_t s = 0; s < slices; s++)
        for (int64_t r0 = 0; r0 < rank; r0 += 16) {
            col[n] = s * max_rank + r0;
            mask[n++] = mask_of(rank - r0);
        }
    const int64_t a_stride = slices * max_rank;
    for (int c0 = 0; c0 < n; c0 += CHUNKS) {
        const int nc = n - c0 < CHUNKS ? n - c0 : CHUNKS;
        switch (nc) {
        case 1: shrink_1(out, x_rows, valid, a, a_stride, in, col + c0, mask + c0); break;
        case 2: shrink_2(out, x_rows, valid, a, a_stride, in, col + c0, mask + c0); break;
        case 3: shrink_3(out, x_rows, valid, a, a_stride, in, col + c0, mask + c0); break;
        default: shrink_4(out, x_rows, valid, a, a_stride, in, col + c0, mask + c0); break;
        }
    }
}

/* y[rows, col0 : col0 + width] += shrunk[rows, s_col : s_col + rank] @ b[:rank, col0 : col0 + width], width <= 64:
 * float32 sums of exact products, added to y's value in float32 and rounded once. b: the slot's Bᵀ [max_rank,
 * out] (rows past ``rank`` are not read: ``rank`` may be the slot's last row). */
TARGET static void expand_block(uint16_t *const *y_rows, const uint16_t *const *shrunk, int valid, int64_t s_col,
                                int64_t rank, const uint16_t *b, int64_t out, int64_t col0, int64_t width) {
    __m512 acc[GROUP][CHUNKS];
    __mmask16 mask[CHUNKS];
    for (int c = 0; c < CHUNKS; c++) mask[c] = width > 16 * c ? mask_of(width - 16 * c) : 0;
    for (int m = 0; m < GROUP; m++)
        for (int c = 0; c < CHUNKS; c++) acc[m][c] = _mm512_setzero_ps();
    for (int64_t r = 0; r < rank; r += 2) {
        const int both = r + 1 < rank;
        const uint16_t *br = b + r * out + col0;
        __m512bh bv[CHUNKS];
        for (int c = 0; c < CHUNKS; c++) bv[c] = pair_rows(br + 16 * c, both ? br + out + 16 * c : NULL, mask[c]);
        for (int m = 0; m < GROUP; m++) {
            const __m512bh sv = pair_scalar(shrunk[m] + s_col + r, both);
            for (int c = 0; c < CHUNKS; c++) acc[m][c] = _mm512_dpbf16_ps(acc[m][c], sv, bv[c]);
        }
    }
    for (int m = 0; m < valid; m++)
        for (int c = 0; c < CHUNKS && mask[c]; c++) {
            uint16_t *p = y_rows[m] + col0 + 16 * c;
            const __m512 sum = _mm512_add_ps(load_bf16x16(p, mask[c]), acc[m][c]);
            _mm256_mask_storeu_epi16(p, mask[c], (__m256i)_mm512_cvtneps_pbh(sum));
        }
}

typedef struct {
    int64_t slot, first, count; /* rows[first : first + count], count <= GROUP */
} Group;

typedef struct {
    int64_t slice, col0, width; /* output columns [col0, col0 + width) of one slice */
} Block;

typedef struct {
    uint16_t *y;
    const uint16_t *x, *a, *b;
    const int64_t *rows, *ranks;
    int64_t y_stride, x_stride, in, out, slices, max_rank, scratch_stride;
    int64_t slice_start[MAX_SLICES];
    uint16_t *scratch; /* [m, slices * max_rank] bf16: row i of the scratch is rows[i]'s shrunk product */
} Call;

TARGET static void group_pointers(const Call *c, const Group *g, const uint16_t **x_rows, uint16_t **y_rows,
                                  uint16_t **shrunk) {
    for (int m = 0; m < GROUP; m++) {
        const int64_t i = g->first + (m < g->count ? m : g->count - 1); /* padding repeats the last row */
        x_rows[m] = c->x + c->rows[i] * c->x_stride;
        y_rows[m] = c->y + c->rows[i] * c->y_stride;
        shrunk[m] = c->scratch + i * c->scratch_stride;
    }
}

TARGET static void run(const Call *c, const Group *groups, int64_t num_groups, const Block *blocks,
                       int64_t num_blocks, int threads) {
    const int64_t a_slot = c->in * c->slices * c->max_rank, b_slot = c->max_rank * c->out;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < num_groups; i++) {
            const Group *g = &groups[i];
            const uint16_t *x_rows[GROUP];
            uint16_t *y_rows[GROUP];
            uint16_t *shrunk[GROUP];
            group_pointers(c, g, x_rows, y_rows, shrunk);
            shrink_group(shrunk, x_rows, (int)g->count, c->a + g->slot * a_slot, c->in, c->slices, c->max_rank,
                         c->ranks[g->slot]);
        }
#pragma omp for schedule(static)
        for (int64_t item = 0; item < num_groups * num_blocks; item++) {
            const Group *g = &groups[item / num_blocks];
            const Block *k = &blocks[item % num_blocks];
            const uint16_t *x_rows[GROUP];
            uint16_t *y_rows[GROUP];
            uint16_t *shrunk[GROUP];
            group_pointers(c, g, x_rows, y_rows, shrunk);
            expand_block(y_rows, (const uint16_t *const *)shrunk, (int)g->count, k->slice * c->max_rank,
                         c->ranks[g->slot], c->b + g->slot * b_slot, c->out, k->col0, k->width);
        }
    }
}

static int cpu_has_avx512_bf16(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
}

/* The work items: groups of up to GROUP rows of each segment whose slot adapts this module; blocks of each slice's
 * output columns. NULL on a bad segment or slot (the message set). */
static Group *make_groups(const int64_t *seg_slots, const int64_t *starts, const int64_t *ends, int64_t num_segs,
                          const int64_t *ranks, int64_t num_slots, int64_t max_rank, int64_t m, int64_t *count) {
    int64_t n = 0;
    for (int64_t i = 0; i < num_segs; i++) {
        if (seg_slots[i] < 0 || seg_slots[i] >= num_slots || starts[i] < 0 || ends[i] < starts[i] || ends[i] > m) {
            PyErr_Format(PyExc_ValueError, "sgmv: segment %lld (slot %lld, rows %lld:%lld) is outside %lld slots, "
                         "%lld rows", (long long)i, (long long)seg_slots[i], (long long)starts[i],
                         (long long)ends[i], (long long)num_slots, (long long)m);
            return NULL;
        }
        if (ranks[seg_slots[i]] < 0 || ranks[seg_slots[i]] > max_rank) {
            PyErr_Format(PyExc_ValueError, "sgmv: slot %lld has rank %lld, beyond max_rank %lld",
                         (long long)seg_slots[i], (long long)ranks[seg_slots[i]], (long long)max_rank);
            return NULL;
        }
        if (ranks[seg_slots[i]] > 0) n += (ends[i] - starts[i] + GROUP - 1) / GROUP;
    }
    Group *groups = malloc((n ? n : 1) * sizeof *groups);
    if (!groups) {
        PyErr_NoMemory();
        return NULL;
    }
    n = 0;
    for (int64_t i = 0; i < num_segs; i++) {
        if (ranks[seg_slots[i]] == 0) continue;
        for (int64_t first = starts[i]; first < ends[i]; first += GROUP) {
            const int64_t left = ends[i] - first;
            groups[n++] = (Group){seg_slots[i], first, left < GROUP ? left : GROUP};
        }
    }
    *count = n;
    return groups;
}

static PyObject *sgmv(PyObject *self, PyObject *args) {
    unsigned long long y, x, a, b, rows, seg_slots, starts, ends, ranks;
    long long n, m, y_stride, x_stride, num_segs, num_slots, in, max_rank;
    long long slice_outs[MAX_SLICES] = {0, 0, 0};
    int num_threads;
    if (!PyArg_ParseTuple(args, "KLKLKKKKKKKLLLLLL(LLL)i", &y, &y_stride, &x, &x_stride, &a, &b, &rows, &seg_slots,
                          &starts, &ends, &ranks, &n, &m, &num_segs, &num_slots, &in, &max_rank, &slice_outs[0],
                          &slice_outs[1], &slice_outs[2], &num_threads))
        return NULL;
    if (!cpu_has_avx512_bf16()) return PyErr_Format(PyExc_RuntimeError, "sgmv: this CPU has no AVX512-BF16");
    Call c = {(uint16_t *)y, (const uint16_t *)x, (const uint16_t *)a, (const uint16_t *)b, (const int64_t *)rows,
              (const int64_t *)ranks, y_stride, x_stride, in, 0, 0, max_rank, 0, {0, 0, 0}, NULL};
    for (int s = 0; s < MAX_SLICES && slice_outs[s] > 0; s++) {
        c.slice_start[s] = c.out;
        c.out += slice_outs[s];
        c.slices++;
    }
    if (c.slices == 0 || max_rank < 1 || max_rank > MAX_RANK || in < 1 || n < 0 || m < 0 || m > n ||
        y_stride < c.out || x_stride < in)
        return PyErr_Format(PyExc_ValueError, "sgmv: slices %lld, max_rank %lld (1 to %d), in %lld, rows %lld of "
                            "%lld, y_stride %lld, x_stride %lld", (long long)c.slices, max_rank, MAX_RANK, in, m, n,
                            y_stride, x_stride);
    for (int64_t i = 0; i < m; i++)
        if (c.rows[i] < 0 || c.rows[i] >= n)
            return PyErr_Format(PyExc_ValueError, "sgmv: row %lld is outside the batch of %lld",
                                (long long)c.rows[i], n);
    int64_t num_groups = 0;
    Group *groups = make_groups((const int64_t *)seg_slots, (const int64_t *)starts, (const int64_t *)ends, num_segs,
                                c.ranks, num_slots, max_rank, m, &num_groups);
    if (!groups) return NULL;
    int64_t num_blocks = 0;
    for (int64_t s = 0; s < c.slices; s++) num_blocks += (slice_outs[s] + BLOCK - 1) / BLOCK;
    Block *blocks = malloc(num_blocks * sizeof *blocks);
    if (!blocks) {
        free(groups);
        return PyErr_NoMemory();
    }
    num_blocks = 0;
    for (int64_t s = 0; s < c.slices; s++)
        for (int64_t col = 0; col < slice_outs[s]; col += BLOCK) {
            const int64_t left = slice_outs[s] - col;
            blocks[num_blocks++] = (Block){s, c.slice_start[s] + col, left < BLOCK ? left : BLOCK};
        }
    c.scratch_stride = c.slices * max_rank;
    c.scratch = malloc((m ? m : 1) * c.scratch_stride * sizeof(uint16_t));
    if (!c.scratch) {
        free(blocks);
        free(groups);
        return PyErr_NoMemory();
    }
    /* no more threads than work items (a single row's step runs on the calling thread) */
    const int64_t items = num_groups * num_blocks;
    const int threads = num_threads < 1 ? 1 : (items < num_threads ? (items ? (int)items : 1) : num_threads);
    Py_BEGIN_ALLOW_THREADS
    run(&c, groups, num_groups, blocks, num_blocks, threads);
    Py_END_ALLOW_THREADS
    free(c.scratch);
    free(blocks);
    free(groups);
    Py_RETURN_NONE;
}

static PyObject *has_avx512_bf16(PyObject *self, PyObject *args) { return PyBool_FromLong(cpu_has_avx512_bf16()); }

static PyMethodDef methods[] = {
    {"sgmv", sgmv, METH_VARARGS,
     "sgmv(y, y_stride, x, x_stride, a, b, rows, seg_slots, starts, ends, ranks, n, m, num_segs, num_slots, in, "
     "max_rank, (out of each slice, 0 for none), num_threads): y[rows] += LoRA of x[rows], in place, all bfloat16 "
     "but the int64 rows, segments and ranks"},
    {"has_avx512_bf16", has_avx512_bf16, METH_NOARGS, "whether this CPU runs sgmv"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_lora", NULL, -1, methods};

PyMODINIT_FUNC PyInit__cpu_lora(void) {
    PyObject *m = PyModule_Create(&module);
    if (m && (PyModule_AddIntConstant(m, "MAX_RANK", MAX_RANK) < 0 || PyModule_AddIntConstant(m, "MAX_SLICES",
                                                                                                MAX_SLICES) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
