/* Many LoRA adapters over one step's flat batch of bfloat16 rows, for one fused linear, in one call (Punica's SGMV
 * on the CPU): y[row] += x[row] @ Aᵀ[slot] @ Bᵀ[slot] for every row that carries an adapter slot, in place.
 *
 * The operands are the stacks runtime/layers/lora.py keeps (LoraSlots): Aᵀ [slots, in, slices, max_rank] and
 * Bᵀ [slots, max_rank, out], where the output columns of slice s (q, k, v or gate, up) take slice s's rank
 * columns of the shrunk product. The rows come as the step's segments (LoraStep's tiles): ``rows`` sorted by slot,
 * segment i being rows[starts[i]:ends[i]] of slot seg_slots[i]. Each slot's own rank for this module (0: its
 * adapter leaves the module out) bounds the work, not max_rank.
 *
 * Shrink: each group of up to 4 rows of one segment against its slot's Aᵀ, exact products summed in float32,
 * rounded to bf16 into a scratch [rows, slices * max_rank], as the PyTorch path's bmm rounds its output. Expand:
 * per group of rows and block of 64 output columns of one slice, the shrunk values times the slot's Bᵀ rows summed
 * in float32, added to y in float32 and rounded once to bfloat16 (round to nearest even). Here the rounding
 * differs from the PyTorch path, which rounds the delta to bf16 (its bmm output) before the add: results differ by
 * up to a bf16 unit of the result (tests/runtime/test_cpu_lora.py states the bound). One OpenMP region (torch's
 * libgomp) runs both phases, each spread over the threads.
 *
 * Two paths, chosen by isa_level (isa.h) in ``sgmv`` only: AVX512-BF16, whose dot products take bf16 pairs, and
 * AVX2 with FMA and F16C, which widens the bf16 values to float32 in registers (x once per group, into a thread's
 * scratch) and adds the same exact products by FMA in the same order, pair by pair as the dot product does, so
 * both paths give the same sums but where the dot product flushes subnormals. Below AVX2 ``sgmv`` refuses;
 * runtime/kernels/cpu_lora.py takes the PyTorch path there. Any sizes (masked or padded loads at the edges).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "isa.h"
#include "vec256.h"

#define GROUP 4      /* rows of one slot per work item: each weight vector loaded is used by 4 rows */
#define BLOCK 64     /* output columns per expand work item */
#define MAX_SLICES 3
#define MAX_RANK 128 /* slot rank: up to 8 vectors of 16 columns per slice */

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
    /* [m, slices * max_rank]: row i is rows[i]'s shrunk product, rounded to bf16; one of the two, by the path */
    uint16_t *shrunk;  /* AVX512-BF16: as bf16 */
    float *shrunk32;   /* AVX2: as float32 */
    float *x32;        /* AVX2: GROUP rows of in float32 per thread, a group's x widened */
} Call;

/* The group's rows (the last repeated up to GROUP). */
static inline void group_pointers(const Call *c, const Group *g, const uint16_t **x_rows, uint16_t **y_rows,
                                  int64_t *scratch_rows) {
    for (int m = 0; m < GROUP; m++) {
        const int64_t i = g->first + (m < g->count ? m : g->count - 1);
        x_rows[m] = c->x + c->rows[i] * c->x_stride;
        y_rows[m] = c->y + c->rows[i] * c->y_stride;
        scratch_rows[m] = i * c->scratch_stride;
    }
}

#if WARMSTART_X86

/* ---- AVX512-BF16 ---- */

#define AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define CHUNKS 4 /* 16-column vectors per pass: GROUP * CHUNKS float32 accumulators in registers, BLOCK columns */

AVX512_BF16 static inline __m512 load_bf16x16(const uint16_t *p, __mmask16 mask) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}

static inline __mmask16 mask_of(int64_t count) {
    return count >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << count) - 1u);
}

/* Both products below sum over pairs (k, k + 1) with _mm512_dpbf16_ps, whose operand pairs are adjacent bf16
 * elements: the scalar side (two x values, two shrunk values) is one 32-bit broadcast, and the matrix side needs
 * 16 columns of two consecutive rows interleaved, row0[0], row1[0], row0[1], row1[1], ... (one permute, shared by
 * the group's rows). ``next`` NULL: the odd last row, paired with zeros. */
