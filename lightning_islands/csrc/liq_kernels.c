/*
 * Fused CPU kernels for the lightning_islands codecs (see lightning_islands/codecs.py for the
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

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__)
#define LIQ_HOT __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define LIQ_HOT
#endif

#define LIQ_PACK_GROUP 2048
#define LIQ_SLAB_TARGET 32768 /* elements per sub-slab: 128 KiB of fp32, L2-resident */
#define LIQ_ABS_MASK 0x7FFFFFFFu
#define LIQ_INF_BITS 0x7F800000u

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

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
        for (int64_t j = 0; j < len; j++) q[s + j] = (int8_t)(int32_t)rintf(x[s + j] * r);
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
 * round and pack in one pass, no int8 temporary. inv/scales point at the group's first block. */
LIQ_HOT static void round_pack_group(const float *restrict x, const float *restrict inv, int64_t block, int bits,
                                     uint8_t *restrict out) {
    if (bits == 4) {
        const int64_t per = LIQ_PACK_GROUP / 2, nbh = per / block;
        for (int64_t bb = 0; bb < nbh; bb++) {
            const float r0 = inv[bb], r1 = inv[nbh + bb];
            const float *restrict x0 = x + bb * block, *restrict x1 = x + per + bb * block;
            uint8_t *restrict o = out + bb * block;
            for (int64_t j = 0; j < block; j++) {
                int32_t q0 = (int32_t)rintf(x0[j] * r0), q1 = (int32_t)rintf(x1[j] * r1);
                o[j] = (uint8_t)((q0 + 8) | ((q1 + 8) << 4));
            }
        }
    } else {
        const int64_t per = LIQ_PACK_GROUP / 4, nbh = per / block;
        for (int64_t bb = 0; bb < nbh; bb++) {
            const float r0 = inv[bb], r1 = inv[nbh + bb], r2 = inv[2 * nbh + bb], r3 = inv[3 * nbh + bb];
            const float *restrict x0 = x + bb * block;
            uint8_t *restrict o = out + bb * block;
            for (int64_t j = 0; j < block; j++) {
                int32_t q0 = (int32_t)rintf(x0[j] * r0), q1 = (int32_t)rintf(x0[j + per] * r1);
                int32_t q2 = (int32_t)rintf(x0[j + 2 * per] * r2), q3 = (int32_t)rintf(x0[j + 3 * per] * r3);
                o[j] = (uint8_t)((q0 + 1) | ((q1 + 1) << 2) | ((q2 + 1) << 4) | ((q3 + 1) << 6));
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

/*
 * Blockwise absmax int8/int4/int2 encode of x[0:count] (count from a block- and group-aligned
 * start). Writes ceil(count/block) fp32 scales and the packed values. Returns 0, or -1 if out of
 * memory.
 */
int liq_int_encode(const float *x, int64_t count, int64_t block, int bits, float *scales, uint8_t *values) {
    float qmax = (float)((1 << (bits - 1)) - 1);
    int pack = 8 / bits;
    int64_t slab = slab_elems(block, pack, count);
    float *inv = malloc(sizeof(float) * (size_t)((slab + block - 1) / block + 1));
    int8_t *q = pack == 1 ? NULL : malloc((size_t)slab + 1);
    if (!inv || (pack != 1 && !q)) { free(inv); free(q); return -1; }
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
    }
    free(inv);
    free(q);
    return 0;
}

int liq_int_decode(const uint8_t *values, const float *scales, int64_t count, int64_t block, int bits, float *out) {
    int pack = 8 / bits;
    int64_t slab = slab_elems(block, pack, count);
    int8_t *q = pack == 1 ? NULL : malloc((size_t)slab + 1);
    if (pack != 1 && !q) return -1;
    for (int64_t s = 0; s < count; s += slab) {
        int64_t len = count - s < slab ? count - s : slab;
        if (pack == 1) {
            block_rescale((const int8_t *)values + s, len, block, scales + s / block, out + s);
        } else if ((LIQ_PACK_GROUP / pack) % block == 0) {
            int64_t full = len / LIQ_PACK_GROUP * LIQ_PACK_GROUP;
            for (int64_t g = 0; g < full; g += LIQ_PACK_GROUP)
                unpack_scale_group(values + (s + g) / pack, scales + (s + g) / block, block, bits, out + s + g);
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
    return 0;
}

/* float -> float8_e4m3fn, round to nearest even, for |t| <= 448 (no NaN/overflow handling).
 * Branch-free so that it vectorizes: both candidate codes are computed and one is selected. */
static inline uint8_t to_e4m3(float t) {
    uint32_t u = f2u(t);
    uint32_t a = u & LIQ_ABS_MASK;
    /* normal range (>= 2**-6): round the 23-bit mantissa to 3 bits, rebias the exponent 127 -> 7 */
    uint32_t normal = ((a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20) - (120u << 3);
    /* subnormal range: multiples of 2**-9 (exact scaling, then round half to even) */
    uint32_t sub = (uint32_t)(int32_t)rintf(u2f(a) * 512.0f);
    uint32_t is_normal = 0u - (uint32_t)(a >= 0x3C800000u); /* all ones or zero: a select without a branch */
    uint32_t code = (normal & is_normal) | (sub & ~is_normal);
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

int liq_fp8_encode(const float *x, int64_t count, int64_t block, float *scales, uint8_t *values) {
    int64_t slab = slab_elems(block, 1, count);
    float *inv = malloc(sizeof(float) * (size_t)((slab + block - 1) / block + 1));
    if (!inv) return -1;
    for (int64_t s = 0; s < count; s += slab) {
        int64_t len = count - s < slab ? count - s : slab;
        block_scales(x + s, len, block, 448.0f, scales + s / block, inv);
        block_fp8(x + s, len, block, inv, values + s);
    }
    free(inv);
    return 0;
}

/* lut: the 256 float8_e4m3fn values as fp32 (exact). out = lut[v] * scale. */
LIQ_HOT int liq_fp8_decode(const uint8_t *restrict values, const float *restrict scales, int64_t count,
                           int64_t block, const float *restrict lut, float *restrict out) {
    int64_t nb = (count + block - 1) / block;
    for (int64_t b = 0; b < nb; b++) {
        int64_t s = b * block, len = count - s < block ? count - s : block;
        float sc = scales[b];
        for (int64_t j = 0; j < len; j++) out[s + j] = lut[values[s + j]] * sc;
    }
    return 0;
}

/* bf16 = round_half_even(clamp(x, +-max bf16)); returns 1 if x holds NaN/Inf (output undefined). */
LIQ_HOT int liq_bf16_encode(const float *restrict x, int64_t count, uint16_t *restrict out) {
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
    return worst >= LIQ_INF_BITS;
}

LIQ_HOT int liq_bf16_decode(const uint16_t *restrict in, int64_t count, float *restrict out) {
    uint32_t *ob = (uint32_t *)out;
    for (int64_t j = 0; j < count; j++) ob[j] = (uint32_t)in[j] << 16;
    return 0;
}

/* Copy with a finiteness check; returns 1 if x holds NaN/Inf. */
LIQ_HOT int liq_f32_copy_checked(const float *restrict x, int64_t count, float *restrict out) {
    const uint32_t *xb = (const uint32_t *)x;
    uint32_t *ob = (uint32_t *)out;
    uint32_t worst = 0;
    for (int64_t j = 0; j < count; j++) {
        uint32_t u = xb[j];
        uint32_t a = u & LIQ_ABS_MASK;
        worst = a > worst ? a : worst;
        ob[j] = u;
    }
    return worst >= LIQ_INF_BITS;
}
