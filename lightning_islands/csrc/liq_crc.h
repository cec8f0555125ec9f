/*
 * CRC-32 of the payload checksum: zlib's (reflected polynomial 0xEDB88320, initial value and final
 * xor 0xFFFFFFFF), so liq_crc32(c, p, n) == zlib.crc32(bytes(p[0:n]), c). Included by
 * liq_kernels.c, whose kernels checksum each sub-slab they write (or are about to read) while it
 * is in L1, instead of a separate pass over the payload.
 *
 * Large inputs are folded with carry-less multiplication (PCLMULQDQ) where the CPU has it, in four
 * independent 128-bit lanes. The math, in zlib's reflected bit order: 16 message bytes loaded as a
 * little-endian 128-bit value hold a polynomial whose bit i is the coefficient of x^(127-i), so
 * the low qword is its high half H and the high qword its low half L (value H*x^64 + L). Moving a
 * lane D bits forward multiplies it by x^D, i.e. H*(x^(D+64) mod P) + L*(x^D mod P), which stays
 * within 128 bits. A carry-less product of two such reflected qwords comes out multiplied by x
 * (bit m of the product stands for x^(126-m), bit m of the register for x^(127-m)), so the
 * constants are x^(D+63) mod P and x^(D-1) mod P, each written as a reflected qword (bit j is the
 * coefficient of x^(63-j)). The folded 16 bytes are congruent to the message so far, so the table
 * loop over them from a zero register finishes the job (no Barrett reduction needed). The constants
 * were computed with exact GF(2) arithmetic; the tests compare against zlib on many lengths,
 * alignments and initial values.
 */
#ifndef LIQ_CRC_H
#define LIQ_CRC_H

#include <stdint.h>

static uint32_t liq_crc_table[256];
static int liq_crc_level; /* 0: bytes only, 1: PCLMULQDQ, 2: 512-bit VPCLMULQDQ; set at load time */
static int crc_detect_level(void);

__attribute__((constructor)) static void liq_crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0xEDB88320u & (0u - (c & 1u)));
        liq_crc_table[i] = c;
    }
    liq_crc_level = crc_detect_level();
}

/* The raw (unconditioned) CRC register r advanced over p[0:n], a byte at a time. */
static uint32_t crc_bytes(uint32_t r, const uint8_t *p, int64_t n) {
    for (int64_t i = 0; i < n; i++) r = liq_crc_table[(r ^ p[i]) & 0xFFu] ^ (r >> 8);
    return r;
}

/* x86-64 Linux with GCC >= 8 or clang: the CPU check needs the compiler runtime's __cpu_model, which
 * Apple's toolchain does not provide (elsewhere the byte loop runs and the Python side checksums
 * with zlib-ng instead, see liq_crc_fast). */
#if defined(__x86_64__) && defined(__linux__) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 8))
#include <immintrin.h>
#define LIQ_CLMUL __attribute__((target("pclmul,sse4.1")))

/* x^(D+63) mod P (low qword) and x^(D-1) mod P (high qword), reflected: a fold forward by D bits */
#define LIQ_K_FOLD512_LO 0x653D982200000000ull /* D = 512: four lanes of 16 bytes */
#define LIQ_K_FOLD512_HI 0xCAD38E8F00000000ull
#define LIQ_K_FOLD128_LO 0x65673B4600000000ull /* D = 128: one lane onto the next */
#define LIQ_K_FOLD128_HI 0x9BA54C6F00000000ull
#define LIQ_K_FOLD2048_LO 0x7CC8E1E700000000ull /* D = 2048: sixteen lanes (four 512-bit registers) */
#define LIQ_K_FOLD2048_HI 0x03F9F86300000000ull

LIQ_CLMUL static inline __m128i crc_fold16(__m128i x, __m128i k) {
    return _mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11));
}

