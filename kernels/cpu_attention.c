/* Paged attention on the CPU, reading every key and value where it lies in the paged cache.
 *
 * The same contract as kernels/attention.py (its torch reference and its Triton kernel): a ragged
 * batch of new query tokens, request i owning q[cu_q[i] : cu_q[i+1]], attends causally over
 * the ctx[i] positions of KV its block table lists. Nothing is gathered: for each block of
 * the table, the kernel reads the block's rows in the cache itself, scores them against the
 * queries and folds them into a running softmax (FlashAttention's online softmax, one block
 * at a time), so the bytes it moves are the KV it reads, once.
 *
 * One work item is one request x one KV head x up to TILE_Q of the request's query tokens;
 * its rows are those tokens times the GROUP query heads that share the KV head (GQA), so
 * every key loaded serves all of them. Items run in parallel (OpenMP, torch's thread count).
 * float32 only; the Python side (kernels/cpu_attention.py) compiles and calls this file.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define TILE_Q 16

typedef struct {
    int req, q0, q1, kv_head;
} Item;

static inline __attribute__((always_inline)) float dot(const float *a, const float *b, int n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int d = 0; d < n; d++) s += a[d] * b[d];
    return s;
}

/* exp(x) for x <= 0 in plain arithmetic the compiler vectorizes (libm's expf is a call per value):
 * x = n ln2 + r with |r| <= ln2 / 2, exp(r) by Cephes' degree-6 polynomial (within 2 ulp of expf),
 * 2^n put straight into the exponent bits. Below -87 the result is flushed to 0 (2^-126 and under
 * cannot change a softmax whose largest term is 1). */
static inline __attribute__((always_inline)) float exp_nonpositive(float x) {
    const int under = x < -87.0f;
    x = under ? -87.0f : x;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } scale = {.i = ((int32_t)n + 127) << 23};
    return under ? 0.0f : p * scale.f;
}

#if defined(__AVX512F__)
#include <immintrin.h>
/* With AVX-512 and a head dim of 16 * NV (64: NV = 4, 128: NV = 8), one row's work on one block is
 * done in registers: the query and the row's accumulator in NV registers each, the block's scores
 * 16 at a time. The same arithmetic as the plain loops below, in another order of summation. */

/* exp_nonpositive on 16 lanes (the same steps, one vector instruction each). */
static inline __attribute__((always_inline)) __m512 exp16_nonpositive(__m512 x) {
    const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                          _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 r =
        _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps(keep, p, _mm512_castsi512_ps(e));
}

/* One row (query qm, accumulator a, running max *m_i and sum *l_i) folded over the `seen` keys of one
 * block (K, V: its rows of this KV head); s: scratch for the block's scores. Kn/Vn, when not NULL: the
 * next block's rows, asked for between the dot products. */
static inline __attribute__((always_inline)) void row_block_avx512(const float *qm, float *a, float *m_i, float *l_i,
                                                                   const float *K, int64_t sk_s, const float *V,
                                                                   int64_t sv_s, int seen, int page, float *s,
                                                                   const float *Kn, const float *Vn, const int NV) {
    __m512 q[8], acc[8];
    for (int k = 0; k < NV; k++) q[k] = _mm512_loadu_ps(qm + 16 * k);
    if (Kn != NULL)
        for (int j = 0; j < page; j++)
            for (int k = 0; k < NV; k++) {
                _mm_prefetch((const char *)(Kn + j * sk_s + 16 * k), _MM_HINT_T0);
                _mm_prefetch((const char *)(Vn + j * sv_s + 16 * k), _MM_HINT_T0);
            }
    for (int j = 0; j < seen; j++) {
        const float *kj = K + j * sk_s;
        __m512 d = _mm512_mul_ps(q[0], _mm512_loadu_ps(kj));
        for (int k = 1; k < NV; k++) d = _mm512_fmadd_ps(q[k], _mm512_loadu_ps(kj + 16 * k), d);
        s[j] = _mm512_reduce_add_ps(d);
    }
    __m512 mx16 = _mm512_set1_ps(*m_i);
    for (int j0 = 0; j0 < seen; j0 += 16) {
        const __mmask16 in = seen - j0 >= 16 ? 0xFFFF : (__mmask16)((1u << (seen - j0)) - 1);
        mx16 = _mm512_mask_max_ps(mx16, in, mx16, _mm512_maskz_loadu_ps(in, s + j0));
    }
    const float mx = _mm512_reduce_max_ps(mx16);
    const float alpha = expf(*m_i - mx); /* rescales what was summed under the old max */
    __m512 sum16 = _mm512_setzero_ps();
    for (int j0 = 0; j0 < seen; j0 += 16) {
        const __mmask16 in = seen - j0 >= 16 ? 0xFFFF : (__mmask16)((1u << (seen - j0)) - 1);
        const __m512 p = _mm512_maskz_mov_ps(in, exp16_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(in, s + j0),
                                                                                  _mm512_set1_ps(mx))));
        _mm512_mask_storeu_ps(s + j0, in, p);
        sum16 = _mm512_add_ps(sum16, p);
    }
    *l_i = *l_i * alpha + _mm512_reduce_add_ps(sum16);
    *m_i = mx;
    const __m512 al = _mm512_set1_ps(alpha);
    for (int k = 0; k < NV; k++) acc[k] = _mm512_mul_ps(_mm512_loadu_ps(a + 16 * k), al);
    for (int j = 0; j < seen; j++) {
        const __m512 p = _mm512_set1_ps(s[j]);
        const float *vj = V + j * sv_s;
        for (int k = 0; k < NV; k++) acc[k] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vj + 16 * k), acc[k]);
    }
    for (int k = 0; k < NV; k++) _mm512_storeu_ps(a + 16 * k, acc[k]);
}
#endif

