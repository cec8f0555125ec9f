/*
 * Fused CPU kernels for the lightning_islands codecs (see the lightning_islands.codecs package for the
 * wire format). Each function handles one contiguous range of a flat vector in cache-sized
 * sub-slabs, so the vector is read once from memory and written once; the Python side runs one
 * call per thread on ranges aligned to whole blocks and packing groups.
 *
 * Bit-exactness: every result is an IEEE-754 single-precision operation (division, multiply,
 * round-to-nearest-even) or an exact integer operation, so the bytes equal those of the torch
 * reference path on any machine. Build with -ffp-contract=off and without -ffast-math.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "liq_crc.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* Hot loops get one clone per x86 level, picked at load time. x86-64-v4 (AVX-512 F/BW/DQ/VL)
 * rather than plain avx512f: without BW/VL the byte packing and the fp8 rounding do not use the
 * 512-bit registers well (measured 2x slower int4 packing on an AMD EPYC). */
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#define LIQ_HOT __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#elif defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__)
#define LIQ_HOT __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define LIQ_HOT
#endif

#define LIQ_PACK_GROUP 2048
#define LIQ_SLAB_TARGET 2048 /* elements per sub-slab: 8 KiB of fp32, L1-resident */
#define LIQ_ABS_MASK 0x7FFFFFFFu
#define LIQ_INF_BITS 0x7F800000u

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* round_half_even(t) for |t| < 2**22, as the low bits of a float's bit pattern: t + 1.5 * 2**23
 * lies in [2**23, 2**24), where the float spacing is exactly 1, so the addition rounds t to the
 * nearest integer (ties to even, as rintf) and the result's bits are 0x4B400000 + q. The low 8 bits
 * of that are q modulo 256 (0x4B400000 is a multiple of 256): the two's complement byte of q. This is
 * one addition instead of a rounding and a conversion, and it needs no narrowing from 32-bit lanes. */
#define LIQ_ROUND_MAGIC 12582912.0f
static inline uint32_t round_bits(float t) { return f2u(t + LIQ_ROUND_MAGIC); }

static int64_t gcd64(int64_t a, int64_t b) { while (b) { int64_t t = a % b; a = b; b = t; } return a; }

/* Elements per sub-slab of a `count`-value range: whole blocks and, for packed values (pack > 1),
 * whole packing groups; a multiple of that unit near LIQ_SLAB_TARGET, at most `count`. */
static int64_t slab_elems(int64_t block, int pack, int64_t count) {
    int64_t unit = pack == 1 ? block : block / gcd64(block, LIQ_PACK_GROUP) * LIQ_PACK_GROUP;
    int64_t k = LIQ_SLAB_TARGET / unit;
    int64_t slab = (k > 0 ? k : 1) * unit;
    return slab > count ? count : slab;
}

/* Largest |x| per block as raw bits (max over (bits & 0x7FFFFFFF) is the max of |x| and is
 * above 0x7F800000 iff a NaN is present), then scale = absmax/qmax and inv = min(1/scale, FLT_MAX). */
LIQ_HOT static void block_scales(const float *restrict x, int64_t count, int64_t block, float qmax,
                                 float *restrict scales, float *restrict inv) {
    const uint32_t *xb = (const uint32_t *)x;
    int64_t nb = (count + block - 1) / block;
    for (int64_t b = 0; b < nb; b++) {
        int64_t s = b * block, len = count - s < block ? count - s : block;
        uint32_t m = 0;
        for (int64_t j = 0; j < len; j++) {
            uint32_t a = xb[s + j] & LIQ_ABS_MASK;
            m = a > m ? a : m;
        }
        float sc = u2f(m) / qmax; /* NaN/Inf stay non-finite and are reported by the caller */
        float r = 1.0f / sc;
        scales[b] = sc;
        inv[b] = r > FLT_MAX ? FLT_MAX : r;
    }
}

/* q = round_half_even(x * inv) as int8, one block at a time. */
LIQ_HOT static void block_round(const float *restrict x, int64_t count, int64_t block, const float *restrict inv,
                                int8_t *restrict q) {
    int64_t nb = (count + block - 1) / block;
    for (int64_t b = 0; b < nb; b++) {
        int64_t s = b * block, len = count - s < block ? count - s : block;
        float r = inv[b];
        for (int64_t j = 0; j < len; j++) q[s + j] = (int8_t)(uint8_t)round_bits(x[s + j] * r); /* |.| <= 127 */
    }
}

/* out = (float)q * scale, one block at a time (the one rounding of the decode). */
LIQ_HOT static void block_rescale(const int8_t *restrict q, int64_t count, int64_t block, const float *restrict scales,
                                  float *restrict out) {
    int64_t nb = (count + block - 1) / block;
    for (int64_t b = 0; b < nb; b++) {
        int64_t s = b * block, len = count - s < block ? count - s : block;
        float sc = scales[b];
        for (int64_t j = 0; j < len; j++) out[s + j] = (float)q[s + j] * sc;
    }
}

/* Group-planar packing of `count` int8 values (count may end in a partial group). */
LIQ_HOT static void pack_planar(const int8_t *restrict q, int64_t count, int bits, uint8_t *restrict out) {
    int pack = 8 / bits;
    int off = bits == 4 ? 8 : 1; /* offset binary: q + 8 (int4), q + 1 (int2) */
    for (int64_t g = 0; g < count; g += LIQ_PACK_GROUP) {
        int64_t rem = count - g < LIQ_PACK_GROUP ? count - g : LIQ_PACK_GROUP;
        int64_t per = (rem + pack - 1) / pack;
        const int8_t *src = q + g;
        uint8_t *dst = out + g / pack;
        if (per * pack == rem) {
            if (bits == 4) {
                for (int64_t j = 0; j < per; j++)
                    dst[j] = (uint8_t)((uint8_t)(src[j] + 8) | (uint8_t)((src[j + per] + 8) << 4));
            } else {
                for (int64_t j = 0; j < per; j++)
                    dst[j] = (uint8_t)((uint8_t)(src[j] + 1) | (uint8_t)((src[j + per] + 1) << 2) |
                                       (uint8_t)((src[j + 2 * per] + 1) << 4) |
                                       (uint8_t)((src[j + 3 * per] + 1) << 6));
            }
        } else { /* last, partial group: missing values are zeros */
            for (int64_t j = 0; j < per; j++) {
                uint32_t byte = 0;
                for (int i = 0; i < pack; i++) {
                    int64_t idx = j + i * per;
                    int v = idx < rem ? src[idx] : 0;
                    byte |= (uint32_t)((v + off) & ((1 << bits) - 1)) << (bits * i);
                }
                dst[j] = (uint8_t)byte;
            }
        }
    }
}

LIQ_HOT static void unpack_planar(const uint8_t *restrict in, int64_t count, int bits, int8_t *restrict q) {
    int pack = 8 / bits;
    int off = bits == 4 ? 8 : 1;
    for (int64_t g = 0; g < count; g += LIQ_PACK_GROUP) {
        int64_t rem = count - g < LIQ_PACK_GROUP ? count - g : LIQ_PACK_GROUP;
        int64_t per = (rem + pack - 1) / pack;
        const uint8_t *src = in + g / pack;
        int8_t *dst = q + g;
        if (per * pack == rem) {
            if (bits == 4) {
                for (int64_t j = 0; j < per; j++) {
                    dst[j] = (int8_t)((src[j] & 0x0F) - 8);
                    dst[j + per] = (int8_t)((src[j] >> 4) - 8);
                }
            } else {
                for (int64_t j = 0; j < per; j++) {
                    dst[j] = (int8_t)((src[j] & 3) - 1);
                    dst[j + per] = (int8_t)(((src[j] >> 2) & 3) - 1);
                    dst[j + 2 * per] = (int8_t)(((src[j] >> 4) & 3) - 1);
                    dst[j + 3 * per] = (int8_t)((src[j] >> 6) - 1);
                }
            }
        } else {
            for (int64_t j = 0; j < per; j++)
                for (int i = 0; i < pack; i++) {
                    int64_t idx = j + i * per;
                    if (idx < rem) dst[idx] = (int8_t)(((src[j] >> (bits * i)) & ((1 << bits) - 1)) - off);
                }
        }
    }
}

/* Fast path for a full packing group whose planes are whole blocks (block divides 2048/pack):
 * round and pack in one pass, no int8 temporary. inv/scales point at the group's first block.
 * |x * inv| <= qmax <= 7 here, well inside round_bits' range. */
LIQ_HOT static void round_pack_group(const float *restrict x, const float *restrict inv, int64_t block, int bits,
                                     uint8_t *restrict out) {
    if (bits == 4) {
        const int64_t per = LIQ_PACK_GROUP / 2, nbh = per / block;
        for (int64_t bb = 0; bb < nbh; bb++) {
            const float r0 = inv[bb], r1 = inv[nbh + bb];
            const float *restrict x0 = x + bb * block, *restrict x1 = x + per + bb * block;
            uint8_t *restrict o = out + bb * block;
            for (int64_t j = 0; j < block; j++) {
                uint32_t q0 = round_bits(x0[j] * r0) + 8u, q1 = round_bits(x1[j] * r1) + 8u;
                o[j] = (uint8_t)((q0 & 0x0Fu) | (q1 << 4));
            }
        }
    } else {
        const int64_t per = LIQ_PACK_GROUP / 4, nbh = per / block;
        for (int64_t bb = 0; bb < nbh; bb++) {
            const float r0 = inv[bb], r1 = inv[nbh + bb], r2 = inv[2 * nbh + bb], r3 = inv[3 * nbh + bb];
            const float *restrict x0 = x + bb * block;
            uint8_t *restrict o = out + bb * block;
            for (int64_t j = 0; j < block; j++) {
                uint32_t q0 = round_bits(x0[j] * r0) + 1u, q1 = round_bits(x0[j + per] * r1) + 1u;
                uint32_t q2 = round_bits(x0[j + 2 * per] * r2) + 1u, q3 = round_bits(x0[j + 3 * per] * r3) + 1u;
                o[j] = (uint8_t)((q0 & 3u) | ((q1 & 3u) << 2) | ((q2 & 3u) << 4) | (q3 << 6));
            }
        }
    }
}

