// Native CPU kernels for the fast Llama backend (AVX2 + FMA + F16C), loaded by cpu_kernels.py.
//
// Small-batch GEMMs (M = 1 to K+1 rows: decoding and verification), each reading every weight
// from memory once per call and applying it to all rows while it sits in registers or L1:
//   q8_linear   int8 weights in groups of 32 (llama.cpp's Q8_0), activations quantized to int16
//               per row and group, exact integer group sums;
//   panel_linear  fp16, bf16 or fp32 weights in 16-channel panels, fp32 activations and accumulation.
// In both a row's output does not depend on which other rows share the call (verification is
// bit-identical to decoding one token at a time). linear_wide, a register-blocked GEMM for long
// fp16 and int8 prefills, keeps that for fp16 and gives it up for int8. Then the glue between the GEMMs (add+RMSNorm,
// SiLU*mul, RoPE + KV cache + grouped-query attention) and decoder_forward, the whole layer
// stack in one call.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define GROUP 32
#define MAX_TILE 8

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// Symmetric int16 per group of 32, scale = max|v| / 32767, for one activation row: 16-bit
// activations keep the activation rounding error ~250x below the int8 weights' own.
static void quantize_row(const float *v, int64_t K, int16_t *q, float *scales) {
    for (int64_t g = 0; g < K / GROUP; g++) {
        float amax = 0.0f;
        for (int i = 0; i < GROUP; i++) {
            const float a = fabsf(v[g * GROUP + i]);
            amax = a > amax ? a : amax;
        }
        const float d = amax > 0.0f ? amax / 32767.0f : 1e-12f;  // as quantize_activations in cpu_kernels.py
        scales[g] = d;
        for (int i = 0; i < GROUP; i++) q[g * GROUP + i] = (int16_t)lroundf(v[g * GROUP + i] / d);
    }
}

// One output channel against `rows` (1..MAX_TILE) quantized input rows; `rows` is a compile-time
// constant at every call site below, so the row loops unroll and the accumulators stay in registers.
// Per group: the 32 weights are widened to int16 once and shared by all rows; each row's 32
// products are summed exactly in int32 lanes (|sum| <= 4 * 127 * 32767 < 2^24, so the float
// conversion is exact too), then scaled by weight scale x activation scale.
static inline __attribute__((always_inline)) void channel_tile(
    const int16_t *xq, const float *xs, int64_t K, const int8_t *q, const float *scale, int64_t groups,
    float *y, int64_t N, const int rows) {
    __m256 acc[MAX_TILE];
    for (int m = 0; m < rows; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + g * GROUP)));
        const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + g * GROUP + 16)));
        for (int m = 0; m < rows; m++) {
            const int16_t *xg = xq + m * K + g * GROUP;
            const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)xg)),
                                                 _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(xg + 16))));
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(scale[g] * xs[m * groups + g]), acc[m]);
        }
    }
    for (int m = 0; m < rows; m++) y[m * N] = hsum(acc[m]);
}

// x [M, K] float32, q [N, K] int8, scales [N, K/32] float32, y [M, N] float32; K % 32 == 0.
void q8_linear(const float *x, int64_t M, int64_t K, const int8_t *q, const float *scales,
               int64_t N, float *y) {
    const int64_t groups = K / GROUP;
    int16_t *xq = malloc(M * K * sizeof(int16_t));
    float *xs = malloc(M * groups * sizeof(float));
    for (int64_t m = 0; m < M; m++) quantize_row(x + m * K, K, xq + m * K, xs + m * groups);
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *qn = q + n * K;
        const float *sn = scales + n * groups;
        for (int64_t m0 = 0; m0 < M; m0 += MAX_TILE) {
            const int16_t *xm = xq + m0 * K;
            const float *sm = xs + m0 * groups;
            float *ym = y + m0 * N + n;
            switch (M - m0 < MAX_TILE ? M - m0 : MAX_TILE) {
                case 1: channel_tile(xm, sm, K, qn, sn, groups, ym, N, 1); break;
                case 2: channel_tile(xm, sm, K, qn, sn, groups, ym, N, 2); break;
                case 3: channel_tile(xm, sm, K, qn, sn, groups, ym, N, 3); break;
                case 4: channel_tile(xm, sm, K, qn, sn, groups, ym, N, 4); break;
                case 5: channel_tile(xm, sm, K, qn, sn, groups, ym, N, 5); break;
                case 6: channel_tile(xm, sm, K, qn, sn, groups, ym, N, 6); break;
                case 7: channel_tile(xm, sm, K, qn, sn, groups, ym, N, 7); break;
                default: channel_tile(xm, sm, K, qn, sn, groups, ym, N, 8); break;
            }
        }
    }
    free(xq);
    free(xs);
}

