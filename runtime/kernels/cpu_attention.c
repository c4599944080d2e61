/* Decode and prefill attention over the paged KV pool, for the CPU path (runtime/layers/attention.py calls it).
 * Prefill is described further down, above its code; this comment is about decode.
 *
 * The PyTorch path gathers every sequence's KV blocks into a contiguous copy and then runs two batched
 * matmuls over it: the copy is written once and read twice, and every sequence is padded to the longest of
 * its group. Here each (sequence, KV head) pair reads its keys and values straight from the pool, once, for
 * exactly its own length: scores for the query heads sharing that KV head, a float32 softmax, and the
 * weighted sum of values. Pairs are spread over the threads with OpenMP; torch ships the same libgomp
 * (soname libgomp.so.1), so the process keeps one thread pool.
 *
 * Pool layout (runtime/engine/model_runner.py): K and V each [kv_heads, num_blocks, block_size, head_dim],
 * contiguous. Queries and outputs: [batch, heads, head_dim], contiguous. Row b attends the keys
 * key_start[b] <= j < key_end[b], where key j lives in block tables[b, j / block_size] at offset
 * j % block_size. float32 or bfloat16; arithmetic in float32.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "isa.h"

#include "decode_attention.h"

static PyObject *decode(PyObject *self, PyObject *args) {
    DecodeArgs a;
    unsigned long long out, q, k, v, tables, key_start, key_end;
    int num_threads;
    if (!PyArg_ParseTuple(args, "KKKKKKKLLLLLLLfii", &out, &q, &k, &v, &tables, &key_start, &key_end, &a.batch,
                          &a.heads, &a.kv_heads, &a.head_dim, &a.block_size, &a.table_width, &a.head_stride,
                          &a.scale, &a.bf16, &num_threads))
        return NULL;
    if (a.kv_heads <= 0 || a.heads % a.kv_heads || a.heads / a.kv_heads > MAX_GROUP || a.head_dim > MAX_HEAD_DIM ||
        a.block_size <= 0 || num_threads <= 0) {
        PyErr_Format(PyExc_ValueError,
                     "decode: unsupported shape (heads %lld, kv_heads %lld, head_dim %lld, block_size %lld); "
                     "at most %d query heads per KV head and head_dim %d",
                     (long long)a.heads, (long long)a.kv_heads, (long long)a.head_dim, (long long)a.block_size,
                     MAX_GROUP, MAX_HEAD_DIM);
        return NULL;
    }
    a.block_shift = -1;
    for (int shift = 0; shift < 31; shift++)
        if (((int64_t)1 << shift) == a.block_size) a.block_shift = shift;
    a.out = (void *)(uintptr_t)out;
    a.q = (const void *)(uintptr_t)q;
    a.k = (const void *)(uintptr_t)k;
    a.v = (const void *)(uintptr_t)v;
    a.tables = (const int64_t *)(uintptr_t)tables;
    a.key_start = (const int64_t *)(uintptr_t)key_start;
    a.key_end = (const int64_t *)(uintptr_t)key_end;
    int64_t longest = 1;
    for (int64_t b = 0; b < a.batch; b++)
        if (a.key_end[b] - a.key_start[b] > longest) longest = a.key_end[b] - a.key_start[b];
    const int64_t group = a.heads / a.kv_heads, pairs = a.batch * a.kv_heads;
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * (size_t)(group * longest));
        if (scores == NULL) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < pairs; i++)
            if (scores != NULL) attend_dispatch(&a, i / a.kv_heads, i % a.kv_heads, scores);
        free(scores);
    }
    Py_END_ALLOW_THREADS
    if (failed) return PyErr_NoMemory();
    Py_RETURN_NONE;
}


/* ---- Prefill: causal attention of chunks of queries over the pool in place ----
 *
 * One call takes one or more sequences' chunks. Sequence s's chunk is T queries at positions pos0 .. pos0+T-1,
 * rows row0 .. row0+T-1 of q and out (q rows q_stride elements apart, so q may be a view of the qkv output; out
 * rows out_stride apart). Its keys, this chunk's own included, are already in the pool: column c of its row of
 * tables holds positions key_base + c * block_size .. The query at position p attends the keys
 * max(key_base, p - window + 1) .. p (window 0: no window).
 *
 * Work items are (sequence, KV head, tile of queries); a tile's rows are its queries times the query heads that
 * share the KV head, so each key is read once for all of them (GQA). Rows sit in vector lanes: scores are
 * S^T[key][row] = sum over d of K[key][d] (broadcast) * Q^T[d][row], outputs O^T[d][row] += V[key][d]
 * (broadcast) * P^T[key][row], and the online softmax's running max and sum are lane-wise, with no horizontal
 * reductions. Keys go in tiles of PF_KEYS, which may span pool blocks. With AVX512-BF16 the products take two
 * dims (QK) or two keys (PV) at a time, bf16 x bf16 summed in float32 (vdpbf16ps); P is rounded to bf16 for it,
 * as SDPA's bf16 path rounds it. Otherwise float32 FMAs, on 16 lanes with AVX-512 (head_dim a multiple of 16) or
 * on 8 with AVX2 (a multiple of 8), the same floats either way; below that (isa.h's portable level, aarch64), a
 * portable two-pass loop per query, which runtime/layers/attention.py leaves to SDPA as slower.
 */
#define PF_KEYS 32
#define PF_ROWS 64 /* rows per work item at most: four vectors of 16 lanes, eight of 8 */

typedef struct {
    void *out;
    const void *q, *k, *v;
    const int64_t *tables, *seqs; /* seqs: [nseq, 4] first row, queries, first query's position, key_base */
    int64_t nseq, heads, kv_heads, head_dim, block_size, table_width, head_stride, q_stride, out_stride, window;
    int64_t tile_queries; /* queries per work item */
    float scale;
    int bf16;
} PrefillArgs;