LIQ_HOT static void unpack_scale_group(const uint8_t *restrict in, const float *restrict scales, int64_t block,
                                       int bits, float *restrict out) {
    if (bits == 4) {
        const int64_t per = LIQ_PACK_GROUP / 2, nbh = per / block;
        for (int64_t bb = 0; bb < nbh; bb++) {
            const float s0 = scales[bb], s1 = scales[nbh + bb];
            const uint8_t *restrict v = in + bb * block;
            float *restrict o0 = out + bb * block, *restrict o1 = out + per + bb * block;
            for (int64_t j = 0; j < block; j++) {
                o0[j] = (float)((int32_t)(v[j] & 0x0F) - 8) * s0;
                o1[j] = (float)((int32_t)(v[j] >> 4) - 8) * s1;
            }
        }
    } else {
        const int64_t per = LIQ_PACK_GROUP / 4, nbh = per / block;
        for (int64_t bb = 0; bb < nbh; bb++) {
            const float s0 = scales[bb], s1 = scales[nbh + bb], s2 = scales[2 * nbh + bb], s3 = scales[3 * nbh + bb];
            const uint8_t *restrict v = in + bb * block;
            float *restrict o = out + bb * block;
            for (int64_t j = 0; j < block; j++) {
                o[j] = (float)((int32_t)(v[j] & 3) - 1) * s0;
                o[j + per] = (float)((int32_t)((v[j] >> 2) & 3) - 1) * s1;
                o[j + 2 * per] = (float)((int32_t)((v[j] >> 4) & 3) - 1) * s2;
                o[j + 3 * per] = (float)((int32_t)(v[j] >> 6) - 1) * s3;
            }
        }
    }
}

/* The portable loops of liq_bf16_encode / liq_bf16_decode / liq_f32_copy_checked (the encodes
 * return the largest |x| bit pattern seen). */
LIQ_HOT static uint32_t bf16_round(const float *restrict x, int64_t count, uint16_t *restrict out) {
    const uint32_t *xb = (const uint32_t *)x;
    uint32_t worst = 0;
    for (int64_t j = 0; j < count; j++) {
        uint32_t u = xb[j];
        uint32_t a = u & LIQ_ABS_MASK;
        worst = a > worst ? a : worst;
        a = a > 0x7F7F0000u ? 0x7F7F0000u : a; /* finite beyond the bf16 range (or ties to Inf): clamp */
        uint32_t r = (a + 0x7FFFu + ((a >> 16) & 1u)) >> 16;
        r = r > 0x7F7Fu ? 0x7F7Fu : r;
        out[j] = (uint16_t)(r | ((u >> 16) & 0x8000u));
    }
    return worst;
}

LIQ_HOT static void bf16_widen(const uint16_t *restrict in, int64_t count, uint32_t *restrict out) {
    for (int64_t j = 0; j < count; j++) out[j] = (uint32_t)in[j] << 16;
}

LIQ_HOT static uint32_t f32_copy_max(const float *restrict x, int64_t count, float *restrict out) {
    const uint32_t *xb = (const uint32_t *)x;
    uint32_t *ob = (uint32_t *)out;
    uint32_t worst = 0;
    for (int64_t j = 0; j < count; j++) {
        uint32_t u = xb[j];
        uint32_t a = u & LIQ_ABS_MASK;
        worst = a > worst ? a : worst;
        ob[j] = u;
    }
    return worst;
}

/* The float8_e4m3fn code c as fp32, exactly, without a table (a table lookup is a gather, which
 * vectorizes poorly): a normal code (exponent field != 0) rebiases its exponent (7 -> 127) by
 * integer addition; a subnormal one is its mantissa times 2**-9 (an exact conversion and scaling,
 * never an fp32 denormal, so flush-to-zero modes cannot touch it). The NaN codes (never produced
 * by the encoder, and rejected with their payload by the checksum) decode as 480. */
static inline float from_e4m3(uint32_t c) {
    uint32_t em = c & 0x7Fu;
    uint32_t normal = (em << 20) + (120u << 23);
    uint32_t sub = f2u((float)(int32_t)em * 0x1p-9f);
    uint32_t is_normal = 0u - (uint32_t)(em >= 8u);
    return u2f(((normal & is_normal) | (sub & ~is_normal)) | ((c & 0x80u) << 24));
}

/*
 * Streaming (non-temporal) stores for large outputs: x86-64 Linux with AVX2 (the CPU check needs
 * the compiler runtime's __cpu_model, which Apple's toolchain does not provide).
 *
 * A decoded vector much larger than the caches is not read back soon; writing it with streaming
 * stores skips the read-for-ownership of every destination line. On the 2-core AMD EPYC VM of
 * docs/BENCHMARKS.md this made a cold 64 MiB int4 decode ~20% faster and a one-thread one ~40%.
 * The streaming loops do the same IEEE operations as the portable ones (exact int-to-float
 * conversions, one rounded multiply), so the bytes are identical; the tests compare every path
 * with the torch reference. They run only for outputs of at least LIQ_STREAM_MIN_BYTES at a
 * 32-byte aligned address on a CPU with AVX2, and end with a store fence.
 */
#define LIQ_STREAM_MIN_BYTES ((int64_t)4 << 20)

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__)
#include <immintrin.h>
#define LIQ_AVX2 __attribute__((target("avx2")))

static int stream_ok(const void *out, int64_t nbytes) {
    return nbytes >= LIQ_STREAM_MIN_BYTES && ((uintptr_t)out & 31u) == 0 && __builtin_cpu_supports("avx2");
}

/* The largest of 8 unsigned 32-bit lanes. */
LIQ_AVX2 static inline uint32_t hmax8(__m256i v) {
    uint32_t lanes[8], w = 0;
    _mm256_storeu_si256((__m256i *)lanes, v);
    for (int i = 0; i < 8; i++) w = lanes[i] > w ? lanes[i] : w;
    return w;
}

/* out[0:8] = (float)q * s, streamed */
LIQ_AVX2 static inline void put8(float *out, __m256i q, __m256 s) {
    _mm256_stream_ps(out, _mm256_mul_ps(_mm256_cvtepi32_ps(q), s));
}

/* unpack_scale_group with streaming stores (block a multiple of 8). */
LIQ_AVX2 static void unpack_scale_group_stream(const uint8_t *in, const float *scales, int64_t block, int bits,
                                               float *out) {
    if (bits == 4) {
        const int64_t per = LIQ_PACK_GROUP / 2, nbh = per / block;
        const __m256i lo = _mm256_set1_epi32(0x0F), eight = _mm256_set1_epi32(8);
        for (int64_t bb = 0; bb < nbh; bb++) {
            const __m256 s0 = _mm256_set1_ps(scales[bb]), s1 = _mm256_set1_ps(scales[nbh + bb]);
            const uint8_t *v = in + bb * block;
            float *o0 = out + bb * block, *o1 = out + per + bb * block;
            for (int64_t j = 0; j < block; j += 8) {
                __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(v + j)));
                put8(o0 + j, _mm256_sub_epi32(_mm256_and_si256(w, lo), eight), s0);
                put8(o1 + j, _mm256_sub_epi32(_mm256_srli_epi32(w, 4), eight), s1);
            }
        }
    } else {
        const int64_t per = LIQ_PACK_GROUP / 4, nbh = per / block;
        const __m256i m = _mm256_set1_epi32(3), one = _mm256_set1_epi32(1);
        for (int64_t bb = 0; bb < nbh; bb++) {
            const __m256 s0 = _mm256_set1_ps(scales[bb]), s1 = _mm256_set1_ps(scales[nbh + bb]);
            const __m256 s2 = _mm256_set1_ps(scales[2 * nbh + bb]), s3 = _mm256_set1_ps(scales[3 * nbh + bb]);
            const uint8_t *v = in + bb * block;
            float *o = out + bb * block;
            for (int64_t j = 0; j < block; j += 8) {
                __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(v + j)));
                put8(o + j, _mm256_sub_epi32(_mm256_and_si256(w, m), one), s0);
                put8(o + j + per, _mm256_sub_epi32(_mm256_and_si256(_mm256_srli_epi32(w, 2), m), one), s1);
                put8(o + j + 2 * per, _mm256_sub_epi32(_mm256_and_si256(_mm256_srli_epi32(w, 4), m), one), s2);
                put8(o + j + 3 * per, _mm256_sub_epi32(_mm256_srli_epi32(w, 6), one), s3);
            }
        }
    }
}

/* block_rescale of int8 values with streaming stores (block a multiple of 8; the last block may
 * be partial: its tail past a multiple of 8 is stored normally). */
LIQ_AVX2 static void block_rescale_stream(const int8_t *q, int64_t count, int64_t block, const float *scales,
                                          float *out) {
    int64_t nb = (count + block - 1) / block;
    for (int64_t b = 0; b < nb; b++) {
        int64_t s = b * block, len = count - s < block ? count - s : block, j = 0;
        const __m256 sc = _mm256_set1_ps(scales[b]);
        for (; j + 8 <= len; j += 8)
            put8(out + s + j, _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + s + j))), sc);
        for (; j < len; j++) out[s + j] = (float)q[s + j] * scales[b];
    }
}

/* out = bf16 bits << 16, streamed. */
LIQ_AVX2 static void bf16_widen_stream(const uint16_t *in, int64_t count, float *out) {
    int64_t j = 0;
    for (; j + 8 <= count; j += 8) {
        __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(in + j)));
        _mm256_stream_si256((__m256i *)(out + j), _mm256_slli_epi32(w, 16));
    }
    for (; j < count; j++) ((uint32_t *)out)[j] = (uint32_t)in[j] << 16;
}

