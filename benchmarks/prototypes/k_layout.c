/* What storing K transposed within each page would give the decode step (issue 20's "lever left"): a C
 * prototype of one bfloat16 decode step's two phases, one thread, a hot layer (re-read every call), float32 q.
 *
 *   gcc -O3 -march=native -o /tmp/k_layout benchmarks/prototypes/k_layout.c && /tmp/k_layout 8 4 4096
 *   arguments: kv heads, q heads per kv head (a multiple of 4), tokens (a multiple of 32)
 *
 * q.k, two layouts of the same bfloat16 keys, pages of 32 tokens:
 *   rows        K [page][kv head][token][d] (the pool's layout): 4 q heads x 4 keys of float32 accumulators over
 *               d, widened from bfloat16 pairs by a shift and a mask, then a butterfly of shuffles and adds turns
 *               the 16 accumulators into 16 scores (what decode/kernels/register_blocks.py does);
 *   transposed  K [page][kv head][d][token]: per d one 32-token row, widened, times q[h, d] broadcast into 4 x 2
 *               accumulators of 16 scores each (an outer product: no reduction at all).
 * PV (the same in both: V stays row-major): 4 q heads x 64 dims of accumulators, one value row widened per token.
 * Each phase prefetches the next page's tile as it reads one (as the kernels do). Softmax and the online rescale
 * are left out (the same in both layouts). Prints the median of 41 calls of each phase.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define D 128
#define P 32

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
static inline __m512 even16(__m512i x) { return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)); }
static inline __m512 odd16(__m512i x) {
    return _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xFFFF0000)));
}

/* q in pair order per 32 dims: q[h][c .. c + 15] the even dims, q[h][c + 16 .. c + 31] the odd ones */
static void qk_rows(const uint16_t *K, int pages, int hkv, int G, const float *q, float *s) {
    for (int h = 0; h < hkv; h++)
        for (int pg = 0; pg < pages; pg++) {
            const uint16_t *tile = K + ((size_t)pg * hkv + h) * P * D;
            for (int g0 = 0; g0 < G; g0 += 4)
                for (int t0 = 0; t0 < P; t0 += 4) {
                    __m512 a[4][4];
                    for (int i = 0; i < 4; i++)
                        for (int j = 0; j < 4; j++) a[i][j] = _mm512_setzero_ps();
                    for (int c = 0; c < D; c += 32) {
                        __m512 ke[4], ko[4];
                        for (int j = 0; j < 4; j++) {
                            _mm_prefetch((const char *)(tile + (size_t)hkv * P * D + (t0 + j) * D + c), _MM_HINT_T0);
                            __m512i x = _mm512_loadu_si512(tile + (t0 + j) * D + c);
                            ke[j] = even16(x);
                            ko[j] = odd16(x);
                        }
                        for (int i = 0; i < 4; i++) {
                            const float *qi = q + (size_t)(h * G + g0 + i) * D + c;
                            __m512 e = _mm512_loadu_ps(qi), o = _mm512_loadu_ps(qi + 16);
                            for (int j = 0; j < 4; j++) {
                                a[i][j] = _mm512_fmadd_ps(e, ke[j], a[i][j]);
                                a[i][j] = _mm512_fmadd_ps(o, ko[j], a[i][j]);
                            }
                        }
                    }
                    __m512 w[8], u[4], r[2];      /* butterfly: 16 accumulators -> one vector of 16 scores */
                    for (int k = 0; k < 8; k++) {
                        __m512 x = a[k / 2][(2 * k) % 4], y = a[k / 2][(2 * k + 1) % 4];
                        w[k] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
                    }
                    for (int k = 0; k < 4; k++)
                        u[k] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], 0x88),
                                             _mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], 0xDD));
                    for (int k = 0; k < 2; k++)
                        r[k] = _mm512_add_ps(_mm512_unpacklo_ps(u[2 * k], u[2 * k + 1]),
                                             _mm512_unpackhi_ps(u[2 * k], u[2 * k + 1]));
                    __m512d r0 = _mm512_castps_pd(r[0]), r1 = _mm512_castps_pd(r[1]);
                    __m512 z = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(r0, r1)),
                                             _mm512_castpd_ps(_mm512_unpackhi_pd(r0, r1)));
                    _mm512_storeu_ps(s + (((size_t)h * pages + pg) * G + g0) * P + t0 * 4, z);
                }
        }
}

/* KT[page][h][d][32 tokens as (t, t + 16) pairs]: the widening gives tokens 0..15 and 16..31 */
static void qk_transposed(const uint16_t *KT, int pages, int hkv, int G, const float *q, float *s) {
    for (int h = 0; h < hkv; h++)
        for (int pg = 0; pg < pages; pg++) {
            const uint16_t *tile = KT + ((size_t)pg * hkv + h) * P * D;
            for (int g0 = 0; g0 < G; g0 += 4) {
                __m512 a[4][2];
                for (int i = 0; i < 4; i++) a[i][0] = a[i][1] = _mm512_setzero_ps();
                const float *q0 = q + (size_t)(h * G + g0) * D;
                for (int d = 0; d < D; d++) {
                    _mm_prefetch((const char *)(tile + (size_t)hkv * P * D + d * P), _MM_HINT_T0);
                    __m512i x = _mm512_loadu_si512(tile + d * P);
                    __m512 ke = even16(x), ko = odd16(x);
                    for (int i = 0; i < 4; i++) {
                        __m512 b = _mm512_set1_ps(q0[i * D + d]);
                        a[i][0] = _mm512_fmadd_ps(b, ke, a[i][0]);
                        a[i][1] = _mm512_fmadd_ps(b, ko, a[i][1]);
                    }
                }
                float *o = s + (((size_t)h * pages + pg) * G + g0) * P;
                for (int i = 0; i < 4; i++) {
                    _mm512_storeu_ps(o + i * P, a[i][0]);
                    _mm512_storeu_ps(o + i * P + 16, a[i][1]);
                }
            }
        }
}