typedef struct { /* one thread's scratch, 64-byte aligned */
    float *qt;     /* [E][rows] Q^T: float, or uint32 pairs of bf16 dims (E = head_dim / 2) */
    float *st;     /* [PF_KEYS][rows] scores, then probabilities */
    uint32_t *pp;  /* [PF_KEYS / 2][rows] probabilities of key pairs as bf16 pairs */
    float *ot;     /* [head_dim][rows] O^T */
    float *kb, *vb; /* [PF_KEYS][head_dim] keys and values converted to float32, or value pairs as uint32 */
    float *row;    /* [head_dim] the portable path's accumulator */
} Scratch;

static inline int64_t pf_offset(const PrefillArgs *a, int64_t s, int64_t h, int64_t position) {
    const int64_t column = position - a->seqs[4 * s + 3];
    const int64_t block = a->tables[s * a->table_width + column / a->block_size];
    return h * a->head_stride + (block * a->block_size + column % a->block_size) * a->head_dim;
}

/* pf_offset of ``count`` consecutive positions from ``first``, with one division rather than one per key. */
static inline void pf_offsets(const PrefillArgs *a, int64_t s, int64_t h, int64_t first, int64_t count,
                              int64_t *offsets) {
    const int64_t column = first - a->seqs[4 * s + 3], *table = a->tables + s * a->table_width;
    int64_t block = column / a->block_size, within = column % a->block_size;
    for (int64_t j = 0; j < count; j++) {
        offsets[j] = h * a->head_stride + (table[block] * a->block_size + within) * a->head_dim;
        if (++within == a->block_size) {
            within = 0;
            block++;
        }
    }
}

static inline float pf_load(const PrefillArgs *a, const void *base, int64_t offset) {
    return a->bf16 ? bf16_to_f32(((const uint16_t *)base)[offset]) : ((const float *)base)[offset];
}

static inline void pf_store(const PrefillArgs *a, int64_t offset, float x) {
    if (a->bf16)
        ((uint16_t *)a->out)[offset] = f32_to_bf16(x);
    else
        ((float *)a->out)[offset] = x;
}

static inline int64_t pf_min(int64_t x, int64_t y) { return x < y ? x : y; }

/* The keys of the queries at positions first .. last: [*lo, *hi]. */
static inline void pf_key_range(const PrefillArgs *a, int64_t s, int64_t first, int64_t last, int64_t *lo,
                                int64_t *hi) {
    const int64_t key_base = a->seqs[4 * s + 3];
    *lo = a->window > 0 && first - a->window + 1 > key_base ? first - a->window + 1 : key_base;
    *hi = last;
}

/* Portable: each query row by itself, scores in ``scores`` (as many floats as its longest key range). */
static void prefill_portable(const PrefillArgs *a, int64_t s, int64_t h, int64_t tile, Scratch *sc, float *scores) {
    const int64_t d_len = a->head_dim, group = a->heads / a->kv_heads;
    const int64_t *seq = a->seqs + 4 * s;
    const int64_t t_end = pf_min(seq[1], (tile + 1) * a->tile_queries);
    float *acc = sc->row;
    for (int64_t t = tile * a->tile_queries; t < t_end; t++) {
        int64_t lo, hi;
        pf_key_range(a, s, seq[2] + t, seq[2] + t, &lo, &hi);
        for (int64_t g = 0; g < group; g++) {
            const int64_t q_off = (seq[0] + t) * a->q_stride + (h * group + g) * d_len;
            float max = -INFINITY, sum = 0.f;
            for (int64_t j = lo; j <= hi; j++) {
                const int64_t k_off = pf_offset(a, s, h, j);
                float dot = 0.f;
                for (int64_t d = 0; d < d_len; d++) dot += pf_load(a, a->q, q_off + d) * pf_load(a, a->k, k_off + d);
                scores[j - lo] = dot * a->scale;
                if (scores[j - lo] > max) max = scores[j - lo];
            }
            for (int64_t d = 0; d < d_len; d++) acc[d] = 0.f;
            for (int64_t j = lo; j <= hi; j++) {
                const float p = expf(scores[j - lo] - max);
                const int64_t v_off = pf_offset(a, s, h, j);
                sum += p;
                for (int64_t d = 0; d < d_len; d++) acc[d] += p * pf_load(a, a->v, v_off + d);
            }
            const int64_t o_off = (seq[0] + t) * a->out_stride + (h * group + g) * d_len;
            for (int64_t d = 0; d < d_len; d++) pf_store(a, o_off + d, acc[d] / sum);
        }
    }
}

#if WARMSTART_X86

/* The AVX-512 paths. Compiled for AVX512-BF16 so that one body serves both; with ``dots`` 0 it uses no BF16
 * instruction (the compiler emits them only for their intrinsics), so it runs on AVX-512 CPUs without them. */
#define AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))

static const float pf_zeros[MAX_HEAD_DIM];

/* 2^x for the probabilities the bf16 products take: a degree-6 polynomial, within 2e-7 relative (about float32's own
 * rounding; degree 5, 3e-6, was no faster measurably); x finite or -inf (masked lanes, zeroed by the caller). */