/* The raw register r advanced over p[0:n], n a multiple of 64 and at least 128. */
LIQ_CLMUL static uint32_t crc_fold(uint32_t r, const uint8_t *p, int64_t n) {
    const __m128i k4 = _mm_set_epi64x((long long)LIQ_K_FOLD512_HI, (long long)LIQ_K_FOLD512_LO);
    const __m128i k1 = _mm_set_epi64x((long long)LIQ_K_FOLD128_HI, (long long)LIQ_K_FOLD128_LO);
    __m128i x0 = _mm_xor_si128(_mm_loadu_si128((const __m128i *)p), _mm_cvtsi32_si128((int)r));
    __m128i x1 = _mm_loadu_si128((const __m128i *)(p + 16));
    __m128i x2 = _mm_loadu_si128((const __m128i *)(p + 32));
    __m128i x3 = _mm_loadu_si128((const __m128i *)(p + 48));
    for (int64_t i = 64; i < n; i += 64) {
        x0 = _mm_xor_si128(crc_fold16(x0, k4), _mm_loadu_si128((const __m128i *)(p + i)));
        x1 = _mm_xor_si128(crc_fold16(x1, k4), _mm_loadu_si128((const __m128i *)(p + i + 16)));
        x2 = _mm_xor_si128(crc_fold16(x2, k4), _mm_loadu_si128((const __m128i *)(p + i + 32)));
        x3 = _mm_xor_si128(crc_fold16(x3, k4), _mm_loadu_si128((const __m128i *)(p + i + 48)));
    }
    __m128i x = _mm_xor_si128(crc_fold16(x0, k1), x1);
    x = _mm_xor_si128(crc_fold16(x, k1), x2);
    x = _mm_xor_si128(crc_fold16(x, k1), x3);
    uint8_t rest[16];
    _mm_storeu_si128((__m128i *)rest, x);
    return crc_bytes(0, rest, 16);
}

#define LIQ_VCLMUL __attribute__((target("avx512f,avx512vl,vpclmulqdq,pclmul,sse4.1")))

LIQ_VCLMUL static inline __m512i crc_fold64(__m512i x, __m512i k, __m512i next) {
    /* 0x96: a ^ b ^ c */
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, k, 0x00), _mm512_clmulepi64_epi128(x, k, 0x11),
                                     next, 0x96);
}

/* crc_fold with 512-bit carry-less multiplies (four per instruction), sixteen lanes: n a multiple
 * of 256 and at least 512. The same math; each of the four 512-bit lanes then folds onto the next
 * (D = 512), and the four 128-bit parts of the result as in crc_fold. */
LIQ_VCLMUL static uint32_t crc_fold_wide(uint32_t r, const uint8_t *p, int64_t n) {
    const __m512i k16 = _mm512_broadcast_i32x4(_mm_set_epi64x((long long)LIQ_K_FOLD2048_HI,
                                                              (long long)LIQ_K_FOLD2048_LO));
    const __m512i k4 = _mm512_broadcast_i32x4(_mm_set_epi64x((long long)LIQ_K_FOLD512_HI,
                                                             (long long)LIQ_K_FOLD512_LO));
    const __m128i k1 = _mm_set_epi64x((long long)LIQ_K_FOLD128_HI, (long long)LIQ_K_FOLD128_LO);
    __m512i x0 = _mm512_xor_si512(_mm512_loadu_si512(p), _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)r)));
    __m512i x1 = _mm512_loadu_si512(p + 64), x2 = _mm512_loadu_si512(p + 128), x3 = _mm512_loadu_si512(p + 192);
    for (int64_t i = 256; i < n; i += 256) {
        x0 = crc_fold64(x0, k16, _mm512_loadu_si512(p + i));
        x1 = crc_fold64(x1, k16, _mm512_loadu_si512(p + i + 64));
        x2 = crc_fold64(x2, k16, _mm512_loadu_si512(p + i + 128));
        x3 = crc_fold64(x3, k16, _mm512_loadu_si512(p + i + 192));
    }
    __m512i x = crc_fold64(crc_fold64(crc_fold64(x0, k4, x1), k4, x2), k4, x3);
    __m128i y = _mm512_extracti32x4_epi32(x, 0);
    y = _mm_xor_si128(crc_fold16(y, k1), _mm512_extracti32x4_epi32(x, 1));
    y = _mm_xor_si128(crc_fold16(y, k1), _mm512_extracti32x4_epi32(x, 2));
    y = _mm_xor_si128(crc_fold16(y, k1), _mm512_extracti32x4_epi32(x, 3));
    uint8_t rest[16];
    _mm_storeu_si128((__m128i *)rest, y);
    return crc_bytes(0, rest, 16);
}