// panel_linear: y[M, N] = x[M, K] @ W[N, K]^T for float weights stored in panels of 16 output
// channels, k-major: panel[k][16] (pack_panels in cpu_kernels.py), in one of the panel formats
//   PANEL_F16  fp16, widened by F16C;
//   PANEL_BF16 bf16, widened by a shift and a mask (pack_panels stores channel c next to c + 8);
//   PANEL_F32  fp32, as stored.
// For each input k the 16 channels are one load (32 or 64 bytes), multiplied by the broadcast
// x[m][k]: the weights stream front to back and there are no horizontal sums. Every (row, channel)
// sum is one sequential fp32 chain over k, the same whatever M or the tile, so a row's result is
// bit-identical however many rows share the call. Tiles keep at least 6 chains in flight (FMA
// latency 5): 3 panels for one row, 2 for two, 1 for 3-6 rows. Measured on the default target's
// GEMMs (2 threads), fp16, against the row-major layout with two partial sums per row it replaced:
// one row 16.8 -> 13.7 ms, two rows 18.5 -> 17.2, five 27.4 -> 26.0 (F16C costs this CPU about two
// FMAs' issue slots per vector, the bf16 shift nearly nothing: 5 rows take 21 ms in bf16).
#define PANEL 16
#define PANEL_TILE 6
enum { PANEL_F16 = 1, PANEL_BF16 = 2, PANEL_F32 = 3 };  // format codes; 0 is int8 (q8_linear)

static inline __attribute__((always_inline)) void panel_load(const void *w, int64_t at, const int format, __m256 *w0,
                                                             __m256 *w1) {
    if (format == PANEL_F32) {
        *w0 = _mm256_load_ps((const float *)w + at);
        *w1 = _mm256_load_ps((const float *)w + at + 8);
    } else if (format == PANEL_BF16) {
        const __m256i raw = _mm256_load_si256((const __m256i *)((const uint16_t *)w + at));
        *w0 = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
        *w1 = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32((int)0xffff0000u)));
    } else {
        *w0 = _mm256_cvtph_ps(_mm_load_si128((const __m128i *)((const uint16_t *)w + at)));
        *w1 = _mm256_cvtph_ps(_mm_load_si128((const __m128i *)((const uint16_t *)w + at + 8)));
    }
}

static inline __attribute__((always_inline)) void panel_tile(const float *x, int64_t K, const void *w, float *y,
                                                             int64_t ldy, const int rows, const int panels,
                                                             const int format) {
    const int64_t bytes = format == PANEL_F32 ? 4 : 2;
    __m256 acc[PANEL_TILE][3][2];
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < panels; j++) acc[m][j][0] = acc[m][j][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        for (int j = 0; j < panels; j++) {
            __m256 w0, w1;
            _mm_prefetch((const char *)w + (j * K + k + 64) * PANEL * bytes, _MM_HINT_T0);
            panel_load(w, (j * K + k) * PANEL, format, &w0, &w1);
            for (int m = 0; m < rows; m++) {
                const __m256 a = _mm256_broadcast_ss(x + m * K + k);
                acc[m][j][0] = _mm256_fmadd_ps(a, w0, acc[m][j][0]);
                acc[m][j][1] = _mm256_fmadd_ps(a, w1, acc[m][j][1]);
            }
        }
    }
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < panels; j++) {
            _mm256_storeu_ps(y + m * ldy + j * PANEL, acc[m][j][0]);
            _mm256_storeu_ps(y + m * ldy + j * PANEL + 8, acc[m][j][1]);
        }
}