/* Copy x to out (streamed) and return the largest |x| bit pattern. */
LIQ_AVX2 static uint32_t f32_copy_max_stream(const float *x, int64_t count, float *out) {
    const __m256i mask = _mm256_set1_epi32((int)LIQ_ABS_MASK);
    __m256i worst = _mm256_setzero_si256();
    int64_t j = 0;
    for (; j + 8 <= count; j += 8) {
        __m256i u = _mm256_loadu_si256((const __m256i *)(x + j));
        worst = _mm256_max_epu32(worst, _mm256_and_si256(u, mask));
        _mm256_stream_si256((__m256i *)(out + j), u);
    }
    uint32_t w = hmax8(worst);
    for (; j < count; j++) {
        uint32_t u = f2u(x[j]), a = u & LIQ_ABS_MASK;
        w = a > w ? a : w;
        out[j] = x[j];
    }
    return w;
}

/* out[0:nbytes] = src[0:nbytes], streamed (out 32-byte aligned). */
LIQ_AVX2 static void stream_copy(const void *src, int64_t nbytes, void *out) {
    const uint8_t *in = (const uint8_t *)src;
    uint8_t *o = (uint8_t *)out;
    int64_t j = 0;
    for (; j + 32 <= nbytes; j += 32) _mm256_stream_si256((__m256i *)(o + j), _mm256_loadu_si256((const __m256i *)(in + j)));
    memcpy(o + j, in + j, (size_t)(nbytes - j));
}

/* o[0:n] = sb ^ (bit i of bytes[j]) << 31, streamed (o 32-byte aligned, n a multiple of 8): the
 * inner loop of unpack_signs for large outputs. */
LIQ_AVX2 static void sign_run_stream(const uint8_t *bytes, int i, uint32_t sb, int64_t n, uint32_t *o) {
    const __m256i s = _mm256_set1_epi32((int)sb), one = _mm256_set1_epi32(1), shift = _mm256_set1_epi32(i);
    for (int64_t j = 0; j < n; j += 8) {
        __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(bytes + j)));
        __m256i bit = _mm256_and_si256(_mm256_srlv_epi32(b, shift), one);
        _mm256_stream_si256((__m256i *)(o + j), _mm256_xor_si256(s, _mm256_slli_epi32(bit, 31)));
    }
}

/* fp8_rescale with streaming stores (block a multiple of 8; the last block may be partial: its
 * tail past a multiple of 8 is stored normally). The same operations as from_e4m3 (integer
 * rebiasing, an exact int-to-float conversion and scaling by 2**-9, one rounded multiply). */
LIQ_AVX2 static void fp8_rescale_stream(const uint8_t *values, const float *scales, int64_t count, int64_t block,
                                        float *out) {
    const __m256i m7 = _mm256_set1_epi32(0x7F), sign = _mm256_set1_epi32(0x80), seven = _mm256_set1_epi32(7);
    const __m256i bias = _mm256_set1_epi32((int)(120u << 23));
    const __m256 sub_scale = _mm256_set1_ps(0x1p-9f);
    int64_t nb = (count + block - 1) / block;
    for (int64_t b = 0; b < nb; b++) {
        int64_t s = b * block, len = count - s < block ? count - s : block, j = 0;
        const __m256 sc = _mm256_set1_ps(scales[b]);
        for (; j + 8 <= len; j += 8) {
            __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(values + s + j)));
            __m256i em = _mm256_and_si256(c, m7);
            __m256i normal = _mm256_add_epi32(_mm256_slli_epi32(em, 20), bias);
            __m256i sub = _mm256_castps_si256(_mm256_mul_ps(_mm256_cvtepi32_ps(em), sub_scale));
            __m256i v = _mm256_blendv_epi8(sub, normal, _mm256_cmpgt_epi32(em, seven));
            v = _mm256_or_si256(v, _mm256_slli_epi32(_mm256_and_si256(c, sign), 24));
            _mm256_stream_ps(out + s + j, _mm256_mul_ps(_mm256_castsi256_ps(v), sc));
        }
        for (; j < len; j++) out[s + j] = from_e4m3(values[s + j]) * scales[b];
    }
}

static void stream_fence(void) { _mm_sfence(); }
#else
static void sign_run_stream(const uint8_t *bytes, int i, uint32_t sb, int64_t n, uint32_t *o) {
    (void)bytes; (void)i; (void)sb; (void)n; (void)o;
}
static int stream_ok(const void *out, int64_t nbytes) { (void)out; (void)nbytes; return 0; }
#define unpack_scale_group_stream unpack_scale_group
#define block_rescale_stream block_rescale
#define fp8_rescale_stream fp8_rescale
static void bf16_widen_stream(const uint16_t *in, int64_t count, float *out) { (void)in; (void)count; (void)out; }
static uint32_t f32_copy_max_stream(const float *x, int64_t count, float *out) { (void)x; (void)count; (void)out; return 0; }
static void stream_copy(const void *src, int64_t nbytes, void *out) { memcpy(out, src, (size_t)nbytes); }
static void stream_fence(void) {}
#endif

/* 1 if this build on this CPU takes the streaming-store loops for large outputs (for the tests). */
int liq_streaming(void) { return stream_ok((const void *)0, LIQ_STREAM_MIN_BYTES); }

/* Bytes of `count` packed values (pack per byte, group-planar: a partial last group rounds up). */
static int64_t packed_nbytes(int64_t count, int pack) {
    int64_t full = count / LIQ_PACK_GROUP * LIQ_PACK_GROUP;
    return full / pack + (count - full + pack - 1) / pack;
}

/*
 * Blockwise absmax int8/int4/int2 encode of x[0:count] (count from a block- and group-aligned
 * start). Writes ceil(count/block) fp32 scales and the packed values, and, if crc is not NULL,
 * advances crc[0] over the scales' bytes and crc[1] over the values' (checksummed as they are
 * written, from cache). Returns 0, or -1 if out of memory.
 */
int liq_int_encode(const float *x, int64_t count, int64_t block, int bits, float *scales, uint8_t *values,
                   uint32_t *crc) {
    float qmax = (float)((1 << (bits - 1)) - 1);
    int pack = 8 / bits;
    int64_t slab = slab_elems(block, pack, count);
    float *inv = malloc(sizeof(float) * (size_t)((slab + block - 1) / block + 1));
    int8_t *q = pack == 1 ? NULL : malloc((size_t)slab + 1);
    if (!inv || (pack != 1 && !q)) { free(inv); free(q); return -1; }
    crc_cursor cs = crc_start(crc, scales), cv = crc_start(crc ? crc + 1 : NULL, values);
    for (int64_t s = 0; s < count; s += slab) {
        int64_t len = count - s < slab ? count - s : slab;
        float *sc = scales + s / block;
        block_scales(x + s, len, block, qmax, sc, inv);
        if (pack == 1) {
            block_round(x + s, len, block, inv, (int8_t *)values + s);
        } else if ((LIQ_PACK_GROUP / pack) % block == 0) { /* whole groups fused; a partial tail generic */
            int64_t full = len / LIQ_PACK_GROUP * LIQ_PACK_GROUP;
            for (int64_t g = 0; g < full; g += LIQ_PACK_GROUP)
                round_pack_group(x + s + g, inv + g / block, block, bits, values + (s + g) / pack);
            if (full < len) {
                block_round(x + s + full, len - full, block, inv + full / block, q);
                pack_planar(q, len - full, bits, values + (s + full) / pack);
            }
        } else {
            block_round(x + s, len, block, inv, q);
            pack_planar(q, len, bits, values + s / pack);
        }
        int last = s + len == count;
        crc_behind(&cs, scales + (s + len + block - 1) / block, last);
        crc_behind(&cv, values + packed_nbytes(s + len, pack), last);
    }
    free(inv);
    free(q);
    return 0;
}

/* The inverse of liq_int_encode; crc[0] and crc[1] (if not NULL) are advanced over the scales and
 * the values just before the kernel reads them. */
int liq_int_decode(const uint8_t *values, const float *scales, int64_t count, int64_t block, int bits, float *out,
                   uint32_t *crc) {
    int stream = block % 8 == 0 && stream_ok(out, count * (int64_t)sizeof(float));
    int pack = 8 / bits;
    int64_t slab = slab_elems(block, pack, count);
    int8_t *q = pack == 1 ? NULL : malloc((size_t)slab + 1);
    if (pack != 1 && !q) return -1;
    const float *scales_end = scales + (count + block - 1) / block;
    const uint8_t *values_end = values + packed_nbytes(count, pack);
    crc_cursor cs = crc_start(crc, scales), cv = crc_start(crc ? crc + 1 : NULL, values);
    for (int64_t s = 0; s < count; s += slab) {
        int64_t len = count - s < slab ? count - s : slab;
        crc_ahead(&cs, scales + (s + len + block - 1) / block, scales_end);
        crc_ahead(&cv, values + packed_nbytes(s + len, pack), values_end);
        if (pack == 1) {
            if (stream)
                block_rescale_stream((const int8_t *)values + s, len, block, scales + s / block, out + s);
            else
                block_rescale((const int8_t *)values + s, len, block, scales + s / block, out + s);
        } else if ((LIQ_PACK_GROUP / pack) % block == 0) {
            int64_t full = len / LIQ_PACK_GROUP * LIQ_PACK_GROUP;
            for (int64_t g = 0; g < full; g += LIQ_PACK_GROUP) {
                const uint8_t *in = values + (s + g) / pack;
                if (stream)
                    unpack_scale_group_stream(in, scales + (s + g) / block, block, bits, out + s + g);
                else
                    unpack_scale_group(in, scales + (s + g) / block, block, bits, out + s + g);
            }
            if (full < len) {
                unpack_planar(values + (s + full) / pack, len - full, bits, q);
                block_rescale(q, len - full, block, scales + (s + full) / block, out + s + full);
            }
        } else {
            unpack_planar(values + s / pack, len, bits, q);
            block_rescale(q, len, block, scales + s / block, out + s);
        }
    }
    free(q);
    if (stream) stream_fence();
    return 0;
}