AVX512BF16 static inline __m512 exp2_16(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.5403530393e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3333558146e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.6181291076e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.5504108665e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.4022650696e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.9314718056e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

AVX512BF16 static inline __m512 pf_exp(__m512 x, int dots) { return dots ? exp2_16(x) : exp16(x); }

static inline uint32_t load_u32(const uint16_t *p) {
    uint32_t x;
    memcpy(&x, p, sizeof x);
    return x;
}

/* Q^T of the tile's ``rows`` rows (the rest of the RP lanes zero). */
static inline void pf_pack_queries(const PrefillArgs *a, int64_t s, int64_t h, int64_t t0, int64_t rows, int64_t rp,
                                   int dots, Scratch *sc) {
    const int64_t d_len = a->head_dim, group = a->heads / a->kv_heads, e = dots ? d_len / 2 : d_len;
    for (int64_t r = 0; r < rp; r++) {
        if (r >= rows) {
            for (int64_t p = 0; p < e; p++) sc->qt[p * rp + r] = 0.f;
            continue;
        }
        const int64_t off = (a->seqs[4 * s] + t0 + r / group) * a->q_stride + (h * group + r % group) * d_len;
        if (dots) {
            const uint16_t *src = (const uint16_t *)a->q + off;
            uint32_t *dst = (uint32_t *)sc->qt;
            for (int64_t p = 0; p < e; p++) dst[p * rp + r] = load_u32(src + 2 * p);
        } else {
            for (int64_t d = 0; d < d_len; d++) sc->qt[d * rp + r] = pf_load(a, a->q, off + d);
        }
    }
}

/* Rows of ``count`` keys from position k0 as float32 pointers (``dots``: as bf16 pointers), converted into
 * ``buffer`` when the pool is bf16 and the dots are float32; missing rows up to a multiple of 4 point at zeros. */
AVX512BF16 static inline void pf_key_rows(const PrefillArgs *a, const void *pool, const int64_t *offsets,
                                          int64_t count, int dots, float *buffer, const void **rows) {
    const int64_t d_len = a->head_dim;
    for (int64_t j = 0; j < count; j++) {
        const int64_t off = offsets[j];
        if (dots || !a->bf16) {
            rows[j] = a->bf16 ? (const void *)((const uint16_t *)pool + off) : (const void *)((const float *)pool + off);
        } else {
            const uint16_t *src = (const uint16_t *)pool + off;
            for (int64_t c = 0; c < d_len; c += 16) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(src + c));
                _mm512_storeu_ps(buffer + j * d_len + c,
                                 _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)));
            }
            rows[j] = buffer + j * d_len;
        }
    }
    for (int64_t j = count; j < ((count + 3) & ~(int64_t)3); j++) rows[j] = pf_zeros;
}

