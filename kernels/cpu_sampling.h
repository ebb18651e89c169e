/* The one declaration of the cpu sampling kernel (kernels/cpu_sampling.c), shared by both
   sides as kernels/cpu_attention.h is: the kernel includes it, and cffi builds the binding
   from the same text. Declarations and comments only (cffi parses it too). */

/* For each of `rows` rows of `probs` (fp32, rows `row_stride` elements apart, `vocab` long;
   finite or NaN: a NaN counts as the largest, as +inf would, so a row holding +inf before
   a NaN is outside the contract): out[r] = the first v of the largest probs[r][v] /
   E(seeds[r], v), E the keyed Exp(1) noise of worker_svc/sampler.py's keyed_exponential.
   OpenMP over rows. */
void exponential_race(const float *probs, int64_t row_stride, const int64_t *seeds, int64_t *out,
                      int64_t rows, int64_t vocab);
