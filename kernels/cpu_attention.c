/* Paged attention for short queries (decodes, short prefill tails), read straight from the
   block tables: the algorithm and the contract are in kernels/cpu_attention.py's docstring.
   Built by that module with the system C compiler and OpenMP (torch's own runtime). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_attention.h"

#if defined(__AVX512F__)
#include <immintrin.h>
/* 16 bf16 values as 16 floats. */
static inline __m512 widen16(const uint16_t *p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
/* e^x of 16 floats, for softmax's x = score - max <= 0: Cephes' expf polynomial on x
   reduced by n * ln2, scaled by 2^n. x below -88 (and -inf, a masked score) gives 0, where
   expf gives a subnormal at most 6e-39; a NaN stays NaN, as with expf. Written out because expf is a libm call per score,
   which the compiler does not vectorize: it took a fifth of a bf16 decode layer's time and
   a tenth of an fp32 one (bench/compute/cpu_attention.py). */
static inline __m512 exp16(const __m512 in) {
    const __mmask16 live = _mm512_cmp_ps_mask(in, _mm512_set1_ps(-88.0f), _CMP_GE_OQ);
    const __mmask16 nan = _mm512_cmp_ps_mask(in, in, _CMP_UNORD_Q);
    const __m512 x = _mm512_max_ps(in, _mm512_set1_ps(-88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  /* ln2 in two parts */
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_mask_mov_ps(_mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n)), nan, in);
}
#endif

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = ((uint32_t)h) << 16;
    float x;
    memcpy(&x, &bits, 4);
    return x;
}
static inline uint16_t f32_to_bf16(float x) {
    if (isnan(x)) return 0x7FC0;
    uint32_t bits;
    memcpy(&bits, &x, 4);
    bits += 0x7FFFu + ((bits >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(bits >> 16);
}
static inline float load(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}
static inline void store(void *p, int64_t i, float x, int bf16) {
    if (bf16) ((uint16_t *)p)[i] = f32_to_bf16(x); else ((float *)p)[i] = x;
}
/* dot(q, the n cache elements at `off`), and a += p * (the n cache elements at `off`), in
   fp32 (a bf16 is widened by a shift). Where the compiler targets AVX-512 and n is a multiple
   of 16, written with its intrinsics: GCC's own vectorized loop ends each dot product with
   its vector's lanes added one by one through memory, and with 256-bit vectors; these two
   took a decode layer of the `small` preset at batch 64 (context 320) from 1.71 to 1.23 ms in
   bf16, 1.62 to 1.37 ms in fp32, on a 2-core Xeon. Elsewhere the portable loops. */
#define ALWAYS_INLINE static inline __attribute__((always_inline))
ALWAYS_INLINE float dot_row(const float *q, const void *cache, int64_t off, int64_t n, int bf16) {
#if defined(__AVX512F__)
    if (n % 16 == 0) {
        __m512 acc = _mm512_setzero_ps();
        if (bf16) {
            const uint16_t *k = (const uint16_t *)cache + off;
            for (int64_t d = 0; d < n; d += 16) {
                const __m512 kd = widen16(k + d);
                acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), kd, acc);
            }
        } else {
            const float *k = (const float *)cache + off;
            for (int64_t d = 0; d < n; d += 16)
                acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(k + d), acc);
        }
        return _mm512_reduce_add_ps(acc);
    }
#endif
    float dot = 0.0f;
    if (bf16) {
        const uint16_t *k = (const uint16_t *)cache + off;
        #pragma omp simd reduction(+:dot)
        for (int64_t d = 0; d < n; d++) dot += q[d] * bf16_to_f32(k[d]);
    } else {
        const float *k = (const float *)cache + off;
        #pragma omp simd reduction(+:dot)
        for (int64_t d = 0; d < n; d++) dot += q[d] * k[d];
    }
    return dot;
}
ALWAYS_INLINE void axpy_row(float *a, float p, const void *cache, int64_t off, int64_t n, int bf16) {
#if defined(__AVX512F__)
    if (n % 16 == 0) {
        const __m512 pv = _mm512_set1_ps(p);
        if (bf16) {
            const uint16_t *v = (const uint16_t *)cache + off;
            for (int64_t d = 0; d < n; d += 16) {
                _mm512_storeu_ps(a + d, _mm512_fmadd_ps(pv, widen16(v + d), _mm512_loadu_ps(a + d)));
            }
        } else {
            const float *v = (const float *)cache + off;
            for (int64_t d = 0; d < n; d += 16)
                _mm512_storeu_ps(a + d, _mm512_fmadd_ps(pv, _mm512_loadu_ps(v + d), _mm512_loadu_ps(a + d)));
        }
        return;
    }
#endif
    if (bf16) {
        const uint16_t *v = (const uint16_t *)cache + off;
        #pragma omp simd
        for (int64_t d = 0; d < n; d++) a[d] += p * bf16_to_f32(v[d]);
    } else {
        const float *v = (const float *)cache + off;
        #pragma omp simd
        for (int64_t d = 0; d < n; d++) a[d] += p * v[d];
    }
}