AVX512BF16 static inline __attribute__((always_inline)) void prefill_avx512_impl(
    const PrefillArgs *a, int64_t s, int64_t h, int64_t tile, Scratch *sc, const int RG, const int dots) {
    const int64_t d_len = a->head_dim, group = a->heads / a->kv_heads, rp = 16 * RG;
    const int64_t e = dots ? d_len / 2 : d_len;
    const int64_t *seq = a->seqs + 4 * s;
    const int64_t t0 = tile * a->tile_queries, nt = pf_min(seq[1] - t0, a->tile_queries), rows = nt * group;
    const void *k_rows[PF_KEYS], *v_rows[PF_KEYS];
    __m512i high[4], low[4]; /* per lane: the highest and lowest key position its row may attend */
    __m512 max_v[4], sum_v[4];
    __mmask16 valid[PF_KEYS][4];

    pf_pack_queries(a, s, h, t0, rows, rp, dots, sc);
    for (int g = 0; g < RG; g++) {
        int32_t hi_lane[16], lo_lane[16];
        for (int l = 0; l < 16; l++) {
            const int64_t r = 16 * g + l, position = seq[2] + t0 + r / group;
            hi_lane[l] = r < rows ? (int32_t)position : -1;
            lo_lane[l] = a->window > 0 ? (int32_t)(position - a->window + 1) : INT32_MIN;
        }
        high[g] = _mm512_loadu_si512(hi_lane);
        low[g] = _mm512_loadu_si512(lo_lane);
        max_v[g] = _mm512_set1_ps(-1e30f); /* finite: a row with nothing seen yet gets exp(-inf) = 0, not NaN */
        sum_v[g] = _mm512_setzero_ps();
    }
    memset(sc->ot, 0, sizeof(float) * (size_t)(d_len * rp));
    /* the bf16 products take exp2 (log2(e) folded in with the scale); the float32 ones keep exp16's accuracy */
    const __m512 exponent_scale = _mm512_set1_ps(dots ? a->scale * 1.44269504088896341f : a->scale);
    const __m512 minus_inf = _mm512_set1_ps(-INFINITY);
    int64_t lo, hi;
    pf_key_range(a, s, seq[2] + t0, seq[2] + t0 + nt - 1, &lo, &hi);
    for (int64_t k0 = lo; k0 <= hi; k0 += PF_KEYS) {
        const int64_t count = pf_min(PF_KEYS, hi - k0 + 1);
        int64_t offsets[PF_KEYS]; /* of the keys' rows, the same in the K and the V pool */
        pf_offsets(a, s, h, k0, count, offsets);
        pf_key_rows(a, a->k, offsets, count, dots, sc->kb, k_rows);
        /* S^T = K Q^T, four keys at a time */
        for (int64_t j = 0; j < count; j += 4) {
            __m512 acc[4][4];
            for (int jj = 0; jj < 4; jj++)
                for (int g = 0; g < RG; g++) acc[jj][g] = _mm512_setzero_ps();
            for (int64_t p = 0; p < e; p++) {
                __m512 qv[4];
                for (int g = 0; g < RG; g++) qv[g] = _mm512_load_ps(sc->qt + p * rp + 16 * g);
                for (int jj = 0; jj < 4; jj++) {
                    if (dots) {
                        const __m512i kv = _mm512_set1_epi32((int)load_u32((const uint16_t *)k_rows[j + jj] + 2 * p));
                        for (int g = 0; g < RG; g++)
                            acc[jj][g] = _mm512_dpbf16_ps(acc[jj][g], (__m512bh)kv, (__m512bh)qv[g]);
                    } else {
                        const __m512 kv = _mm512_set1_ps(((const float *)k_rows[j + jj])[p]);
                        for (int g = 0; g < RG; g++) acc[jj][g] = _mm512_fmadd_ps(kv, qv[g], acc[jj][g]);
                    }
                }
            }
            for (int jj = 0; jj < 4; jj++)
                for (int g = 0; g < RG; g++) _mm512_store_ps(sc->st + (j + jj) * rp + 16 * g, acc[jj][g]);
        }
        /* online softmax over the raw scores, the scale folded into the exponent's argument; masks only on tiles
         * that reach past a row's own position or below its window (the interior tiles need none) */
        const int interior = k0 + count - 1 <= seq[2] + t0 &&
                             (a->window == 0 || k0 >= seq[2] + t0 + nt - 1 - a->window + 1);
        for (int g = 0; g < RG; g++) {
            __m512 tile_max = max_v[g];
            if (interior) {
                for (int64_t j = 0; j < count; j++) tile_max = _mm512_max_ps(tile_max, _mm512_load_ps(sc->st + j * rp + 16 * g));
            } else {
                for (int64_t j = 0; j < count; j++) {
                    const __m512i position = _mm512_set1_epi32((int32_t)(k0 + j));
                    valid[j][g] = _mm512_cmple_epi32_mask(position, high[g]) & _mm512_cmpge_epi32_mask(position, low[g]);
                    const __m512 x = _mm512_mask_mov_ps(minus_inf, valid[j][g], _mm512_load_ps(sc->st + j * rp + 16 * g));
                    _mm512_store_ps(sc->st + j * rp + 16 * g, x);
                    tile_max = _mm512_max_ps(tile_max, x);
                }
            }
            if (_mm512_cmp_ps_mask(tile_max, max_v[g], _CMP_GT_OQ)) {
                const __m512 alpha = pf_exp(_mm512_mul_ps(_mm512_sub_ps(max_v[g], tile_max), exponent_scale), dots);
                sum_v[g] = _mm512_mul_ps(sum_v[g], alpha);
                for (int64_t d = 0; d < d_len; d++)
                    _mm512_store_ps(sc->ot + d * rp + 16 * g, _mm512_mul_ps(_mm512_load_ps(sc->ot + d * rp + 16 * g), alpha));
                max_v[g] = tile_max;
            }
            const __m512 shift = _mm512_mul_ps(max_v[g], exponent_scale);
            for (int64_t j = 0; j < count; j++) {
                const __m512 x = _mm512_fmsub_ps(_mm512_load_ps(sc->st + j * rp + 16 * g), exponent_scale, shift);
                const __m512 p = interior ? pf_exp(x, dots) : _mm512_maskz_mov_ps(valid[j][g], pf_exp(x, dots));
                sum_v[g] = _mm512_add_ps(sum_v[g], p);
                _mm512_store_ps(sc->st + j * rp + 16 * g, p);
            }
            if (count & 1) _mm512_store_ps(sc->st + count * rp + 16 * g, _mm512_setzero_ps());
        }
        /* O^T += V^T P^T */
        if (dots) {
            const int64_t pairs = (count + 1) / 2;
            const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23,
                                                        7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
            for (int64_t jp = 0; jp < pairs; jp++) {
                for (int g = 0; g < RG; g++) {
                    const __m512 p0 = _mm512_load_ps(sc->st + 2 * jp * rp + 16 * g);
                    const __m512 p1 = _mm512_load_ps(sc->st + (2 * jp + 1) * rp + 16 * g);
                    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p1, p0); /* p0's lanes low, p1's high */
                    _mm512_store_si512(sc->pp + jp * rp + 16 * g, _mm512_permutexvar_epi16(interleave, both));
                }
                const uint16_t *r0 = (const uint16_t *)a->v + offsets[2 * jp];
                const uint16_t *r1 = 2 * jp + 1 < count ? (const uint16_t *)a->v + offsets[2 * jp + 1]
                                                         : (const uint16_t *)pf_zeros;
                uint32_t *dst = (uint32_t *)sc->vb + jp * d_len;
                for (int64_t c = 0; c < d_len; c += 16) {
                    const __m512i x0 = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(r0 + c)));
                    const __m512i x1 = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(r1 + c)));
                    _mm512_storeu_si512(dst + c, _mm512_or_si512(x0, _mm512_slli_epi32(x1, 16)));
                }
            }
            for (int64_t d = 0; d < d_len; d += 4) {
                __m512 acc[4][4];
                for (int dd = 0; dd < 4; dd++)
                    for (int g = 0; g < RG; g++) acc[dd][g] = _mm512_load_ps(sc->ot + (d + dd) * rp + 16 * g);
                for (int64_t jp = 0; jp < pairs; jp++) {
                    __m512i pv[4];
                    for (int g = 0; g < RG; g++) pv[g] = _mm512_load_si512(sc->pp + jp * rp + 16 * g);
                    const uint32_t *vrow = (const uint32_t *)sc->vb + jp * d_len + d;
                    for (int dd = 0; dd < 4; dd++) {
                        const __m512i vv = _mm512_set1_epi32((int)vrow[dd]);
                        for (int g = 0; g < RG; g++)
                            acc[dd][g] = _mm512_dpbf16_ps(acc[dd][g], (__m512bh)vv, (__m512bh)pv[g]);
                    }
                }
                for (int dd = 0; dd < 4; dd++)
                    for (int g = 0; g < RG; g++) _mm512_store_ps(sc->ot + (d + dd) * rp + 16 * g, acc[dd][g]);
            }
        } else {
            pf_key_rows(a, a->v, offsets, count, 0, sc->vb, v_rows);
            for (int64_t d = 0; d < d_len; d += 4) {
                __m512 acc[4][4];
                for (int dd = 0; dd < 4; dd++)
                    for (int g = 0; g < RG; g++) acc[dd][g] = _mm512_load_ps(sc->ot + (d + dd) * rp + 16 * g);
                for (int64_t j = 0; j < count; j++) {
                    __m512 pv[4];
                    for (int g = 0; g < RG; g++) pv[g] = _mm512_load_ps(sc->st + j * rp + 16 * g);
                    const float *vrow = (const float *)v_rows[j] + d;
                    for (int dd = 0; dd < 4; dd++) {
                        const __m512 vv = _mm512_set1_ps(vrow[dd]);
                        for (int g = 0; g < RG; g++) acc[dd][g] = _mm512_fmadd_ps(vv, pv[g], acc[dd][g]);
                    }
                }
                for (int dd = 0; dd < 4; dd++)
                    for (int g = 0; g < RG; g++) _mm512_store_ps(sc->ot + (d + dd) * rp + 16 * g, acc[dd][g]);
            }
        }
    }
    float sums[PF_ROWS];
    for (int g = 0; g < RG; g++) _mm512_storeu_ps(sums + 16 * g, sum_v[g]);
    /* O^T back to rows: a row's 16 dims at a time gathered from O^T's columns */
    const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32((int)rp));
    for (int64_t r = 0; r < rows; r++) {
        const int64_t off = (seq[0] + t0 + r / group) * a->out_stride + (h * group + r % group) * d_len;
        const __m512 inv = _mm512_set1_ps(sums[r] > 0.f ? 1.f / sums[r] : 0.f);
        for (int64_t d = 0; d < d_len; d += 16) {
            const __m512 x = _mm512_mul_ps(_mm512_i32gather_ps(column, sc->ot + d * rp + r, 4), inv);
            if (a->bf16)
                _mm256_storeu_si256((__m256i *)((uint16_t *)a->out + off + d), f32_to_bf16_16(x));
            else
                _mm512_storeu_ps((float *)a->out + off + d, x);
        }
    }
}

