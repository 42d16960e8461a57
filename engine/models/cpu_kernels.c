// Native CPU kernels for the fast Llama backend, loaded by cpu_kernels.py.
//
// One source, built once per instruction set (cpu_kernels.ISAS) and chosen at run time from the
// CPU's flags: AVX2 + FMA + F16C (VW = 8 floats a vector), and AVX-512 F/BW/VL/DQ (VW = 16). Every
// kernel is written in vectors of VW floats (the v* helpers below), so both builds run the same
// algorithm; a weight panel of 16 channels is two AVX2 vectors or one AVX-512 vector.
//
// Small-batch GEMMs (M = 1 to K+1 rows: decoding and verification), each reading every weight
// from memory once per call and applying it to all rows while it sits in registers or L1:
//   q8_linear     int8 weights in groups of 32 (llama.cpp's Q8_0), activations quantized to int16
//                 per row and group, exact integer group sums;
//   panel_linear  weights in 16-channel panels, fp32 activations and accumulation: fp16, bf16 or
//                 fp32 values, or GGUF blocks (Q4_1: w = d * q + m; Q8_0: w = d * q) widened to
//                 exactly the fp32 values llama.cpp's and gguf's dequantisers give.
// In both a row's output does not depend on which other rows share the call (verification is
// bit-identical to decoding one token at a time), and panel_linear's (row, channel) sum is one fp32
// chain over k whatever the format, so Q4_1 blocks give bit for bit the float32 panels' result.
// linear_wide, a register-blocked GEMM for long prefills of fp16, Q4_1/Q8_0 and int8 weights,
// keeps that for the panel formats and gives it up for int8. Then the glue between the GEMMs
// (add+RMSNorm, SiLU*mul, RoPE + KV cache + grouped-query attention) and decoder_forward, the whole
// layer stack in one call.
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define GROUP 32
#define MAX_TILE 8

// ---- Vectors of VW floats: the only place the two instruction sets differ. ----
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define VW 16
typedef __m512 vf;
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vload(const float *p) { return _mm512_loadu_ps(p); }
static inline void vstore(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vset(float x) { return _mm512_set1_ps(x); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
static inline vf vf16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline vf vi8(const int8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))); }
static inline void vnibbles(const uint8_t *p, vf *lo, vf *hi) {  // VW bytes -> their low and high nibbles
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
    *hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}
static inline vf vbf16_panel(const uint16_t *p) {  // 16 bf16 stored c, c + 8 (pack_panels) -> channel order
    const __m256i raw = _mm256_loadu_si256((const __m256i *)p);
    const __m256 lo = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
    const __m256 hi = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32((int)0xffff0000u)));
    return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
}
static inline vf vzero_where_neg_inf(vf e, vf x) {
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ), e);
}
static inline vf vround(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vpow2(vf n) {  // 2^n for integral n in the float range
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
static inline vf vclamp(vf x, float lo, float hi) { return _mm512_min_ps(_mm512_max_ps(x, vset(lo)), vset(hi)); }
static inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vabs(vf x) { return _mm512_abs_ps(x); }
static inline float vhmax(vf v) { return _mm512_reduce_max_ps(v); }
static inline void vstore_i16(int16_t *p, vf v) {  // integral floats in the int16 range
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(v)));
}
// VW int32 lanes: the integer dot products of the int16-activation formats.
typedef __m512i vi;
static inline vi vi_zero(void) { return _mm512_setzero_si512(); }
static inline vi vi_load(const void *p) { return _mm512_loadu_si512(p); }
static inline vi vi_nibble_pairs(vi line, const int s) {  // nibbles 4s and 4s + 4 of each lane as two int16s
    return _mm512_and_si512(_mm512_srli_epi32(line, 4 * s), _mm512_set1_epi32(0x000F000F));
}
static inline vi vi_i8_pairs(const int8_t *p) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p)); }
static inline vf vi_float(vi v) { return _mm512_cvtepi32_ps(v); }
static inline vi vi_dot16(vi acc, vi pairs, int32_t x) {  // acc + each lane's two int16 products with x's two
#ifdef __AVX512VNNI__
    return _mm512_dpwssd_epi32(acc, pairs, _mm512_set1_epi32(x));
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi32(x)));
#endif
}
#else
#define VW 8
typedef __m256 vf;
static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf vload(const float *p) { return _mm256_loadu_ps(p); }
static inline void vstore(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vset(float x) { return _mm256_set1_ps(x); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline float vsum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline vf vf16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline vf vi8(const int8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))); }
static inline void vnibbles(const uint8_t *p, vf *lo, vf *hi) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    *lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
    *hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
}
static inline vf vzero_where_neg_inf(vf e, vf x) {
    return _mm256_and_ps(e, _mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ));
}
static inline vf vround(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vpow2(vf n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
static inline vf vclamp(vf x, float lo, float hi) { return _mm256_min_ps(_mm256_max_ps(x, vset(lo)), vset(hi)); }
static inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf vabs(vf x) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x); }
static inline float vhmax(vf v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline void vstore_i16(int16_t *p, vf v) {
    const __m256i i = _mm256_cvtps_epi32(v);
    _mm_storeu_si128((__m128i *)p, _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1)));
}
typedef __m256i vi;
static inline vi vi_zero(void) { return _mm256_setzero_si256(); }
static inline vi vi_load(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline vi vi_nibble_pairs(vi line, const int s) {
    return _mm256_and_si256(_mm256_srli_epi32(line, 4 * s), _mm256_set1_epi32(0x000F000F));
}
static inline vi vi_i8_pairs(const int8_t *p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)); }
static inline vf vi_float(vi v) { return _mm256_cvtepi32_ps(v); }
static inline vi vi_dot16(vi acc, vi pairs, int32_t x) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi32(x)));
}
#endif

// The instruction set this build was compiled for (cpu_kernels.py checks it after loading).
int kernel_vector_width(void) { return VW; }

// Symmetric int16 per group of 32 for one activation row, as quantize_activations in cpu_kernels.py:
// scale d = max(max|v| / 32767, 1e-12), q = v / d rounded half to even (torch.round). 16-bit
// activations keep the activation rounding error ~250x below int8 weights' own. sums (may be
// NULL): d * sum(q) per group, the term a block's minimum multiplies (the int16-activation formats).
static void quantize_row(const float *v, int64_t K, int16_t *q, float *scales, float *sums) {
    for (int64_t g = 0; g < K / GROUP; g++) {
        const float *vg = v + g * GROUP;
        vf amax = vzero(), total = vzero();
        for (int i = 0; i < GROUP; i += VW) amax = vmax(amax, vabs(vload(vg + i)));
        float d = vhmax(amax) / 32767.0f;
        d = d > 1e-12f ? d : 1e-12f;
        for (int i = 0; i < GROUP; i += VW) {
            const vf r = vround(vdiv(vload(vg + i), vset(d)));
            vstore_i16(q + g * GROUP + i, r);
            total = vadd(total, r);  // integers below 2^20: exact
        }
        scales[g] = d;
        if (sums) sums[g] = d * vsum(total);
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
    vf acc[MAX_TILE];
    for (int m = 0; m < rows; m++) acc[m] = vzero();
    for (int64_t g = 0; g < groups; g++) {
#if VW == 16
        const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(q + g * GROUP)));
        for (int m = 0; m < rows; m++) {
            const __m512i dot = _mm512_madd_epi16(w, _mm512_loadu_si512((const void *)(xq + m * K + g * GROUP)));
            acc[m] = vfma(_mm512_cvtepi32_ps(dot), vset(scale[g] * xs[m * groups + g]), acc[m]);
        }
#else
        const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + g * GROUP)));
        const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + g * GROUP + 16)));
        for (int m = 0; m < rows; m++) {
            const int16_t *xg = xq + m * K + g * GROUP;
            const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)xg)),
                                                 _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(xg + 16))));
            acc[m] = vfma(_mm256_cvtepi32_ps(dot), vset(scale[g] * xs[m * groups + g]), acc[m]);
        }
#endif
    }
    for (int m = 0; m < rows; m++) y[m * N] = vsum(acc[m]);
}

// panel_linear: y[M, N] = x[M, K] @ W[N, K]^T for weights stored in panels of 16 output channels
// (pack_panels / pack_blocks in cpu_kernels.py), in one of the panel formats
//   PANEL_F16   fp16, k-major [k][16], widened by F16C;
//   PANEL_BF16  bf16, k-major, widened by a shift and a mask (channel c is stored next to c + 8);
//   PANEL_F32   fp32, k-major;
//   PANEL_Q4_1  GGUF Q4_1 blocks of 32 k: d[16] fp16, m[16] fp16, then 16 pairs of k as 16 bytes
//               (channel c's byte: k = 2p in the low nibble, 2p + 1 in the high); w = fma(d, q, m),
//               which is exactly gguf's float32 (d * q) + m (d * q is exact);
//   PANEL_Q8_0  GGUF Q8_0 blocks of 32 k: d[16] fp16, then 32 k x 16 int8; w = d * q (exact).
// and two formats for int16 activations (quantize_row), the same GGUF blocks laid out for integer
// dot products (a16_tile below):
//   A16_Q4_1    d[16], m[16], then 4 lines of 64 bytes, each 8 k x 16 channels: channel c's dword
//               in line g holds q(k = 8 g + j) at bit 16 (j % 2) + 4 (j / 2);
//   A16_Q8_0    d[16], then 16 pairs of k as 32 bytes: byte 2 c + r holds q(k = 2 p + r) of channel c.
// For each input k the 16 channels' weights are one panel row (one or two vectors), multiplied by
// the broadcast x[m][k]: the weights stream front to back and there are no horizontal sums. Every
// (row, channel) sum is one sequential fp32 chain over k, the same whatever M, the tile, the format
// or the instruction set, so a row's result is bit-identical however many rows share the call.
// Measured on the default target's GGEMMs (2 threads, Zen 1, AVX2), fp16, against the row-major
// layout with two partial sums per row it replaced: one row 16.8 -> 13.7 ms, five 27.4 -> 26.0.
#define PANEL 16
#define VPP (PANEL / VW)  // vectors per panel row
enum { PANEL_F16 = 1, PANEL_BF16 = 2, PANEL_F32 = 3, PANEL_Q4_1 = 4, PANEL_Q8_0 = 5,  // 0 is int8 (q8_linear)
       A16_Q4_1 = 6, A16_Q8_0 = 7 };
#define Q4_1_BLOCK (PANEL * 4 + PANEL * GROUP / 2)  // bytes of one panel's block of 32 k: 320
#define Q8_0_BLOCK (PANEL * 2 + PANEL * GROUP)      // 544
#if VW == 16
#define TILE_ROWS 8
#define TILE_PANELS 4
#else
#define TILE_ROWS 6
#define TILE_PANELS 3
#endif

static inline int64_t panel_bytes(int format, int64_t K) {  // one panel of 16 channels over all K
    switch (format) {
        case PANEL_F32: return K * PANEL * 4;
        case PANEL_Q4_1: case A16_Q4_1: return K / GROUP * Q4_1_BLOCK;
        case PANEL_Q8_0: case A16_Q8_0: return K / GROUP * Q8_0_BLOCK;
        default: return K * PANEL * 2;
    }
}

// Where the panel rows k = 32 b + 2 p and k + 1 start within a panel, in bytes.
static inline int64_t pair_offset(const int format, int64_t b, int p) {
    switch (format) {
        case PANEL_F32: return (b * GROUP + 2 * p) * PANEL * 4;
        case PANEL_Q4_1: return b * Q4_1_BLOCK + PANEL * 4 + p * PANEL;
        case PANEL_Q8_0: return b * Q8_0_BLOCK + PANEL * 2 + 2 * p * PANEL;
        default: return (b * GROUP + 2 * p) * PANEL * 2;
    }
}