/*
 * sign codec: one bit per value (1 = negative, -0.0 included), scale = the block's mean |x|.
 * The mean is the float64 sum over a fixed pairwise tree of `span` leaves (span a power of two
 * >= block; leaves past the block's length are zero): t[i] += t[i + w] for w = span/2, ..., 1,
 * then t[0] / len rounded to fp32, the same IEEE operations in the same order as the torch path.
 */
/* GCC >= 9 and clang: vector extensions with __builtin_convertvector for the tree's fast path */
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 9)
#define LIQ_VEC_TREE 1
typedef double liq_v8d __attribute__((vector_size(64)));
typedef float liq_v8f __attribute__((vector_size(32)));
typedef int64_t liq_v8l __attribute__((vector_size(64)));
#else
#define LIQ_VEC_TREE 0
#endif

LIQ_HOT static void block_mean_abs(const float *restrict x, int64_t count, int64_t block, int64_t span,
                                   double *restrict t, float *restrict scales) {
    int64_t nb = (count + block - 1) / block;
    for (int64_t b = 0; b < nb; b++) {
        int64_t s = b * block, len = count - s < block ? count - s : block;
        const float *xs = x + s;
        double r;
        if (LIQ_VEC_TREE && len == span && span >= 16) {
#if LIQ_VEC_TREE
            /* a whole power-of-two block, eight leaves per vector: the first level straight from x,
             * the levels down to w = 8 on whole vectors, the last three on the lanes of one */
            const liq_v8l abs_mask = (liq_v8l){0} + INT64_MAX;
            int64_t h = span / 2, nv = h / 8;
            liq_v8d *tv = (liq_v8d *)t; /* t is 64-byte aligned */
            for (int64_t i = 0; i < nv; i++) {
                liq_v8f lo, hi;
                memcpy(&lo, xs + 8 * i, sizeof lo);
                memcpy(&hi, xs + h + 8 * i, sizeof hi);
                liq_v8d a = __builtin_convertvector(lo, liq_v8d), c = __builtin_convertvector(hi, liq_v8d);
                tv[i] = (liq_v8d)((liq_v8l)a & abs_mask) + (liq_v8d)((liq_v8l)c & abs_mask); /* exact |.| */
            }
            for (int64_t w = nv / 2; w >= 1; w /= 2)
                for (int64_t i = 0; i < w; i++) tv[i] += tv[i + w];
            liq_v8d v = tv[0];
            double a0 = v[0] + v[4], a1 = v[1] + v[5], a2 = v[2] + v[6], a3 = v[3] + v[7];
            r = (a0 + a2) + (a1 + a3);
#endif
        } else { /* levels whose partners are all zero leaves add exact zeros: skip them */
            int64_t sp = 1;
            while (sp < len) sp *= 2;
            sp = sp < span ? sp : span;
            for (int64_t j = 0; j < len; j++) t[j] = fabs((double)xs[j]);
            for (int64_t j = len; j < sp; j++) t[j] = 0.0;
            for (int64_t w = sp / 2; w >= 1; w /= 2) {
                double *restrict lo = t, *restrict hi = t + w;
                for (int64_t i = 0; i < w; i++) lo[i] += hi[i];
            }
            r = t[0];
        }
        scales[b] = (float)(r / (double)len);
    }
}

/* Sign bits of x[0:count] packed group-planar, 8 per byte (count may end in a partial group). */
LIQ_HOT static void pack_signs(const float *restrict x, int64_t count, uint8_t *restrict out) {
    const uint32_t *xb = (const uint32_t *)x;
    for (int64_t g = 0; g < count; g += LIQ_PACK_GROUP) {
        int64_t rem = count - g < LIQ_PACK_GROUP ? count - g : LIQ_PACK_GROUP;
        int64_t per = (rem + 7) / 8;
        const uint32_t *src = xb + g;
        uint8_t *dst = out + g / 8;
        if (per * 8 == rem) {
            for (int64_t j = 0; j < per; j++) {
                uint32_t byte = 0;
                for (int i = 0; i < 8; i++) byte |= (src[j + i * per] >> 31) << i;
                dst[j] = (uint8_t)byte;
            }
        } else {
            for (int64_t j = 0; j < per; j++) {
                uint32_t byte = 0;
                for (int i = 0; i < 8; i++) {
                    int64_t idx = j + i * per;
                    byte |= (idx < rem ? src[idx] >> 31 : 0u) << i;
                }
                dst[j] = (uint8_t)byte;
            }
        }
    }
}

/* out[0:count] = the scale of each value's block with its sign bit flipped where the value's bit is
 * set (a bit operation, as the torch path's, whatever bits a payload's scales hold); count from a
 * block- and group-aligned start. */
LIQ_HOT static void unpack_signs(const uint8_t *restrict in, const float *restrict scales, int64_t count, int64_t block,
                                 float *restrict out, int stream) {
    uint32_t *ob = (uint32_t *)out;
    for (int64_t g = 0; g < count; g += LIQ_PACK_GROUP) {
        int64_t rem = count - g < LIQ_PACK_GROUP ? count - g : LIQ_PACK_GROUP;
        int64_t per = (rem + 7) / 8;
        const uint8_t *src = in + g / 8;
        int whole = stream && rem == LIQ_PACK_GROUP; /* runs start and end on multiples of 8 */
        for (int i = 0; i < 8; i++) {
            int64_t e0 = g + i * per, e1 = e0 + per < g + rem ? e0 + per : g + rem;
            for (int64_t e = e0; e < e1;) { /* runs within one block */
                int64_t stop = (e / block + 1) * block;
                stop = stop < e1 ? stop : e1;
                uint32_t sb = f2u(scales[e / block]);
                const uint8_t *bytes = src + (e - e0);
                uint32_t *o = ob + e;
                if (whole)
                    sign_run_stream(bytes, i, sb, stop - e, o);
                else
                    for (int64_t j = 0; j < stop - e; j++) o[j] = sb ^ ((uint32_t)(bytes[j] >> i) & 1u) << 31;
                e = stop;
            }
        }
    }
}

/* sign encode of x[0:count] (count from a block- and group-aligned start); crc as in
 * liq_int_encode. Returns 0, or -1 if out of memory. */
int liq_sign_encode(const float *x, int64_t count, int64_t block, float *scales, uint8_t *values, uint32_t *crc) {
    int64_t span = 1, used = 1;
    while (span < block) span *= 2;
    while (used < count && used < span) used *= 2; /* the tree never needs more leaves than count */
    int64_t slab = slab_elems(block, 8, count);
    double *t = aligned_alloc(64, sizeof(double) * (size_t)(used < 8 ? 8 : used)); /* vectors of 8 */
    if (!t) return -1;
    crc_cursor cs = crc_start(crc, scales), cv = crc_start(crc ? crc + 1 : NULL, values);
    for (int64_t s = 0; s < count; s += slab) {
        int64_t len = count - s < slab ? count - s : slab;
        block_mean_abs(x + s, len, block, span, t, scales + s / block);
        pack_signs(x + s, len, values + s / 8);
        int last = s + len == count;
        crc_behind(&cs, scales + (s + len + block - 1) / block, last);
        crc_behind(&cv, values + packed_nbytes(s + len, 8), last);
    }
    free(t);
    return 0;
}

/* The inverse of liq_sign_encode; crc as in liq_int_decode. */
int liq_sign_decode(const uint8_t *values, const float *scales, int64_t count, int64_t block, float *out,
                    uint32_t *crc) {
    int stream = block % 8 == 0 && stream_ok(out, count * (int64_t)sizeof(float));
    int64_t slab = slab_elems(block, 8, count);
    const float *scales_end = scales + (count + block - 1) / block;
    const uint8_t *values_end = values + packed_nbytes(count, 8);
    crc_cursor cs = crc_start(crc, scales), cv = crc_start(crc ? crc + 1 : NULL, values);
    for (int64_t s = 0; s < count; s += slab) {
        int64_t len = count - s < slab ? count - s : slab;
        crc_ahead(&cs, scales + (s + len + block - 1) / block, scales_end);
        crc_ahead(&cv, values + packed_nbytes(s + len, 8), values_end);
        unpack_signs(values + s / 8, scales + s / block, len, block, out + s, stream);
    }
    if (stream) stream_fence();
    return 0;
}

/* float -> float8_e4m3fn, round to nearest even, for |t| <= 448 (no NaN/overflow handling).
 * One float addition does the rounding: c = 2**(e+20), with e the exponent of |t| raised to e4m3's
 * smallest normal exponent -6, has a float spacing of 2**(e-3), the e4m3 spacing at |t| (2**-9 in
 * the subnormal range), so |t| + c = c + q * 2**(e-3) with q = |t| / 2**(e-3) rounded half to even
 * (0..16). Its bit pattern is c's plus q, and the code is 8 * e + 48 + q: (exponent e + 7, mantissa
 * q - 8) for a normal value, q for a subnormal one, and a carry (q = 16) lands on the next
 * exponent's code. Exact integer work besides the one rounding; checked against the previous
 * two-branch form on every fp32 value of magnitude <= 448. Branch-free, so it vectorizes. */
static inline uint8_t to_e4m3(float t) {
    uint32_t u = f2u(t);
    uint32_t a = u & LIQ_ABS_MASK;
    uint32_t e = a & 0x7F800000u;
    uint32_t c = (e > 0x3C800000u ? e : 0x3C800000u) + (20u << 23); /* 0x3C800000 = 2**-6 */
    uint32_t q = f2u(u2f(a) + u2f(c)) - c;
    uint32_t code = (c >> 20) - 1128u + q; /* (c >> 20) - 1128 = 8 * e + 48 */
    return (uint8_t)(((u >> 24) & 0x80u) | code);
}

LIQ_HOT static void block_fp8(const float *restrict x, int64_t count, int64_t block, const float *restrict inv,
                              uint8_t *restrict v) {
    int64_t nb = (count + block - 1) / block;
    for (int64_t b = 0; b < nb; b++) {
        int64_t s = b * block, len = count - s < block ? count - s : block;
        float r = inv[b];
        for (int64_t j = 0; j < len; j++) v[s + j] = to_e4m3(x[s + j] * r);
    }
}