static int crc_detect_level(void) {
    __builtin_cpu_init(); /* needed before __builtin_cpu_supports in a constructor */
    if (!(__builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1"))) return 0;
    return __builtin_cpu_supports("vpclmulqdq") && __builtin_cpu_supports("avx512f")
           && __builtin_cpu_supports("avx512vl") ? 2 : 1;
}
#else
static int crc_detect_level(void) { return 0; }
static uint32_t crc_fold(uint32_t r, const uint8_t *p, int64_t n) { return crc_bytes(r, p, n); }
static uint32_t crc_fold_wide(uint32_t r, const uint8_t *p, int64_t n) { return crc_bytes(r, p, n); }
#endif

/* zlib.crc32(p[0:n], crc) */
static uint32_t crc32_update(uint32_t crc, const void *data, int64_t n) {
    const uint8_t *p = (const uint8_t *)data;
    uint32_t r = ~crc;
    int level = n >= 128 ? liq_crc_level : 0;
    if (level == 2 && n >= 512) {
        int64_t m = n & ~(int64_t)255;
        r = crc_fold_wide(r, p, m);
        p += m;
        n -= m;
    }
    if (level >= 1 && n >= 128) {
        int64_t m = n & ~(int64_t)63;
        r = crc_fold(r, p, m);
        p += m;
        n -= m;
    }
    return ~crc_bytes(r, p, n);
}

/* zlib.crc32 for the Python side (tests, and payload pieces no kernel writes). */
uint32_t liq_crc32(uint32_t crc, const void *data, int64_t n) { return crc32_update(crc, data, n); }

/* 1 if the kernels' CRC-32 is a fold (tens of GB/s); 0 if it is the byte loop (~0.2 GB/s), and the
 * Python side should pass no CRC pointer and checksum with zlib(-ng) instead. */
int liq_crc_fast(void) { return liq_crc_level > 0; }

/*
 * A running checksum of one contiguous region that a kernel walks front to back (the region's
 * bytes in order, whatever the kernel's sub-slabs). Checksumming a few KiB at a time keeps each
 * call efficient (the 512-bit fold runs at ~50 GB/s from 16 KiB up, ~18 GB/s at 1 KiB on the
 * benchmark VM) while the bytes are still in L1/L2. crc may be NULL: no checksum wanted.
 */
#define LIQ_CRC_CHUNK ((int64_t)16 << 10)

typedef struct {
    uint32_t *crc;       /* where the running CRC-32 lives (NULL: none wanted) */
    const uint8_t *done; /* bytes before this are in *crc */
} crc_cursor;

static inline crc_cursor crc_start(uint32_t *crc, const void *region) {
    crc_cursor c = {crc, (const uint8_t *)region};
    return c;
}

/* For output just written: checksum [done, end) once it is at least a chunk, or if last. */
static inline void crc_behind(crc_cursor *c, const void *end, int last) {
    int64_t n = (const uint8_t *)end - c->done;
    if (!c->crc || n <= 0 || (n < LIQ_CRC_CHUNK && !last)) return;
    *c->crc = crc32_update(*c->crc, c->done, n);
    c->done = (const uint8_t *)end;
}

/* For input about to be read: make sure [.., end) is checksummed, reading ahead by up to a chunk
 * (never past limit), so the kernel then reads those bytes from cache. */
static inline void crc_ahead(crc_cursor *c, const void *end, const void *limit) {
    const uint8_t *e = (const uint8_t *)end;
    if (!c->crc || e <= c->done) return;
    const uint8_t *ahead = c->done + LIQ_CRC_CHUNK, *lim = (const uint8_t *)limit;
    if (ahead > lim) ahead = lim;
    if (ahead > e) e = ahead;
    *c->crc = crc32_update(*c->crc, c->done, e - c->done);
    c->done = e;
}

#endif