/* V[page][h][token][d] row-major; p[h * G + g][N]; out[h * G + g][D] (dims in pair order) */
static void pv(const uint16_t *V, int pages, int hkv, int G, const float *p, int N, float *out) {
    for (int h = 0; h < hkv; h++)
        for (int g0 = 0; g0 < G; g0 += 4)
            for (int half = 0; half < 2; half++) {
                __m512 a[4][4];
                for (int i = 0; i < 4; i++)
                    for (int j = 0; j < 4; j++) a[i][j] = _mm512_setzero_ps();
                for (int pg = 0; pg < pages; pg++) {
                    const uint16_t *tile = V + ((size_t)pg * hkv + h) * P * D + half * 64;
                    const float *pp = p + (size_t)(h * G + g0) * N + pg * P;
                    for (int t = 0; t < P; t++) {
                        _mm_prefetch((const char *)(tile + (size_t)hkv * P * D + t * D), _MM_HINT_T0);
                        __m512i x0 = _mm512_loadu_si512(tile + t * D), x1 = _mm512_loadu_si512(tile + t * D + 32);
                        __m512 v0 = even16(x0), v1 = odd16(x0), v2 = even16(x1), v3 = odd16(x1);
                        for (int i = 0; i < 4; i++) {
                            __m512 b = _mm512_set1_ps(pp[i * N + t]);
                            a[i][0] = _mm512_fmadd_ps(b, v0, a[i][0]);
                            a[i][1] = _mm512_fmadd_ps(b, v1, a[i][1]);
                            a[i][2] = _mm512_fmadd_ps(b, v2, a[i][2]);
                            a[i][3] = _mm512_fmadd_ps(b, v3, a[i][3]);
                        }
                    }
                }
                for (int i = 0; i < 4; i++)
                    for (int j = 0; j < 4; j++)
                        _mm512_storeu_ps(out + (size_t)(h * G + g0 + i) * D + half * 64 + 16 * j, a[i][j]);
            }
}

static int by_value(const void *a, const void *b) { double x = *(const double *)a, y = *(const double *)b; return (x > y) - (x < y); }

int main(int argc, char **argv) {
    if (argc != 4) { fprintf(stderr, "usage: k_layout KV_HEADS GROUP TOKENS\n"); return 2; }
    int hkv = atoi(argv[1]), G = atoi(argv[2]), N = atoi(argv[3]), pages = N / P;
    if (hkv < 1 || G < 4 || G % 4 || N < P || N % P) {
        fprintf(stderr, "expected kv heads >= 1, a group that is a multiple of 4, tokens a multiple of %d\n", P);
        return 2;
    }
    size_t n = (size_t)pages * hkv * P * D;
    uint16_t *K = aligned_alloc(64, n * 2), *KT = aligned_alloc(64, n * 2), *V = aligned_alloc(64, n * 2);
    float *q = aligned_alloc(64, (size_t)hkv * G * D * 4), *s = aligned_alloc(64, (size_t)hkv * G * N * 4);
    float *p = aligned_alloc(64, (size_t)hkv * G * N * 4), *out = aligned_alloc(64, (size_t)hkv * G * D * 4);
    srand(1);
    for (size_t i = 0; i < n; i++) { K[i] = KT[i] = 0x3f80 + (rand() & 0x7f); V[i] = 0x3f80 + (rand() & 0x7f); }
    for (int i = 0; i < hkv * G * D; i++) q[i] = (rand() % 1000) / 1000.0f;
    for (size_t i = 0; i < (size_t)hkv * G * N; i++) p[i] = (rand() % 1000) / 1e6f;
    enum { CALLS = 41 };
    double t[3][CALLS];
    for (int r = 0; r < CALLS; r++) {
        double t0 = now();
        qk_rows(K, pages, hkv, G, q, s);
        double t1 = now();
        qk_transposed(KT, pages, hkv, G, q, s);
        double t2 = now();
        pv(V, pages, hkv, G, p, N, out);
        double t3 = now();
        t[0][r] = t1 - t0; t[1][r] = t2 - t1; t[2][r] = t3 - t2;
    }
    for (int k = 0; k < 3; k++) qsort(t[k], CALLS, sizeof(double), by_value);
    printf("kv heads %d, group %d, tokens %d (K %.1f MiB): q.k rows %.3f ms, q.k transposed %.3f ms, PV %.3f ms; "
           "step without softmax: rows %.3f, transposed %.3f ms (%.2fx)\n", hkv, G, N, n * 2.0 / (1 << 20),
           t[0][CALLS / 2] * 1e3, t[1][CALLS / 2] * 1e3, t[2][CALLS / 2] * 1e3,
           (t[0][CALLS / 2] + t[2][CALLS / 2]) * 1e3, (t[1][CALLS / 2] + t[2][CALLS / 2]) * 1e3,
           (t[0][CALLS / 2] + t[2][CALLS / 2]) / (t[1][CALLS / 2] + t[2][CALLS / 2]));
    return 0;
}