/* Blockwise fp8 encode; crc as in liq_int_encode. */
int liq_fp8_encode(const float *x, int64_t count, int64_t block, float *scales, uint8_t *values, uint32_t *crc) {
    int64_t slab = slab_elems(block, 1, count);
    float *inv = malloc(sizeof(float) * (size_t)((slab + block - 1) / block + 1));
    if (!inv) return -1;
    crc_cursor cs = crc_start(crc, scales), cv = crc_start(crc ? crc + 1 : NULL, values);
    for (int64_t s = 0; s < count; s += slab) {
        int64_t len = count - s < slab ? count - s : slab;
        block_scales(x + s, len, block, 448.0f, scales + s / block, inv);
        block_fp8(x + s, len, block, inv, values + s);
        int last = s + len == count;
        crc_behind(&cs, scales + (s + len + block - 1) / block, last);
        crc_behind(&cv, values + s + len, last);
    }
    free(inv);
    return 0;
}

/* out = e4m3(v) * scale: the one rounding of the decode. */
LIQ_HOT static void fp8_rescale(const uint8_t *restrict values, const float *restrict scales, int64_t count,
                                int64_t block, float *restrict out) {
    int64_t nb = (count + block - 1) / block;
    for (int64_t b = 0; b < nb; b++) {
        int64_t s = b * block, len = count - s < block ? count - s : block;
        float sc = scales[b];
        for (int64_t j = 0; j < len; j++) out[s + j] = from_e4m3(values[s + j]) * sc;
    }
}

/* The inverse of liq_fp8_encode; crc as in liq_int_decode. */
int liq_fp8_decode(const uint8_t *values, const float *scales, int64_t count, int64_t block, float *out,
                   uint32_t *crc) {
    int stream = block % 8 == 0 && stream_ok(out, count * (int64_t)sizeof(float));
    int64_t slab = slab_elems(block, 1, count);
    crc_cursor cs = crc_start(crc, scales), cv = crc_start(crc ? crc + 1 : NULL, values);
    for (int64_t s = 0; s < count; s += slab) {
        int64_t len = count - s < slab ? count - s : slab;
        crc_ahead(&cs, scales + (s + len + block - 1) / block, scales + (count + block - 1) / block);
        crc_ahead(&cv, values + s + len, values + count);
        if (stream)
            fp8_rescale_stream(values + s, scales + s / block, len, block, out + s);
        else
            fp8_rescale(values + s, scales + s / block, len, block, out + s);
    }
    if (stream) stream_fence();
    return 0;
}

/* Elements per sub-slab of the element-wise kernels (bf16, fp32): 16 KiB of fp32. */
#define LIQ_FLAT_SLAB 4096

/* bf16 = round_half_even(clamp(x, +-max bf16)); returns 1 if x holds NaN/Inf (output undefined).
 * If crc is not NULL, crc[0] is advanced over the output bytes. A large output is written with
 * streaming stores from an L1 staging buffer, which is checksummed first. */
int liq_bf16_encode(const float *x, int64_t count, uint16_t *out, uint32_t *crc) {
    uint32_t worst = 0;
    int stream = stream_ok(out, count * (int64_t)sizeof(uint16_t));
    uint16_t stage[LIQ_FLAT_SLAB] __attribute__((aligned(64)));
    crc_cursor c = crc_start(crc, out);
    for (int64_t s = 0; s < count; s += LIQ_FLAT_SLAB) {
        int64_t len = count - s < LIQ_FLAT_SLAB ? count - s : LIQ_FLAT_SLAB;
        uint32_t w;
        if (stream) {
            w = bf16_round(x + s, len, stage);
            if (crc) *crc = crc32_update(*crc, stage, len * (int64_t)sizeof(uint16_t));
            stream_copy(stage, len * (int64_t)sizeof(uint16_t), out + s);
        } else {
            w = bf16_round(x + s, len, out + s);
            crc_behind(&c, out + s + len, s + len == count);
        }
        worst = w > worst ? w : worst;
    }
    if (stream) stream_fence();
    return worst >= LIQ_INF_BITS;
}

/* out = bf16 bits << 16; crc[0] (if not NULL) is advanced over the input bytes. */
int liq_bf16_decode(const uint16_t *in, int64_t count, float *out, uint32_t *crc) {
    int stream = stream_ok(out, count * (int64_t)sizeof(float));
    crc_cursor c = crc_start(crc, in);
    for (int64_t s = 0; s < count; s += LIQ_FLAT_SLAB) {
        int64_t len = count - s < LIQ_FLAT_SLAB ? count - s : LIQ_FLAT_SLAB;
        crc_ahead(&c, in + s + len, in + count);
        if (stream)
            bf16_widen_stream(in + s, len, out + s);
        else
            bf16_widen(in + s, len, (uint32_t *)(out + s));
    }
    if (stream) stream_fence();
    return 0;
}

/* Copy with a finiteness check; returns 1 if x holds NaN/Inf. crc[0] (if not NULL) is advanced
 * over the copied bytes (taken from x right after reading it, so encode and decode both use it). */
int liq_f32_copy_checked(const float *x, int64_t count, float *out, uint32_t *crc) {
    uint32_t worst = 0;
    int stream = stream_ok(out, count * (int64_t)sizeof(float));
    crc_cursor c = crc_start(crc, x);
    for (int64_t s = 0; s < count; s += LIQ_FLAT_SLAB) {
        int64_t len = count - s < LIQ_FLAT_SLAB ? count - s : LIQ_FLAT_SLAB;
        uint32_t w = stream ? f32_copy_max_stream(x + s, len, out + s) : f32_copy_max(x + s, len, out + s);
        crc_behind(&c, x + s + len, s + len == count);
        worst = w > worst ? w : worst;
    }
    if (stream) stream_fence();
    return worst >= LIQ_INF_BITS;
}

/*
 * Top-k selection by magnitude, exact and in index order (magnitudes compare as their bits: the
 * order of non-negative floats is that of their bit patterns), in one pass over x:
 *   1. liq_topk_pick: for a band [lo, hi) of magnitudes that should hold the k-th largest (the
 *      caller guesses it from a sample), every entry >= lo with its index, in order, and how many
 *      of them are >= hi; the caller checks the guess, finds the exact threshold among the entries
 *      inside the band and keeps those above it plus the first ones equal to it (a short list:
 *      about k entries);
 *   1'. if the guess was poor, liq_topk_hist (a histogram of |x| bits >> 20: the exponent and 3
 *      mantissa bits) finds the bucket that holds the k-th largest, and that bucket is the band.
 * The caller splits x into ranges and concatenates their picks in range order, so the selected set
 * is "the k largest magnitudes, ties at the k-th broken towards lower indices". Indices are int32:
 * the fused top-k serves vectors of at most 2**31 entries (8 GiB of fp32; longer ones take the torch
 * path), which halves what the pick and the keep write for them.
 */
#define LIQ_TOPK_SHIFT 20
#define LIQ_TOPK_BUCKETS 2048
#define LIQ_TOPK_CHUNK (1 << 28) /* elements per uint32 sub-histogram flush */

/* hist[2048] += bucket counts of x[0:count]; returns 1 if x holds NaN/Inf (hist then undefined). */
LIQ_HOT int liq_topk_hist(const float *restrict x, int64_t count, int64_t *restrict hist) {
    const uint32_t *xb = (const uint32_t *)x;
    uint32_t *sub = calloc(4 * LIQ_TOPK_BUCKETS, sizeof(uint32_t)); /* 4 copies break store-load chains */
    if (!sub) return -1;
    uint32_t worst = 0;
    for (int64_t s = 0; s < count; s += LIQ_TOPK_CHUNK) {
        int64_t len = count - s < LIQ_TOPK_CHUNK ? count - s : LIQ_TOPK_CHUNK, j = 0;
        const uint32_t *p = xb + s;
        for (; j + 4 <= len; j += 4) {
            uint32_t a0 = p[j] & LIQ_ABS_MASK, a1 = p[j + 1] & LIQ_ABS_MASK;
            uint32_t a2 = p[j + 2] & LIQ_ABS_MASK, a3 = p[j + 3] & LIQ_ABS_MASK;
            uint32_t m01 = a0 > a1 ? a0 : a1, m23 = a2 > a3 ? a2 : a3, m = m01 > m23 ? m01 : m23;
            worst = m > worst ? m : worst;
            sub[a0 >> LIQ_TOPK_SHIFT]++;
            sub[LIQ_TOPK_BUCKETS + (a1 >> LIQ_TOPK_SHIFT)]++;
            sub[2 * LIQ_TOPK_BUCKETS + (a2 >> LIQ_TOPK_SHIFT)]++;
            sub[3 * LIQ_TOPK_BUCKETS + (a3 >> LIQ_TOPK_SHIFT)]++;
        }
        for (; j < len; j++) {
            uint32_t a = p[j] & LIQ_ABS_MASK;
            worst = a > worst ? a : worst;
            sub[a >> LIQ_TOPK_SHIFT]++;
        }
        for (int b = 0; b < LIQ_TOPK_BUCKETS; b++) {
            hist[b] += (int64_t)sub[b] + sub[LIQ_TOPK_BUCKETS + b] + sub[2 * LIQ_TOPK_BUCKETS + b] +
                       sub[3 * LIQ_TOPK_BUCKETS + b];
        }
        memset(sub, 0, 4 * LIQ_TOPK_BUCKETS * sizeof(uint32_t));
    }
    free(sub);
    return worst >= LIQ_INF_BITS;
}

#define LIQ_TOPK_BLOCK 16 /* entries tested together (vectorized) before any scalar work */

/* Per 16-entry block b of p[0:16*nblocks]: flag[b] = whether it holds an |x| bit pattern >= l;
 * *bad |= nonzero if it holds NaN/Inf. Returns how many entries are >= h. */