#define PANEL_CASE(R, P) case R * 4 + P: panel_tile(x, K, w, y, ldy, R, P, format); break
static inline __attribute__((always_inline)) void panel_dispatch(const float *x, int64_t K, const void *w, float *y,
                                                                 int64_t ldy, int rows, int panels, const int format) {
    switch (rows * 4 + panels) {
        PANEL_CASE(1, 1); PANEL_CASE(1, 2); PANEL_CASE(1, 3); PANEL_CASE(2, 1); PANEL_CASE(2, 2);
        PANEL_CASE(3, 1); PANEL_CASE(4, 1); PANEL_CASE(5, 1); default: panel_tile(x, K, w, y, ldy, 6, 1, format); break;
    }
}

// x [M, K] float32, w [ceil(N/16), K, 16] panels in `format`, y [M, N].
void panel_linear(const float *x, int64_t M, int64_t K, const void *w, int64_t N, float *y, int format) {
    const int64_t panels = (N + PANEL - 1) / PANEL, bytes = format == PANEL_F32 ? 4 : 2;
    const int group = M == 1 ? 3 : M == 2 ? 2 : 1;
    const int64_t tiles = (M + PANEL_TILE - 1) / PANEL_TILE;  // rows split evenly: 7 -> 4 + 3, not 6 + 1
    #pragma omp parallel for schedule(static)
    for (int64_t p0 = 0; p0 < panels; p0 += group) {
        const int np = panels - p0 < group ? (int)(panels - p0) : group;
        const int full = (p0 + np) * PANEL <= N;
        const void *wp = (const char *)w + p0 * K * PANEL * bytes;
        for (int64_t t = 0, m0 = 0; t < tiles; t++) {
            const int rows = (int)((M - m0) / (tiles - t));
            float buf[PANEL_TILE * 3 * PANEL];
            float *out = full ? y + m0 * N + p0 * PANEL : buf;
            const int64_t ldy = full ? N : np * PANEL;
            switch (format) {
                case PANEL_F32: panel_dispatch(x + m0 * K, K, wp, out, ldy, rows, np, PANEL_F32); break;
                case PANEL_BF16: panel_dispatch(x + m0 * K, K, wp, out, ldy, rows, np, PANEL_BF16); break;
                default: panel_dispatch(x + m0 * K, K, wp, out, ldy, rows, np, PANEL_F16); break;
            }
            if (!full)  // the last panel is zero-padded past N: keep its real channels only
                for (int m = 0; m < rows; m++)
                    memcpy(y + (m0 + m) * N + p0 * PANEL, buf + m * ldy, (N - p0 * PANEL) * sizeof(float));
            m0 += rows;
        }
    }
}

// linear_wide: the same products for prefills of fp16 and int8 weights, whose widening is worth
// amortising over many rows. Each thread converts a block of 16 channels x 256 k once into an fp32
// [k][16] panel (F16C; or int8 x its group scale, then an 8x8 transpose), and a 6-row x 16-channel
// register block (12 accumulators) broadcasts x and streams the panel: 12 FMAs per 2 panel loads,
// the classic BLIS micro-kernel shape. Measured on the default target's prefill: 1.1-1.2x faster
// than panel_linear in fp16, 1.4-1.5x than q8_linear in int8 (30-120 rows). For fp16 each
// (row, channel) sum keeps panel_linear's order (the k blocks continue one chain), so the results
// are bit-identical; int8 weights meet float32 activations here (no int16 rounding), so those differ.
#define PANEL_K 256
#define WIDE_ROWS 6

