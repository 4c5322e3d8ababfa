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
 * be a multiple of 16 (the vector width).
 *
 * A step reads every cached key and value of the batch, so the kernel is
 * written to run at memory speed: it walks a sequence block by block, and
 * every query head works on a block while it is in L1; scores come eight
 * tokens at a time, summed across lanes together; the softmax's exp is
 * vectorized; the value rows accumulate into registers for a whole block.
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

/* Sixteen floats: one AVX-512 register, two AVX2 ones (the compiler splits what the machine lacks).
 * aligned(4) because rows in the pool are only float-aligned. */
typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t vi16 __attribute__((vector_size(64), aligned(4)));
typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef int32_t vi8 __attribute__((vector_size(32), aligned(4)));

#define INLINE static inline __attribute__((always_inline))

INLINE v16 load16(const float *p) { return *(const v16 *)p; }
INLINE void store16(float *p, v16 x) { *(v16 *)p = x; }
INLINE void store8(float *p, v8 x) { *(v8 *)p = x; }
INLINE v16 splat16(float x) { return (v16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

INLINE v8 fold(v16 x) {
    return __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7)
         + __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
}

INLINE float hsum(v16 x) {
    v8 y = fold(x);
    return ((y[0] + y[4]) + (y[1] + y[5])) + ((y[2] + y[6]) + (y[3] + y[7]));
}

INLINE v16 max16(v16 a, v16 b) {
    vi16 a_wins = a > b;
    return (v16)((a_wins & (vi16)a) | (~a_wins & (vi16)b));
}

/* Lane i of the result is the sum of the lanes of r_i: eight horizontal sums in a few shuffles. */
INLINE v8 sum_lanes(v16 r0, v16 r1, v16 r2, v16 r3, v16 r4, v16 r5, v16 r6, v16 r7) {
    const vi8 even = {0, 8, 2, 10, 4, 12, 6, 14}, odd = {1, 9, 3, 11, 5, 13, 7, 15};
    const vi8 lo2 = {0, 1, 8, 9, 4, 5, 12, 13}, hi2 = {2, 3, 10, 11, 6, 7, 14, 15};
    const vi8 lo4 = {0, 1, 2, 3, 8, 9, 10, 11}, hi4 = {4, 5, 6, 7, 12, 13, 14, 15};
    v8 f0 = fold(r0), f1 = fold(r1), f2 = fold(r2), f3 = fold(r3);
    v8 f4 = fold(r4), f5 = fold(r5), f6 = fold(r6), f7 = fold(r7);
    v8 a = __builtin_shuffle(f0, f1, even) + __builtin_shuffle(f0, f1, odd);
    v8 b = __builtin_shuffle(f2, f3, even) + __builtin_shuffle(f2, f3, odd);
    v8 c = __builtin_shuffle(f4, f5, even) + __builtin_shuffle(f4, f5, odd);
    v8 d = __builtin_shuffle(f6, f7, even) + __builtin_shuffle(f6, f7, odd);
    v8 ab = __builtin_shuffle(a, b, lo2) + __builtin_shuffle(a, b, hi2);
    v8 cd = __builtin_shuffle(c, d, lo2) + __builtin_shuffle(c, d, hi2);
    return __builtin_shuffle(ab, cd, lo4) + __builtin_shuffle(ab, cd, hi4);
}

/* exp(x) for x <= 0 (a score less its row's maximum), sixteen at once: x = n ln2 + r with |r| <= ln2 / 2,
 * exp(r) by Cephes' expf polynomial (within about an ulp, as expf), times 2^n written into the exponent
 * bits. x is first raised to EXP_MIN, so 2^n stays a normal float: a weight below e^-87 is then 1.6e-38
 * instead of a denormal, which no softmax sum of at least 1 can tell apart. */
#define EXP_MIN -87.0f
INLINE v16 exp16(v16 x) {
    x = max16(x, splat16(EXP_MIN));
    vi16 n = -__builtin_convertvector(0.5f - x * 1.44269504088896341f, vi16);  /* round(x / ln2); 0.5 - x/ln2 > 0 */
    v16 nf = __builtin_convertvector(n, v16);
    v16 r = x - nf * 0.693359375f + nf * 2.12194440e-4f;  /* ln2 in two parts, so r keeps its low bits */
    v16 p = splat16(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return p * (v16)((n + 127) << 23);
}

/* Asks for the cache lines of floats [from, from + part) of a block (none past `end`) ahead of their
 * use. Blocks lie anywhere in the pool, and the hardware prefetchers neither follow a jump between
 * blocks nor cross a page, so without this every block would start with stalls on memory. A block is
 * asked for a part at a time, while the block before it is being worked on: asking for all of it at
 * once fills the core's queue of misses and stalls it as badly (measured: 30 GB/s against 16 from
 * one core, SmolLM2's decode shapes). */
INLINE void prefetch_part(const float *block, int64_t from, int64_t part, int64_t end) {
    const int64_t to = from + part < end ? from + part : end;
    for (int64_t i = from; i < to; i += 16)
        __builtin_prefetch(block + i, 0, 3);
}

/* The dot products of one query head with the key rows of eight consecutive tokens. */
INLINE v8 dot8_rows(const float *restrict qh, const float *restrict k, int64_t stride, int64_t nv) {
    v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
    for (int64_t c = 0; c < nv; c++) {
        const v16 qc = load16(qh + 16 * c);
        const float *kc = k + 16 * c;
        a0 += qc * load16(kc);
        a1 += qc * load16(kc + stride);
        a2 += qc * load16(kc + 2 * stride);
        a3 += qc * load16(kc + 3 * stride);
        a4 += qc * load16(kc + 4 * stride);
        a5 += qc * load16(kc + 5 * stride);
        a6 += qc * load16(kc + 6 * stride);
        a7 += qc * load16(kc + 7 * stride);
    }
    return sum_lanes(a0, a1, a2, a3, a4, a5, a6, a7);
}

INLINE float dot(const float *restrict a, const float *restrict b, int64_t nv) {
    v16 sum = {0};
    for (int64_t c = 0; c < nv; c++)
        sum += load16(a + 16 * c) * load16(b + 16 * c);
    return hsum(sum);
}

/* Softmax of one head's scores in place, unnormalized: returns 1 / the sum of the weights. */
INLINE float softmax_weights(float *restrict s, int64_t len) {
    v16 mv = splat16(s[0]);
    int64_t t = 0;
    for (; t + 16 <= len; t += 16)
        mv = max16(mv, load16(s + t));
    float m = mv[0];
    for (int i = 1; i < 16; i++)
        m = mv[i] > m ? mv[i] : m;
    for (; t < len; t++)
        m = s[t] > m ? s[t] : m;
    v16 sum16 = {0};
    for (t = 0; t + 16 <= len; t += 16) {
        const v16 e = exp16(load16(s + t) - m);
        store16(s + t, e);
        sum16 += e;
    }
    float sum = hsum(sum16);
    for (; t < len; t++) {
        s[t] = expf(s[t] - m);
        sum += s[t];
    }
    return 1.0f / sum;
}

/* Every head of one sequence over its `len` tokens, nv = head_dim / 16 vectors a head. `scores` holds
 * num_heads * len floats, `inv_sums` num_heads, `acc` num_heads * nv vectors. Inlined for the usual
 * head sizes, so that nv is a constant and a head's accumulators live in registers. */
INLINE void attend(const float *restrict q, const float *restrict k_cache, const float *restrict v_cache,
                   const int64_t *restrict table, int64_t len, float *restrict out, int64_t num_heads,
                   int64_t group, int64_t block_size, float scale, float *restrict scores,
                   float *restrict inv_sums, v16 *restrict acc, const int64_t nv)
{
    const int64_t head_dim = 16 * nv;
    const int64_t token_stride = num_heads / group * head_dim;
    const int64_t block_stride = block_size * token_stride;
    /* How much of the next block each query head asks for: whole cache lines, all of it in one pass. */
    const int64_t part = (block_stride / num_heads + 15) / 16 * 16;

    for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const float *kb = k_cache + table[t0 / block_size] * block_stride;
        const int64_t n = len - t0 < block_size ? len - t0 : block_size;
        const float *next = t0 + block_size < len ? k_cache + table[t0 / block_size + 1] * block_stride : NULL;
        for (int64_t hq = 0; hq < num_heads; hq++) {
            if (next != NULL)
                prefetch_part(next, hq * part, part, block_stride);
            const float *qh = q + hq * head_dim, *kh = kb + hq / group * head_dim;
            float *s = scores + hq * len + t0;
            int64_t i = 0;
            for (; i + 8 <= n; i += 8)
                store8(s + i, dot8_rows(qh, kh + i * token_stride, token_stride, nv) * scale);
            for (; i < n; i++)
                s[i] = dot(qh, kh + i * token_stride, nv) * scale;
        }
    }
    for (int64_t hq = 0; hq < num_heads; hq++)
        inv_sums[hq] = softmax_weights(scores + hq * len, len);

    memset(acc, 0, sizeof(v16) * num_heads * nv);
    for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const float *vb = v_cache + table[t0 / block_size] * block_stride;
        const int64_t n = len - t0 < block_size ? len - t0 : block_size;
        const float *next = t0 + block_size < len ? v_cache + table[t0 / block_size + 1] * block_stride : NULL;
        for (int64_t hq = 0; hq < num_heads; hq++) {
            if (next != NULL)
                prefetch_part(next, hq * part, part, block_stride);
            const float *vh = vb + hq / group * head_dim, *p = scores + hq * len + t0;
            v16 a[nv];
            for (int64_t c = 0; c < nv; c++)
                a[c] = acc[hq * nv + c];
            for (int64_t i = 0; i < n; i++) {
                const v16 pi = splat16(p[i]);
                for (int64_t c = 0; c < nv; c++)
                    a[c] += pi * load16(vh + i * token_stride + 16 * c);
            }
            for (int64_t c = 0; c < nv; c++)
                acc[hq * nv + c] = a[c];
        }
    }
    for (int64_t hq = 0; hq < num_heads; hq++)
        for (int64_t c = 0; c < nv; c++)
            store16(out + hq * head_dim + 16 * c, acc[hq * nv + c] * inv_sums[hq]);
}