/* Inlined into one copy per common head dim (a constant D lets the compiler keep a row's
 * accumulator in vector registers and unroll the dot products) and one for any other D. */
static inline __attribute__((always_inline)) void attend_item(const Item *it, const float *q, int64_t sq_t, int64_t sq_h, const float *kc,
                        const float *vc, int64_t sk_b, int64_t sk_s, int64_t sk_h, int64_t sv_b,
                        int64_t sv_s, int64_t sv_h, float *out, int64_t so_t, int64_t so_h,
                        const int32_t *block_tables, int64_t s_bt, const int32_t *cu_q, const int32_t *ctx,
                        int group, int D, int page, float scale, float *scratch,
                        const float *k_after, const float *v_after) {
    const int req = it->req, h = it->kv_head;
    const int q_start = cu_q[req], q_len = cu_q[req + 1] - q_start;
    const int first_pos = ctx[req] - q_len;           /* position of the request's first new token */
    const int M = (it->q1 - it->q0) * group;          /* rows: query token x query head of the group */
    const int kv_end = first_pos + it->q1;             /* keys the tile's last query may see */
    float *Q = scratch, *acc = Q + (size_t)M * D, *m_i = acc + (size_t)M * D, *l_i = m_i + M;
    float *s = l_i + M;                                /* one block's scores of one row */
    int *q_pos = (int *)(s + page);
    for (int m = 0; m < M; m++) {
        int t = it->q0 + m / group, head = h * group + m % group;
        const float *src = q + (int64_t)(q_start + t) * sq_t + (int64_t)head * sq_h;
        for (int d = 0; d < D; d++) {
            Q[(size_t)m * D + d] = src[d] * scale;
            acc[(size_t)m * D + d] = 0.0f;
        }
        m_i[m] = -INFINITY;
        l_i[m] = 0.0f;
        q_pos[m] = first_pos + t;
    }
    const int32_t *table = block_tables + (int64_t)req * s_bt;
    for (int n0 = 0; n0 < kv_end; n0 += page) {
        const int64_t block = table[n0 / page];
        const int nn = kv_end - n0 < page ? kv_end - n0 : page;
        const float *K = kc + block * sk_b + (int64_t)h * sk_h;
        const float *V = vc + block * sv_b + (int64_t)h * sv_h;
        /* The next block's rows of this KV head (after the last block: the next item's first) are asked
         * for while this block is computed: the blocks of a table lie anywhere in the cache, where the
         * hardware's stream prefetchers cannot follow. */
        const int last = n0 + page >= kv_end;
        const float *Kn = last ? k_after : kc + (int64_t)table[n0 / page + 1] * sk_b + (int64_t)h * sk_h;
        const float *Vn = last ? v_after : vc + (int64_t)table[n0 / page + 1] * sv_b + (int64_t)h * sv_h;
        int ask = Kn != NULL;
        for (int m = 0; m < M; m++) {
            int seen = q_pos[m] - n0 + 1;              /* keys of this block row m may see */
            if (seen <= 0) continue;
            if (seen > nn) seen = nn;
            const float *qm = Q + (size_t)m * D;
#if defined(__AVX512F__)
            if (D == 64 || D == 128) {
                row_block_avx512(qm, acc + (size_t)m * D, m_i + m, l_i + m, K, sk_s, V, sv_s, seen, page, s,
                                 ask ? Kn : NULL, ask ? Vn : NULL, D / 16);
                ask = 0;
                continue;
            }
#endif
            if (ask) { /* the first row of the block: the asks spread between its dot products */
                ask = 0;
                for (int j = 0; j < page; j++) {
                    for (int d = 0; d < D; d += 16) {
                        __builtin_prefetch(Kn + j * sk_s + d, 0, 3);
                        __builtin_prefetch(Vn + j * sv_s + d, 0, 3);
                    }
                    if (j < seen) s[j] = dot(qm, K + j * sk_s, D);
                }
            } else
                for (int j = 0; j < seen; j++) s[j] = dot(qm, K + j * sk_s, D);
            float mx = m_i[m];
#pragma omp simd reduction(max : mx)
            for (int j = 0; j < seen; j++) mx = s[j] > mx ? s[j] : mx;
            const float alpha = expf(m_i[m] - mx);     /* rescales what was summed under the old max */
            float block_sum = 0.0f;
#pragma omp simd reduction(+ : block_sum)
            for (int j = 0; j < seen; j++) {
                s[j] = exp_nonpositive(s[j] - mx);     /* the block's probabilities, unnormalised */
                block_sum += s[j];
            }
            const float l = l_i[m] * alpha + block_sum;
            float *a = acc + (size_t)m * D;
            /* a = a * alpha + sum_j p_j v_j, one accumulator per d kept in a register over the keys */
            for (int d0 = 0; d0 < D; d0 += 16) {       /* 16 floats: one AVX-512 register */
                const int w = D - d0 < 16 ? D - d0 : 16;
                float t[16];
                for (int k = 0; k < w; k++) t[k] = a[d0 + k] * alpha;
                if (w == 16) {
                    for (int j = 0; j < seen; j++) {
                        const float p = s[j], *v = V + j * sv_s + d0;
#pragma omp simd
                        for (int k = 0; k < 16; k++) t[k] += p * v[k];
                    }
                } else {
                    for (int j = 0; j < seen; j++)
                        for (int k = 0; k < w; k++) t[k] += s[j] * V[j * sv_s + d0 + k];
                }
                for (int k = 0; k < w; k++) a[d0 + k] = t[k];
            }
            m_i[m] = mx;
            l_i[m] = l;
        }
    }
    for (int m = 0; m < M; m++) {
        int t = it->q0 + m / group, head = h * group + m % group;
        float *dst = out + (int64_t)(q_start + t) * so_t + (int64_t)head * so_h;
        const float inv = 1.0f / l_i[m];
        for (int d = 0; d < D; d++) dst[d] = acc[(size_t)m * D + d] * inv;
    }
}

