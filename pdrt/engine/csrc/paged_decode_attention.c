/* Decode attention straight over the paged KV pool, for float32 on the CPU.
 *
 * One query token per sequence attends over that sequence's blocks where
 * they lie in the pool: no gather into a padded batch and no length mask,
 * so each key and value is read once, from the pool, and padding costs
 * nothing. The work is split by sequence across OpenMP threads; the caller
 * passes the thread count, so the kernel follows torch's setting.
 *
 * Layout, for one layer: k_cache and v_cache are [num_blocks, block_size,
 * num_kv_heads, head_dim]; q and out are [num_seqs, num_heads, head_dim];
 * block_tables is [num_seqs, max_blocks]. Query head hq reads KV head
 * hq / (num_heads / num_kv_heads) (grouped-query attention). head_dim must
 * be a multiple of 8.
 *
 * Built at run time by pdrt/engine/cpu_attention.py with the machine's own
 * vector instructions (-march=native).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

/* Below this many (query head, token) pairs a step's attention takes less time than waking a second thread. */
#define MIN_PARALLEL_WORK 16384

/* Eight floats; aligned(4) because rows in the pool are only float-aligned. */
typedef float v8 __attribute__((vector_size(32), aligned(4)));

static inline v8 load8(const float *p) { return *(const v8 *)p; }

static inline float hsum(v8 x) {
    return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
}

/* Every head of one sequence over its `len` tokens. `scores` holds num_heads * len floats,
 * `acc` num_heads * head_dim / 8 vectors. */
static void attend_sequence(const float *restrict q, const float *restrict k_cache, const float *restrict v_cache,
                            const int64_t *restrict table, int64_t len, float *restrict out, int64_t num_heads,
                            int64_t group, int64_t head_dim, int64_t block_size, float scale,
                            float *restrict scores, v8 *restrict acc)
{
    const int64_t nv = head_dim / 8;
    const int64_t token_stride = num_heads / group * head_dim;
    const int64_t block_stride = block_size * token_stride;

    /* Scores: every query head against each token's key row (the token's KV heads are adjacent). */
    for (int64_t t = 0; t < len; t++) {
        const float *k = k_cache + table[t / block_size] * block_stride + (t % block_size) * token_stride;
        for (int64_t hq = 0; hq < num_heads; hq++) {
            const float *qh = q + hq * head_dim, *kh = k + hq / group * head_dim;
            v8 a0 = {0}, a1 = {0};  /* two chains: the additions of one would wait on each other */
            int64_t c = 0;
            for (; c + 1 < nv; c += 2) {
                a0 += load8(qh + 8 * c) * load8(kh + 8 * c);
                a1 += load8(qh + 8 * c + 8) * load8(kh + 8 * c + 8);
            }
            if (c < nv)
                a0 += load8(qh + 8 * c) * load8(kh + 8 * c);
            scores[hq * len + t] = hsum(a0 + a1) * scale;
        }
    }
    /* Softmax per head, max-subtracted as SDPA does. */
    for (int64_t hq = 0; hq < num_heads; hq++) {
        float *s = scores + hq * len;
        float m = s[0];
        for (int64_t t = 1; t < len; t++)
            m = s[t] > m ? s[t] : m;
        float sum = 0.0f;
        for (int64_t t = 0; t < len; t++) {
            s[t] = expf(s[t] - m);
            sum += s[t];
        }
        const float inv = 1.0f / sum;
        for (int64_t t = 0; t < len; t++)
            s[t] *= inv;
    }
    /* Weighted sum of the value rows. */
    memset(acc, 0, sizeof(v8) * num_heads * nv);
    for (int64_t t = 0; t < len; t++) {
        const float *v = v_cache + table[t / block_size] * block_stride + (t % block_size) * token_stride;
        for (int64_t hq = 0; hq < num_heads; hq++) {
            const float p = scores[hq * len + t];
            const float *vh = v + hq / group * head_dim;
            v8 *a = acc + hq * nv;
            for (int64_t c = 0; c < nv; c++)
                a[c] += p * load8(vh + 8 * c);
        }
    }
    memcpy(out, acc, sizeof(float) * num_heads * head_dim);
}

/* Returns 0, or -1 when a thread could not allocate its scratch (out is then incomplete). */
int paged_decode_attention(const float *q, const float *k_cache, const float *v_cache, const int64_t *block_tables,
                           const int64_t *lengths, float *out, int64_t num_seqs, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,
                           int64_t max_len, float scale, int num_threads)
{
    const int64_t group = num_heads / num_kv_heads;
    int64_t work = 0;
    for (int64_t s = 0; s < num_seqs; s++)
        work += lengths[s] * num_heads;
    if (work < MIN_PARALLEL_WORK)
        num_threads = 1;
    int failed = 0;
    #pragma omp parallel num_threads(num_threads) reduction(|:failed)
    {
        float *scores = malloc(sizeof(float) * num_heads * max_len);
        v8 *acc = malloc(sizeof(v8) * num_heads * (head_dim / 8));
        if (scores == NULL || acc == NULL)
            failed = 1;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t s = 0; s < num_seqs; s++) {
            if (failed)
                continue;
            attend_sequence(q + s * num_heads * head_dim, k_cache, v_cache, block_tables + s * max_blocks,
                            lengths[s], out + s * num_heads * head_dim, num_heads, group, head_dim, block_size,
                            scale, scores, acc);
        }
        free(scores);
        free(acc);
    }
    return failed ? -1 : 0;
}