LIQ_HOT static int64_t pick_blocks(const uint32_t *restrict p, int nblocks, uint32_t l, uint32_t h,
                                   uint8_t *restrict flag, uint32_t *restrict bad) {
    uint32_t n_bad = 0;
    int64_t n_above = 0;
    for (int b = 0; b < nblocks; b++) {
        uint32_t n_hi = 0, n_lo = 0;
        for (int j = 0; j < LIQ_TOPK_BLOCK; j++) {
            uint32_t a = p[b * LIQ_TOPK_BLOCK + j] & LIQ_ABS_MASK;
            n_bad |= a >= LIQ_INF_BITS;
            n_hi += a >= h;
            n_lo += a >= l;
        }
        n_above += n_hi;
        flag[b] = n_lo != 0;
    }
    *bad |= n_bad;
    return n_above;
}

/* The entries of one 16-entry block with |x| bits >= l: indices (first + j) into idx, values into
 * vals, in order; returns how many. Branch-free: every entry is stored at the write position,
 * which advances only for the kept ones (so 16 slots must be free). */
LIQ_HOT static int pick_block(const float *restrict x, int64_t first, uint32_t l, int32_t *restrict idx,
                              float *restrict vals) {
    const uint32_t *xb = (const uint32_t *)x;
    int m = 0;
    for (int j = 0; j < LIQ_TOPK_BLOCK; j++) {
        idx[m] = (int32_t)(first + j);
        vals[m] = x[j];
        m += (xb[j] & LIQ_ABS_MASK) >= l;
    }
    return m;
}

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__)
/* pick_blocks with two 512-bit compares per block and a mask population count (the compiler
 * vectorizes the portable loop across blocks instead, transposing 16 blocks at a time: 1.5x
 * slower on a 64 MiB vector). */
__attribute__((target("avx512f,popcnt"))) static int64_t pick_blocks_avx512(
    const uint32_t *restrict p, int nblocks, uint32_t l, uint32_t h, uint8_t *restrict flag, uint32_t *restrict bad) {
    const __m512i absm = _mm512_set1_epi32((int)LIQ_ABS_MASK), vl = _mm512_set1_epi32((int)l);
    const __m512i vh = _mm512_set1_epi32((int)h), vinf = _mm512_set1_epi32((int)LIQ_INF_BITS);
    __mmask16 n_bad = 0;
    int64_t n_above = 0;
    for (int b = 0; b < nblocks; b++) {
        __m512i a = _mm512_and_si512(_mm512_loadu_si512(p + b * LIQ_TOPK_BLOCK), absm);
        n_above += __builtin_popcount((unsigned)_mm512_cmpge_epu32_mask(a, vh));
        n_bad |= _mm512_cmpge_epu32_mask(a, vinf);
        flag[b] = _mm512_cmpge_epu32_mask(a, vl) != 0;
    }
    *bad |= n_bad != 0;
    return n_above;
}

/* pick_block with compress instructions (into registers: Zen 4 microcodes compress-to-memory). */
__attribute__((target("avx512f,popcnt"))) static int pick_block_avx512(const float *restrict x, int64_t first,
                                                                        uint32_t l, int32_t *restrict idx,
                                                                        float *restrict vals) {
    __m512 v = _mm512_loadu_ps(x);
    __m512i a = _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32((int)LIQ_ABS_MASK));
    __mmask16 keep = _mm512_cmpge_epu32_mask(a, _mm512_set1_epi32((int)l));
    __m512i j = _mm512_maskz_compress_epi32(keep, _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,
                                                                    14, 15));
    _mm512_storeu_ps(vals, _mm512_maskz_compress_ps(keep, v));
    _mm512_storeu_si512(idx, _mm512_add_epi32(_mm512_set1_epi32((int)first), j));
    return __builtin_popcount((unsigned)keep);
}

static int liq_pick_avx512;

__attribute__((constructor)) static void liq_pick_init(void) {
    __builtin_cpu_init(); /* needed before __builtin_cpu_supports in a constructor */
    liq_pick_avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("popcnt");
}
#else
static const int liq_pick_avx512 = 0;
#define pick_blocks_avx512 pick_blocks
#define pick_block_avx512 pick_block
#endif

#define LIQ_TOPK_CHUNK_PICK 1024 /* entries per L1-resident chunk of liq_topk_pick */

/* One pass for a guessed threshold band [lo, hi) of |x| bits: every entry of x[0:count] whose
 * magnitude is >= lo, in order, its index (plus base) into idx and its value into vals; *above =
 * how many of them are >= hi. The caller finds the threshold among those inside the band and keeps
 * what is above it (plus ties), without a second pass over x. Returns how many were written, -1 if
 * that would exceed cap - 16 (the guess was poor: the caller falls back to the histogram), or -2
 * if x holds NaN/Inf. Per chunk, a vectorized loop counts and flags the 16-entry blocks that hold an
 * entry >= lo; only flagged blocks are then scanned. */
LIQ_HOT int64_t liq_topk_pick(const float *restrict x, int64_t count, int64_t base, int64_t lo, int64_t hi,
                              int32_t *restrict idx, float *restrict vals, int64_t cap, int64_t *restrict above) {
    const uint32_t *xb = (const uint32_t *)x;
    uint32_t l = (uint32_t)lo, h = (uint32_t)hi, bad = 0;
    int64_t m = 0, n_above = 0;
    uint8_t flag[LIQ_TOPK_CHUNK_PICK / LIQ_TOPK_BLOCK];
    for (int64_t c0 = 0; c0 < count; c0 += LIQ_TOPK_CHUNK_PICK) {
        const uint32_t *p = xb + c0;
        int64_t len = count - c0 < LIQ_TOPK_CHUNK_PICK ? count - c0 : LIQ_TOPK_CHUNK_PICK;
        int nblocks = (int)(len / LIQ_TOPK_BLOCK);
        n_above += liq_pick_avx512 ? pick_blocks_avx512(p, nblocks, l, h, flag, &bad)
                                   : pick_blocks(p, nblocks, l, h, flag, &bad);
        for (int b = 0; b < nblocks; b++) {
            if (!flag[b]) continue;
            if (m + LIQ_TOPK_BLOCK > cap) return -1;
            int64_t first = c0 + (int64_t)b * LIQ_TOPK_BLOCK;
            m += liq_pick_avx512 ? pick_block_avx512(x + first, base + first, l, idx + m, vals + m)
                                 : pick_block(x + first, base + first, l, idx + m, vals + m);
        }
        for (int64_t j = (int64_t)nblocks * LIQ_TOPK_BLOCK; j < len; j++) { /* the ragged tail */
            uint32_t a = p[j] & LIQ_ABS_MASK;
            bad |= a >= LIQ_INF_BITS;
            n_above += a >= h;
            if (a >= l) {
                if (m == cap) return -1;
                idx[m] = (int32_t)(base + c0 + j);
                vals[m++] = x[c0 + j];
            }
        }
    }
    *above = n_above;
    return bad ? -2 : m;
}

#define LIQ_BAND_BUCKETS 4096 /* buckets of liq_topk_band_hist */
#define LIQ_BAND_FLUSH (1 << 30) /* entries per uint32 sub-histogram flush */

/* Of m |x| bit patterns (the band's, drawn out of the picked entries by liq_topk_band_bits):
 * hist[(a - lo) >> shift] += 1 for each a inside the band [lo, hi), where (hi - lo - 1) >> shift <
 * LIQ_BAND_BUCKETS; returns how many are >= hi (0 for the band's own bits: the caller checks). Entries
 * outside the band count in a spare bucket, so none is written out of place. With the counts the
 * caller finds the one bucket that holds the threshold, without sorting the band. */
LIQ_HOT int64_t liq_topk_band_hist(const float *restrict vals, int64_t m, int64_t lo, int64_t hi, int64_t shift,
                                   int64_t *restrict hist) {
    const uint32_t *vb = (const uint32_t *)vals;
    uint32_t l = (uint32_t)lo, h = (uint32_t)hi, sh = (uint32_t)shift;
    uint32_t sub[2][LIQ_BAND_BUCKETS + 1]; /* two copies break store-load chains on one bucket */
    int64_t n_above = 0;
    for (int64_t s = 0; s < m; s += LIQ_BAND_FLUSH) {
        int64_t len = m - s < LIQ_BAND_FLUSH ? m - s : LIQ_BAND_FLUSH, j = 0;
        const uint32_t *p = vb + s;
        memset(sub, 0, sizeof(sub));
        for (; j + 2 <= len; j += 2) {
            uint32_t a0 = p[j] & LIQ_ABS_MASK, a1 = p[j + 1] & LIQ_ABS_MASK;
            uint32_t in0 = (a0 >= l) & (a0 < h), in1 = (a1 >= l) & (a1 < h);
            n_above += (a0 >= h) + (a1 >= h);
            sub[0][in0 ? (a0 - l) >> sh : LIQ_BAND_BUCKETS]++;
            sub[1][in1 ? (a1 - l) >> sh : LIQ_BAND_BUCKETS]++;
        }
        for (; j < len; j++) {
            uint32_t a = p[j] & LIQ_ABS_MASK, in = (a >= l) & (a < h);
            n_above += a >= h;
            sub[0][in ? (a - l) >> sh : LIQ_BAND_BUCKETS]++;
        }
        for (int b = 0; b < LIQ_BAND_BUCKETS; b++) hist[b] += (int64_t)sub[0][b] + sub[1][b];
    }
    return n_above;
}

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__)
/* liq_topk_band_bits 16 entries at a time, with a compress into a register and a full store. */
__attribute__((target("avx512f,popcnt"))) static int64_t band_bits_avx512(const uint32_t *restrict vb, int64_t m,
                                                                           uint32_t l, uint32_t h,
                                                                           uint32_t *restrict band) {
    const __m512i absm = _mm512_set1_epi32((int)LIQ_ABS_MASK), vl = _mm512_set1_epi32((int)l);
    const __m512i vw = _mm512_set1_epi32((int)(h - l));
    int64_t n = 0, i = 0;
    for (; i + LIQ_TOPK_BLOCK <= m; i += LIQ_TOPK_BLOCK) {
        __m512i a = _mm512_and_si512(_mm512_loadu_si512(vb + i), absm);
        __mmask16 in = _mm512_cmplt_epu32_mask(_mm512_sub_epi32(a, vl), vw); /* l <= a < h */
        _mm512_storeu_si512(band + n, _mm512_maskz_compress_epi32(in, a));
        n += __builtin_popcount((unsigned)in);
    }
    for (; i < m; i++) {
        uint32_t a = vb[i] & LIQ_ABS_MASK;
        band[n] = a;
        n += a - l < h - l;
    }
    return n;
}
#endif

