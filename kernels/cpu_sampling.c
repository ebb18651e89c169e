/* The sampler's exponential race on the CPU: worker_svc/sampler.py's `exponential_race`
   (its torch reference) in one pass over each row, the noise never stored. The Python
   side, the numerics and the bound that skips most logarithms: kernels/cpu_sampling.py. */

#include <math.h>
#include <stdint.h>

#include "cpu_sampling.h"

/* The top 23 bits of splitmix64's (token + 1)-th output from `seed` (uint64 arithmetic
   wraps, as the reference's int64 does). */
static inline uint64_t noise_bits(uint64_t seed, uint64_t token) {
    uint64_t z = seed + (token + 1) * 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    z ^= z >> 31;
    return z >> 41;
}

#define CHUNK 256 /* entries tested together (loops the compiler vectorizes) */
#define MARGIN (1.0f + 0x1p-18f) /* covers logf's error, the division's and the test's roundings */
#define SKIP_FROM 0x1p-100f /* below it a product may be subnormal, its error not relative: no skipping */

static int64_t race_row(const float *p, uint64_t seed, int64_t vocab) {
    float best = -1.0f; /* every x is >= 0, or NaN, made +inf */
    int64_t best_v = 0;
    float u[CHUNK];
    unsigned char maybe[CHUNK];
    for (int64_t start = 0; start < vocab; start += CHUNK) {
        int64_t n = vocab - start < CHUNK ? vocab - start : CHUNK;
        const float *pc = p + start;
        for (int64_t i = 0; i < n; i++)
            u[i] = ((float)noise_bits(seed, (uint64_t)(start + i)) + 0.5f) * 0x1p-23f;
        /* -log(u) >= 1 - u (exact in fp32), so x = p / -log(u) <= p / (1 - u) up to
           rounding: an entry with p * MARGIN <= best * (1 - u) cannot beat `best` (nor tie
           it: ties keep the first). `best` only grows, so the chunk's first value is a
           safe bound for all of it. A NaN p is never ruled out. */
        float bound = best >= SKIP_FROM ? best : -1.0f;
        int any = 0;
        for (int64_t i = 0; i < n; i++) {
            maybe[i] = !(pc[i] * MARGIN <= bound * (1.0f - u[i]));
            any |= maybe[i];
        }
        if (!any)
            continue;
        for (int64_t i = 0; i < n; i++) {
            if (!maybe[i] || (best >= SKIP_FROM && pc[i] * MARGIN <= best * (1.0f - u[i])))
                continue; /* again, with `best` now */
            float x = pc[i] / -logf(u[i]);
            if (x != x)
                x = INFINITY;
            if (x > best) {
                best = x;
                best_v = start + i;
            }
        }
    }
    return best_v;
}

void exponential_race(const float *probs, int64_t row_stride, const int64_t *seeds, int64_t *out,
                      int64_t rows, int64_t vocab) {
#pragma omp parallel for schedule(static) if (rows > 1 && rows * vocab >= (1 << 16))
    for (int64_t r = 0; r < rows; r++)
        out[r] = race_row(probs + r * row_stride, (uint64_t)seeds[r], vocab);
}