/* Ask for the `bytes` at element `off` of `cache` early: rows of one block are contiguous,
   but blocks are scattered, so the hardware prefetcher stalls at every block. The passes
   below fetch each token's row of the next block while they read the same row of this one:
   one block ahead. */
static inline void prefetch(const void *cache, int64_t off, int64_t elem, int64_t bytes) {
    const char *p = (const char *)cache + off * elem;
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 3);
}

/* Block b of a request's context as both passes walk it: its tokens [l0, l1) (cut by the
   window's first token lo and by seq_len) lie at element base + (l - start) * slot_stride;
   next is block b + 1's base, for the prefetch, or -1 after the last block. */
struct block_walk { int64_t start, l0, l1, base, next; };
static inline struct block_walk walk_block(const int32_t *table, int64_t b, int64_t end_block,
                                           int64_t lo, int64_t seq_len, int64_t block_size,
                                           int64_t slot_stride, int64_t head_off) {
    const int64_t start = b * block_size;
    return (struct block_walk){
        .start = start,
        .l0 = start > lo ? start : lo,
        .l1 = start + block_size < seq_len ? start + block_size : seq_len,
        .base = (int64_t)table[b] * block_size * slot_stride + head_off,
        .next = b + 1 < end_block ? (int64_t)table[b + 1] * block_size * slot_stride + head_off : -1,
    };
}

/* Work item w: request reqs[w / splits] (w / splits without reqs), kv heads
   [h0, h0 + heads) with heads = num_kv_heads / splits. */