// The block's scales (d) and, for Q4_1, minimums (m) of one panel, as VPP vectors each.
static inline __attribute__((always_inline)) void panel_scales(const char *pw, int64_t b, const int format, vf *d,
                                                               vf *mn) {
    if (format == PANEL_Q4_1 || format == PANEL_Q8_0) {
        const char *blk = pw + b * (format == PANEL_Q4_1 ? Q4_1_BLOCK : Q8_0_BLOCK);
        for (int i = 0; i < VPP; i++) {
            d[i] = vf16((const uint16_t *)blk + i * VW);
            if (format == PANEL_Q4_1) mn[i] = vf16((const uint16_t *)blk + PANEL + i * VW);
        }
    }
}

// Panel rows k = 32 b + 2 p and k + 1 of one panel, widened to fp32.
static inline __attribute__((always_inline)) void panel_pair(const char *pw, int64_t b, int p, const int format,
                                                             const vf *d, const vf *mn, vf *w0, vf *w1) {
    const char *at = pw + pair_offset(format, b, p);
    for (int i = 0; i < VPP; i++) {
        if (format == PANEL_F32) {
            w0[i] = vload((const float *)at + i * VW);
            w1[i] = vload((const float *)at + PANEL + i * VW);
        } else if (format == PANEL_F16) {
            w0[i] = vf16((const uint16_t *)at + i * VW);
            w1[i] = vf16((const uint16_t *)at + PANEL + i * VW);
        } else if (format == PANEL_Q4_1) {
            vf lo, hi;
            vnibbles((const uint8_t *)at + i * VW, &lo, &hi);
            w0[i] = vfma(d[i], lo, mn[i]);
            w1[i] = vfma(d[i], hi, mn[i]);
        } else if (format == PANEL_Q8_0) {
            w0[i] = vmul(vi8((const int8_t *)at + i * VW), d[i]);
            w1[i] = vmul(vi8((const int8_t *)at + PANEL + i * VW), d[i]);
        }
    }
    if (format == PANEL_BF16) {
        const uint16_t *h = (const uint16_t *)at;
#if VW == 16
        w0[0] = vbf16_panel(h);
        w1[0] = vbf16_panel(h + PANEL);
#else
        for (int r = 0; r < 2; r++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(h + r * PANEL));
            vf *w = r ? w1 : w0;
            w[0] = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
            w[1] = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32((int)0xffff0000u)));
        }
#endif
    }
}

// How far ahead the next tile's weights start, for prefetching them into L2 while this tile runs:
// each tile opens `panels` new streams, whose first misses the hardware prefetcher cannot foresee.
// 0 (no such prefetch) where a tile spans more than 128 KB: its prefetched successor would leave
// L2 (512 KB on Zen 1) before it is read, and the read bandwidth would halve.
static inline int64_t next_tile(int64_t stride, int panels) {
    return panels * stride <= (128 << 10) ? panels * stride : 0;
}

// A tile's accumulators: rows x panels x VPP vectors, zeroed, then stored to y (row stride ldy).
typedef vf Tile[TILE_ROWS][TILE_PANELS][VPP];
static inline __attribute__((always_inline)) void zero_tile(Tile acc, const int rows, const int panels) {
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < panels; j++)
            for (int i = 0; i < VPP; i++) acc[m][j][i] = vzero();
}
static inline __attribute__((always_inline)) void store_tile(Tile acc, float *y, int64_t ldy, const int rows,
                                                             const int panels) {
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < panels; j++)
            for (int i = 0; i < VPP; i++) vstore(y + m * ldy + j * PANEL + i * VW, acc[m][j][i]);
}

static inline __attribute__((always_inline)) void panel_tile(const float *x, int64_t K, const char *w, int64_t stride,
                                                             float *y, int64_t ldy, const int rows, const int panels,
                                                             const int format) {
    Tile acc;
    // Prefetch a line per 64 bytes streamed, about 1 KB ahead: every 4th pair of k in Q4_1 (16 bytes
    // a pair), every other in Q8_0, every pair in fp16/bf16, and two lines a pair in fp32. The same
    // lines of the thread's next tile (`panels` panels on) go to L2 (`next_tile`).
    const int every = format == PANEL_Q4_1 ? 4 : format == PANEL_Q8_0 ? 2 : 1;
    const int64_t ahead = next_tile(stride, panels);
    zero_tile(acc, rows, panels);
    for (int64_t b = 0; b < K / GROUP; b++) {
        vf d[TILE_PANELS][VPP], mn[TILE_PANELS][VPP];
        for (int j = 0; j < panels; j++) panel_scales(w + j * stride, b, format, d[j], mn[j]);
        for (int p = 0; p < GROUP / 2; p++) {
            const int64_t k = b * GROUP + 2 * p;
            for (int j = 0; j < panels; j++) {
                vf w0[VPP], w1[VPP];
                if (p % every == 0) {
                    const char *at = w + j * stride + pair_offset(format, b, p);
                    _mm_prefetch(at + 1024, _MM_HINT_T0);
                    if (ahead) _mm_prefetch(at + ahead, _MM_HINT_T1);
                    if (format == PANEL_F32) {
                        _mm_prefetch(at + 1024 + 64, _MM_HINT_T0);
                        if (ahead) _mm_prefetch(at + ahead + 64, _MM_HINT_T1);
                    }
                }
                panel_pair(w + j * stride, b, p, format, d[j], mn[j], w0, w1);
                for (int m = 0; m < rows; m++) {
                    const vf a0 = vset(x[m * K + k]), a1 = vset(x[m * K + k + 1]);
                    for (int i = 0; i < VPP; i++) acc[m][j][i] = vfma(a0, w0[i], acc[m][j][i]);
                    for (int i = 0; i < VPP; i++) acc[m][j][i] = vfma(a1, w1[i], acc[m][j][i]);
                }
            }
        }
    }
    store_tile(acc, y, ldy, rows, panels);
}

// Tiles keep >= 6 FMA chains in flight (FMA latency 4-5) where the registers allow: AVX2 (16
// registers) 3 panels for one row, 2 for two, 1 for 3-6; AVX-512 (32) 3 panels for 1-2 rows, 2 for 3-8.
#define PANEL_CASE(R, P) case R * 8 + P: panel_tile(x, K, w, stride, y, ldy, R, P, format); break
static inline __attribute__((always_inline)) void panel_dispatch(const float *x, int64_t K, const char *w,
                                                                 int64_t stride, float *y, int64_t ldy, int rows,
                                                                 int panels, const int format) {
    switch (rows * 8 + panels) {
        PANEL_CASE(1, 1); PANEL_CASE(1, 2); PANEL_CASE(1, 3); PANEL_CASE(2, 1); PANEL_CASE(2, 2);
#if VW == 16
        PANEL_CASE(2, 3); PANEL_CASE(3, 1); PANEL_CASE(3, 2); PANEL_CASE(4, 1); PANEL_CASE(4, 2);
        PANEL_CASE(5, 1); PANEL_CASE(5, 2); PANEL_CASE(6, 1); PANEL_CASE(6, 2); PANEL_CASE(7, 1);
        PANEL_CASE(7, 2); PANEL_CASE(8, 1); default: panel_tile(x, K, w, stride, y, ldy, 8, 2, format); break;
#else
        PANEL_CASE(3, 1); PANEL_CASE(4, 1); PANEL_CASE(5, 1); default: panel_tile(x, K, w, stride, y, ldy, 6, 1, format); break;
#endif
    }
}

// The int16-activation formats: y = sum over blocks of xs (d (q . xq) + m sum(xq)), with x = xs xq
// per row and block (quantize_row) and w = d q + m (Q4_1; m = 0 for Q8_0). Each block's q . xq is
// an exact int32 dot product (|.| < 32 * 15 * 32767 < 2^24, so its float is exact too): for one
// lane (channel) and a pair of k, VNNI's vpdpwssd does the two products and the sum in one
// instruction (vpmaddwd + vpaddd without VNNI), against 9 vector instructions per 32 weights of
// one row in the float path. Rows stay independent: a (row, channel) sum is one fp32 chain over the
// blocks, whatever the tile, the instruction set, or the other rows.
typedef struct { const int16_t *q; const float *scale, *sum; int64_t K; } Rows16;  // q [M, K]; scale, sum [M, K/32]
#if VW == 16
#define A16_TILE_ROWS 8
#else
#define A16_TILE_ROWS 3
#endif

static inline int32_t x_pair(const Rows16 *x, int64_t row, int64_t k) {  // xq[row][k], xq[row][k + 1] as one dword
    int32_t v;
    memcpy(&v, x->q + row * x->K + k, sizeof v);
    return v;
}

static inline __attribute__((always_inline)) void a16_tile(const Rows16 *x, int64_t m0, const char *w, int64_t stride,
                                                           float *y, int64_t ldy, const int rows, const int panels,
                                                           const int format) {
    const int64_t groups = x->K / GROUP, block = format == A16_Q4_1 ? Q4_1_BLOCK : Q8_0_BLOCK;
    const int64_t ahead = next_tile(stride, panels);
    Tile acc;
    zero_tile(acc, rows, panels);
    for (int64_t b = 0; b < groups; b++) {
        vi dot[A16_TILE_ROWS][TILE_PANELS][VPP];
        for (int m = 0; m < rows; m++)
            for (int j = 0; j < panels; j++)
                for (int i = 0; i < VPP; i++) dot[m][j][i] = vi_zero();
        if (format == A16_Q4_1) {
            for (int g = 0; g < 4; g++)
                for (int j = 0; j < panels; j++) {
                    const char *line = w + j * stride + b * block + 4 * PANEL + g * 64;
                    _mm_prefetch(line + 1024, _MM_HINT_T0);  // and the next tile's, as panel_tile
                    if (ahead) _mm_prefetch(line + ahead, _MM_HINT_T1);
                    for (int i = 0; i < VPP; i++) {
                        const vi packed = vi_load(line + i * VW * 4);
                        for (int s = 0; s < 4; s++) {
                            const vi pairs = vi_nibble_pairs(packed, s);
                            for (int m = 0; m < rows; m++)
                                dot[m][j][i] = vi_dot16(dot[m][j][i], pairs, x_pair(x, m0 + m, b * GROUP + 8 * g + 2 * s));
                        }
                    }
                }
        } else {
            for (int p = 0; p < GROUP / 2; p++)
                for (int j = 0; j < panels; j++) {
                    const char *pair = w + j * stride + b * block + 2 * PANEL + p * 2 * PANEL;
                    if (p % 2 == 0) {
                        _mm_prefetch(pair + 1024, _MM_HINT_T0);
                        if (ahead) _mm_prefetch(pair + ahead, _MM_HINT_T1);
                    }
                    for (int i = 0; i < VPP; i++) {
                        const vi pairs = vi_i8_pairs((const int8_t *)pair + i * 2 * VW);
                        for (int m = 0; m < rows; m++)
                            dot[m][j][i] = vi_dot16(dot[m][j][i], pairs, x_pair(x, m0 + m, b * GROUP + 2 * p));
                    }
                }
        }
        for (int j = 0; j < panels; j++) {
            const uint16_t *scales = (const uint16_t *)(w + j * stride + b * block);
            for (int i = 0; i < VPP; i++) {
                const vf d = vf16(scales + i * VW);
                const vf mn = format == A16_Q4_1 ? vf16(scales + PANEL + i * VW) : vzero();
                for (int m = 0; m < rows; m++) {
                    const int64_t at = (m0 + m) * groups + b;
                    acc[m][j][i] = vfma(vi_float(dot[m][j][i]), vmul(d, vset(x->scale[at])), acc[m][j][i]);
                    if (format == A16_Q4_1) acc[m][j][i] = vfma(vset(x->sum[at]), mn, acc[m][j][i]);
                }
            }
        }
    }
    store_tile(acc, y, ldy, rows, panels);
}