// Store r[i] = 8 k values of channel c0 + i as panel rows k..k+7 (an 8x8 transpose).
static inline void store_transposed(__m256 r[8], float *p) {
    __m256 t[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {  // r[0..3] now hold k 0-3 | 4-7 of channels 0-3, r[4..7] of 4-7
        _mm256_store_ps(p + i * PANEL, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
        _mm256_store_ps(p + (i + 4) * PANEL, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
    }
}

// Panel of channels n0..n0+15, k0..k0+kn-1 (k0 and kn multiples of 8) as fp32 [kn][16]: fp16
// panels are widened, int8 (format 0, row-major) is scaled and transposed.
static void pack_panel(const void *w, const float *scales, int format, int64_t K, int64_t n0, int64_t k0,
                       int64_t kn, float *panel) {
    if (format == PANEL_F16) {
        for (int64_t k = 0; k < kn; k++) {
            __m256 w0, w1;
            panel_load(w, n0 * K + (k0 + k) * PANEL, PANEL_F16, &w0, &w1);
            _mm256_store_ps(panel + k * PANEL, w0);
            _mm256_store_ps(panel + k * PANEL + 8, w1);
        }
        return;
    }
    for (int c0 = 0; c0 < PANEL; c0 += 8) {
        for (int64_t k = 0; k < kn; k += 8) {
            __m256 r[8];
            for (int i = 0; i < 8; i++) {
                const int64_t row = n0 + c0 + i, at = row * K + k0 + k;
                const __m128i q = _mm_loadl_epi64((const __m128i *)((const int8_t *)w + at));
                r[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)),
                                     _mm256_set1_ps(scales[row * (K / GROUP) + (k0 + k) / GROUP]));
            }
            store_transposed(r, panel + k * PANEL + c0);
        }
    }
}

static inline __attribute__((always_inline)) void wide_tile(const float *x, int64_t K, const float *panel, int64_t kn,
                                                             float *y, int64_t N, int first, const int rows) {
    __m256 acc[WIDE_ROWS][2];
    for (int m = 0; m < rows; m++) {
        acc[m][0] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y + m * N);
        acc[m][1] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y + m * N + 8);
    }
    for (int64_t k = 0; k < kn; k++) {
        const __m256 b0 = _mm256_load_ps(panel + k * PANEL), b1 = _mm256_load_ps(panel + k * PANEL + 8);
        for (int m = 0; m < rows; m++) {
            const __m256 a = _mm256_broadcast_ss(x + m * K + k);
            acc[m][0] = _mm256_fmadd_ps(a, b0, acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(a, b1, acc[m][1]);
        }
    }
    for (int m = 0; m < rows; m++) {
        _mm256_storeu_ps(y + m * N, acc[m][0]);
        _mm256_storeu_ps(y + m * N + 8, acc[m][1]);
    }
}

// x [M, K] float32, w (format 0: int8 [N, K] with scales [N, K/32]; else panels as panel_linear),
// y [M, N]; K % 32 == 0. fp32 and bf16 panels need no conversion worth amortising, so they stay on
// panel_linear (measured: 0.83-0.94x and 0.95-1.03x its speed here at 30-120 rows), as does an N
// that is not a multiple of the panel width.
void linear_wide(const float *x, int64_t M, int64_t K, const void *w, const float *scales, int format, int64_t N,
                 float *y) {
    if (N % PANEL || format == PANEL_F32 || format == PANEL_BF16) {
        if (format == 0) q8_linear(x, M, K, w, scales, N, y);
        else panel_linear(x, M, K, w, N, y, format);
        return;
    }
    #pragma omp parallel
    {
        float *panel = aligned_alloc(32, PANEL_K * PANEL * sizeof(float));
        #pragma omp for schedule(static)
        for (int64_t n0 = 0; n0 < N; n0 += PANEL) {
            for (int64_t k0 = 0; k0 < K; k0 += PANEL_K) {
                const int64_t kn = K - k0 < PANEL_K ? K - k0 : PANEL_K;
                pack_panel(w, scales, format, K, n0, k0, kn, panel);
                for (int64_t m0 = 0; m0 < M; m0 += WIDE_ROWS) {
                    const float *xm = x + m0 * K + k0;
                    float *ym = y + m0 * N + n0;
                    switch (M - m0 < WIDE_ROWS ? M - m0 : WIDE_ROWS) {
                        case 1: wide_tile(xm, K, panel, kn, ym, N, k0 == 0, 1); break;
                        case 2: wide_tile(xm, K, panel, kn, ym, N, k0 == 0, 2); break;
                        case 3: wide_tile(xm, K, panel, kn, ym, N, k0 == 0, 3); break;
                        case 4: wide_tile(xm, K, panel, kn, ym, N, k0 == 0, 4); break;
                        case 5: wide_tile(xm, K, panel, kn, ym, N, k0 == 0, 5); break;
                        default: wide_tile(xm, K, panel, kn, ym, N, k0 == 0, 6); break;
                    }
                }
            }
        }
        free(panel);
    }
}

