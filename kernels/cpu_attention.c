/* Paged attention for short queries (decodes, short prefill tails), read straight from the
   block tables: the algorithm and the contract are in kernels/cpu_attention.py's docstring.
   Built by that module with the system C compiler and OpenMP (torch's own runtime). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_attention.h"

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
/* The K or V vectors of kv heads [h0, h0 + n) of one token, as floats. */
static inline const float *token_row(const void *cache, int64_t base, int64_t n, float *buf,
                                     int bf16) {
    if (!bf16) return (const float *)cache + base;
    const uint16_t *src = (const uint16_t *)cache + base;
    for (int64_t d = 0; d < n; d++) buf[d] = bf16_to_f32(src[d]);
    return buf;
}

/* Element offset of kv head h0 of token l in a [blocks, block_size, kv_heads, head_dim] cache. */
static inline int64_t slot_offset(const int32_t *table, int64_t l, int64_t block_size,
                                  int64_t slot_stride, int64_t h0, int64_t head_dim) {
    return ((int64_t)table[l / block_size] * block_size + l % block_size) * slot_stride
           + h0 * head_dim;
}

/* Ask for the K or V vectors of token l + PREFETCH_DISTANCE early: rows of one block are
   contiguous, but blocks are scattered, so the hardware prefetcher stalls at every block. */
#define PREFETCH_DISTANCE 16 /* tokens: one block at block size 16 */
static inline void prefetch_row(const void *cache, const int32_t *table, int64_t l, int64_t end,
                                int64_t block_size, int64_t slot_stride, int64_t h0,
                                int64_t head_dim, int64_t width, int64_t elem) {
    if (l >= end) return;
    const char *p = (const char *)cache
                    + slot_offset(table, l, block_size, slot_stride, h0, head_dim) * elem;
    for (int64_t b = 0; b < width * elem; b += 64) __builtin_prefetch(p + b, 0, 3);
}

/* Work item w: request reqs[w / splits], kv heads [h0, h0 + heads) with heads =
   num_kv_heads / splits. */
int paged_attention(const struct paged_attention_args *args) {
    const void *query = args->query, *k_cache = args->k_cache, *v_cache = args->v_cache;
    void *out = args->out;
    const int32_t *block_tables = args->block_tables, *seq_lens = args->seq_lens;
    const int32_t *query_start_loc = args->query_start_loc, *reqs = args->reqs;
    const int64_t table_stride = args->table_stride, num_reqs = args->num_reqs;
    const int64_t q_row_stride = args->q_row_stride, num_heads = args->num_heads;
    const int64_t num_kv_heads = args->num_kv_heads, head_dim = args->head_dim;
    const int64_t block_size = args->block_size, window = args->window;
    const int64_t max_q_len = args->max_q_len, max_scores = args->max_scores;
    const int64_t splits = args->splits;
    const float scale = args->scale, soft_cap = args->soft_cap;
    const int bf16 = args->bf16;
    const int64_t group = num_heads / num_kv_heads, heads = num_kv_heads / splits;
    const int64_t row_stride = num_heads * head_dim;      /* out rows */
    const int64_t slot_stride = num_kv_heads * head_dim;  /* one token in the cache */
    const int64_t max_vecs = max_q_len * heads * group, width = heads * head_dim;
    const int64_t elem = bf16 ? 2 : 4;
    int failed = 0;
    #pragma omp parallel
    {
        float *qv = malloc(sizeof(float) * max_vecs * head_dim);
        float *acc = malloc(sizeof(float) * max_vecs * head_dim);
        float *s = malloc(sizeof(float) * max_scores * heads * group);
        float *buf = malloc(sizeof(float) * width);
        int64_t *koff = malloc(sizeof(int64_t) * max_vecs), *pos = malloc(sizeof(int64_t) * max_vecs);
        if (!qv || !acc || !s || !buf || !koff || !pos) {
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
                const int64_t r = reqs[w / splits], h0 = (w % splits) * heads;
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
                for (int64_t l = lo; l < seq_len; l++) {
                    const int64_t base = slot_offset(table, l, block_size, slot_stride, h0, head_dim);
                    prefetch_row(k_cache, table, l + PREFETCH_DISTANCE, seq_len, block_size,
                                 slot_stride, h0, head_dim, width, elem);
                    const float *k = token_row(k_cache, base, width, buf, bf16);
                    float *sl = s + (l - lo);
                    for (int64_t i = 0; i < nv; i++) {
                        const float *q = qv + i * head_dim, *kh = k + koff[i];
                        float dot = 0.0f;
                        #pragma omp simd reduction(+:dot)
                        for (int64_t d = 0; d < head_dim; d++) dot += q[d] * kh[d];
                        if (soft_cap > 0.0f) dot = soft_cap * tanhf(dot / soft_cap);
                        const int visible = l <= pos[i] && (window <= 0 || l > pos[i] - window);
                        sl[i * span] = visible ? dot : -INFINITY;
                    }
                }
                for (int64_t i = 0; i < nv; i++) {
                    float *si = s + i * span, m = -INFINITY, sum = 0.0f;
                    for (int64_t l = 0; l < span; l++) m = si[l] > m ? si[l] : m;
                    for (int64_t l = 0; l < span; l++) { si[l] = expf(si[l] - m); sum += si[l]; }
                    const float inv = 1.0f / sum;
                    for (int64_t l = 0; l < span; l++) si[l] *= inv;
                }
                for (int64_t l = lo; l < seq_len; l++) {
                    const int64_t base = slot_offset(table, l, block_size, slot_stride, h0, head_dim);
                    prefetch_row(v_cache, table, l + PREFETCH_DISTANCE, seq_len, block_size,
                                 slot_stride, h0, head_dim, width, elem);
                    const float *v = token_row(v_cache, base, width, buf, bf16);
                    const float *sl = s + (l - lo);
                    for (int64_t i = 0; i < nv; i++) {
                        const float p = sl[i * span];
                        if (p == 0.0f) continue;
                        float *a = acc + i * head_dim;
                        const float *vh = v + koff[i];
                        #pragma omp simd
                        for (int64_t d = 0; d < head_dim; d++) a[d] += p * vh[d];
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
        free(qv); free(acc); free(s); free(buf); free(koff); free(pos);
    }
    return failed ? -1 : 0;
}