// Tiles of the int16-activation formats hold an int32 and an fp32 accumulator per (row, panel
// vector): AVX-512 4 panels for one row, 2 for 2-4 rows, 1 for 5-8; AVX2 2 panels for one row, 1 for 2-3.
#define A16_CASE(R, P) case R * 8 + P: a16_tile(x, m0, w, stride, y, ldy, R, P, format); break
static inline __attribute__((always_inline)) void a16_dispatch(const Rows16 *x, int64_t m0, const char *w,
                                                               int64_t stride, float *y, int64_t ldy, int rows,
                                                               int panels, const int format) {
    switch (rows * 8 + panels) {
        A16_CASE(1, 1); A16_CASE(1, 2); A16_CASE(2, 1); A16_CASE(3, 1);
#if VW == 16
        A16_CASE(1, 3); A16_CASE(1, 4); A16_CASE(2, 2); A16_CASE(3, 2); A16_CASE(4, 1); A16_CASE(4, 2);
        A16_CASE(5, 1); A16_CASE(6, 1); A16_CASE(7, 1); default: a16_tile(x, m0, w, stride, y, ldy, 8, 1, format); break;
#else
        default: a16_tile(x, m0, w, stride, y, ldy, 3, 1, format); break;
#endif
    }
}

static int panel_group(int64_t rows, int a16) {  // panels per tile for a tile of `rows` rows
#if VW == 16
    if (a16) return rows == 1 ? 4 : rows <= 4 ? 2 : 1;
    return rows <= 2 ? 3 : 2;
#else
    if (a16) return rows == 1 ? 2 : 1;
    return rows == 1 ? 3 : rows == 2 ? 2 : 1;
#endif
}

// linear_wide: the same products for prefills of the weights whose widening is worth amortising
// over many rows (fp16, Q4_1, Q8_0 panels; int8). Each thread converts a block of 16 channels x 256 k
// once into an fp32 [k][16] panel (the panel formats' own widening; or int8 x its group scale, then
// an 8x8 transpose), and a register block of WIDE_ROWS rows x 16 channels broadcasts x and streams
// the panel (12 accumulators, the BLIS micro-kernel shape). Measured on the default target's prefill
// (Zen 1): 1.1-1.2x faster than panel_linear in fp16, 1.4-1.5x than q8_linear in int8 (30-120 rows).
// For the panel formats each (row, channel) sum keeps panel_linear's order (the k blocks continue
// one chain), so the results are bit-identical; int8 weights meet float32 activations here (no
// int16 rounding), so those differ.
#define PANEL_K 256
#define WIDE_ROWS (12 / VPP)

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

static inline __attribute__((always_inline)) void widen_panel(const char *pw, int64_t k0, int64_t kn, float *panel,
                                                              const int format) {
    for (int64_t b = k0 / GROUP; b < (k0 + kn) / GROUP; b++) {
        vf d[VPP], mn[VPP];
        panel_scales(pw, b, format, d, mn);
        for (int p = 0; p < GROUP / 2; p++) {
            vf w0[VPP], w1[VPP];
            float *row = panel + (b * GROUP + 2 * p - k0) * PANEL;
            panel_pair(pw, b, p, format, d, mn, w0, w1);
            for (int i = 0; i < VPP; i++) {
                vstore(row + i * VW, w0[i]);
                vstore(row + PANEL + i * VW, w1[i]);
            }
        }
    }
}