/* Every block row the item `it` will read, asked for into the L2 cache (while the item before it is
 * computed): a whole item ahead, the cache's misses overlap with the arithmetic. */
static void prefetch_item(const Item *it, const float *kc, const float *vc, int64_t sk_b, int64_t sk_s, int64_t sk_h,
                          int64_t sv_b, int64_t sv_s, int64_t sv_h, const int32_t *block_tables, int64_t s_bt,
                          const int32_t *cu_q, const int32_t *ctx, int D, int page) {
    const int q_len = cu_q[it->req + 1] - cu_q[it->req];
    const int kv_end = ctx[it->req] - q_len + it->q1;
    const int32_t *table = block_tables + (int64_t)it->req * s_bt;
    for (int n0 = 0; n0 < kv_end; n0 += page) {
        const float *K = kc + (int64_t)table[n0 / page] * sk_b + (int64_t)it->kv_head * sk_h;
        const float *V = vc + (int64_t)table[n0 / page] * sv_b + (int64_t)it->kv_head * sv_h;
        const int nn = kv_end - n0 < page ? kv_end - n0 : page;
        for (int j = 0; j < nn; j++)
            for (int d = 0; d < D; d += 16) {
                __builtin_prefetch(K + j * sk_s + d, 0, 2);
                __builtin_prefetch(V + j * sv_s + d, 0, 2);
            }
    }
}