AVX512_BF16 static inline __m512bh pair_rows(const uint16_t *row0, const uint16_t *next, __mmask16 mask) {
    const __m512i interleave = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7,
                                                38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i r0 = _mm512_castsi256_si512(_mm256_maskz_loadu_epi16(mask, row0));
    const __m512i r1 = next ? _mm512_castsi256_si512(_mm256_maskz_loadu_epi16(mask, next)) : _mm512_setzero_si512();
    return (__m512bh)_mm512_permutex2var_epi16(r0, interleave, r1);
}

AVX512_BF16 static inline __m512bh pair_scalar(const uint16_t *p, int both) {
    uint32_t two = p[0];
    if (both) memcpy(&two, p, sizeof two);
    return (__m512bh)_mm512_set1_epi32((int)two);
}

/* A group's rows (x_rows, the last repeated up to GROUP) against NC 16-column vectors of one slot's Aᵀ
 * (a: the slot's [in, slices * max_rank], columns col[c] masked by mask[c]): float32 sums of exact products,
 * rounded to bf16 into the first ``valid`` rows of the scratch (the PyTorch path's bmm rounds there too). A macro
 * so that the accumulators' sizes are constants and stay in registers. */
#define DEFINE_SHRINK(NC)                                                                                            \
    AVX512_BF16 static void shrink_##NC(uint16_t *const *out, const uint16_t *const *x_rows, int valid,             \
                                        const uint16_t *a, int64_t a_stride, int64_t in, const int64_t *col,         \
                                        const __mmask16 *mask) {                                                     \
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
AVX512_BF16 static void shrink_group(uint16_t *const *out, const uint16_t *const *x_rows, int valid,
                                     const uint16_t *a, int64_t in, int64_t slices, int64_t max_rank, int64_t rank) {
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
AVX512_BF16 static void expand_block(uint16_t *const *y_rows, const uint16_t *const *shrunk, int valid,
                                     int64_t s_col, int64_t rank, const uint16_t *b, int64_t out, int64_t col0,
                                     int64_t width) {
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

/* The work items on this path: a group's shrink, a group's expand of one block. */
AVX512_BF16 static void shrink_item_avx512_bf16(const Call *c, const Group *g, float *unused) {
    const uint16_t *x_rows[GROUP];
    uint16_t *y_rows[GROUP], *shrunk[GROUP];
    int64_t scratch_rows[GROUP];
    group_pointers(c, g, x_rows, y_rows, scratch_rows);
    for (int m = 0; m < GROUP; m++) shrunk[m] = c->shrunk + scratch_rows[m];
    shrink_group(shrunk, x_rows, (int)g->count, c->a + g->slot * c->in * c->slices * c->max_rank, c->in, c->slices,
                 c->max_rank, c->ranks[g->slot]);
}

AVX512_BF16 static void expand_item_avx512_bf16(const Call *c, const Group *g, const Block *k) {
    const uint16_t *x_rows[GROUP], *shrunk[GROUP];
    uint16_t *y_rows[GROUP];
    int64_t scratch_rows[GROUP];
    group_pointers(c, g, x_rows, y_rows, scratch_rows);
    for (int m = 0; m < GROUP; m++) shrunk[m] = c->shrunk + scratch_rows[m];
    expand_block(y_rows, shrunk, (int)g->count, k->slice * c->max_rank, c->ranks[g->slot],
                 c->b + g->slot * c->max_rank * c->out, c->out, k->col0, k->width);
}

/* ---- AVX2 with FMA and F16C ---- */

#define CHUNKS8 2 /* 8-column vectors per pass: GROUP * CHUNKS8 accumulators and two rows' vectors in 16 registers */

/* n of the bf16 values at p as float32, zeros after them; nothing past p[n - 1] read. */
VEC256 static inline __m256 load_bf16_upto8(const uint16_t *p, int64_t n) {
    if (n >= 8) return load_bf16_8(p);
    uint16_t t[8] = {0};
    memcpy(t, p, (size_t)n * sizeof *t);
    return load_bf16_8(t);
}

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* acc[m][c] = sum over k < depth of s[m][k] * w[k * w_stride + col[c] + j], lanes j < width[c] (others undefined),
 * c < nc: exact products of bf16 values (s widened to float32 already) added by FMA, pairs (k, k + 1) in the order
 * _mm512_dpbf16_ps adds them (k + 1 first), so the sums are the AVX512-BF16 path's. w_len: the elements readable
 * from w; a vector of fewer than 8 columns is read whole while that stays inside them, padded after. Always
 * inlined with a constant nc, so that the accumulators stay in registers. */
VEC256 static inline __attribute__((always_inline)) void product8(__m256 acc[GROUP][CHUNKS8], int nc,
                                                                  const float *const *s, const uint16_t *w,
                                                                  int64_t w_stride, int64_t w_len, int64_t depth,
                                                                  const int64_t *col, const int64_t *width) {
    for (int m = 0; m < GROUP; m++)
        for (int c = 0; c < nc; c++) acc[m][c] = _mm256_setzero_ps();
    int64_t whole = depth; /* rows k < whole: every vector read whole */
    for (int c = 0; c < nc; c++)
        if (width[c] < 8) whole = min64(whole, w_len < col[c] + 8 ? 0 : (w_len - col[c] - 8) / w_stride + 1);
    int64_t k = 0;
    for (; k + 2 <= whole; k += 2) {
        const uint16_t *wk = w + k * w_stride;
        __m256 w1[CHUNKS8], w0[CHUNKS8];
        for (int c = 0; c < nc; c++) {
            w1[c] = load_bf16_8(wk + w_stride + col[c]);
            w0[c] = load_bf16_8(wk + col[c]);
        }
        for (int m = 0; m < GROUP; m++) {
            const __m256 s1 = _mm256_broadcast_ss(s[m] + k + 1), s0 = _mm256_broadcast_ss(s[m] + k);
            for (int c = 0; c < nc; c++) acc[m][c] = _mm256_fmadd_ps(s0, w0[c], _mm256_fmadd_ps(s1, w1[c], acc[m][c]));
        }
    }
    for (; k < depth; k += 2) { /* the last rows, padded where a vector would read past w_len */
        const uint16_t *wk = w + k * w_stride;
        for (int m = 0; m < GROUP; m++)
            for (int c = 0; c < nc; c++) {
                if (k + 1 < depth)
                    acc[m][c] = _mm256_fmadd_ps(_mm256_broadcast_ss(s[m] + k + 1),
                                                load_bf16_upto8(wk + w_stride + col[c], width[c]), acc[m][c]);
                acc[m][c] = _mm256_fmadd_ps(_mm256_broadcast_ss(s[m] + k), load_bf16_upto8(wk + col[c], width[c]),
                                            acc[m][c]);
            }
    }
}

/* The first n lanes of v stored at p (float32). */
VEC256 static inline void store_f32_upto8(float *p, __m256 v, int64_t n) {
    if (n >= 8) {
        _mm256_storeu_ps(p, v);
    } else {
        float t[8];
        _mm256_storeu_ps(t, v);
        memcpy(p, t, (size_t)n * sizeof *t);
    }
}

/* The first n lanes of v (bf16) stored at p. */
VEC256 static inline void store_bf16_upto8(uint16_t *p, __m128i v, int64_t n) {
    if (n >= 8) {
        _mm_storeu_si128((__m128i *)p, v);
    } else {
        uint16_t t[8];
        _mm_storeu_si128((__m128i *)t, v);
        memcpy(p, t, (size_t)n * sizeof *t);
    }
}

/* A group's shrink: its x rows widened into x32, then every rank column of every slice of its slot in passes of
 * up to CHUNKS8 vectors, rounded to bf16 (kept as float32) into the first ``count`` rows of shrunk32. */
VEC256 static void shrink_item_avx2(const Call *c, const Group *g, float *x32) {
    const uint16_t *x_rows[GROUP];
    uint16_t *y_rows[GROUP];
    int64_t scratch_rows[GROUP];
    group_pointers(c, g, x_rows, y_rows, scratch_rows);
    const float *s[GROUP];
    for (int m = 0; m < GROUP; m++) {
        s[m] = x32 + (m < g->count ? m : g->count - 1) * c->in;
        if (m >= g->count) continue;
        float *row = x32 + m * c->in;
        int64_t k = 0;
        for (; k + 8 <= c->in; k += 8) _mm256_storeu_ps(row + k, load_bf16_8(x_rows[m] + k));
        for (; k < c->in; k++) row[k] = bf16_to_f32(x_rows[m][k]);
    }
    const int64_t rank = c->ranks[g->slot], a_stride = c->slices * c->max_rank;
    const uint16_t *a = c->a + g->slot * c->in * a_stride;
    int64_t col[MAX_SLICES * MAX_RANK / 8], width[MAX_SLICES * MAX_RANK / 8];
    int n = 0;
    for (int64_t sl = 0; sl < c->slices; sl++)
        for (int64_t r0 = 0; r0 < rank; r0 += 8) {
            col[n] = sl * c->max_rank + r0;
            width[n++] = rank - r0;
        }
    for (int c0 = 0; c0 < n; c0 += CHUNKS8) {
        __m256 acc[GROUP][CHUNKS8];
        const int nc = n - c0 < CHUNKS8 ? n - c0 : CHUNKS8;
        if (nc == CHUNKS8) /* two copies: a constant nc for the full passes */
            product8(acc, CHUNKS8, s, a, a_stride, c->in * a_stride, c->in, col + c0, width + c0);
        else
            product8(acc, nc, s, a, a_stride, c->in * a_stride, c->in, col + c0, width + c0);
        for (int m = 0; m < g->count; m++)
            for (int j = 0; j < nc; j++) {
                const __m256 rounded = bf16_8_to_f32(f32_to_bf16_8(acc[m][j]));
                store_f32_upto8(c->shrunk32 + scratch_rows[m] + col[c0 + j], rounded, width[c0 + j]);
            }
    }
}

/* y[rows, block] += shrunk[rows, the slice's rank columns] @ Bᵀ[:rank, block], in passes of up to CHUNKS8 vectors:
 * float32 sums, added to y's value in float32 and rounded once. Rows past ``rank`` are not read (``rank`` may be
 * the slot's last row). */
VEC256 static void expand_item_avx2(const Call *c, const Group *g, const Block *k) {
    const uint16_t *x_rows[GROUP];
    uint16_t *y_rows[GROUP];
    int64_t scratch_rows[GROUP];
    group_pointers(c, g, x_rows, y_rows, scratch_rows);
    const int64_t rank = c->ranks[g->slot];
    const float *s[GROUP];
    for (int m = 0; m < GROUP; m++) s[m] = c->shrunk32 + scratch_rows[m] + k->slice * c->max_rank;
    const uint16_t *b = c->b + g->slot * c->max_rank * c->out;
    int64_t col[BLOCK / 8], width[BLOCK / 8];
    int n = 0;
    for (int64_t j = 0; j < k->width; j += 8) {
        col[n] = k->col0 + j;
        width[n++] = k->width - j;
    }
    for (int c0 = 0; c0 < n; c0 += CHUNKS8) {
        __m256 acc[GROUP][CHUNKS8];
        const int nc = n - c0 < CHUNKS8 ? n - c0 : CHUNKS8;
        if (nc == CHUNKS8) /* two copies: a constant nc for the full passes */
            product8(acc, CHUNKS8, s, b, c->out, rank * c->out, rank, col + c0, width + c0);
        else
            product8(acc, nc, s, b, c->out, rank * c->out, rank, col + c0, width + c0);
        for (int m = 0; m < g->count; m++)
            for (int j = 0; j < nc; j++) {
                uint16_t *p = y_rows[m] + col[c0 + j];
                const __m256 sum = _mm256_add_ps(load_bf16_upto8(p, width[c0 + j]), acc[m][j]);
                store_bf16_upto8(p, f32_to_bf16_8(sum), width[c0 + j]);
            }
    }
}

#endif /* WARMSTART_X86 */

typedef void ShrinkItem(const Call *c, const Group *g, float *x32);
typedef void ExpandItem(const Call *c, const Group *g, const Block *k);

/* Both phases in one parallel region: every group's shrink, then every (group, block) expand. */
static void run(const Call *c, const Group *groups, int64_t num_groups, const Block *blocks, int64_t num_blocks,
                ShrinkItem *shrink, ExpandItem *expand, int threads) {
#pragma omp parallel num_threads(threads)
    {
        float *x32 = c->x32 ? c->x32 + (int64_t)omp_get_thread_num() * GROUP * c->in : NULL;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < num_groups; i++) shrink(c, &groups[i], x32);
#pragma omp for schedule(static)
        for (int64_t item = 0; item < num_groups * num_blocks; item++)
            expand(c, &groups[item / num_blocks], &blocks[item % num_blocks]);
    }
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
    /* the path isa_level allows, chosen here only */
    ShrinkItem *shrink = NULL;
    ExpandItem *expand = NULL;
    int avx2 = 0;
#if WARMSTART_X86
    if (isa_level >= ISA_AVX512_BF16) {
        shrink = shrink_item_avx512_bf16;
        expand = expand_item_avx512_bf16;
    } else if (isa_level >= ISA_AVX2) {
        avx2 = 1;
        shrink = shrink_item_avx2;
        expand = expand_item_avx2;
    }
#endif
    if (!shrink)
        return PyErr_Format(PyExc_RuntimeError, "sgmv: the LoRA kernel needs AVX2 (with FMA and F16C) or AVX512-BF16 "
                            "and the CPU kernels run at '%s' (runtime/kernels/isa.py); runtime/kernels/cpu_lora.py "
                            "takes the PyTorch path there", isa_names[isa_level]);
    Call c = {(uint16_t *)y, (const uint16_t *)x, (const uint16_t *)a, (const uint16_t *)b, (const int64_t *)rows,
              (const int64_t *)ranks, y_stride, x_stride, in, 0, 0, max_rank, 0, {0, 0, 0}, NULL, NULL, NULL};
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
    /* no more threads than work items (a single row's step runs on the calling thread) */
    const int64_t items = num_groups * num_blocks;
    const int threads = num_threads < 1 ? 1 : (items < num_threads ? (items ? (int)items : 1) : num_threads);
    c.scratch_stride = c.slices * max_rank;
    const size_t scratch = (size_t)(m ? m : 1) * c.scratch_stride;
    if (avx2) {
        c.shrunk32 = malloc(scratch * sizeof(float));
        c.x32 = malloc((size_t)threads * GROUP * in * sizeof(float));
    } else {
        c.shrunk = malloc(scratch * sizeof(uint16_t));
    }
    if (avx2 ? !c.shrunk32 || !c.x32 : !c.shrunk) {
        free(c.shrunk32);
        free(c.x32);
        free(blocks);
        free(groups);
        return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS
    run(&c, groups, num_groups, blocks, num_blocks, shrink, expand, threads);
    Py_END_ALLOW_THREADS
    free(c.shrunk);
    free(c.shrunk32);
    free(c.x32);
    free(blocks);
    free(groups);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"sgmv", sgmv, METH_VARARGS,
     "sgmv(y, y_stride, x, x_stride, a, b, rows, seg_slots, starts, ends, ranks, n, m, num_segs, num_slots, in, "
     "max_rank, (out of each slice, 0 for none), num_threads): y[rows] += LoRA of x[rows], in place, all bfloat16 "
     "but the int64 rows, segments and ranks"},
    ISA_METHODS,
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_lora", NULL, -1, methods};

PyMODINIT_FUNC PyInit__cpu_lora(void) {
    isa_init();
    PyObject *m = PyModule_Create(&module);
    if (m && (PyModule_AddIntConstant(m, "MAX_RANK", MAX_RANK) < 0 || PyModule_AddIntConstant(m, "MAX_SLICES",
                                                                                                MAX_SLICES) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