/* Of m picked entries: the |x| bits of those in [lo, hi) (inside the band, or one bucket of it),
 * lo < hi, into band, in order; returns how many. Branch-free: band needs 16 slots more than that.
 * Without AVX-512, 16 entries are tested together and only blocks with one inside are stored. */
int64_t liq_topk_band_bits(const float *restrict vals, int64_t m, int64_t lo, int64_t hi, uint32_t *restrict band) {
    const uint32_t *vb = (const uint32_t *)vals;
    uint32_t l = (uint32_t)lo, w = (uint32_t)hi - (uint32_t)lo;
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__)
    if (liq_pick_avx512) return band_bits_avx512(vb, m, l, (uint32_t)hi, band);
#endif
    int64_t n = 0, i = 0;
    for (; i + LIQ_TOPK_BLOCK <= m; i += LIQ_TOPK_BLOCK) {
        uint32_t any = 0;
        for (int j = 0; j < LIQ_TOPK_BLOCK; j++) any |= ((vb[i + j] & LIQ_ABS_MASK) - l) < w;
        if (!any) continue;
        for (int j = 0; j < LIQ_TOPK_BLOCK; j++) {
            uint32_t a = vb[i + j] & LIQ_ABS_MASK;
            band[n] = a;
            n += a - l < w;
        }
    }
    for (; i < m; i++) {
        uint32_t a = vb[i] & LIQ_ABS_MASK;
        band[n] = a;
        n += a - l < w;
    }
    return n;
}

/* Of m picked entries: how many have |x| bits > thr (returned) and == thr (*equal). */
LIQ_HOT int64_t liq_topk_count(const float *restrict vals, int64_t m, int64_t thr, int64_t *restrict equal) {
    const uint32_t *vb = (const uint32_t *)vals;
    uint32_t t = (uint32_t)thr;
    int64_t gt = 0, eq = 0;
    for (int64_t i = 0; i < m; i++) {
        uint32_t a = vb[i] & LIQ_ABS_MASK;
        gt += a > t;
        eq += a == t;
    }
    *equal = eq;
    return gt;
}

/* Of m picked entries, in order: those with |x| bits > thr, and those == thr while *ties > 0
 * (decremented for each), the first cap of them copied to out_idx / out_vals; returns how many
 * there are (more than cap: the caller's count was wrong). Branch-free: whether an entry is kept is
 * data, not a branch the CPU would mispredict; nothing is stored at or beyond out[cap], so pieces
 * of the picked entries can keep into adjacent parts of one output concurrently. */
int64_t liq_topk_keep(const int32_t *restrict idx, const float *restrict vals, int64_t m, int64_t thr,
                      int64_t *restrict ties, int64_t cap, int32_t *restrict out_idx, float *restrict out_vals) {
    const uint32_t *vb = (const uint32_t *)vals;
    uint32_t t = (uint32_t)thr;
    int64_t n = 0, left = *ties;
    for (int64_t i = 0; i < m; i++) {
        uint32_t a = vb[i] & LIQ_ABS_MASK;
        int64_t tie = a == t, keep = (a > t) | (tie & (left > 0));
        left -= tie & keep;
        if (n < cap) { /* false only past a wrong count: predictable */
            out_idx[n] = idx[i];
            out_vals[n] = vals[i];
        }
        n += keep;
    }
    *ties = left;
    return n;
}

/*
 * Elias-Fano code of k strictly increasing indices below n (layout in codecs/wire.py): the low `low`
 * bits of each index as a little-endian bit stream (low_bytes), then the high parts in unary
 * (bit (idx >> low) + i set, high_bytes). Encode and decode come in parts that run concurrently
 * (as jobs): each writes bytes or indices no other part writes. The encoder reads int32 indices (the
 * fused top-k's, n <= 2**31; the torch path codes any n), the decoder writes int64 ones.
 */

/* Position of index i's mark in the high part. Strictly increasing in i. */
static inline int64_t ef_mark(const int32_t *idx, int64_t i, int low) { return (int64_t)((uint32_t)idx[i] >> low) + i; }

/* 64-bit words of a little-endian byte stream, whatever the host's byte order. */
static inline void store_le64(uint8_t *p, uint64_t w) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    memcpy(p, &w, 8);
#else
    for (int b = 0; b < 8; b++) p[b] = (uint8_t)(w >> (8 * b));
#endif
}

static inline uint64_t load_le64(const uint8_t *p) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    uint64_t w;
    memcpy(&w, p, 8);
    return w;
#else
    uint64_t w = 0;
    for (int b = 0; b < 8; b++) w |= (uint64_t)p[b] << (8 * b);
    return w;
#endif
}

/* Word `word` of the high part out[0:nbytes] = w (only the bytes that exist, for the last word). */
static inline void ef_store_word(uint8_t *out, int64_t nbytes, int64_t word, uint64_t w) {
    int64_t at = 8 * word;
    if (at + 8 <= nbytes) {
        store_le64(out + at, w);
    } else {
        for (; at < nbytes; at++, w >>= 8) out[at] = (uint8_t)w;
    }
}

/* The 64-bit word of the high part that part `part`'s first index marks: the part owns the words
 * from there to the next part's (part 0 from word 0; a part past the last index owns nothing). */
static int64_t ef_first_word(const int32_t *idx, int64_t k, int low, int64_t run, int64_t part, int64_t words) {
    if (part == 0) return 0;
    int64_t i = part * run;
    return i < k ? ef_mark(idx, i, low) >> 6 : words;
}

/* The low bits of idx[i0:i1] (i0 a multiple of 8) into their bytes of low_out[0:low_bytes]; the
 * run that ends at k also writes the zero padding. Up to 8 low bits, each 8 indices fill exactly
 * `low` bytes, assembled in one 64-bit word (no branch per index); more, through an accumulator. */
static void ef_low_run(const int32_t *restrict idx, int64_t k, int low, uint8_t *restrict low_out, int64_t low_bytes,
                       int64_t i0, int64_t i1) {
    uint64_t mask = ~(uint64_t)0 >> (64 - low);
    int64_t at = i0 * low / 8, end = i1 == k ? low_bytes : i1 * low / 8; /* exact: i0, i1 < k multiples of 8 */
    if (low <= 8) {
        int64_t i = i0;
        for (; i < i1; i += 8, at += low) {
            int64_t len = i1 - i < 8 ? i1 - i : 8;
            uint64_t v = 0;
            if (len == 8) {
                for (int j = 0; j < 8; j++) v |= ((uint64_t)(uint32_t)idx[i + j] & mask) << (j * low);
            } else {
                for (int j = 0; j < len; j++) v |= ((uint64_t)(uint32_t)idx[i + j] & mask) << (j * low);
            }
            if (at + 8 <= end) {
                store_le64(low_out + at, v); /* the bytes past `low` are the next group's: written next */
            } else {
                for (int64_t b = at; b < end && b < at + low; b++, v >>= 8) low_out[b] = (uint8_t)v;
            }
        }
        return;
    }
    uint64_t acc = 0;
    int fill = 0; /* bits of acc in use, < 64 */
    for (int64_t i = i0; i < i1; i++) {
        uint64_t lo = (uint64_t)(uint32_t)idx[i] & mask;
        acc |= lo << fill;
        if (fill + low >= 64) {
            store_le64(low_out + at, acc);
            at += 8;
            acc = fill ? lo >> (64 - fill) : 0; /* the bits of lo that did not fit */
            fill += low - 64;
        } else {
            fill += low;
        }
    }
    for (; at < end; at++, acc >>= 8) low_out[at] = (uint8_t)acc;
}

/* Part `part` of `parts` of the code of idx[0:k]: the low bits of its run of indices (a multiple of
 * 8 of them, so the run starts on a byte), and the 64-bit words of the high part that it owns, from
 * the word its run's first index marks to the next part's first word: marks gathered in a register
 * and each word stored once, zeros included. The few indices before the run that mark its first
 * word are its own too; those at the run's end that mark the next part's first word are not (their
 * marks stay in the register).
 * Together the parts write every byte, padding included. Returns 0. */
int liq_ef_encode_part(const int32_t *idx, int64_t k, int low, uint8_t *low_out, int64_t low_bytes, uint8_t *high_out,
                       int64_t high_bytes, int64_t part, int64_t parts) {
    int64_t run = (k + parts - 1) / parts;
    run = (run + 7) / 8 * 8;
    int64_t i0 = part * run < k ? part * run : k, i1 = i0 + run < k ? i0 + run : k;
    int64_t words = (high_bytes + 7) / 8;
    int64_t w0 = ef_first_word(idx, k, low, run, part, words), w1 = ef_first_word(idx, k, low, run, part + 1, words);
    int64_t j0 = i0; /* the first index whose mark lies in word w0 or later */
    while (j0 > 0 && ef_mark(idx, j0 - 1, low) >> 6 >= w0) j0--;
    if (low && i0 < i1) ef_low_run(idx, k, low, low_out, low_bytes, i0, i1);
    uint64_t marks = 0;
    int64_t word = w0;
    for (int64_t i = j0; i < i1; i++) { /* marks in word w1 (the next part's) are never stored */
        int64_t pos = ef_mark(idx, i, low), w = pos >> 6;
        for (; word < w; word++, marks = 0) ef_store_word(high_out, high_bytes, word, marks);
        marks |= (uint64_t)1 << (pos & 63);
    }
    for (; word < w1; word++, marks = 0) ef_store_word(high_out, high_bytes, word, marks);
    return 0;
}