int paged_attention(const struct paged_attention_args *args) {
    const void *query = args->query, *k_cache = args->k_cache, *v_cache = args->v_cache;
    void *out = args->out;
    const int32_t *block_tables = args->block_tables, *seq_lens = args->seq_lens;
    const int32_t *query_start_loc = args->query_start_loc, *reqs = args->reqs;
    const int32_t *bidir_spans = args->bidir_spans;
    const int64_t table_stride = args->table_stride, num_reqs = args->num_reqs;
    const int64_t q_row_stride = args->q_row_stride, num_heads = args->num_heads;
    const int64_t num_kv_heads = args->num_kv_heads, head_dim = args->head_dim;
    const int64_t block_size = args->block_size, window = args->window;
    const int64_t max_q_len = args->max_q_len, max_scores = args->max_scores;
    const int64_t splits = args->splits;
    const float scale = args->scale, soft_cap = args->soft_cap;
    const int bf16 = args->bf16, kv_bf16 = args->kv_bf16;
    const int64_t group = num_heads / num_kv_heads, heads = num_kv_heads / splits;
    const int64_t row_stride = num_heads * head_dim;      /* out rows */
    const int64_t slot_stride = num_kv_heads * head_dim;  /* one token in the cache */
    const int64_t max_vecs = max_q_len * heads * group, width = heads * head_dim;
    const int64_t elem = kv_bf16 ? 2 : 4;  /* bytes per cache element */
    int failed = 0;
    #pragma omp parallel
    {
        float *qv = malloc(sizeof(float) * max_vecs * head_dim);
        float *acc = malloc(sizeof(float) * max_vecs * head_dim);
        float *s = malloc(sizeof(float) * max_scores * heads * group);
        int64_t *koff = malloc(sizeof(int64_t) * max_vecs), *pos = malloc(sizeof(int64_t) * max_vecs);
        /* The last key each vector sees before the window cuts: its position p, or with a
           span [s, e) holding p (checked by the Python side) e - 1: [0, p] u [s, e) = [0, e - 1].
           Without spans it is `pos` itself: nothing more to do per score. */
        int64_t *reach = bidir_spans ? malloc(sizeof(int64_t) * max_vecs) : NULL;
        const int64_t *last = bidir_spans ? reach : pos;
        if (!qv || !acc || !s || !koff || !pos || (bidir_spans && !reach)) {
            #pragma omp atomic write
            failed = 1;
        }
        /* Every thread of the team must reach the `omp for`, or none: agree first. */
        #pragma omp barrier
        int give_up;
        #pragma omp atomic read
        give_up = failed;
        if (!give_up) {
            #pragma omp for schedule(dynamic, 1)
            for (int64_t w = 0; w < num_reqs * splits; w++) {
                const int64_t r = reqs ? reqs[w / splits] : w / splits, h0 = (w % splits) * heads;
                const int64_t q0 = query_start_loc[r], q_len = query_start_loc[r + 1] - q0;
                const int64_t seq_len = seq_lens[r], ctx0 = seq_len - q_len;
                const int64_t per_row = heads * group, nv = q_len * per_row;
                const int64_t lo = window > 0 && ctx0 - window + 1 > 0 ? ctx0 - window + 1 : 0;
                const int64_t span = seq_len - lo;
                const int32_t *table = block_tables + r * table_stride;
                /* vector i: query row q0 + i / per_row, head h0 * group + i % per_row */
                for (int64_t i = 0; i < nv; i++) {
                    const int64_t src = (q0 + i / per_row) * q_row_stride
                                        + (h0 * group + i % per_row) * head_dim;
                    for (int64_t d = 0; d < head_dim; d++)
                        qv[i * head_dim + d] = load(query, src + d, bf16) * scale;
                    memset(acc + i * head_dim, 0, sizeof(float) * head_dim);
                    koff[i] = (i % per_row) / group * head_dim;  /* its kv head in the row */
                    pos[i] = ctx0 + i / per_row;                  /* its position */
                }
                if (bidir_spans) {
                    for (int64_t i = 0; i < nv; i++) {
                        const int32_t *block = bidir_spans + 2 * (q0 + i / per_row);
                        reach[i] = block[0] < block[1] && block[1] - 1 > pos[i] ? block[1] - 1 : pos[i];
                    }
                }
                /* The context block by block: one table read per block, no division per token. */
                const int64_t first_block = lo / block_size;
                const int64_t end_block = (seq_len + block_size - 1) / block_size;
                for (int64_t b = first_block; b < end_block; b++) {
                    const struct block_walk blk = walk_block(table, b, end_block, lo, seq_len,
                                                             block_size, slot_stride, h0 * head_dim);
                    for (int64_t l = blk.l0; l < blk.l1; l++) {
                        const int64_t base = blk.base + (l - blk.start) * slot_stride;
                        if (blk.next >= 0)
                            prefetch(k_cache, blk.next + (l - blk.start) * slot_stride, elem, width * elem);
                        float *sl = s + (l - lo);
                        for (int64_t i = 0; i < nv; i++) {
                            float dot = dot_row(qv + i * head_dim, k_cache, base + koff[i], head_dim, kv_bf16);
                            if (soft_cap > 0.0f) dot = soft_cap * tanhf(dot / soft_cap);
                            const int visible = l <= last[i] && (window <= 0 || l > pos[i] - window);
                            sl[i * span] = visible ? dot : -INFINITY;
                        }
                    }
                }
                for (int64_t i = 0; i < nv; i++) {
                    float *si = s + i * span, m = -INFINITY, sum = 0.0f;
                    #pragma omp simd reduction(max:m)
                    for (int64_t l = 0; l < span; l++) m = si[l] > m ? si[l] : m;
                    int64_t l = 0;
#if defined(__AVX512F__)
                    __m512 sums = _mm512_setzero_ps();
                    for (; l + 16 <= span; l += 16) {
                        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(si + l), _mm512_set1_ps(m)));
                        _mm512_storeu_ps(si + l, e);
                        sums = _mm512_add_ps(sums, e);
                    }
                    sum = _mm512_reduce_add_ps(sums);
#endif
                    for (; l < span; l++) { si[l] = expf(si[l] - m); sum += si[l]; }
                    const float inv = 1.0f / sum;
                    for (int64_t l = 0; l < span; l++) si[l] *= inv;
                }
                for (int64_t b = first_block; b < end_block; b++) {
                    const struct block_walk blk = walk_block(table, b, end_block, lo, seq_len,
                                                             block_size, slot_stride, h0 * head_dim);
                    for (int64_t l = blk.l0; l < blk.l1; l++) {
                        const int64_t base = blk.base + (l - blk.start) * slot_stride;
                        if (blk.next >= 0)
                            prefetch(v_cache, blk.next + (l - blk.start) * slot_stride, elem, width * elem);
                        const float *sl = s + (l - lo);
                        for (int64_t i = 0; i < nv; i++) {
                            const float p = sl[i * span];
                            if (p != 0.0f)
                                axpy_row(acc + i * head_dim, p, v_cache, base + koff[i], head_dim, kv_bf16);
                        }
                    }
                }
                for (int64_t i = 0; i < nv; i++) {
                    const int64_t dst = (q0 + i / per_row) * row_stride
                                        + (h0 * group + i % per_row) * head_dim;
                    for (int64_t d = 0; d < head_dim; d++)
                        store(out, dst + d, acc[i * head_dim + d], bf16);
                }
            }
        }
        free(qv); free(acc); free(s); free(koff); free(pos); free(reach);
    }
    return failed ? -1 : 0;
}