// ---- The glue between the GEMMs: each replaces several small torch ops (and their per-op cost). ----

// x += y (y may be NULL), then out = x / rms(x) * w, for M rows of H (RMSNorm, Zhang & Sennrich 2019).
void add_rms_norm(float *x, const float *y, const float *w, float eps, float *out, int64_t M, int64_t H) {
    for (int64_t m = 0; m < M; m++) {
        float *xm = x + m * H, *om = out + m * H;
        float ss = 0.0f;
        if (y) {
            const float *ym = y + m * H;
            for (int64_t i = 0; i < H; i++) xm[i] += ym[i];
        }
        #pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < H; i++) ss += xm[i] * xm[i];
        const float r = 1.0f / sqrtf(ss / (float)H + eps);
        for (int64_t i = 0; i < H; i++) om[i] = xm[i] * r * w[i];
    }
}

// exp(x) for 8 floats: Cephes' expf (range reduction to [-ln2/2, ln2/2] and a degree-5
// polynomial, as in avx_mathfun), within ~2 ulp; inputs are clamped to the float range.
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(pow2n));
}

// out[m, i] = silu(gate[m, i]) * up[m, i], with gate_up[m] = [gate | up] (the SwiGLU MLP's glue).
void silu_mul(const float *gate_up, float *out, int64_t M, int64_t F) {
    #pragma omp parallel for schedule(static) if (M * F >= 65536)
    for (int64_t m = 0; m < M; m++) {
        const float *g = gate_up + m * 2 * F, *u = g + F;
        float *o = out + m * F;
        int64_t i = 0;
        for (; i + 8 <= F; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 sig = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(sig, _mm256_loadu_ps(u + i)));
        }
        for (; i < F; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

// Rotate interleaved (re, im) pairs by rope = [hd/2] (cos, sin) pairs: one complex multiply each.
static inline void rotate(const float *src, const float *rope, float *dst, int64_t hd) {
    for (int64_t p = 0; p < hd / 2; p++) {
        const float a = src[2 * p], b = src[2 * p + 1], c = rope[2 * p], s = rope[2 * p + 1];
        dst[2 * p] = a * c - b * s;
        dst[2 * p + 1] = a * s + b * c;
    }
}

// s[j] = exp(s[j] - best), exactly 0 for masked (-inf) scores; returns the sum.
static inline float softmax_numerators(float *s, int64_t limit, float best) {
    const __m256 neg_inf = _mm256_set1_ps(-INFINITY), b = _mm256_set1_ps(best);
    __m256 sum = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= limit; j += 8) {
        const __m256 x = _mm256_loadu_ps(s + j);
        const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(x, b)), _mm256_cmp_ps(x, neg_inf, _CMP_NEQ_OQ));
        _mm256_storeu_ps(s + j, e);
        sum = _mm256_add_ps(sum, e);
    }
    float total = hsum(sum);
    for (; j < limit; j++) {
        s[j] = s[j] == -INFINITY ? 0.0f : expf(s[j] - best);
        total += s[j];
    }
    return total;
}