AVX512BF16 static void prefill_avx512(const PrefillArgs *a, int64_t s, int64_t h, int64_t tile, Scratch *sc,
                                      int dots) {
    const int64_t queries = pf_min(a->seqs[4 * s + 1] - tile * a->tile_queries, a->tile_queries);
    const int rows = (int)(queries * (a->heads / a->kv_heads)); /* a short chunk's tile uses fewer vectors */
    switch ((rows + 15) / 16 * 2 + (dots != 0)) {
    case 2: prefill_avx512_impl(a, s, h, tile, sc, 1, 0); break;
    case 3: prefill_avx512_impl(a, s, h, tile, sc, 1, 1); break;
    case 4: prefill_avx512_impl(a, s, h, tile, sc, 2, 0); break;
    case 5: prefill_avx512_impl(a, s, h, tile, sc, 2, 1); break;
    case 6: prefill_avx512_impl(a, s, h, tile, sc, 3, 0); break;
    case 7: prefill_avx512_impl(a, s, h, tile, sc, 3, 1); break;
    case 8: prefill_avx512_impl(a, s, h, tile, sc, 4, 0); break;
    default: prefill_avx512_impl(a, s, h, tile, sc, 4, 1); break;
    }
}

/* ---- AVX2 (with FMA and F16C): prefill_avx512's float32 path on 8 lanes ----
 * A work item's rows fill RG vectors of 8 lanes (RG up to 8). AVX2 has 16 registers, so S^T and O^T are computed
 * in blocks of PF8_BLOCK vectors of rows times 4 keys (or 4 dims); each lane's sums are taken in prefill_avx512's
 * order, so both give the same floats. */
#define PF8_BLOCK 2

/* pf_key_rows on 8 lanes, float32 products only. */
VEC256 static inline void pf_key_rows8(const PrefillArgs *a, const void *pool, const int64_t *offsets, int64_t count,
                                       float *buffer, const float **rows) {
    const int64_t d_len = a->head_dim;
    for (int64_t j = 0; j < count; j++) {
        if (!a->bf16) {
            rows[j] = (const float *)pool + offsets[j];
            continue;
        }
        const uint16_t *src = (const uint16_t *)pool + offsets[j];
        for (int64_t c = 0; c < d_len; c += 8) _mm256_storeu_ps(buffer + j * d_len + c, load_bf16_8(src + c));
        rows[j] = buffer + j * d_len;
    }
    for (int64_t j = count; j < ((count + 3) & ~(int64_t)3); j++) rows[j] = pf_zeros;
}

/* S^T's rows j .. j+3 (keys), lanes of the NB vectors from vector g0 (query rows). */
VEC256 static inline __attribute__((always_inline)) void pf8_scores(const float *qt, const float *const *k_rows,
                                                                     int64_t count, int64_t d_len, int64_t rp,
                                                                     int g0, const int NB, float *st) {
    for (int64_t j = 0; j < count; j += 4) {
        __m256 acc[4][PF8_BLOCK];
        for (int jj = 0; jj < 4; jj++)
            for (int g = 0; g < NB; g++) acc[jj][g] = _mm256_setzero_ps();
        for (int64_t p = 0; p < d_len; p++) {
            __m256 qv[PF8_BLOCK];
            for (int g = 0; g < NB; g++) qv[g] = _mm256_load_ps(qt + p * rp + 8 * (g0 + g));
            for (int jj = 0; jj < 4; jj++) {
                const __m256 kv = _mm256_broadcast_ss(k_rows[j + jj] + p);
                for (int g = 0; g < NB; g++) acc[jj][g] = _mm256_fmadd_ps(kv, qv[g], acc[jj][g]);
            }
        }
        for (int jj = 0; jj < 4; jj++)
            for (int g = 0; g < NB; g++) _mm256_store_ps(st + (j + jj) * rp + 8 * (g0 + g), acc[jj][g]);
    }
}

/* O^T += V^T P^T for the NB vectors of rows from vector g0. */
VEC256 static inline __attribute__((always_inline)) void pf8_values(const float *st, const float *const *v_rows,
                                                                     int64_t count, int64_t d_len, int64_t rp,
                                                                     int g0, const int NB, float *ot) {
    for (int64_t d = 0; d < d_len; d += 4) {
        __m256 acc[4][PF8_BLOCK];
        for (int dd = 0; dd < 4; dd++)
            for (int g = 0; g < NB; g++) acc[dd][g] = _mm256_load_ps(ot + (d + dd) * rp + 8 * (g0 + g));
        for (int64_t j = 0; j < count; j++) {
            __m256 pv[PF8_BLOCK];
            for (int g = 0; g < NB; g++) pv[g] = _mm256_load_ps(st + j * rp + 8 * (g0 + g));
            for (int dd = 0; dd < 4; dd++) {
                const __m256 vv = _mm256_broadcast_ss(v_rows[j] + d + dd);
                for (int g = 0; g < NB; g++) acc[dd][g] = _mm256_fmadd_ps(vv, pv[g], acc[dd][g]);
            }
        }
        for (int dd = 0; dd < 4; dd++)
            for (int g = 0; g < NB; g++) _mm256_store_ps(ot + (d + dd) * rp + 8 * (g0 + g), acc[dd][g]);
    }
}

