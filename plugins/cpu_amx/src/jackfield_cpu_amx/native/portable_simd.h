/*
 * Plain-C stand-ins for the AVX-512 (F, BW, VL, BF16) and AVX intrinsics that mla_decode.c
 * uses, so that the same kernel source builds with any GCC or Clang on any CPU (x86-64 without
 * AVX-512, aarch64). Included instead of <immintrin.h> when JF_PORTABLE is defined; that build
 * is for tests only (the backend never picks it).
 *
 * Each function computes what Intel's pseudocode for the instruction says, bit for bit, for the
 * operands the kernel passes: IEEE float32 operations rounded to nearest even (the default
 * rounding mode, as the hardware's MXCSR default), fmadd fused (fmaf), the bfloat16 conversions
 * with their fixed denormals-to-zero and round-to-nearest-even. So the portable build's outputs
 * equal the AVX-512 build's (a test compares them where the CPU has AVX-512). NaN payloads are
 * not modelled: the kernel never lets a NaN reach an output. The build must not contract a * b + c
 * into an fma (-ffp-contract=off), or plain C arithmetic would differ between CPUs.
 *
 * The names are the intrinsics' own (<immintrin.h> is not included in this build), and the
 * vector types are GCC/Clang vector extensions, so the kernel's casts between them still work.
 * Only what the kernel uses is here; an intrinsic it starts using must be added.
 */
#ifndef JF_PORTABLE_SIMD_H
#define JF_PORTABLE_SIMD_H

#include <math.h>
#include <stdint.h>
#include <string.h>

typedef float __m512 __attribute__((vector_size(64)));
typedef int64_t __m512i __attribute__((vector_size(64)));
typedef int64_t __m256i __attribute__((vector_size(32)));
typedef uint16_t __m512bh __attribute__((vector_size(64))); /* 32 bfloat16 */
typedef uint16_t __m256bh __attribute__((vector_size(32))); /* 16 bfloat16 */
typedef uint16_t __mmask16;

/* Lane views of the integer vectors. */
typedef int32_t jf_i32x16 __attribute__((vector_size(64)));
typedef uint16_t jf_u16x32 __attribute__((vector_size(64)));

#define _MM_SHUFFLE(a, b, c, d) (((a) << 6) | ((b) << 4) | ((c) << 2) | (d))
#define _MM_FROUND_TO_NEAREST_INT 0x00
#define _MM_FROUND_NO_EXC 0x08
#define _MM_HINT_T1 2 /* __builtin_prefetch's locality for L2 */
#define _mm_prefetch(address, hint) __builtin_prefetch((address), 0, (hint))

/* ---- loads, stores, constants ------------------------------------------------------------- */