/* Number of set bits in p[0:n]: the index marks before a part of the high part. */
int64_t liq_popcount(const uint8_t *p, int64_t n) {
    int64_t c = 0, i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8); /* the count does not depend on the byte order */
        c += __builtin_popcountll(w);
    }
    for (; i < n; i++) c += __builtin_popcount(p[i]);
    return c;
}

/* Bits [bit, bit + low) of the little-endian bit stream p[0:nbytes] (low <= 62). */
static inline uint64_t ef_low_bits(const uint8_t *p, int64_t nbytes, int64_t bit, int low) {
    int64_t byte = bit >> 3;
    int off = (int)(bit & 7), need = (off + low + 7) >> 3; /* bytes touched, at most 9 */
    uint64_t w = 0;
    if (byte + 8 <= nbytes) {
        w = load_le64(p + byte);
    } else {
        for (int j = 0; j < need && j < 8; j++) w |= (uint64_t)p[byte + j] << (8 * j);
    }
    w >>= off;
    if (need == 9) w |= (uint64_t)p[byte + 8] << (64 - off);
    return w & (~(uint64_t)0 >> (64 - low));
}

/* The indices whose marks lie in high-part bytes [b0, b1), the first of them index number i0 (the
 * marks before b0), into idx[i0:]; the high part is read 64 bits at a time from b0 (the caller
 * cuts the parts at multiples of 8 bytes). Returns how many; -1 if that would pass k; -2 if they do not increase strictly or one is
 * not below n (the caller checks across parts). */
int64_t liq_ef_decode_part(const uint8_t *data, int64_t n, int64_t k, int low, int64_t low_bytes, int64_t b0,
                           int64_t b1, int64_t i0, int64_t *idx) {
    const uint8_t *high = data + low_bytes;
    int64_t i = i0, prev = -1;
    for (int64_t at = b0; at < b1; at += 8) {
        uint64_t w = 0;
        if (at + 8 <= b1) {
            w = load_le64(high + at);
        } else {
            for (int64_t j = at; j < b1; j++) w |= (uint64_t)high[j] << (8 * (j - at));
        }
        while (w) {
            int b = __builtin_ctzll(w);
            w &= w - 1;
            if (i == k) return -1;
            int64_t high_part = (at << 3) + b - i;
            if (high_part < 0) return -2; /* more marks than a strictly increasing sequence can make */
            int64_t v = high_part << low;
            if (low) v |= (int64_t)ef_low_bits(data, low_bytes, i * (int64_t)low, low);
            if (v <= prev || v >= n) return -2;
            idx[i++] = prev = v;
        }
    }
    return i - i0;
}

/* out[start:stop] = 0 except out[idx[i]] = vals[i] for the k increasing indices idx[0:k], all in
 * [start, stop): the dense vector of a top-k payload, written once. A large range is assembled in
 * an L1 buffer, LIQ_FLAT_SLAB values at a time, and streamed out: the output is written without
 * being read (the gaps between kept entries are too short for memset's own streaming stores). */
int liq_topk_scatter(const int64_t *restrict idx, const float *restrict vals, int64_t k, int64_t start, int64_t stop,
                     float *restrict out) {
    int64_t at = start, i = 0;
    int64_t head = (int64_t)((32u - ((uintptr_t)(out + start) & 31u)) & 31u);
    if (head % 4 == 0 && stream_ok(out + start + head / 4, (stop - start - head / 4) * (int64_t)sizeof(float))) {
        float stage[LIQ_FLAT_SLAB] __attribute__((aligned(64)));
        int64_t c = start + head / 4;
        for (; at < c; at++) out[at] = 0.0f; /* the unaligned head (under 8 values) */
        for (; i < k && idx[i] < c; i++) out[idx[i]] = vals[i];
        for (; c < stop; c += LIQ_FLAT_SLAB) {
            int64_t len = stop - c < LIQ_FLAT_SLAB ? stop - c : LIQ_FLAT_SLAB;
            memset(stage, 0, sizeof(float) * (size_t)len);
            for (; i < k && idx[i] < c + len; i++) stage[idx[i] - c] = vals[i];
            stream_copy(stage, len * (int64_t)sizeof(float), out + c);
        }
        stream_fence();
        return 0;
    }
    for (; i < k; i++) {
        int64_t j = idx[i];
        if (j > at) memset(out + at, 0, sizeof(float) * (size_t)(j - at));
        out[j] = vals[i];
        at = j + 1;
    }
    if (stop > at) memset(out + at, 0, sizeof(float) * (size_t)(stop - at));
    return 0;
}

/*
 * Jobs: several kernel calls run concurrently from one foreign call.
 *
 * The Python side splits a vector into one range per thread. Where this library is built with
 * OpenMP against the runtime torch already computes with (GNU libgomp, loaded before this library
 * is), liq_run_jobs runs the ranges on that runtime's thread team: the same threads that finished
 * torch's last parallel operation and are still spinning for more work. Ranges handed instead to
 * threads of our own had to wait for those spinning threads to give up their cores (on the 2-core
 * VM of docs/BENCHMARKS.md, for milliseconds after every torch operation). Each job names a kernel
 * by its index in liq_job_names and passes its arguments as int64 values (pointers, sizes); the
 * kernel is called with its own argument types, and its return value is stored in the job.
 */
typedef struct {
    int64_t kernel;
    int64_t arg[9];
    int64_t result;
} liq_job;

static const char *const liq_job_names[] = {
    "liq_int_encode", "liq_int_decode", "liq_fp8_encode", "liq_fp8_decode", "liq_sign_encode", "liq_sign_decode",
    "liq_bf16_encode", "liq_bf16_decode", "liq_f32_copy_checked", "liq_topk_hist", "liq_topk_pick",
    "liq_topk_scatter", "liq_topk_keep", "liq_ef_encode_part", "liq_popcount", "liq_ef_decode_part",
    "liq_topk_band_hist", "liq_topk_band_bits", "liq_topk_count",
};
#define LIQ_JOB_KINDS ((int)(sizeof(liq_job_names) / sizeof(liq_job_names[0])))
#define LIQ_JOB_UNKNOWN ((int64_t)-1000) /* result of a job whose kernel index is out of range */

/* The index of kernel `name` for liq_job.kernel; -1 if it cannot run as a job. */
int liq_job_id(const char *name) {
    for (int i = 0; i < LIQ_JOB_KINDS; i++)
        if (strcmp(name, liq_job_names[i]) == 0) return i;
    return -1;
}

#define P(i, T) ((T)(intptr_t)a[i])
static int64_t liq_job_call(int64_t kernel, const int64_t *a) {
    switch (kernel) {
    case 0: return liq_int_encode(P(0, const float *), a[1], a[2], (int)a[3], P(4, float *), P(5, uint8_t *),
                                  P(6, uint32_t *));
    case 1: return liq_int_decode(P(0, const uint8_t *), P(1, const float *), a[2], a[3], (int)a[4], P(5, float *),
                                  P(6, uint32_t *));
    case 2: return liq_fp8_encode(P(0, const float *), a[1], a[2], P(3, float *), P(4, uint8_t *), P(5, uint32_t *));
    case 3: return liq_fp8_decode(P(0, const uint8_t *), P(1, const float *), a[2], a[3], P(4, float *),
                                  P(5, uint32_t *));
    case 4: return liq_sign_encode(P(0, const float *), a[1], a[2], P(3, float *), P(4, uint8_t *), P(5, uint32_t *));
    case 5: return liq_sign_decode(P(0, const uint8_t *), P(1, const float *), a[2], a[3], P(4, float *),
                                   P(5, uint32_t *));
    case 6: return liq_bf16_encode(P(0, const float *), a[1], P(2, uint16_t *), P(3, uint32_t *));
    case 7: return liq_bf16_decode(P(0, const uint16_t *), a[1], P(2, float *), P(3, uint32_t *));
    case 8: return liq_f32_copy_checked(P(0, const float *), a[1], P(2, float *), P(3, uint32_t *));
    case 9: return liq_topk_hist(P(0, const float *), a[1], P(2, int64_t *));
    case 10: return liq_topk_pick(P(0, const float *), a[1], a[2], a[3], a[4], P(5, int32_t *), P(6, float *), a[7],
                                  P(8, int64_t *));
    case 11: return liq_topk_scatter(P(0, const int64_t *), P(1, const float *), a[2], a[3], a[4], P(5, float *));
    case 12: return liq_topk_keep(P(0, const int32_t *), P(1, const float *), a[2], a[3], P(4, int64_t *), a[5],
                                  P(6, int32_t *), P(7, float *));
    case 13: return liq_ef_encode_part(P(0, const int32_t *), a[1], (int)a[2], P(3, uint8_t *), a[4], P(5, uint8_t *),
                                       a[6], a[7], a[8]);
    case 14: return liq_popcount(P(0, const uint8_t *), a[1]);
    case 15: return liq_ef_decode_part(P(0, const uint8_t *), a[1], a[2], (int)a[3], a[4], a[5], a[6], a[7],
                                       P(8, int64_t *));
    case 16: return liq_topk_band_hist(P(0, const float *), a[1], a[2], a[3], a[4], P(5, int64_t *));
    case 17: return liq_topk_band_bits(P(0, const float *), a[1], a[2], a[3], P(4, uint32_t *));
    case 18: return liq_topk_count(P(0, const float *), a[1], a[2], P(3, int64_t *));
    default: return LIQ_JOB_UNKNOWN;
    }
}
#undef P

/* Run jobs[0:n], concurrently where built with OpenMP (at most one thread per job, at most the
 * runtime's thread count: more jobs than threads are handed out as threads free up), else one
 * after another. */
void liq_run_jobs(liq_job *jobs, int64_t n) {
#ifdef _OPENMP
    int team = omp_get_max_threads();
    team = n < team ? (int)n : team;
#pragma omp parallel for schedule(dynamic, 1) num_threads(team > 1 ? team : 1) if (n > 1)
#endif
    for (int64_t i = 0; i < n; i++) jobs[i].result = liq_job_call(jobs[i].kernel, jobs[i].arg);
}

/* 1 if liq_run_jobs runs its jobs concurrently (built with OpenMP). */
int liq_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}