/* Rows of an 8 x 8 block become its columns. */
VEC256 static inline void transpose8(__m256 *r) {
    __m256 t[8], s[8];
    for (int k = 0; k < 4; k++) {
        t[2 * k] = _mm256_unpacklo_ps(r[2 * k], r[2 * k + 1]);
        t[2 * k + 1] = _mm256_unpackhi_ps(r[2 * k], r[2 * k + 1]);
    }
    for (int k = 0; k < 2; k++) {
        s[4 * k] = _mm256_shuffle_ps(t[4 * k], t[4 * k + 2], _MM_SHUFFLE(1, 0, 1, 0));
        s[4 * k + 1] = _mm256_shuffle_ps(t[4 * k], t[4 * k + 2], _MM_SHUFFLE(3, 2, 3, 2));
        s[4 * k + 2] = _mm256_shuffle_ps(t[4 * k + 1], t[4 * k + 3], _MM_SHUFFLE(1, 0, 1, 0));
        s[4 * k + 3] = _mm256_shuffle_ps(t[4 * k + 1], t[4 * k + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int k = 0; k < 4; k++) {
        r[k] = _mm256_permute2f128_ps(s[k], s[k + 4], 0x20);
        r[k + 4] = _mm256_permute2f128_ps(s[k], s[k + 4], 0x31);
    }
}

VEC256 static inline __attribute__((always_inline)) void prefill_avx2_impl(const PrefillArgs *a, int64_t s, int64_t h,
                                                                            int64_t tile, Scratch *sc, const int RG) {
    const int64_t d_len = a->head_dim, group = a->heads / a->kv_heads, rp = 8 * RG;
    const int64_t *seq = a->seqs + 4 * s;
    const int64_t t0 = tile * a->tile_queries, nt = pf_min(seq[1] - t0, a->tile_queries), rows = nt * group;
    const float *k_rows[PF_KEYS], *v_rows[PF_KEYS];
    __m256i high[8], low[8]; /* per lane: the highest and lowest key position its row may attend */
    __m256 max_v[8], sum_v[8];
    __m256 invalid[PF_KEYS][8];

    pf_pack_queries(a, s, h, t0, rows, rp, 0, sc);
    for (int g = 0; g < RG; g++) {
        int32_t hi_lane[8], lo_lane[8];
        for (int l = 0; l < 8; l++) {
            const int64_t r = 8 * g + l, position = seq[2] + t0 + r / group;
            hi_lane[l] = r < rows ? (int32_t)position : -1;
            lo_lane[l] = a->window > 0 ? (int32_t)(position - a->window + 1) : INT32_MIN;
        }
        high[g] = _mm256_loadu_si256((const __m256i *)hi_lane);
        low[g] = _mm256_loadu_si256((const __m256i *)lo_lane);
        max_v[g] = _mm256_set1_ps(-1e30f); /* finite: a row with nothing seen yet gets exp(-inf) = 0, not NaN */
        sum_v[g] = _mm256_setzero_ps();
    }
    memset(sc->ot, 0, sizeof(float) * (size_t)(d_len * rp));
    const __m256 scale = _mm256_set1_ps(a->scale), minus_inf = _mm256_set1_ps(-INFINITY);
    int64_t lo, hi;
    pf_key_range(a, s, seq[2] + t0, seq[2] + t0 + nt - 1, &lo, &hi);
    for (int64_t k0 = lo; k0 <= hi; k0 += PF_KEYS) {
        const int64_t count = pf_min(PF_KEYS, hi - k0 + 1);
        int64_t offsets[PF_KEYS];
        pf_offsets(a, s, h, k0, count, offsets);
        pf_key_rows8(a, a->k, offsets, count, sc->kb, k_rows);
        for (int g0 = 0; g0 < RG; g0 += PF8_BLOCK)
            if (RG - g0 >= PF8_BLOCK)
                pf8_scores(sc->qt, k_rows, count, d_len, rp, g0, PF8_BLOCK, sc->st);
            else
                pf8_scores(sc->qt, k_rows, count, d_len, rp, g0, 1, sc->st);
        /* the online softmax as prefill_avx512's float32 path takes it, masks as vectors */
        const int interior = k0 + count - 1 <= seq[2] + t0 &&
                             (a->window == 0 || k0 >= seq[2] + t0 + nt - 1 - a->window + 1);
        for (int g = 0; g < RG; g++) {
            float *st = sc->st + 8 * g;
            __m256 tile_max = max_v[g];
            if (interior) {
                for (int64_t j = 0; j < count; j++) tile_max = _mm256_max_ps(tile_max, _mm256_load_ps(st + j * rp));
            } else {
                for (int64_t j = 0; j < count; j++) {
                    const __m256i position = _mm256_set1_epi32((int32_t)(k0 + j));
                    invalid[j][g] = _mm256_castsi256_ps(
                        _mm256_or_si256(_mm256_cmpgt_epi32(position, high[g]), _mm256_cmpgt_epi32(low[g], position)));
                    const __m256 x = _mm256_blendv_ps(_mm256_load_ps(st + j * rp), minus_inf, invalid[j][g]);
                    _mm256_store_ps(st + j * rp, x);
                    tile_max = _mm256_max_ps(tile_max, x);
                }
            }
            if (_mm256_movemask_ps(_mm256_cmp_ps(tile_max, max_v[g], _CMP_GT_OQ))) {
                const __m256 alpha = exp8(_mm256_mul_ps(_mm256_sub_ps(max_v[g], tile_max), scale));
                sum_v[g] = _mm256_mul_ps(sum_v[g], alpha);
                for (int64_t d = 0; d < d_len; d++) {
                    float *o = sc->ot + d * rp + 8 * g;
                    _mm256_store_ps(o, _mm256_mul_ps(_mm256_load_ps(o), alpha));
                }
                max_v[g] = tile_max;
            }
            const __m256 shift = _mm256_mul_ps(max_v[g], scale);
            for (int64_t j = 0; j < count; j++) {
                const __m256 e = exp8(_mm256_fmsub_ps(_mm256_load_ps(st + j * rp), scale, shift));
                const __m256 p = interior ? e : _mm256_andnot_ps(invalid[j][g], e);
                sum_v[g] = _mm256_add_ps(sum_v[g], p);
                _mm256_store_ps(st + j * rp, p);
            }
        }
        pf_key_rows8(a, a->v, offsets, count, sc->vb, v_rows);
        for (int g0 = 0; g0 < RG; g0 += PF8_BLOCK)
            if (RG - g0 >= PF8_BLOCK)
                pf8_values(sc->st, v_rows, count, d_len, rp, g0, PF8_BLOCK, sc->ot);
            else
                pf8_values(sc->st, v_rows, count, d_len, rp, g0, 1, sc->ot);
    }
    /* O^T back to rows, 8 x 8 blocks at a time */
    for (int g = 0; g < RG; g++) {
        float sums[8];
        _mm256_storeu_ps(sums, sum_v[g]);
        for (int64_t d = 0; d < d_len; d += 8) {
            __m256 block[8];
            for (int i = 0; i < 8; i++) block[i] = _mm256_load_ps(sc->ot + (d + i) * rp + 8 * g);
            transpose8(block);
            for (int l = 0; l < 8 && 8 * g + l < rows; l++) {
                const int64_t r = 8 * g + l;
                const int64_t off = (seq[0] + t0 + r / group) * a->out_stride + (h * group + r % group) * d_len + d;
                const __m256 x = _mm256_mul_ps(block[l], _mm256_set1_ps(sums[l] > 0.f ? 1.f / sums[l] : 0.f));
                if (a->bf16)
                    _mm_storeu_si128((__m128i *)((uint16_t *)a->out + off), f32_to_bf16_8(x));
                else
                    _mm256_storeu_ps((float *)a->out + off, x);
            }
        }
    }
}

VEC256 static void prefill_avx2(const PrefillArgs *a, int64_t s, int64_t h, int64_t tile, Scratch *sc) {
    const int64_t queries = pf_min(a->seqs[4 * s + 1] - tile * a->tile_queries, a->tile_queries);
    switch ((queries * (a->heads / a->kv_heads) + 7) / 8) { /* a short chunk's tile uses fewer vectors */
    case 1: prefill_avx2_impl(a, s, h, tile, sc, 1); break;
    case 2: prefill_avx2_impl(a, s, h, tile, sc, 2); break;
    case 3: prefill_avx2_impl(a, s, h, tile, sc, 3); break;
    case 4: prefill_avx2_impl(a, s, h, tile, sc, 4); break;
    case 5: prefill_avx2_impl(a, s, h, tile, sc, 5); break;
    case 6: prefill_avx2_impl(a, s, h, tile, sc, 6); break;
    case 7: prefill_avx2_impl(a, s, h, tile, sc, 7); break;
    default: prefill_avx2_impl(a, s, h, tile, sc, 8); break;
    }
}

#endif /* WARMSTART_X86 */

enum { PREFILL_PORTABLE, PREFILL_AVX2, PREFILL_AVX512 }; /* the paths */

static void free_scratch(Scratch *sc) {
    free(sc->qt);
    free(sc->st);
    free(sc->pp);
    free(sc->ot);
    free(sc->kb);
    free(sc->vb);
    free(sc->row);
}

static int alloc_scratch(Scratch *sc, int64_t head_dim) {
    const size_t f = sizeof(float), rows = PF_ROWS, d = (size_t)head_dim;
    memset(sc, 0, sizeof *sc);
    sc->qt = aligned_alloc(64, d * rows * f);
    sc->st = aligned_alloc(64, PF_KEYS * rows * f);
    sc->pp = aligned_alloc(64, PF_KEYS / 2 * rows * f);
    sc->ot = aligned_alloc(64, d * rows * f);
    sc->kb = aligned_alloc(64, PF_KEYS * d * f);
    sc->vb = aligned_alloc(64, PF_KEYS * d * f);
    sc->row = aligned_alloc(64, (d + 16) * f);
    return sc->qt && sc->st && sc->pp && sc->ot && sc->kb && sc->vb && sc->row;
}

static PyObject *prefill(PyObject *self, PyObject *args) {
    PrefillArgs a;
    unsigned long long out, q, k, v, tables, seqs;
    int num_threads;
    if (!PyArg_ParseTuple(args, "KKKKKKLLLLLLLLLLfii", &out, &q, &k, &v, &tables, &seqs, &a.nseq, &a.heads,
                          &a.kv_heads, &a.head_dim, &a.block_size, &a.table_width, &a.head_stride, &a.q_stride,
                          &a.out_stride, &a.window, &a.scale, &a.bf16, &num_threads))
        return NULL;
    if (a.kv_heads <= 0 || a.heads % a.kv_heads || a.heads / a.kv_heads > MAX_GROUP || a.head_dim > MAX_HEAD_DIM ||
        a.head_dim <= 0 || a.block_size <= 0 || a.nseq < 0 || a.window < 0 || num_threads <= 0) {
        PyErr_Format(PyExc_ValueError,
                     "prefill: unsupported shape (heads %lld, kv_heads %lld, head_dim %lld, block_size %lld, "
                     "window %lld); at most %d query heads per KV head and head_dim %d",
                     (long long)a.heads, (long long)a.kv_heads, (long long)a.head_dim, (long long)a.block_size,
                     (long long)a.window, MAX_GROUP, MAX_HEAD_DIM);
        return NULL;
    }
    a.out = (void *)(uintptr_t)out;
    a.q = (const void *)(uintptr_t)q;
    a.k = (const void *)(uintptr_t)k;
    a.v = (const void *)(uintptr_t)v;
    a.tables = (const int64_t *)(uintptr_t)tables;
    a.seqs = (const int64_t *)(uintptr_t)seqs;
    const int64_t group = a.heads / a.kv_heads;
    a.tile_queries = PF_ROWS / group;
    int64_t items = 0, longest = 1;
    for (int64_t s = 0; s < a.nseq; s++) {
        const int64_t *seq = a.seqs + 4 * s, last = seq[2] + seq[1] - 1;
        if (seq[1] <= 0 || seq[0] < 0 || seq[3] < 0 || seq[2] < seq[3] || (last - seq[3]) / a.block_size >= a.table_width) {
            PyErr_Format(PyExc_ValueError,
                         "prefill: sequence %lld (%lld queries from position %lld, keys from %lld) does not fit its "
                         "block table of %lld columns of %lld",
                         (long long)s, (long long)seq[1], (long long)seq[2], (long long)seq[3],
                         (long long)a.table_width, (long long)a.block_size);
            return NULL;
        }
        items += a.kv_heads * ((seq[1] + a.tile_queries - 1) / a.tile_queries);
        if (last - seq[3] + 1 > longest) longest = last - seq[3] + 1;
    }
    /* the best path isa_level (isa.h) allows for this head_dim; AVX512-BF16's products only for a bf16 pool */
    int path = PREFILL_PORTABLE;
#if WARMSTART_X86
    if (isa_level >= ISA_AVX512 && a.head_dim % 16 == 0)
        path = PREFILL_AVX512;
    else if (isa_level >= ISA_AVX2 && a.head_dim % 8 == 0)
        path = PREFILL_AVX2;
    const int dots = path == PREFILL_AVX512 && isa_level >= ISA_AVX512_BF16 && a.bf16;
#endif
    int64_t *work = malloc(sizeof(int64_t) * 3 * (size_t)(items ? items : 1));
    if (work == NULL) return PyErr_NoMemory();
    /* (sequence, head, tile), the costly last tiles of each sequence first so that the threads end together */
    int64_t n = 0;
    for (int64_t s = 0; s < a.nseq; s++) {
        const int64_t tiles = (a.seqs[4 * s + 1] + a.tile_queries - 1) / a.tile_queries;
        for (int64_t t = tiles - 1; t >= 0; t--)
            for (int64_t h = 0; h < a.kv_heads; h++, n++) {
                work[3 * n] = s;
                work[3 * n + 1] = h;
                work[3 * n + 2] = t;
            }
    }
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel num_threads(items < num_threads ? (int)(items ? items : 1) : num_threads) reduction(| : failed)
    {
        Scratch sc;
        float *scores = path == PREFILL_PORTABLE ? malloc(sizeof(float) * (size_t)longest) : NULL;
        const int ok = alloc_scratch(&sc, a.head_dim) && (path != PREFILL_PORTABLE || scores != NULL);
        if (!ok) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < items; i++) {
            if (!ok) continue;
#if WARMSTART_X86
            if (path == PREFILL_AVX512) {
                prefill_avx512(&a, work[3 * i], work[3 * i + 1], work[3 * i + 2], &sc, dots);
                continue;
            }
            if (path == PREFILL_AVX2) {
                prefill_avx2(&a, work[3 * i], work[3 * i + 1], work[3 * i + 2], &sc);
                continue;
            }
#endif
            prefill_portable(&a, work[3 * i], work[3 * i + 1], work[3 * i + 2], &sc, scores);
        }
        free_scratch(&sc);
        free(scores);
    }
    Py_END_ALLOW_THREADS
    free(work);
    if (failed) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* ---- The KV write: each new token's key and value rows copied to their pool slots ----
 * k and v: [N, kv_heads, head_dim] with rows k_stride / v_stride elements apart (views of the qkv output). One
 * copy per (token, head) row; index_copy_ over the transposed views did the same with a parallel region and
 * strided indexing per call. */
static PyObject *write_kv(PyObject *self, PyObject *args) {
    unsigned long long k_pool, v_pool, k, v, slots_ptr;
    long long n, kv_heads, head_dim, pool_slots, k_stride, v_stride, elem;
    if (!PyArg_ParseTuple(args, "KKKKKLLLLLLL", &k_pool, &v_pool, &k, &v, &slots_ptr, &n, &kv_heads, &head_dim,
                          &pool_slots, &k_stride, &v_stride, &elem))
        return NULL;
    const int64_t *slots = (const int64_t *)(uintptr_t)slots_ptr;
    for (long long i = 0; i < n; i++)
        if (slots[i] < 0 || slots[i] >= pool_slots) {
            PyErr_Format(PyExc_ValueError, "write_kv: slot %lld of token %lld is outside the pool's %lld slots",
                         (long long)slots[i], i, pool_slots);
            return NULL;
        }
    char *kp = (char *)(uintptr_t)k_pool, *vp = (char *)(uintptr_t)v_pool;
    const char *ks = (const char *)(uintptr_t)k, *vs = (const char *)(uintptr_t)v;
    const size_t row = (size_t)(head_dim * elem);
    Py_BEGIN_ALLOW_THREADS
    /* One thread: a step's rows are a few MB at most, copied at memory speed; a parallel region costs more than
     * it saves, far more when another process holds the other core. */
    for (long long i = 0; i < n; i++)
        for (long long h = 0; h < kv_heads; h++) {
            const size_t dst = (size_t)((h * pool_slots + slots[i]) * head_dim * elem);
            memcpy(kp + dst, ks + (size_t)((i * k_stride + h * head_dim) * elem), row);
            memcpy(vp + dst, vs + (size_t)((i * v_stride + h * head_dim) * elem), row);
        }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"decode", decode, METH_VARARGS,
     "decode(out, q, k, v, tables, key_start, key_end, batch, heads, kv_heads, head_dim, block_size, "
     "table_width, head_stride, scale, bf16, num_threads): pointers as ints; see the file's comment."},
    {"prefill", prefill, METH_VARARGS,
     "prefill(out, q, k, v, tables, seqs, nseq, heads, kv_heads, head_dim, block_size, table_width, head_stride, "
     "q_stride, out_stride, window, scale, bf16, num_threads): pointers as ints; see the comment above prefill."},
    {"write_kv", write_kv, METH_VARARGS,
     "write_kv(k_pool, v_pool, k, v, slots, n, kv_heads, head_dim, pool_slots, k_stride, v_stride, elem_size): "
     "pointers as ints; see the comment above write_kv."},
    ISA_METHODS,
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_attention", NULL, -1, methods};

PyMODINIT_FUNC PyInit__cpu_attention(void) {
    isa_init();
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "MAX_GROUP", MAX_GROUP) < 0 ||
        PyModule_AddIntConstant(m, "MAX_HEAD_DIM", MAX_HEAD_DIM) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