static inline __m512 _mm512_loadu_ps(const void *p) {
    __m512 v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline __m512 _mm512_load_ps(const void *p) { return _mm512_loadu_ps(p); }
static inline void _mm512_storeu_ps(void *p, __m512 v) { memcpy(p, &v, sizeof v); }
static inline void _mm512_store_ps(void *p, __m512 v) { memcpy(p, &v, sizeof v); }

static inline __m512i _mm512_loadu_si512(const void *p) {
    __m512i v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline void _mm512_store_si512(void *p, __m512i v) { memcpy(p, &v, sizeof v); }

static inline __m256i _mm256_loadu_si256(const __m256i *p) {
    __m256i v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline void _mm256_storeu_si256(__m256i *p, __m256i v) { memcpy(p, &v, sizeof v); }

static inline __m512 _mm512_set1_ps(float x) {
    __m512 v;
    for (int i = 0; i < 16; i++) v[i] = x;
    return v;
}
static inline __m512 _mm512_setzero_ps(void) { return _mm512_set1_ps(0.0f); }
static inline __m512i _mm512_setzero_si512(void) { return (__m512i){0}; }
static inline __m256i _mm256_setzero_si256(void) { return (__m256i){0}; }

static inline __m512i _mm512_set1_epi32(int32_t x) {
    jf_i32x16 v;
    for (int i = 0; i < 16; i++) v[i] = x;
    return (__m512i)v;
}
static inline __m512i _mm512_setr_epi32(int32_t e0, int32_t e1, int32_t e2, int32_t e3, int32_t e4, int32_t e5,
                                        int32_t e6, int32_t e7, int32_t e8, int32_t e9, int32_t e10, int32_t e11,
                                        int32_t e12, int32_t e13, int32_t e14, int32_t e15) {
    return (__m512i)(jf_i32x16){e0, e1, e2, e3, e4, e5, e6, e7, e8, e9, e10, e11, e12, e13, e14, e15};
}

/* ---- float32 arithmetic and compares -------------------------------------------------------- */

static inline __m512 _mm512_add_ps(__m512 a, __m512 b) { return a + b; }
static inline __m512 _mm512_sub_ps(__m512 a, __m512 b) { return a - b; }
static inline __m512 _mm512_mul_ps(__m512 a, __m512 b) { return a * b; }

/* VMAXPS: the second operand when either is NaN or both are zero. */
static inline __m512 _mm512_max_ps(__m512 a, __m512 b) {
    __m512 r;
    for (int i = 0; i < 16; i++) r[i] = a[i] > b[i] ? a[i] : b[i];
    return r;
}

static inline __m512 _mm512_fmadd_ps(__m512 a, __m512 b, __m512 c) {
    __m512 r;
    for (int i = 0; i < 16; i++) r[i] = fmaf(a[i], b[i], c[i]);
    return r;
}

static inline __m512 _mm512_mask_mul_ps(__m512 src, __mmask16 k, __m512 a, __m512 b) {
    __m512 r;
    for (int i = 0; i < 16; i++) r[i] = k >> i & 1 ? a[i] * b[i] : src[i];
    return r;
}

/* imm[7:4] fraction bits kept; imm[2] rounds as the current mode says (nearest even: the kernel
 * never changes it), else imm[1:0]: nearest even, down, up, toward zero. */
static inline __m512 _mm512_roundscale_ps(__m512 a, int imm) {
    const float scale = (float)(1 << (imm >> 4 & 15));
    __m512 r;
    for (int i = 0; i < 16; i++) {
        const float x = a[i] * scale;
        float rounded;
        if (imm & 4 || (imm & 3) == 0) rounded = rintf(x);
        else if ((imm & 3) == 1) rounded = floorf(x);
        else if ((imm & 3) == 2) rounded = ceilf(x);
        else rounded = truncf(x);
        r[i] = rounded / scale;
    }
    return r;
}

/* a * 2^floor(b), rounded once. Past +-300 the result is 0 or infinity for any float a, so the
 * exponent is clamped there before the conversion to int. */
static inline __m512 _mm512_scalef_ps(__m512 a, __m512 b) {
    __m512 r;
    for (int i = 0; i < 16; i++) {
        if (isnan(a[i]) || isnan(b[i])) r[i] = a[i] + b[i];
        else if (isinf(b[i])) r[i] = b[i] > 0 ? a[i] * INFINITY : a[i] * 0.0f;
        else r[i] = ldexpf(a[i], (int)fmaxf(-300.0f, fminf(300.0f, floorf(b[i]))));
    }
    return r;
}

/* Only the compare predicates the kernel uses are defined: another one fails to compile. */
#define _mm512_cmp_ps_mask(a, b, predicate) jf_cmp_ps_mask##predicate(a, b)

/* _CMP_NEQ_OQ: ordered (neither is NaN) and not equal. */
static inline __mmask16 jf_cmp_ps_mask_CMP_NEQ_OQ(__m512 a, __m512 b) {
    __mmask16 k = 0;
    for (int i = 0; i < 16; i++) k |= (__mmask16)((a[i] < b[i] || a[i] > b[i]) << i);
    return k;
}

static inline __mmask16 _mm512_cmpgt_epi32_mask(__m512i a, __m512i b) {
    const jf_i32x16 x = (jf_i32x16)a, y = (jf_i32x16)b;
    __mmask16 k = 0;
    for (int i = 0; i < 16; i++) k |= (__mmask16)((x[i] > y[i]) << i);
    return k;
}

/* ---- bfloat16 conversions --------------------------------------------------------------------- */

/* VCVTNEPS2BF16 on one element: zero and denormal inputs give a signed zero, NaN is quieted,
 * everything else (infinity included) rounds to nearest even. */
static inline uint16_t jf_float_to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7f800000u) == 0) return (uint16_t)(u >> 16 & 0x8000u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)(u >> 16 | 0x0040u);
    return (uint16_t)((u + 0x7fffu + (u >> 16 & 1u)) >> 16);
}

