/* The one declaration of the cpu attention kernel (kernels/cpu_attention.c), shared by both
   sides: the kernel includes it, so its definition must agree with it (or it does not
   compile), and kernels/cpu_attention.py hands this same text to cffi, whose generated
   binding is compiled against it. Arguments travel by name in one struct; at load the
   Python side checks that its fields are exactly these.

   This text is read by cffi's parser too: declarations and comments only, no preprocessor
   lines (the includers include <stdint.h> first). */

struct paged_attention_args {
    const void *query;              /* [tokens, num_heads, head_dim] rows, q_row_stride apart */
    void *out;                      /* [tokens, num_heads, head_dim], contiguous */
    const void *k_cache;            /* [num_blocks, block_size, num_kv_heads, head_dim] */
    const void *v_cache;            /* same shape as k_cache */
    const int32_t *block_tables;    /* [num requests, table_stride] */
    int64_t table_stride;
    const int32_t *seq_lens;        /* [num requests]: tokens in context, this step's included */
    const int32_t *query_start_loc; /* [num requests + 1]: first query row of each request */
    const int32_t *reqs;            /* [num_reqs]: the requests this call computes;
                                       NULL: requests 0 .. num_reqs - 1 */
    const int32_t *bidir_spans;     /* [tokens, 2]: query row t sees keys [s, e) too, its
                                       position p in s <= p < e <= seq_len, or s == e (none);
                                       NULL: no spans (plain causal) */
    int64_t num_reqs;
    int64_t q_row_stride;           /* elements between two query rows */
    int64_t num_heads;
    int64_t num_kv_heads;
    int64_t head_dim;
    int64_t block_size;
    float scale;
    int64_t window;                 /* sliding window in tokens; <= 0: none */
    float soft_cap;                 /* <= 0: none */
    int64_t max_q_len;              /* the largest q_len among reqs */
    int64_t max_scores;             /* the largest q_len x keys scored among reqs */
    int64_t splits;                 /* work items per request (divides num_kv_heads) */
    int bf16;                       /* 1: query and out are bf16; 0: fp32 */
    int kv_bf16;                    /* 1: the caches are bf16; 0: fp32 */
};

/* 0, or -1 if scratch memory could not be allocated. */
int paged_attention(const struct paged_attention_args *args);