// softmax(q . k_j + mask_j) @ v over keys j < limit for one query; q and o are [8 * D] floats with
// D a compile-time constant at the call sites, so q and the output stay in registers.
static inline __attribute__((always_inline)) void attend(
    const float *q, const float *k, const float *v, const float *mask, int64_t limit, float *s, float *o, const int D) {
    __m256 qr[16], acc[16];
    for (int d = 0; d < D; d++) qr[d] = _mm256_loadu_ps(q + 8 * d);
    float best = -INFINITY;
    for (int64_t j = 0; j < limit; j++) {
        __m256 dot = _mm256_mul_ps(qr[0], _mm256_loadu_ps(k + j * 8 * D));
        for (int d = 1; d < D; d++) dot = _mm256_fmadd_ps(qr[d], _mm256_loadu_ps(k + j * 8 * D + 8 * d), dot);
        s[j] = mask ? hsum(dot) + mask[j] : hsum(dot);
        best = s[j] > best ? s[j] : best;
    }
    const float total = softmax_numerators(s, limit, best);
    for (int d = 0; d < D; d++) acc[d] = _mm256_setzero_ps();
    for (int64_t j = 0; j < limit; j++) {
        if (s[j] == 0.0f) continue;
        const __m256 p = _mm256_set1_ps(s[j]);
        for (int d = 0; d < D; d++) acc[d] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + j * 8 * D + 8 * d), acc[d]);
    }
    const __m256 inv = _mm256_set1_ps(1.0f / total);
    for (int d = 0; d < D; d++) _mm256_storeu_ps(o + 8 * d, _mm256_mul_ps(acc[d], inv));
}

// The same for any head_dim, without registers kept across keys.
static void attend_any(const float *q, const float *k, const float *v, const float *mask, int64_t limit,
                       int64_t hd, float *s, float *o) {
    float best = -INFINITY, total;
    for (int64_t j = 0; j < limit; j++) {
        float dot = 0.0f;
        for (int64_t d = 0; d < hd; d++) dot += q[d] * k[j * hd + d];
        s[j] = mask ? dot + mask[j] : dot;
        best = s[j] > best ? s[j] : best;
    }
    total = softmax_numerators(s, limit, best);
    for (int64_t d = 0; d < hd; d++) o[d] = 0.0f;
    for (int64_t j = 0; j < limit; j++)
        for (int64_t d = 0; d < hd; d++) o[d] += s[j] * v[j * hd + d];
    for (int64_t d = 0; d < hd; d++) o[d] /= total;
}

// Grouped-query attention for n new tokens whose K/V go to cache slots [slot, slot + n).
// qkv [n, (heads + 2 kv_heads) * hd], q/k pairs interleaved and q pre-scaled (fast_llama._Layer);
// rope [n, hd/2, 2]; caches [kv_heads, cap, hd]; mask [n, slot + n] additive, or NULL for causal
// (query i sees keys 0..slot+i); out [n, heads * hd].
void attention(const float *qkv, int64_t n, const float *rope, float *kc, float *vc, int64_t cap,
               int64_t slot, const float *mask, int64_t heads, int64_t kv_heads, int64_t hd, float *out) {
    const int64_t row = (heads + 2 * kv_heads) * hd, keys = slot + n, group = heads / kv_heads;
    for (int64_t i = 0; i < n; i++) {
        const float *qi = qkv + i * row, *ri = rope + i * hd;
        for (int64_t h = 0; h < heads; h++) rotate(qi + h * hd, ri, out + i * heads * hd + h * hd, hd);
        for (int64_t h = 0; h < kv_heads; h++) {
            rotate(qi + (heads + h) * hd, ri, kc + (h * cap + slot + i) * hd, hd);
            memcpy(vc + (h * cap + slot + i) * hd, qi + (heads + kv_heads + h) * hd, hd * sizeof(float));
        }
    }
    // Always split heads across threads: even one query at a 20-token context runs faster on two
    // threads than one (measured 0.24 vs 0.30 ms over the default target's 30 layers).
    #pragma omp parallel
    {
        float *s = malloc(keys * sizeof(float)), *q = malloc(hd * sizeof(float));
        #pragma omp for collapse(2) schedule(static)
        for (int64_t h = 0; h < heads; h++) {
            for (int64_t i = 0; i < n; i++) {
                float *o = out + i * heads * hd + h * hd;
                const float *k = kc + (h / group) * cap * hd, *v = vc + (h / group) * cap * hd;
                const float *mi = mask ? mask + i * keys : NULL;
                const int64_t limit = mask ? keys : slot + i + 1;
                memcpy(q, o, hd * sizeof(float));  // o holds the rotated query until it is overwritten
                if (hd == 64) attend(q, k, v, mi, limit, s, o, 8);
                else if (hd == 128) attend(q, k, v, mi, limit, s, o, 16);
                else attend_any(q, k, v, mi, limit, hd, s, o);
            }
        }
        free(s);
        free(q);
    }
}