/* Returns 0, or -1 if scratch memory could not be had. */
int paged_attention_f32(const float *q, int64_t sq_t, int64_t sq_h, const float *kc, const float *vc,
                        int64_t sk_b, int64_t sk_s, int64_t sk_h, int64_t sv_b, int64_t sv_s, int64_t sv_h,
                        float *out, int64_t so_t, int64_t so_h, const int32_t *block_tables, int64_t s_bt,
                        const int32_t *cu_q, const int32_t *ctx, int batch, int num_kv_heads, int group, int D,
                        int page, float scale, int num_threads) {
    int n_items = 0;
    for (int r = 0; r < batch; r++) n_items += (cu_q[r + 1] - cu_q[r] + TILE_Q - 1) / TILE_Q * num_kv_heads;
    Item *items = malloc(sizeof(Item) * (n_items ? n_items : 1));
    if (!items) return -1;
    int k = 0;
    for (int r = 0; r < batch; r++) {
        int q_len = cu_q[r + 1] - cu_q[r];
        for (int q0 = 0; q0 < q_len; q0 += TILE_Q)
            for (int h = 0; h < num_kv_heads; h++) {
                Item it = {r, q0, q0 + TILE_Q < q_len ? q0 + TILE_Q : q_len, h};
                items[k++] = it;
            }
    }
    const int max_m = TILE_Q * group;
    const size_t scratch_floats = (size_t)max_m * D * 2 + 2 * max_m + page + max_m;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scratch = malloc(sizeof(float) * scratch_floats);
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#define ATTEND(HEAD_DIM)                                                                                     \
    attend_item(&items[i], q, sq_t, sq_h, kc, vc, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, out, so_t, so_h,       \
                block_tables, s_bt, cu_q, ctx, group, HEAD_DIM, page, scale, scratch, k_after, v_after)
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < n_items; i++) {
            if (!scratch) continue;
            const float *k_after = NULL, *v_after = NULL; /* the first block of the item after this one */
            if (i + 1 < n_items) {
                const Item *nx = &items[i + 1];
                const int64_t b0 = block_tables[(int64_t)nx->req * s_bt];
                k_after = kc + b0 * sk_b + (int64_t)nx->kv_head * sk_h;
                v_after = vc + b0 * sv_b + (int64_t)nx->kv_head * sv_h;
                prefetch_item(nx, kc, vc, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, block_tables, s_bt, cu_q, ctx, D, page);
            }
            switch (D) {
            case 64: ATTEND(64); break;
            case 128: ATTEND(128); break;
            default: ATTEND(D);
            }
        }
        free(scratch);
    }
    free(items);
    return failed ? -1 : 0;
}

/* Before attention reads the cache: RoPE on the step's new queries and keys, and the keys and values
 * written to their cache slots (llama.py's q * cos + rotate_half(q) * sin, the same for k, then
 * k_cache[slot] = k and v_cache[slot] = v; vLLM's rotary embedding and reshape_and_cache), in one pass
 * over the rows of the fused q/k/v projection's output ``qkv`` [T, (H + 2 Hkv) D], row stride s_t;
 * queries rotated in place. cos/sin: [T, D] rows of stride s_cs; the caches: contiguous
 * [slots, Hkv, D]. Rounded as torch rounds it (each product, then their sum: no fused multiply-add),
 * so the results are the reference's bit for bit. */
__attribute__((optimize("fp-contract=off"))) void rope_and_cache_f32(float *qkv, int64_t s_t, int T, int H, int Hkv,
                                                                     int D, const float *cos, const float *sin,
                                                                     int64_t s_cs, float *kc, float *vc,
                                                                     const int64_t *slots) {
    const int half = D / 2;
    for (int t = 0; t < T; t++) {
        float *row = qkv + (int64_t)t * s_t;
        const float *c = cos + (int64_t)t * s_cs, *s = sin + (int64_t)t * s_cs;
        float *k_dst = kc + slots[t] * Hkv * D, *v_dst = vc + slots[t] * Hkv * D;
        for (int h = 0; h < H + Hkv; h++) {
            float *x = row + (int64_t)h * D;
            float *dst = h < H ? x : k_dst + (int64_t)(h - H) * D;
            float r[512]; /* the rotated row (head_dim <= 512, checked by the caller) */
            for (int d = 0; d < half; d++) {
                float a = x[d] * c[d], b = x[d + half] * s[d];
                r[d] = a - b;
            }
            for (int d = half; d < D; d++) {
                float a = x[d] * c[d], b = x[d - half] * s[d];
                r[d] = a + b;
            }
            for (int d = 0; d < D; d++) dst[d] = r[d];
        }
        const float *v = row + (int64_t)(H + Hkv) * D;
        for (int d = 0; d < Hkv * D; d++) v_dst[d] = v[d];
    }
}

/* RMSNorm of T rows of n floats (llama.py's RMSNorm, torch's F.rms_norm): out = x / sqrt(mean(x^2) + eps) * w,
 * the mean summed in float32 (in another order than torch's: equal within float32 rounding). x: rows of
 * stride s_x; out: contiguous [T, n]. */
void rms_norm_f32(const float *x, int64_t s_x, int T, int n, const float *w, float eps, float *out) {
    for (int t = 0; t < T; t++) {
        const float *r = x + (int64_t)t * s_x;
        float *o = out + (int64_t)t * n;
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int d = 0; d < n; d++) ss += r[d] * r[d];
        const float inv = 1.0f / sqrtf(ss / (float)n + eps);
#pragma omp simd
        for (int d = 0; d < n; d++) o[d] = (r[d] * inv) * w[d];
    }
}