/* Elements 0-15 from b, 16-31 from a. */
static inline __m512bh _mm512_cvtne2ps_pbh(__m512 a, __m512 b) {
    __m512bh r;
    for (int i = 0; i < 16; i++) {
        r[i] = jf_float_to_bf16(b[i]);
        r[16 + i] = jf_float_to_bf16(a[i]);
    }
    return r;
}

static inline __m256bh _mm512_cvtneps_pbh(__m512 a) {
    __m256bh r;
    for (int i = 0; i < 16; i++) r[i] = jf_float_to_bf16(a[i]);
    return r;
}

/* ---- shuffles ----------------------------------------------------------------------------------- */

/* PUNPCKL / PUNPCKH: within each 128-bit lane, the low (or high) half's elements of a and b
 * alternate, a first. */
static inline void jf_unpack(const void *a, const void *b, void *out, int bytes, int size, int high) {
    const unsigned char *x = a, *y = b;
    unsigned char *r = out;
    const int half = 8 / size, first = high ? half : 0;
    for (int lane = 0; lane < bytes; lane += 16) {
        for (int i = 0; i < half; i++) {
            memcpy(r + lane + 2 * i * size, x + lane + (first + i) * size, size);
            memcpy(r + lane + (2 * i + 1) * size, y + lane + (first + i) * size, size);
        }
    }
}

#define JF_UNPACK(name, type, size, high)                     \
    static inline type name(type a, type b) {                 \
        type r;                                               \
        jf_unpack(&a, &b, &r, (int)sizeof(type), size, high); \
        return r;                                             \
    }
JF_UNPACK(_mm512_unpacklo_epi16, __m512i, 2, 0)
JF_UNPACK(_mm512_unpackhi_epi16, __m512i, 2, 1)
JF_UNPACK(_mm512_unpacklo_epi32, __m512i, 4, 0)
JF_UNPACK(_mm512_unpackhi_epi32, __m512i, 4, 1)
JF_UNPACK(_mm512_unpacklo_epi64, __m512i, 8, 0)
JF_UNPACK(_mm512_unpackhi_epi64, __m512i, 8, 1)
JF_UNPACK(_mm256_unpacklo_epi16, __m256i, 2, 0)
JF_UNPACK(_mm256_unpackhi_epi16, __m256i, 2, 1)
#undef JF_UNPACK

/* 128-bit lanes 0-1 from a, 2-3 from b, each chosen by two bits of imm. */
static inline __m512i _mm512_shuffle_i32x4(__m512i a, __m512i b, int imm) {
    __m512i r;
    for (int lane = 0; lane < 4; lane++) {
        const __m512i *from = lane < 2 ? &a : &b;
        memcpy((char *)&r + 16 * lane, (const char *)from + 16 * (imm >> (2 * lane) & 3), 16);
    }
    return r;
}

static inline __m512i _mm512_permutexvar_epi16(__m512i index, __m512i a) {
    const jf_u16x32 idx = (jf_u16x32)index, x = (jf_u16x32)a;
    jf_u16x32 r;
    for (int i = 0; i < 32; i++) r[i] = x[idx[i] & 31];
    return (__m512i)r;
}

static inline __m512 _mm512_permutexvar_ps(__m512i index, __m512 a) {
    const jf_i32x16 idx = (jf_i32x16)index;
    __m512 r;
    for (int i = 0; i < 16; i++) r[i] = a[idx[i] & 15];
    return r;
}

/* Element i: index bit 4 picks b over a, bits 0-3 the element. */
static inline __m512 _mm512_permutex2var_ps(__m512 a, __m512i index, __m512 b) {
    const jf_i32x16 idx = (jf_i32x16)index;
    __m512 r;
    for (int i = 0; i < 16; i++) r[i] = idx[i] & 16 ? b[idx[i] & 15] : a[idx[i] & 15];
    return r;
}

/* The upper half is undefined for the instruction; zero here. */
static inline __m512i _mm512_castsi256_si512(__m256i a) {
    __m512i r = {0};
    memcpy(&r, &a, sizeof a);
    return r;
}

static inline __m512i _mm512_inserti64x4(__m512i a, __m256i b, int imm) {
    memcpy((char *)&a + 32 * (imm & 1), &b, sizeof b);
    return a;
}

#endif /* JF_PORTABLE_SIMD_H */