// Panel of channels n0..n0+15, k0..k0+kn-1 (k0 and kn multiples of 32) as fp32 [kn][16]: the panel
// formats are widened, int8 (format 0, row-major) is scaled and transposed.
static void pack_panel(const void *w, const float *scales, int format, int64_t K, int64_t n0, int64_t k0,
                       int64_t kn, float *panel) {
    const char *pw = (const char *)w + n0 / PANEL * panel_bytes(format, K);
    switch (format) {
        case PANEL_F16: widen_panel(pw, k0, kn, panel, PANEL_F16); return;
        case PANEL_Q4_1: widen_panel(pw, k0, kn, panel, PANEL_Q4_1); return;
        case PANEL_Q8_0: widen_panel(pw, k0, kn, panel, PANEL_Q8_0); return;
        default: break;
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
    vf acc[WIDE_ROWS][VPP];
    for (int m = 0; m < rows; m++)
        for (int i = 0; i < VPP; i++) acc[m][i] = first ? vzero() : vload(y + m * N + i * VW);
    for (int64_t k = 0; k < kn; k++) {
        vf b[VPP];
        for (int i = 0; i < VPP; i++) b[i] = vload(panel + k * PANEL + i * VW);
        for (int m = 0; m < rows; m++) {
            const vf a = vset(x[m * K + k]);
            for (int i = 0; i < VPP; i++) acc[m][i] = vfma(a, b[i], acc[m][i]);
        }
    }
    for (int m = 0; m < rows; m++)
        for (int i = 0; i < VPP; i++) vstore(y + m * N + i * VW, acc[m][i]);
}

// ---- The glue between the GEMMs: each replaces several small torch ops (and their per-op cost). ----

// x += y (y may be NULL), then out = x / rms(x) * w, for M rows of H (RMSNorm, Zhang & Sennrich 2019).
void add_rms_norm(float *x, const float *y, const float *w, float eps, float *out, int64_t M, int64_t H) {
    for (int64_t m = 0; m < M; m++) {
        float *xm = x + m * H, *om = out + m * H;
        float ss = 0.0f;
        if (y) {
            const float *ym = y + m * H;
            #pragma omp simd
            for (int64_t i = 0; i < H; i++) xm[i] += ym[i];
        }
        #pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < H; i++) ss += xm[i] * xm[i];
        const float r = 1.0f / sqrtf(ss / (float)H + eps);
        #pragma omp simd
        for (int64_t i = 0; i < H; i++) om[i] = xm[i] * r * w[i];
    }
}

// exp(x) for VW floats: Cephes' expf (range reduction to [-ln2/2, ln2/2] and a degree-5
// polynomial, as in avx_mathfun), within ~2 ulp; inputs are clamped to the float range.
static inline vf vexp(vf x) {
    x = vclamp(x, -87.3f, 88.3f);
    const vf n = vround(vmul(x, vset(1.44269504088896341f)));
    x = vfma(n, vset(-0.693359375f), x);
    x = vfma(n, vset(2.12194440e-4f), x);
    vf y = vset(1.9875691500e-4f);
    y = vfma(y, x, vset(1.3981999507e-3f));
    y = vfma(y, x, vset(8.3334519073e-3f));
    y = vfma(y, x, vset(4.1665795894e-2f));
    y = vfma(y, x, vset(1.6666665459e-1f));
    y = vfma(y, x, vset(5.0000001201e-1f));
    y = vfma(y, vmul(x, x), vadd(x, vset(1.0f)));
    return vmul(y, vpow2(n));
}

// out[i] = silu(gate[i]) * up[i] for one row of the SwiGLU MLP's glue.
static void silu_row(const float *g, const float *u, float *o, int64_t F) {
    int64_t i = 0;
    for (; i + VW <= F; i += VW) {
        const vf gv = vload(g + i);
        const vf sig = vdiv(gv, vadd(vset(1.0f), vexp(vsub(vzero(), gv))));
        vstore(o + i, vmul(sig, vload(u + i)));
    }
    for (; i < F; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
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
    const vf b = vset(best);
    vf sum = vzero();
    int64_t j = 0;
    for (; j + VW <= limit; j += VW) {
        const vf x = vload(s + j);
        const vf e = vzero_where_neg_inf(vexp(vsub(x, b)), x);
        vstore(s + j, e);
        sum = vadd(sum, e);
    }
    float total = vsum(sum);
    for (; j < limit; j++) {
        s[j] = s[j] == -INFINITY ? 0.0f : expf(s[j] - best);
        total += s[j];
    }
    return total;
}

// softmax(q . k_j + mask_j) @ v over keys j < limit for one query; q and o are [VW * D] floats with
// D a compile-time constant at the call sites, so q and the output stay in registers.
static inline __attribute__((always_inline)) void attend(
    const float *q, const float *k, const float *v, const float *mask, int64_t limit, float *s, float *o, const int D) {
    vf qr[16], acc[16];
    for (int d = 0; d < D; d++) qr[d] = vload(q + VW * d);
    float best = -INFINITY;
    for (int64_t j = 0; j < limit; j++) {
        vf dot = vmul(qr[0], vload(k + j * VW * D));
        for (int d = 1; d < D; d++) dot = vfma(qr[d], vload(k + j * VW * D + VW * d), dot);
        s[j] = mask ? vsum(dot) + mask[j] : vsum(dot);
        best = s[j] > best ? s[j] : best;
    }
    const float total = softmax_numerators(s, limit, best);
    for (int d = 0; d < D; d++) acc[d] = vzero();
    for (int64_t j = 0; j < limit; j++) {
        if (s[j] == 0.0f) continue;
        const vf p = vset(s[j]);
        for (int d = 0; d < D; d++) acc[d] = vfma(p, vload(v + j * VW * D + VW * d), acc[d]);
    }
    const vf inv = vset(1.0f / total);
    for (int d = 0; d < D; d++) vstore(o + VW * d, vmul(acc[d], inv));
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

// ---- The kernels as phases of a job (work_pool.h): items any thread may compute, and publish. ----

// Where a phase's items also write their rows quantized (quantize_row) for the GEMM that reads them
// next (int8 weights and the int16-activation formats take int16 rows); q NULL: nowhere.
typedef struct { int16_t *q; float *scale, *sum; } Quantized;

typedef struct {  // y [M, N] = x [M, K] @ W[N, K]^T; an item is a run of `per` panels of 16 channels
    int format, wide, group;  // group: panels a tile spans
    int64_t M, K, N, stride, tiles;
    const float *x;  // float rows (panel formats, and every `wide` GEMM)
    Rows16 x16;      // int16 rows (int8 and the int16-activation formats)
    const void *w;
    const float *scales;
    float *y;
    // The qkv GEMM (rope not NULL): y is not written; rows go to q [M, heads hd] rotated, to the
    // caches' slots [slot, slot + M) as k rotated and v (fast_llama._Layer: q, k pairs interleaved).
    const float *rope;  // [M, hd] (hd/2 cos, sin pairs a row)
    float *q, *kc, *vc;
    int64_t cap, slot, heads, kv_heads, hd;
    // The head of a forward that runs the round's rule (target_forward): each item also keeps, per
    // row, the `topk` largest of the logits it computed (while they are in its cache) in its result,
    // committed to cand [M, items, 2 topk] (values, then ids as floats), from which the rule takes its
    // support instead of scanning every logit again (head_candidates).
    int64_t topk, per, items;
    float *cand;
} GemmPhase;

enum { ROWS_NORM, ROWS_SILU, ROWS_QUANT };
typedef struct {  // an item is a run of `per` rows
    int op;  // ROWS_NORM: x (+= y), h = rmsnorm(x) w (also to out); ROWS_SILU: h = silu(gate) up, zero-padded;
             // ROWS_QUANT: x's rows into hq only
    int64_t width, inner;  // h's row width; SILU: the MLP width (x rows are [gate | up], 2 inner)
    float *x, *h, *out;
    const float *y, *w;
    float eps;
    Quantized hq;
} RowsPhase;

typedef struct {  // softmax(q k^T + mask) v; an item is a run of `per` (head, query) pairs, head-major
    const float *q, *kc, *vc, *mask;  // q [n, heads hd]; caches [kv_heads, cap, hd]; mask [n, slot + n] or NULL
    int64_t cap, slot, n, heads, group, hd;
    float *out;  // [n, heads hd]
    Quantized oq;
} AttentionPhase;

enum { PHASE_GEMM, PHASE_ROWS, PHASE_ATTENTION };
typedef struct Phase {
    int kind;
    int64_t items, per, units;  // items of `per` units (panels, rows, (head, query) pairs) out of `units`
    union { GemmPhase gemm; RowsPhase rows; AttentionPhase attn; };
} Phase;

#include "work_pool.h"

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t up16(int64_t floats) { return (floats + 15) / 16 * 16; }  // whole 64-byte lines
static inline int64_t quantized_floats(int64_t width) { return width / 2 + 2 * (width / GROUP); }
static inline int64_t row_floats(int64_t width) { return up16(2 * width) + up16(quantized_floats(width)); }

// Quantize v [width] into the layout `row_floats` leaves after 2 width floats: int16 q, scales, sums.
static void quantize_into(const float *v, int64_t width, float *at) {
    quantize_row(v, width, (int16_t *)at, at + width / 2, at + width / 2 + width / GROUP);
}
static void publish_quantized(const Quantized *t, int64_t row, int64_t col, int64_t ld, int64_t width, const float *at) {
    memcpy(t->q + row * ld + col, at, width * sizeof(int16_t));
    memcpy(t->scale + (row * ld + col) / GROUP, at + width / 2, width / GROUP * sizeof(float));
    memcpy(t->sum + (row * ld + col) / GROUP, at + width / 2 + width / GROUP, width / GROUP * sizeof(float));
}

static int64_t phase_result_floats(const Phase *p) {
    switch (p->kind) {
        case PHASE_GEMM: return p->gemm.M * (p->per * PANEL + 2 * p->gemm.topk);
        case PHASE_ROWS: return p->per * row_floats(p->rows.width);
        default: return p->per * row_floats(p->attn.hd);
    }
}

#define WIDE_CASE(R) case R: wide_tile(xm, g->K, panel, kn, ym, ld, k0 == 0, R); break
// Channels [16 p0, 16 p1) of every row into r [M, 16 (p1 - p0)].
static void gemm_compute(const GemmPhase *g, int64_t p0, int64_t p1, float *r, Own *own) {
    const int64_t ld = (p1 - p0) * PANEL, K = g->K, groups = K / GROUP;
    if (g->wide) {
        float *panel = buffer_at_least(&own->panel, PANEL_K * PANEL);
        for (int64_t pn = p0; pn < p1; pn++)
            for (int64_t k0 = 0; k0 < K; k0 += PANEL_K) {
                const int64_t kn = min64(K - k0, PANEL_K);
                pack_panel(g->w, g->scales, g->format, K, pn * PANEL, k0, kn, panel);
                for (int64_t m0 = 0; m0 < g->M; m0 += WIDE_ROWS) {
                    const float *xm = g->x + m0 * K + k0;
                    float *ym = r + m0 * ld + (pn - p0) * PANEL;
                    switch (min64(g->M - m0, WIDE_ROWS)) {
                        WIDE_CASE(1); WIDE_CASE(2); WIDE_CASE(3); WIDE_CASE(4); WIDE_CASE(5);
#if VW == 16
                        WIDE_CASE(6); WIDE_CASE(7); WIDE_CASE(8); WIDE_CASE(9); WIDE_CASE(10); WIDE_CASE(11);
#endif
                        default: wide_tile(xm, K, panel, kn, ym, ld, k0 == 0, WIDE_ROWS); break;
                    }
                }
            }
        return;
    }
    if (g->format == 0) {  // int8 rows: one channel at a time against MAX_TILE rows
        for (int64_t n = p0 * PANEL; n < min64(p1 * PANEL, g->N); n++) {
            const int8_t *qn = (const int8_t *)g->w + n * K;
            const float *sn = g->scales + n * groups;
            for (int64_t m0 = 0; m0 < g->M; m0 += MAX_TILE) {
                const int16_t *xm = g->x16.q + m0 * K;
                const float *sm = g->x16.scale + m0 * groups;
                float *ym = r + m0 * ld + n - p0 * PANEL;
                switch (min64(g->M - m0, MAX_TILE)) {
                    case 1: channel_tile(xm, sm, K, qn, sn, groups, ym, ld, 1); break;
                    case 2: channel_tile(xm, sm, K, qn, sn, groups, ym, ld, 2); break;
                    case 3: channel_tile(xm, sm, K, qn, sn, groups, ym, ld, 3); break;
                    case 4: channel_tile(xm, sm, K, qn, sn, groups, ym, ld, 4); break;
                    case 5: channel_tile(xm, sm, K, qn, sn, groups, ym, ld, 5); break;
                    case 6: channel_tile(xm, sm, K, qn, sn, groups, ym, ld, 6); break;
                    case 7: channel_tile(xm, sm, K, qn, sn, groups, ym, ld, 7); break;
                    default: channel_tile(xm, sm, K, qn, sn, groups, ym, ld, 8); break;
                }
            }
        }
        return;
    }
    for (int64_t q0 = p0; q0 < p1; q0 += g->group) {  // tiles of `group` panels; later row tiles find them in L2
        const int np = (int)min64(g->group, p1 - q0);
        const char *wp = (const char *)g->w + q0 * g->stride;
        for (int64_t tile = 0, m0 = 0; tile < g->tiles; tile++) {
            const int rows = (int)((g->M - m0) / (g->tiles - tile));
            float *out = r + m0 * ld + (q0 - p0) * PANEL;
            const float *xm = g->x + m0 * K;
            switch (g->format) {
                case PANEL_F32: panel_dispatch(xm, K, wp, g->stride, out, ld, rows, np, PANEL_F32); break;
                case PANEL_BF16: panel_dispatch(xm, K, wp, g->stride, out, ld, rows, np, PANEL_BF16); break;
                case PANEL_Q4_1: panel_dispatch(xm, K, wp, g->stride, out, ld, rows, np, PANEL_Q4_1); break;
                case PANEL_Q8_0: panel_dispatch(xm, K, wp, g->stride, out, ld, rows, np, PANEL_Q8_0); break;
                case A16_Q4_1: a16_dispatch(&g->x16, m0, wp, g->stride, out, ld, rows, np, A16_Q4_1); break;
                case A16_Q8_0: a16_dispatch(&g->x16, m0, wp, g->stride, out, ld, rows, np, A16_Q8_0); break;
                default: panel_dispatch(xm, K, wp, g->stride, out, ld, rows, np, PANEL_F16); break;
            }
            m0 += rows;
        }
    }
}

static void top_k_row(const float *row, int64_t n, int64_t k, float *vals, int64_t *ids);
#define MAX_CANDIDATES 64  // the widest support the native rule takes (sampling._MAX_NATIVE_TOP_K)

// Where an item's candidates sit in its result: after its products [M, per panels].
static inline float *candidates_of(const GemmPhase *g, const float *r) {
    return (float *)r + g->M * g->per * PANEL;
}

// Each row's `topk` largest of channels [16 p0, 16 p1) after the item's products (r [M, 16 (p1 - p0)]),
// as top_k_row orders them, into the item's candidates: values, then ids as floats (exact below
// 2^24); a chunk narrower than topk pads with id -1.
static void head_candidates(const GemmPhase *g, int64_t p0, int64_t p1, float *r) {
    const int64_t ld = (p1 - p0) * PANEL, n = min64(p1 * PANEL, g->N) - p0 * PANEL, k = g->topk, kept = min64(k, n);
    int64_t ids[MAX_CANDIDATES];
    for (int64_t m = 0; m < g->M; m++) {
        float *vals = candidates_of(g, r) + m * 2 * k, *at = vals + k;
        top_k_row(r + m * ld, n, kept, vals, ids);
        for (int64_t j = 0; j < k; j++) {
            if (j >= kept) vals[j] = -INFINITY;
            at[j] = j < kept ? (float)(ids[j] + p0 * PANEL) : -1.0f;
        }
    }
}

static void gemm_run(const GemmPhase *g, int64_t p0, int64_t p1, float *r, Own *own) {
    gemm_compute(g, p0, p1, r, own);
    if (g->topk) head_candidates(g, p0, p1, r);
}

static void gemm_commit(const GemmPhase *g, int64_t p0, int64_t p1, const float *r) {
    const int64_t ld = (p1 - p0) * PANEL, c0 = p0 * PANEL, c1 = min64(p1 * PANEL, g->N);
    const int64_t hd = g->hd, A = g->heads * hd, KV = g->kv_heads * hd;
    if (g->topk)
        for (int64_t m = 0; m < g->M; m++)
            memcpy(g->cand + (m * g->items + p0 / g->per) * 2 * g->topk, candidates_of(g, r) + m * 2 * g->topk,
                   2 * g->topk * sizeof(float));
    for (int64_t m = 0; m < g->M; m++) {
        const float *rm = r + m * ld;
        if (g->rope == NULL) {
            memcpy(g->y + m * g->N + c0, rm, (c1 - c0) * sizeof(float));
            continue;
        }
        for (int64_t c = c0; c < c1;) {  // runs within one head: q, then k, then v heads
            const int64_t d = c % hd, run = min64(c1 - c, hd - d);
            const float *src = rm + c - c0, *rope = g->rope + m * hd + d;
            if (c < A) rotate(src, rope, g->q + m * A + c, run);
            else if (c < A + KV) rotate(src, rope, g->kc + (((c - A) / hd) * g->cap + g->slot + m) * hd + d, run);
            else memcpy(g->vc + (((c - A - KV) / hd) * g->cap + g->slot + m) * hd + d, src, run * sizeof(float));
            c += run;
        }
    }
}

static void rows_run(const RowsPhase *p, int64_t i0, int64_t i1, float *r) {
    const int64_t W = p->width, at = up16(2 * W);
    for (int64_t i = i0; i < i1; i++, r += row_floats(W)) {
        float *h = r + W;
        if (p->op == ROWS_QUANT) {
            quantize_into(p->x + i * W, W, r + at);
            continue;
        }
        if (p->op == ROWS_NORM) {
            memcpy(r, p->x + i * W, W * sizeof(float));
            add_rms_norm(r, p->y ? p->y + i * W : NULL, p->w, p->eps, h, 1, W);
        } else {
            const float *gate = p->x + i * 2 * p->inner;
            silu_row(gate, gate + p->inner, h, p->inner);
            memset(h + p->inner, 0, (W - p->inner) * sizeof(float));
        }
        if (p->hq.q) quantize_into(h, W, r + at);
    }
}

static void rows_commit(const RowsPhase *p, int64_t i0, int64_t i1, const float *r) {
    const int64_t W = p->width, at = up16(2 * W);
    for (int64_t i = i0; i < i1; i++, r += row_floats(W)) {
        if (p->op == ROWS_NORM && p->y) memcpy(p->x + i * W, r, W * sizeof(float));
        if (p->h) memcpy(p->h + i * W, r + W, W * sizeof(float));
        if (p->out) memcpy(p->out + i * W, r + W, W * sizeof(float));
        if (p->hq.q) publish_quantized(&p->hq, i, 0, W, W, r + at);
    }
}

static void attention_run(const AttentionPhase *a, int64_t u0, int64_t u1, float *r, Own *own) {
    const int64_t hd = a->hd, A = a->heads * hd, keys = a->slot + a->n, at = up16(2 * hd);
    float *s = buffer_at_least(&own->scores, keys);
    for (int64_t u = u0; u < u1; u++, r += row_floats(hd)) {
        const int64_t h = u / a->n, i = u % a->n;
        const float *k = a->kc + (h / a->group) * a->cap * hd, *v = a->vc + (h / a->group) * a->cap * hd;
        const float *q = a->q + i * A + h * hd, *mi = a->mask ? a->mask + i * keys : NULL;
        const int64_t limit = a->mask ? keys : a->slot + i + 1;
        if (hd == 64) attend(q, k, v, mi, limit, s, r, 64 / VW);
        else if (hd == 128) attend(q, k, v, mi, limit, s, r, 128 / VW);
        else attend_any(q, k, v, mi, limit, hd, s, r);
        if (a->oq.q) quantize_into(r, hd, r + at);
    }
}

static void attention_commit(const AttentionPhase *a, int64_t u0, int64_t u1, const float *r) {
    const int64_t hd = a->hd, A = a->heads * hd;
    for (int64_t u = u0; u < u1; u++, r += row_floats(hd)) {
        const int64_t h = u / a->n, i = u % a->n;
        memcpy(a->out + i * A + h * hd, r, hd * sizeof(float));
        if (a->oq.q) publish_quantized(&a->oq, i, h * hd, A, hd, r + up16(2 * hd));
    }
}

static void phase_run(const Phase *p, int64_t item, float *result, Own *own) {
    const int64_t u0 = item * p->per, u1 = min64(u0 + p->per, p->units);
    switch (p->kind) {
        case PHASE_GEMM: gemm_run(&p->gemm, u0, u1, result, own); break;
        case PHASE_ROWS: rows_run(&p->rows, u0, u1, result); break;
        default: attention_run(&p->attn, u0, u1, result, own); break;
    }
}

static void phase_commit(const Phase *p, int64_t item, const float *result) {
    const int64_t u0 = item * p->per, u1 = min64(u0 + p->per, p->units);
    switch (p->kind) {
        case PHASE_GEMM: gemm_commit(&p->gemm, u0, u1, result); break;
        case PHASE_ROWS: rows_commit(&p->rows, u0, u1, result); break;
        default: attention_commit(&p->attn, u0, u1, result); break;
    }
}

// A new phase of `units` units (each `unit_floats` floats of result) in ITEMS_PER_THREAD items for
// each of the job's threads (one for one thread), each a multiple of `multiple` units. Few and
// large: every item costs a few atomic operations on cache lines the threads share (~0.1 us each),
// and with one item per panel pair (6,750 items a forward of the default target) those took 2-3 ms
// of a 5 ms forward. But no larger than ITEM_FLOATS of result where POOL_ITEMS allow: an item's
// result is held twice (its thread's buffer, then the output), so a head over a long prompt's
// every row would otherwise hold a second copy of all its logits.
#define ITEM_FLOATS (1 << 20)
static Phase *new_phase(Job *j, int64_t *n, int kind, int64_t units, int64_t multiple, int64_t unit_floats) {
    Phase *p = &j->phases[(*n)++];
    memset(p, 0, sizeof *p);
    const int64_t wanted = j->threads > 1 ? ITEMS_PER_THREAD * j->threads : 1;
    const int64_t fits = ITEM_FLOATS / unit_floats > 1 ? ITEM_FLOATS / unit_floats : 1;
    const int64_t fewest = (units + POOL_ITEMS - 1) / POOL_ITEMS;  // per item, for at most POOL_ITEMS
    int64_t per = (units + wanted - 1) / wanted;
    if (per > fits) per = fits > fewest ? fits : fewest;
    p->kind = kind;
    p->per = (per + multiple - 1) / multiple * multiple;
    p->units = units;
    p->items = (units + p->per - 1) / p->per;
    return p;
}

// One GEMM's weights: format 0 is int8 (Q8_0 rows, w int8 [N, K] with scales s [N, K/32]); the
// others are panels as panel_linear (s unused). Each GEMM has its own format (a GGUF-backed model
// keeps every tensor in the encoding it was stored in).
typedef struct {
    const void *w;
    const float *s;
    int64_t format;
} Linear;

// linear_wide's formats: the weights whose widening is worth amortising over a prefill's rows.
static int takes_wide(int format, int64_t N) {
    return N % PANEL == 0 && (format == 0 || format == PANEL_F16 || format == PANEL_Q4_1 || format == PANEL_Q8_0);
}
// Whether a GEMM reads its rows as int16 (quantize_row) rather than float.
static int takes_rows16(const Linear *lin, int64_t N, int wide) {
    const int format = (int)lin->format;
    return format == A16_Q4_1 || format == A16_Q8_0 || (format == 0 && !(wide && takes_wide(format, N)));
}

static GemmPhase *add_gemm(Job *j, int64_t *n, const Linear *lin, int64_t M, int64_t K, int64_t N, const float *x,
                           Rows16 x16, float *y, int wide) {
    const int format = (int)lin->format, a16 = format == A16_Q4_1 || format == A16_Q8_0;
    wide = wide && takes_wide(format, N);
    const int64_t tiles = (M + (a16 ? A16_TILE_ROWS : TILE_ROWS) - 1) / (a16 ? A16_TILE_ROWS : TILE_ROWS);
    const int group = panel_group((M + tiles - 1) / tiles, a16);  // for every tile: the largest has these rows
    Phase *p = new_phase(j, n, PHASE_GEMM, (N + PANEL - 1) / PANEL, wide || format == 0 ? 1 : group, M * PANEL);
    p->gemm = (GemmPhase){.format = format, .wide = wide, .group = group, .M = M, .K = K, .N = N,
                          .stride = format == 0 ? 0 : panel_bytes(format, K), .tiles = tiles, .x = x, .x16 = x16,
                          .w = lin->w, .scales = lin->s, .y = y};
    return &p->gemm;
}

// Room in an arena for `rows` int16 rows of `width` (quantize_row's q, scales and sums).
static Rows16 rows16_in(float **at, int64_t rows, int64_t width) {
    int16_t *q = (int16_t *)*at;
    float *scale = *at + up16(rows * width / 2), *sum = scale + up16(rows * width / GROUP);
    *at = sum + up16(rows * width / GROUP);
    return (Rows16){q, scale, sum, width};
}
static inline int64_t rows16_floats(int64_t rows, int64_t width) {
    return up16(rows * width / 2) + 2 * up16(rows * width / GROUP);
}
static inline Quantized quantized(Rows16 r) { return (Quantized){(int16_t *)r.q, (float *)r.scale, (float *)r.sum}; }
// Row `row` of r, quantized from v [r.K].
static void quantize_into_row(const float *v, Rows16 r, int64_t row) {
    quantize_row(v, r.K, (int16_t *)r.q + row * r.K, (float *)r.scale + row * (r.K / GROUP),
                 (float *)r.sum + row * (r.K / GROUP));
}

// y [M, N] = x [M, K] @ W^T as a job of one GEMM (drained: x, W and y belong to the caller).
static void linear_job(const float *x, int64_t M, int64_t K, const Linear *lin, int64_t N, float *y, int wide) {
    Job job = job_begin();
    int64_t n = 0;
    Rows16 x16 = {0};
    if (takes_rows16(lin, N, wide)) {  // quantized by the caller (a few microseconds)
        float *at = job_arena(&job, rows16_floats(M, K));
        x16 = rows16_in(&at, M, K);
        for (int64_t m = 0; m < M; m++) quantize_into_row(x + m * K, x16, m);
    }
    add_gemm(&job, &n, lin, M, K, N, x, x16, y, wide);
    job_run(&job, n);
    job_end(&job, 1);
}

// x [M, K] float32, q [N, K] int8, scales [N, K/32] float32, y [M, N] float32; K % 32 == 0.
void q8_linear(const float *x, int64_t M, int64_t K, const int8_t *q, const float *scales, int64_t N, float *y) {
    const Linear lin = {q, scales, 0};
    linear_job(x, M, K, &lin, N, y, 0);
}

// x [M, K] float32, w: ceil(N/16) panels in `format`, y [M, N]. The threads take runs of a tile's
// panels as they come (the rows are split evenly into tiles, 9 -> 5 + 4); the int16-activation
// formats quantize the rows first.
void panel_linear(const float *x, int64_t M, int64_t K, const void *w, int64_t N, float *y, int format) {
    const Linear lin = {w, NULL, format};
    linear_job(x, M, K, &lin, N, y, 0);
}

// x [M, K] float32, w (format 0: int8 [N, K] with scales [N, K/32]; else panels as panel_linear),
// y [M, N]; K % 32 == 0. fp32 and bf16 panels need no conversion worth amortising, so they stay on
// panel_linear (measured on Zen 1: 0.83-0.94x and 0.95-1.03x its speed at 30-120 rows), as do the
// int16-activation formats (their integer products are their rounding: a float GEMM would differ)
// and an N that is not a multiple of the panel width.
void linear_wide(const float *x, int64_t M, int64_t K, const void *w, const float *scales, int format, int64_t N,
                 float *y) {
    const Linear lin = {w, scales, format};
    linear_job(x, M, K, &lin, N, y, 1);
}

// out[m, i] = silu(gate[m, i]) * up[m, i], with gate_up[m] = [gate | up] (the SwiGLU MLP's glue).
void silu_mul(const float *gate_up, float *out, int64_t M, int64_t F) {
    Job job = job_begin();
    int64_t n = 0;
    Phase *p = new_phase(&job, &n, PHASE_ROWS, M, 1, row_floats(F));
    p->rows = (RowsPhase){.op = ROWS_SILU, .width = F, .inner = F, .x = (float *)gate_up, .h = out};
    job_run(&job, n);
    job_end(&job, 1);
}

// An attention phase over n queries: the heads' (head, run of queries) items.
static AttentionPhase *add_attention(Job *j, int64_t *np, const float *q, const float *kc, const float *vc,
                                     int64_t cap, int64_t slot, const float *mask, int64_t n, int64_t heads,
                                     int64_t kv_heads, int64_t hd, float *out) {
    Phase *p = new_phase(j, np, PHASE_ATTENTION, heads * n, 1, row_floats(hd));
    p->attn = (AttentionPhase){.q = q, .kc = kc, .vc = vc, .mask = mask, .cap = cap, .slot = slot, .n = n,
                               .heads = heads, .group = heads / kv_heads, .hd = hd, .out = out};
    return &p->attn;
}

// Grouped-query attention for n new tokens whose K/V go to cache slots [slot, slot + n).
// qkv [n, (heads + 2 kv_heads) * hd], q/k pairs interleaved and q pre-scaled (fast_llama._Layer);
// rope [n, hd/2, 2]; caches [kv_heads, cap, hd]; mask [n, slot + n] additive, or NULL for causal
// (query i sees keys 0..slot+i); out [n, heads * hd]. The caller rotates q and k and fills the
// caches; the (head, query) pairs are the items: even one query at a 20-token context runs faster
// on two threads than one (measured 0.24 vs 0.30 ms over the default target's 30 layers).
void attention(const float *qkv, int64_t n, const float *rope, float *kc, float *vc, int64_t cap,
               int64_t slot, const float *mask, int64_t heads, int64_t kv_heads, int64_t hd, float *out) {
    const int64_t row = (heads + 2 * kv_heads) * hd, A = heads * hd;
    Job job = job_begin();
    float *q = job_arena(&job, n * A);
    for (int64_t i = 0; i < n; i++) {
        const float *qi = qkv + i * row, *ri = rope + i * hd;
        for (int64_t h = 0; h < heads; h++) rotate(qi + h * hd, ri, q + i * A + h * hd, hd);
        for (int64_t h = 0; h < kv_heads; h++) {
            rotate(qi + (heads + h) * hd, ri, kc + (h * cap + slot + i) * hd, hd);
            memcpy(vc + (h * cap + slot + i) * hd, qi + (heads + kv_heads + h) * hd, hd * sizeof(float));
        }
    }
    int64_t np = 0;
    add_attention(&job, &np, q, kc, vc, cap, slot, mask, n, heads, kv_heads, hd, out);
    job_run(&job, np);
    job_end(&job, 1);
}

// ---- The whole decoder stack in one call: no Python (or ctypes, or thread wake-up) between ops. ----

// Per-layer GEMMs and norm weights as arrays indexed by layer. down's K is the MLP width padded to
// a multiple of 32 (zero columns).
typedef struct {
    const Linear *qkv, *o, *gate_up, *down;
    const float *const *input_norm, *const *post_norm;
    const float *final_norm;
    int64_t layers, hidden, mlp, mlp_padded, heads, kv_heads, head_dim;
    float eps;
} Decoder;

// A decoder's activations for n rows in a job's arena: the residual stream x; the normed rows h,
// rotated queries q, attention output attn, the MLP's gate_up and act (each read by a GEMM, so with
// its int16 rows); tmp (the o and down GEMMs' output); the rows' rope and mask, copied in: a late
// helper may still read them after the caller has freed its own.
typedef struct {
    float *x, *h, *q, *attn, *tmp, *gate_up, *act, *rope, *mask;
    Rows16 h16, attn16, act16;
} Activations;

// The activations of `d` for n rows against `keys` keys (`masked`: with a mask), and `extra` more
// floats for the caller at *extra.
static Activations activations(Job *j, const Decoder *d, int64_t n, int64_t keys, int masked, int64_t extra_floats,
                               float **extra) {
    const int64_t H = d->hidden, A = d->heads * d->head_dim, F = d->mlp, Fp = d->mlp_padded, hd = d->head_dim;
    float *at = job_arena(j, 3 * up16(n * H) + 2 * up16(n * A) + up16(n * 2 * F) + up16(n * Fp) + rows16_floats(n, H) +
                                 rows16_floats(n, A) + rows16_floats(n, Fp) + up16(n * hd) +
                                 (masked ? up16(n * keys) : 0) + extra_floats);
    Activations a;
    float **plain[] = {&a.x, &a.h, &a.tmp, &a.q, &a.attn, &a.gate_up, &a.act, &a.rope, &a.mask};
    const int64_t sizes[] = {n * H, n * H, n * H, n * A, n * A, n * 2 * F, n * Fp, n * hd, masked ? n * keys : 0};
    for (int i = 0; i < 9; i++) {
        *plain[i] = at;
        at += up16(sizes[i]);
    }
    if (!masked) a.mask = NULL;
    a.h16 = rows16_in(&at, n, H);
    a.attn16 = rows16_in(&at, n, A);
    a.act16 = rows16_in(&at, n, Fp);
    *extra = at;
    return a;
}

static Rows16 rows16_from(Rows16 r, int64_t row) {  // the int16 rows from `row` on
    return (Rows16){r.q + row * r.K, r.scale + row * (r.K / GROUP), r.sum + row * (r.K / GROUP), r.K};
}

static Phase *add_norm(Job *j, int64_t *np, const Activations *a, int64_t n, int64_t H, const float *y,
                       const float *w, float eps, float *out, int quantize) {
    Phase *p = new_phase(j, np, PHASE_ROWS, n, 1, row_floats(H));
    p->rows = (RowsPhase){.op = ROWS_NORM, .width = H, .x = a->x, .y = y, .w = w, .eps = eps, .h = a->h, .out = out,
                          .hq = quantize ? quantized(a->h16) : (Quantized){0}};
    return p;
}

// The layer stack on a->x [n, hidden] at cache slots [slot, slot + n), as phases of `j`: the
// final-norm hidden states into a->h (and into out unless NULL), with their int16 rows if `head`
// reads them so. Caches [layers, kv_heads, cap, head_dim]. wide: a prefill whose GEMMs may take
// linear_wide's (the caller decides, cpu_kernels.py). Per layer 8 phases: qkv (rotated into q and
// the caches as it is published), attention, o, add + norm, gate_up, SiLU, down, add + norm.
static void add_decoder(Job *j, int64_t *np, const Decoder *d, const Activations *a, int64_t n, float *k_cache,
                        float *v_cache, int64_t cap, int64_t slot, int wide, float *out, const Linear *head) {
    const int64_t H = d->hidden, hd = d->head_dim, A = d->heads * hd, QKV = (d->heads + 2 * d->kv_heads) * hd;
    const int64_t F = d->mlp, Fp = d->mlp_padded, layer_stride = d->kv_heads * cap * hd;
    add_norm(j, np, a, n, H, NULL, d->input_norm[0], d->eps, NULL, takes_rows16(&d->qkv[0], QKV, wide));
    for (int64_t l = 0; l < d->layers; l++) {
        float *kc = k_cache + l * layer_stride, *vc = v_cache + l * layer_stride;
        GemmPhase *g = add_gemm(j, np, &d->qkv[l], n, H, QKV, a->h, a->h16, NULL, wide);
        g->rope = a->rope, g->q = a->q, g->kc = kc, g->vc = vc, g->cap = cap, g->slot = slot;
        g->heads = d->heads, g->kv_heads = d->kv_heads, g->hd = hd;
        AttentionPhase *at = add_attention(j, np, a->q, kc, vc, cap, slot, a->mask, n, d->heads, d->kv_heads, hd, a->attn);
        if (takes_rows16(&d->o[l], H, wide) && hd % GROUP == 0) {
            at->oq = quantized(a->attn16);  // each head's slice is whole groups of 32
        } else if (takes_rows16(&d->o[l], H, wide)) {
            Phase *p = new_phase(j, np, PHASE_ROWS, n, 1, row_floats(A));
            p->rows = (RowsPhase){.op = ROWS_QUANT, .width = A, .x = a->attn, .hq = quantized(a->attn16)};
        }
        add_gemm(j, np, &d->o[l], n, A, H, a->attn, a->attn16, a->tmp, wide);
        add_norm(j, np, a, n, H, a->tmp, d->post_norm[l], d->eps, NULL, takes_rows16(&d->gate_up[l], 2 * F, wide));
        add_gemm(j, np, &d->gate_up[l], n, H, 2 * F, a->h, a->h16, a->gate_up, wide);
        Phase *p = new_phase(j, np, PHASE_ROWS, n, 1, row_floats(Fp));  // rows of act keep their zero padding
        p->rows = (RowsPhase){.op = ROWS_SILU, .width = Fp, .inner = F, .x = a->gate_up, .h = a->act,
                              .hq = takes_rows16(&d->down[l], H, wide) ? quantized(a->act16) : (Quantized){0}};
        add_gemm(j, np, &d->down[l], n, Fp, H, a->act, a->act16, a->tmp, wide);
        const int last = l + 1 == d->layers;
        add_norm(j, np, a, n, H, a->tmp, last ? d->final_norm : d->input_norm[l + 1], d->eps, last ? out : NULL,
                 last ? head != NULL && takes_rows16(head, 0, 0) : takes_rows16(&d->qkv[l + 1], QKV, wide));
    }
}

// x [n, hidden]: input vectors (the residual stream; not written); out [n, hidden]: final-norm
// hidden states. Caches [layers, kv_heads, cap, head_dim]; rope, slot and mask as in attention().
void decoder_forward(const Decoder *d, const float *x, int64_t n, float *k_cache, float *v_cache, int64_t cap,
                     const float *rope, int64_t slot, const float *mask, int wide, float *out) {
    Job job = job_begin();
    float *extra;
    const Activations a = activations(&job, d, n, slot + n, mask != NULL, 0, &extra);
    memcpy(a.x, x, n * d->hidden * sizeof(float));
    memcpy(a.rope, rope, n * d->head_dim * sizeof(float));
    if (mask) memcpy(a.mask, mask, n * (slot + n) * sizeof(float));
    int64_t np = 0;
    add_decoder(&job, &np, d, &a, n, k_cache, v_cache, cap, slot, wide, out, NULL);
    job_run(&job, np);
    job_end(&job, 0);
}

/* ---- sampling kernels ---- */
// The per-round work between the model forwards (engine.sampling, engine.acceptance): the
// temperature -> top-k -> top-p transform of a few logit rows, and the acceptance rules on the
// target's kept support. Scalar C on a few dozen values per row: what costs here was the ~100
// small torch ops per round, not arithmetic. The formulas and their float32 / float64 precision
// follow the torch reference (sampling.sparse_probs, acceptance.verify) step by step, and
// contraction into FMAs is off so that each product and difference rounds as it does there.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

// The k largest of row[0..n) into vals/ids, largest first; equal values keep the lower id first.
// Once k are held, a block of 64 logits is skipped with one vector compare unless some logit in
// it beats the k-th value, which after the first few blocks is rare.
static void top_k_row(const float *row, int64_t n, int64_t k, float *vals, int64_t *ids) {
    int64_t m = 0;  // entries held
    float floor = -INFINITY;  // the k-th value once k are held
    for (int64_t base = 0; base < n; base += 64) {
        const int64_t end = base + 64 < n ? base + 64 : n;
        if (m == k && end - base == 64) {
            const __m256 f = _mm256_set1_ps(floor);
            __m256 above = _mm256_cmp_ps(_mm256_loadu_ps(row + base), f, _CMP_GT_OQ);
            for (int64_t j = 8; j < 64; j += 8)
                above = _mm256_or_ps(above, _mm256_cmp_ps(_mm256_loadu_ps(row + base + j), f, _CMP_GT_OQ));
            if (!_mm256_movemask_ps(above)) continue;
        }
        for (int64_t j = base; j < end; j++) {
            const float x = row[j];
            if (m == k && !(x > floor)) continue;
            int64_t at = m < k ? m++ : k - 1;  // the slot x enters from (the last one when full)
            while (at > 0 && x > vals[at - 1]) {
                vals[at] = vals[at - 1]; ids[at] = ids[at - 1]; at--;
            }
            vals[at] = x; ids[at] = j;
            if (m == k) floor = vals[k - 1];
        }
    }
}

// sparse_probs for bounded top-k: rows of logits [rows, vocab] -> ids, probs [rows, k], sorted by
// probability (largest first). softmax(values / temperature) over the k kept logits, then the
// top-p cut (keep the smallest prefix whose mass reaches top_p; cumulative sums in float64 as
// torch.cumsum accumulates) and renormalisation; greedy is k = 1 (probability exactly 1).
static void support_probs(float *p, int64_t k, float temperature, float top_p);

void sample_support(const float *logits, int64_t rows, int64_t vocab, int64_t k, float temperature, float top_p,
                    int64_t *ids, float *probs) {
    for (int64_t r = 0; r < rows; r++) {
        top_k_row(logits + r * vocab, vocab, k, probs + r * k, ids + r * k);
        support_probs(probs + r * k, k, temperature, top_p);
    }
}

// The k of a row's candidates [items, 2 topk] (head_candidates: each item's topk values, then their
// ids) that top_k_row would keep from the whole row: the first k by value, then by lower id. Every
// one of those is among its own item's first topk >= k, so the selection is the same, bit for bit.
static inline int ranks_ahead(float x, int64_t id, float y, int64_t other) { return x > y || (x == y && id < other); }

static void top_k_candidates(const float *cand, int64_t items, int64_t topk, int64_t k, float *vals, int64_t *ids) {
    int64_t m = 0;
    for (int64_t i = 0; i < items; i++)
        for (int64_t j = 0; j < topk; j++) {
            const float x = cand[i * 2 * topk + j];
            const int64_t id = (int64_t)cand[i * 2 * topk + topk + j];
            if (id < 0 || (m == k && !ranks_ahead(x, id, vals[k - 1], ids[k - 1]))) continue;
            int64_t at = m < k ? m++ : k - 1;
            while (at > 0 && ranks_ahead(x, id, vals[at - 1], ids[at - 1])) {
                vals[at] = vals[at - 1]; ids[at] = ids[at - 1]; at--;
            }
            vals[at] = x; ids[at] = id;
        }
}

// softmax(values / temperature) over a row's k kept logits p[0..k) (largest first), in place, then
// the top-p cut and renormalisation (sample_support's second half).
static void support_probs(float *p, int64_t k, float temperature, float top_p) {
    const float top = p[0] / temperature;
    float total = 0.0f;
    for (int64_t j = 0; j < k; j++) { p[j] = expf(p[j] / temperature - top); total += p[j]; }
    for (int64_t j = 0; j < k; j++) p[j] = p[j] / total;
    if (top_p < 1.0f) {
        double cumulative = 0.0;
        float kept = 0.0f;
        for (int64_t j = 0; j < k; j++) {
            cumulative += p[j];
            const float before = (float)cumulative - p[j];
            if (before >= top_p) p[j] = 0.0f;
            kept += p[j];
        }
        for (int64_t j = 0; j < k; j++) p[j] = p[j] / kept;
    }
}

// Inverse-CDF draw (sampling.sample_from) over weights w[0..n) listed in ascending token id:
// the first index whose float64 cumulative sum exceeds u * total (zero weights never win).
static int64_t draw_index(const float *w, int64_t n, float u) {
    double total = 0.0;
    for (int64_t j = 0; j < n; j++) total += w[j];
    double uu = u < 0.0f ? 0.0 : (double)u;
    if (uu > 1.0 - 1e-12) uu = 1.0 - 1e-12;
    const double target = uu * total;
    double cumulative = 0.0;
    int64_t last = 0;
    for (int64_t j = 0; j < n; j++) {
        if (w[j] > 0.0f) last = j;
        cumulative += w[j];
        if (cumulative > target) return j;
    }
    return last;
}

// A support row's entries reordered by ascending token id (the order every draw runs in).
static void by_id(const int64_t *ids, const float *probs, int64_t w, int64_t *out_ids, float *out_probs) {
    for (int64_t j = 0; j < w; j++) {
        int64_t at = j;
        while (at > 0 && out_ids[at - 1] > ids[j]) {
            out_ids[at] = out_ids[at - 1]; out_probs[at] = out_probs[at - 1]; at--;
        }
        out_ids[at] = ids[j]; out_probs[at] = probs[j];
    }
}

// One sparse row (ids, probs: any order, w entries) drawn with u, in token-id order -> token id.
int64_t draw_support(const int64_t *ids, const float *probs, int64_t w, float u) {
    int64_t *sorted_ids = malloc(w * sizeof(int64_t));
    float *sorted_probs = malloc(w * sizeof(float));
    by_id(ids, probs, w, sorted_ids, sorted_probs);
    const int64_t token = sorted_ids[draw_index(sorted_probs, w, u)];
    free(sorted_ids); free(sorted_probs);
    return token;
}

static float lookup(const int64_t *ids, const float *probs, int64_t w, int64_t token) {
    for (int64_t j = 0; j < w; j++) if (ids[j] == token) return probs[j];
    return 0.0f;
}

static float kl_term(float a, float b) {  // acceptance.binary_kl's term
    return a > 0.0f ? a * (logf(a > 1e-30f ? a : 1e-30f) - logf(b > 1e-30f ? b : 1e-30f)) : 0.0f;
}

// D_i(token): from dense rows (ids NULL: probs [k, vocab]) or sparse ones (ids, probs [k, w]).
typedef struct { const int64_t *ids; const float *probs; int64_t w; } DraftRows;

static float draft_at(const DraftRows *d, int64_t i, int64_t token) {
    if (d->ids == NULL) return d->probs[i * d->w + token];
    return lookup(d->ids + i * d->w, d->probs + i * d->w, d->w, token);
}

// acceptance.verify for one sequence on the target's sparse rows (method 0 sps, 1 tas, 2 cactus).
// t_ids, t_probs [k+1, w]: T_1..T_{k+1} (sample_support's layout; zeros allowed); the draft's D_i
// as dense rows [k, vocab] (d_ids NULL, d_w = vocab) or sparse ones [k, d_w]; tokens, u_accept [k];
// u_sample [1]. Outputs: stats [7, k+2], rows T_i(x_i), D_i(x_i), gamma, P(accept), Cactus's KL(h_i||T_i) (the
// first k entries of each), H(T_i) (k+1 entries), then T and D (0 for a bonus) of the next token
// at its position; accepted [k] (the test at every position, before the first-rejection cut);
// out [2] = (accepted count, next token).
static void verify_support(int method, int64_t k, int64_t w, const int64_t *t_ids, const float *t_probs,
                           const int64_t *d_ids, const float *d_probs, int64_t d_w, const int64_t *tokens,
                           const float *u_accept, const float *u_sample, float delta, float posterior_threshold,
                           float posterior_alpha, float *stats, uint8_t *accepted, int64_t *out) {
    const DraftRows draft = {d_ids, d_probs, d_w};
    const int64_t r = k + 2;  // row length: room for the two emitted values when k = 0
    float *t_x = stats, *d_x = stats + r, *gamma = stats + 2 * r, *accept = stats + 3 * r, *kl = stats + 4 * r;
    float *entropy = stats + 5 * r, *emitted = stats + 6 * r;
    const float two_delta = (float)(2.0 * (double)delta);
    for (int64_t i = 0; i <= k; i++) {
        float h = 0.0f;
        for (int64_t j = 0; j < w; j++) {
            const float p = t_probs[i * w + j];
            h += p > 0.0f ? -(p * logf(p)) : 0.0f;
        }
        entropy[i] = h;
    }
    int64_t num_accepted = 0;
    int cut = 0;
    for (int64_t i = 0; i < k; i++) {
        const int64_t x = tokens[i];
        const float q = lookup(t_ids + i * w, t_probs + i * w, w, x);
        t_x[i] = q;
        d_x[i] = draft_at(&draft, i, x);
        int ok;
        if (method == 1) {
            float medusa = 0.0f;  // Medusa's entropy, negated: sum T log(T + 1e-5)
            for (int64_t j = 0; j < w; j++) {
                const float p = t_probs[i * w + j];
                medusa += p * logf(p + 1e-5f);
            }
            const float relative = posterior_alpha * expf(medusa);
            const float threshold = posterior_threshold < relative ? posterior_threshold : relative;
            ok = q > threshold;
            gamma[i] = accept[i] = (float)ok;
            kl[i] = 0.0f;  // TAS enforces no divergence constraint
        } else {
            float g = q;
            if (method == 2) {
                g = q + sqrtf(two_delta * q * (1.0f - q));
                g = g < 0.0f ? 0.0f : (g > 1.0f ? 1.0f : g);
            }
            gamma[i] = g;
            const float ratio = g / (d_x[i] > 1e-30f ? d_x[i] : 1e-30f);
            accept[i] = ratio < 1.0f ? ratio : 1.0f;
            ok = u_accept[i] < accept[i];
            kl[i] = method == 2 ? kl_term(g, q) + kl_term(1.0f - g, 1.0f - q) : 0.0f;
        }
        accepted[i] = (uint8_t)ok;
        if (!cut && ok) num_accepted++;
        else cut = 1;
    }
    const int64_t stop = num_accepted;
    const int64_t *ids = t_ids + stop * w;
    const float *row = t_probs + stop * w;
    int64_t next;
    if (stop < k && method == 1) {
        next = ids[0];  // argmax T (ties: the lower id, as sample_support orders them)
    } else {
        int64_t *sorted_ids = malloc(w * sizeof(int64_t));
        float *sorted_probs = malloc(w * sizeof(float)), *residual = malloc(w * sizeof(float));
        by_id(ids, row, w, sorted_ids, sorted_probs);
        float mass = 0.0f;
        for (int64_t j = 0; j < w; j++) {
            float h = sorted_probs[j];
            if (stop < k) {  // recovery: norm(max(h - D, 0)), h = T except for Cactus
                if (method == 2) {
                    const float q = t_x[stop], g = gamma[stop];
                    float scale = (1.0f - g) / (1.0f - q);
                    if (isnan(scale) || isinf(scale)) scale = 1.0f;
                    h = sorted_ids[j] == tokens[stop] ? g : h * scale;
                }
                sorted_probs[j] = h;
                const float d = draft_at(&draft, stop, sorted_ids[j]);
                residual[j] = h - d > 0.0f ? h - d : 0.0f;
            } else {  // bonus: T_{k+1} itself
                residual[j] = h;
            }
            mass += residual[j];
        }
        // A rejection with zero residual mass can only come from rounding (h == D); draw from h.
        next = sorted_ids[draw_index(mass > 0.0f ? residual : sorted_probs, w, u_sample[0])];
        free(sorted_ids); free(sorted_probs); free(residual);
    }
    out[0] = num_accepted;
    out[1] = next;
    emitted[0] = lookup(ids, row, w, next);
    emitted[1] = stop < k ? draft_at(&draft, stop, next) : 0.0f;
}
// One round's rule straight from the target's logits [k+1, vocab]: sample_support's rows (kept in
// t_ids, t_probs [k+1, w] for the token inspector), then verify_support on them. Everything the
// caller reads lands in one float64 block [8, k+2] (one conversion to Python values): the seven
// rows of verify_support's stats, then (accepted count, next token, the k per-position tests).
// The arguments come as one struct (engine.acceptance.NativeRule fills it), so that target_forward
// can run the rule on the logits it just wrote, in the same call.
typedef struct {
    int64_t w;  // support width (1 greedy, else top-k)
    float temperature, top_p;
    int64_t method, k;  // 0 sps, 1 tas, 2 cactus; drafted tokens
    const int64_t *d_ids;  // the draft's rows D_1..D_k as (ids, probs) [k, d_w], or dense probs (d_ids NULL)
    const float *d_probs;
    int64_t d_w;
    const int64_t *tokens;  // the k drafted tokens
    const float *u_accept, *u_sample;
    float delta, posterior_threshold, posterior_alpha;
    int64_t *t_ids;  // out: T_1..T_{k+1} as (ids, probs) [k+1, w]
    float *t_probs;
    double *result;  // out: [8, k+2] as above
} RoundRule;

static void rule_on_support(const RoundRule *rule);

void verify_logits(const float *logits, int64_t vocab, const RoundRule *rule) {
    sample_support(logits, rule->k + 1, vocab, rule->w, rule->temperature, rule->top_p, rule->t_ids, rule->t_probs);
    rule_on_support(rule);
}

// verify_logits from the head's candidates [k+1, items, 2 topk] (head_candidates) instead of its
// logits: the same support rows, without another pass over the vocabulary.
static void verify_candidates(const float *cand, int64_t items, int64_t topk, const RoundRule *rule) {
    for (int64_t i = 0; i <= rule->k; i++) {
        float *p = rule->t_probs + i * rule->w;
        top_k_candidates(cand + i * items * 2 * topk, items, topk, rule->w, p, rule->t_ids + i * rule->w);
        support_probs(p, rule->w, rule->temperature, rule->top_p);
    }
    rule_on_support(rule);
}

// verify_support on the support rows in rule->t_ids, t_probs, packed into rule->result.
static void rule_on_support(const RoundRule *rule) {
    const int64_t k = rule->k, r = k + 2;
    float *stats = malloc(7 * r * sizeof(float));
    uint8_t *accepted = malloc(r);
    int64_t out[2];
    double *result = rule->result;
    verify_support((int)rule->method, k, rule->w, rule->t_ids, rule->t_probs, rule->d_ids, rule->d_probs, rule->d_w,
                   rule->tokens, rule->u_accept, rule->u_sample, rule->delta, rule->posterior_threshold,
                   rule->posterior_alpha, stats, accepted, out);
    for (int64_t j = 0; j < 7 * r; j++) result[j] = stats[j];
    result[7 * r] = (double)out[0];
    result[7 * r + 1] = (double)out[1];
    for (int64_t i = 0; i < k; i++) result[7 * r + 2 + i] = accepted[i];
    free(stats); free(accepted);
}

// A draft token: sample_support on one row of logits [vocab], its ids mapped through head_ids
// (a reduced head's token ids; NULL: none) into ids, probs [w], then the draw with u.
int64_t sample_draw(const float *logits, int64_t vocab, int64_t w, float temperature, float top_p,
                    const int64_t *head_ids, float u, int64_t *ids, float *probs) {
    sample_support(logits, 1, vocab, w, temperature, top_p, ids, probs);
    if (head_ids != NULL)
        for (int64_t j = 0; j < w; j++) ids[j] = head_ids[ids[j]];
    return draw_support(ids, probs, w, u);
}
#pragma GCC pop_options

/* ---- divergence kernel ---- */
// engine.divergence.position_divergence for sparse rows, every tested position of a round in one call
// (the playground's live KL chart, computed on a UI thread): T and D on the union of their supports,
// renormalised in float64; P, the distribution the rule emits there (SpS: T; TAS: D on {T > threshold},
// the rest to argmax T; Cactus: D a + sum_n D(n) (1 - a(n)) g_n, by the literal formula: O(n^2) on the
// few dozen ids of a union); out[2 p] = KL(P || T), out[2 p + 1] = KL(D || T) (inf where the first
// leaves T's support). In numpy a Cactus round took 0.1-0.3 ms holding the GIL, which the engine's
// thread then waited for after its forward.
static double kl_rows(const double *p, const double *q, int64_t n) {
    double total = 0.0;
    for (int64_t i = 0; i < n; i++) {
        if (p[i] <= 0.0) continue;
        if (q[i] <= 0.0) return INFINITY;
        total += p[i] * (log(p[i]) - log(q[i]));
    }
    return total > 0.0 ? total : 0.0;
}

// Row `probs` [w] over `ids` onto the ascending union `support` [n] (zeros elsewhere), then to mass 1.
static void onto_union(const int64_t *support, int64_t n, const int64_t *ids, const double *probs, int64_t w,
                       double *out) {
    double total = 0.0;
    for (int64_t i = 0; i < n; i++) out[i] = 0.0;
    for (int64_t j = 0; j < w; j++) {
        int64_t at = 0;
        while (support[at] != ids[j]) at++;
        out[at] = probs[j];
    }
    for (int64_t i = 0; i < n; i++) total += out[i];
    for (int64_t i = 0; i < n; i++) out[i] /= total;
}

static void induced(const double *t, const double *d, int64_t n, int64_t method, double delta,
                    double posterior_threshold, double posterior_alpha, double *p, double *gamma) {
    if (method == 0) {  // SpS: min(T, D) + max(T - D, 0) = T
        for (int64_t i = 0; i < n; i++) p[i] = t[i];
        return;
    }
    if (method == 1) {  // TAS: Medusa's threshold min(eps, alpha e^-H), H = -sum T log(T + 1e-5)
        double entropy = 0.0, rejected = 0.0;
        int64_t top = 0;
        for (int64_t i = 0; i < n; i++) {
            entropy -= t[i] * log(t[i] + 1e-5);
            if (t[i] > t[top]) top = i;
        }
        const double alpha_term = posterior_alpha * exp(-entropy);
        const double threshold = posterior_threshold < alpha_term ? posterior_threshold : alpha_term;
        for (int64_t i = 0; i < n; i++) {
            const int accept = t[i] > threshold;
            p[i] = accept ? d[i] : 0.0;
            if (!accept) rejected += d[i];
        }
        p[top] += rejected;
        return;
    }
    for (int64_t i = 0; i < n; i++) {  // Cactus: gamma (Cor. 5); the drafts kept, D a with a = min(gamma / D, 1)
        const double g = t[i] + sqrt(2.0 * delta * t[i] * (1.0 - t[i]));
        gamma[i] = g < 0.0 ? 0.0 : g > 1.0 ? 1.0 : g;
        p[i] = d[i] > 0.0 && gamma[i] < d[i] ? gamma[i] : d[i];
    }
    for (int64_t i = 0; i < n; i++) {  // then each rejected draft's recovery
        const double w = d[i] - p[i];  // P(draft i, reject it); h_i = s T off i, gamma at i
        if (!(w > 0.0)) continue;
        const double s = (1.0 - gamma[i]) / (1.0 - t[i]);
        double z = 0.0;
        for (int64_t v = 0; v < n; v++) {
            const double r = (v == i ? gamma[i] : s * t[v]) - d[v];
            if (r > 0.0) z += r;
        }
        for (int64_t v = 0; v < n; v++) {  // from norm(max(h - D, 0)), or from h itself if that is empty
            const double h = v == i ? gamma[i] : s * t[v], r = h - d[v];
            p[v] += z > 0.0 ? (r > 0.0 ? w * r / z : 0.0) : w * h;
        }
    }
}

void position_divergences(int64_t positions, const int64_t *t_ids, const double *t_probs, int64_t t_w,
                          const int64_t *d_ids, const double *d_probs, int64_t d_w, int64_t method, double delta,
                          double posterior_threshold, double posterior_alpha, double *out) {
    const int64_t cap = t_w + d_w;
    int64_t *support = malloc(cap * sizeof(int64_t));
    double *t = malloc(4 * cap * sizeof(double)), *d = t + cap, *p = t + 2 * cap, *gamma = t + 3 * cap;
    for (int64_t pos = 0; pos < positions; pos++) {
        int64_t n = 0;
        for (int64_t side = 0; side < 2; side++) {  // the union of the two rows' ids, ascending
            const int64_t *ids = side ? d_ids + pos * d_w : t_ids + pos * t_w;
            for (int64_t j = 0, w = side ? d_w : t_w; j < w; j++) {
                int64_t at = n;
                while (at > 0 && support[at - 1] > ids[j]) at--;
                if (at > 0 && support[at - 1] == ids[j]) continue;
                memmove(support + at + 1, support + at, (n - at) * sizeof(int64_t));
                support[at] = ids[j];
                n++;
            }
        }
        onto_union(support, n, t_ids + pos * t_w, t_probs + pos * t_w, t_w, t);
        onto_union(support, n, d_ids + pos * d_w, d_probs + pos * d_w, d_w, d);
        induced(t, d, n, method, delta, posterior_threshold, posterior_alpha, p, gamma);
        out[2 * pos] = kl_rows(p, t, n);
        out[2 * pos + 1] = kl_rows(d, t, n);
    }
    free(support); free(t);
}

// A target forward as one call (FastLlamaCausalLM._forward): the embedding rows of n tokens, the
// decoder stack at cache slots [slot, slot + n) -> final-norm hidden states into hidden [n, H], then
// the head on the last `last_n` of them into logits [last_n, head_rows]. The same kernels in the same
// order as that method's op-by-op path, so the same bits; there the ~10 torch ops around the two
// native calls cost 0.3-0.4 ms a forward on a VM whose caches the forward left cold (AMD EPYC Zen 4,
// assets/FAST_BACKEND.md, session 23). With a `rule` (NULL: none), the rule then runs on those rows
// (head_rows must be the vocabulary), its time in *rule_seconds: a verify round's forward and rule in
// one call, where calling the rule from Python cost ~90 us of Python steps whose caches the forward
// had left cold (AMD EPYC Zen 3, session 28). Its support comes from the head's items, which keep
// each row's top-k candidates while their logits are in their cache (head_candidates): the rule's
// own pass over 49,152 logits a row took ~16 us in a round against ~7 us warm: half of it cache misses
// on the other thread's columns (Intel Xeon, session 40).
void target_forward(const Decoder *d, const float *embed, const Linear *head, int64_t head_rows,
                    const int64_t *tokens, int64_t n, float *k_cache, float *v_cache, int64_t cap,
                    const float *rope, int64_t slot, int wide, int64_t last_n, float *hidden, float *logits,
                    const RoundRule *rule, double *rule_seconds) {
    const int64_t H = d->hidden, topk = rule != NULL && rule->w <= MAX_CANDIDATES && head_rows < (1 << 24) ? rule->w : 0;
    Job job = job_begin();
    float *cand;
    const Activations a = activations(&job, d, n, slot + n, 0, last_n * POOL_ITEMS * 2 * topk, &cand);
    for (int64_t j = 0; j < n; j++) memcpy(a.x + j * H, embed + tokens[j] * H, H * sizeof(float));
    memcpy(a.rope, rope, n * d->head_dim * sizeof(float));
    int64_t np = 0;
    add_decoder(&job, &np, d, &a, n, k_cache, v_cache, cap, slot, wide, hidden, head);
    GemmPhase *g = add_gemm(&job, &np, head, last_n, H, head_rows, a.h + (n - last_n) * H,
                            rows16_from(a.h16, n - last_n), logits, 0);
    if (topk) {  // the head's items keep each row's candidates for the rule (head_candidates)
        const Phase *p = &job.phases[np - 1];
        g->topk = topk, g->per = p->per, g->items = p->items, g->cand = cand;
    }
    job_run(&job, np);
    if (rule != NULL) {  // the round's rule on the rows just written, timed apart from the forward
        const double start = omp_get_wtime();
        if (topk) verify_candidates(cand, g->items, topk, rule);
        else verify_logits(logits, head_rows, rule);
        *rule_seconds = omp_get_wtime() - start;
    }
    job_end(&job, 0);
}

// One step of a feature draft (engine.feature_drafter): x_j = fc([embed(t_j); f_{j-1}]) for n
// entries, the draft's decoder stack on them at cache slots [slot, slot + n) -> their f̂ into out
// [n, hidden], then the head on the last f̂ and sample_draw with u into ids, probs [w]; returns the
// drawn token. The same kernels in the same order as the Python path (fc, decoder_forward, head,
// sample_draw; every GEMM a decode GEMM), so the same bits: one ctypes call where that path took
// about 15 torch ops and four ctypes calls a round, each of which costs 10-90 us on a VM whose
// caches went cold during the forwards (assets/FAST_BACKEND.md, session 22).
typedef struct {
    const float *embed;  // [vocab, embed_dim], float32
    Linear fc, head;     // fc [hidden, embed_dim + hidden]; head [head_rows, hidden] (a reduced head)
    const int64_t *head_ids;  // the head's token ids (NULL: the rows are the vocabulary)
    const Decoder *decoder;
    int64_t embed_dim, head_rows;
} FeatureStep;

// x_j = fc([embed(t_j); f_{j-1}]) for the n entries, then the draft's decoder stack on them at cache slots
// [slot, slot + n) (mask: a tree's additive [n, slot + n] visibility, NULL: causal) -> their f̂ into out,
// then the head on the last `heads` f̂: their logits [heads, head_rows], in the job's arena.
static float *feature_forward(Job *job, const FeatureStep *s, const int64_t *tokens, int64_t n, const float *features,
                              float *k_cache, float *v_cache, int64_t cap, const float *rope, int64_t slot,
                              const float *mask, int wide, float *out, int64_t heads) {
    const Decoder *d = s->decoder;
    const int64_t H = d->hidden, E = s->embed_dim, K = E + H, Kp = (K + GROUP - 1) / GROUP * GROUP, V = s->head_rows;
    float *in;
    const Activations a = activations(job, d, n, slot + n, mask != NULL, up16(n * Kp) + rows16_floats(n, Kp) + heads * V,
                                      &in);
    float *at = in + up16(n * Kp);
    const Rows16 in16 = rows16_in(&at, n, Kp);
    float *logits = at;
    memset(in, 0, n * Kp * sizeof(float));
    for (int64_t j = 0; j < n; j++) {  // [embed(t_j); f_{j-1}], zero-padded to Kp as pad_to_group
        memcpy(in + j * Kp, s->embed + tokens[j] * E, E * sizeof(float));
        memcpy(in + j * Kp + E, features + j * H, H * sizeof(float));
        if (takes_rows16(&s->fc, H, 0)) quantize_into_row(in + j * Kp, in16, j);
    }
    memcpy(a.rope, rope, n * d->head_dim * sizeof(float));
    if (mask) memcpy(a.mask, mask, n * (slot + n) * sizeof(float));
    int64_t np = 0;
    add_gemm(job, &np, &s->fc, n, Kp, H, in, in16, a.x, 0);
    add_decoder(job, &np, d, &a, n, k_cache, v_cache, cap, slot, wide, out, &s->head);
    add_gemm(job, &np, &s->head, heads, H, V, a.h + (n - heads) * H, rows16_from(a.h16, n - heads), logits, 0);
    job_run(job, np);
    return logits;
}

int64_t feature_draft_step(const FeatureStep *s, const int64_t *tokens, int64_t n, const float *features,
                           float *k_cache, float *v_cache, int64_t cap, const float *rope, int64_t slot, int wide,
                           float *out, int64_t w, float temperature, float top_p, float u, int64_t *ids,
                           float *probs) {
    Job job = job_begin();
    const float *logits = feature_forward(&job, s, tokens, n, features, k_cache, v_cache, cap, rope, slot, NULL, wide,
                                          out, 1);
    const int64_t token = sample_draw(logits, s->head_rows, w, temperature, top_p, s->head_ids, u, ids, probs);
    job_end(&job, 0);
    return token;
}

// One depth of SSD's cache fill (FeatureDrafter.propose_branches): n branch entries at cache slots
// [slot, slot + n), each with its own position's rope row and the tree's additive visibility mask
// [n, slot + n], the head on every f̂ and one draw per branch with its own uniform u[j] into
// drawn [n], ids, probs [n, w]. The same kernels in the same order as that path's tree step (fc,
// decoder_forward with the mask, the head on the n rows, sample_draw per row), so the same bits;
// there the draws alone were a torch sampling pass per branch (about 37 us each, 0.47 of 0.77 ms
// a step at 12 branches, AMD EPYC Zen 5).
void feature_tree_step(const FeatureStep *s, const int64_t *tokens, int64_t n, const float *features,
                       float *k_cache, float *v_cache, int64_t cap, const float *rope, int64_t slot,
                       const float *mask, float *out, int64_t w, float temperature, float top_p, const float *u,
                       int64_t *drawn, int64_t *ids, float *probs) {
    const int64_t V = s->head_rows;
    Job job = job_begin();
    const float *logits = feature_forward(&job, s, tokens, n, features, k_cache, v_cache, cap, rope, slot, mask, 0,
                                          out, n);
    for (int64_t j = 0; j < n; j++)
        drawn[j] = sample_draw(logits + j * V, V, w, temperature, top_p, s->head_ids, u[j], ids + j * w, probs + j * w);
    job_end(&job, 0);
}