static void attend_sequence(const float *q, const float *k_cache, const float *v_cache, const int64_t *table,
                            int64_t len, float *out, int64_t num_heads, int64_t group, int64_t head_dim,
                            int64_t block_size, float scale, float *scores, float *inv_sums, v16 *acc)
{
    switch (head_dim) {
    case 64:
        attend(q, k_cache, v_cache, table, len, out, num_heads, group, block_size, scale, scores, inv_sums, acc, 4);
        break;
    case 128:
        attend(q, k_cache, v_cache, table, len, out, num_heads, group, block_size, scale, scores, inv_sums, acc, 8);
        break;
    default:
        attend(q, k_cache, v_cache, table, len, out, num_heads, group, block_size, scale, scores, inv_sums, acc,
               head_dim / 16);
    }
}

/* Returns 0; -1 when a thread could not allocate its scratch (out is then incomplete); -2 when head_dim
 * is not a multiple of 16 (out is untouched). */
int paged_decode_attention(const float *q, const float *k_cache, const float *v_cache, const int64_t *block_tables,
                           const int64_t *lengths, float *out, int64_t num_seqs, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,
                           int64_t max_len, float scale, int num_threads)
{
    if (head_dim % 16 != 0)
        return -2;
    const int64_t group = num_heads / num_kv_heads;
    int64_t work = 0;
    for (int64_t s = 0; s < num_seqs; s++)
        work += lengths[s] * num_heads;
    if (work < MIN_PARALLEL_WORK)
        num_threads = 1;
    int failed = 0;
    #pragma omp parallel num_threads(num_threads) reduction(|:failed)
    {
        /* One allocation: num_heads rows of max_len scores, then num_heads inverse sums. */
        float *scores = malloc(sizeof(float) * num_heads * (max_len + 1));
        v16 *acc = malloc(sizeof(v16) * num_heads * (head_dim / 16));
        if (scores == NULL || acc == NULL)
            failed = 1;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t s = 0; s < num_seqs; s++) {
            if (failed)
                continue;
            attend_sequence(q + s * num_heads * head_dim, k_cache, v_cache, block_tables + s * max_blocks,
                            lengths[s], out + s * num_heads * head_dim, num_heads, group, head_dim, block_size,
                            scale, scores, scores + num_heads * max_len, acc);
        }
        free(scores);
        free(acc);
    }
    return failed ? -1 : 0;
}