// ---- The whole decoder stack in one call: no Python (or ctypes, or thread wake-up) between ops. ----

// Per-layer weights and norm weights as arrays indexed by layer. format 0: int8 (Q8_0, *_q int8
// [N, K] with *_s scales [N, K/32]); other formats: *_q panels as panel_linear, *_s unused. down's K is
// the MLP width padded to a multiple of 32 (zero columns).
typedef struct {
    const void *const *qkv_q, *const *o_q, *const *gate_up_q, *const *down_q;
    const float *const *qkv_s, *const *o_s, *const *gate_up_s, *const *down_s;
    const float *const *input_norm, *const *post_norm;
    const float *final_norm;
    int64_t format, layers, hidden, mlp, mlp_padded, heads, kv_heads, head_dim;
    float eps;
} Decoder;

static void decoder_linear(const Decoder *d, const void *w, const float *s, const float *x, int64_t n, int64_t K,
                           int64_t N, float *y, int wide) {
    if (wide) linear_wide(x, n, K, w, s, (int)d->format, N, y);
    else if (d->format == 0) q8_linear(x, n, K, w, s, N, y);
    else panel_linear(x, n, K, w, N, y, (int)d->format);
}

// x [n, hidden]: input vectors, consumed as the residual stream; out [n, hidden]: final-norm
// hidden states. Caches [layers, kv_heads, cap, head_dim]; rope, slot and mask as in attention().
// wide: the GEMMs take linear_wide (a long prefill; the caller decides, cpu_kernels.py).
void decoder_forward(const Decoder *d, float *x, int64_t n, float *k_cache, float *v_cache, int64_t cap,
                     const float *rope, int64_t slot, const float *mask, int wide, float *out) {
    const int64_t H = d->hidden, A = d->heads * d->head_dim, QKV = (d->heads + 2 * d->kv_heads) * d->head_dim;
    const int64_t layer_stride = d->kv_heads * cap * d->head_dim;
    float *h = malloc(n * H * sizeof(float)), *tmp = malloc(n * H * sizeof(float));
    float *qkv = malloc(n * QKV * sizeof(float)), *attn = malloc(n * A * sizeof(float));
    float *gate_up = malloc(n * 2 * d->mlp * sizeof(float)), *act = calloc(n * d->mlp_padded, sizeof(float));
    add_rms_norm(x, NULL, d->input_norm[0], d->eps, h, n, H);
    for (int64_t l = 0; l < d->layers; l++) {
        decoder_linear(d, d->qkv_q[l], d->qkv_s[l], h, n, H, QKV, qkv, wide);
        attention(qkv, n, rope, k_cache + l * layer_stride, v_cache + l * layer_stride, cap, slot, mask,
                  d->heads, d->kv_heads, d->head_dim, attn);
        decoder_linear(d, d->o_q[l], d->o_s[l], attn, n, A, H, tmp, wide);
        add_rms_norm(x, tmp, d->post_norm[l], d->eps, h, n, H);
        decoder_linear(d, d->gate_up_q[l], d->gate_up_s[l], h, n, H, 2 * d->mlp, gate_up, wide);
        for (int64_t i = 0; i < n; i++)  // rows of act keep their zero padding
            silu_mul(gate_up + i * 2 * d->mlp, act + i * d->mlp_padded, 1, d->mlp);
        decoder_linear(d, d->down_q[l], d->down_s[l], act, n, d->mlp_padded, H, tmp, wide);
        const int last = l + 1 == d->layers;
        add_rms_norm(x, tmp, last ? d->final_norm : d->input_norm[l + 1], d->eps, last ? out : h, n, H);
    }
    free(h); free(tmp); free(qkv); free(attn); free(gate_up); free(act);
}
