/* A probe for benchmarks/coded_gemv.py: one row's product with a bf16 weight [N, 4096] read as the link codec's
 * blocks (src/vramshard/runtime/wire_codec.py: one block a row), decoded in registers. Not part of the engine.
 *
 * Per 64 words: the sign+mantissa bytes and 32 code bytes are loaded, the nibbles spread to bytes, the exponents
 * looked up with one byte shuffle from the block's table (replicated in each 128-bit lane), the bf16 words' two
 * bytes put together as byte planes, and each 16 words' bytes permuted straight into the top halves of 16 floats
 * (one two-source byte permute, AVX-512 VBMI) and multiplied. Escaped words (code 15, about one a block) got the flag byte
 * as their exponent; their contribution is corrected after, from the block's escape list. Blocks that overflowed
 * are not handled (the probe's weights never do). AVX-512BW and VBMI. */
#include <immintrin.h>
#include <stdint.h>
#include <omp.h>

#define BLOCK 4096
#define SM_AT 16
#define CODES_AT (SM_AT + BLOCK)
#define ESC_AT (CODES_AT + BLOCK / 2)
#define CODED_BLOCK (ESC_AT + 16)

static inline float vs_word_value(uint16_t w) {
    union { uint32_t u; float f; } v = {(uint32_t)w << 16};
    return v.f;
}

/* Output byte 4m+2 of group q: lo[16q+m]; byte 4m+3: hi[16q+m] (index + 64); bytes 4m, 4m+1 zeroed (the mask). */
static uint8_t vs_idx[4][64];

void vs_prepare(void) {
    for (int q = 0; q < 4; q++)
        for (int m = 0; m < 16; m++) {
            vs_idx[q][4 * m] = vs_idx[q][4 * m + 1] = 0;
            vs_idx[q][4 * m + 2] = (uint8_t)(16 * q + m);
            vs_idx[q][4 * m + 3] = (uint8_t)(64 + 16 * q + m);
        }
}

static float vs_coded_dot(const uint8_t *blk, const float *x) {
    const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)blk));
    const __m512i low4 = _mm512_set1_epi16(0x0F), sign = _mm512_set1_epi8((char)0x80), mant = _mm512_set1_epi8(0x7F);
    const __mmask64 upper = 0xCCCCCCCCCCCCCCCCull;
    const __m512i idx[4] = {_mm512_loadu_si512(vs_idx[0]), _mm512_loadu_si512(vs_idx[1]), _mm512_loadu_si512(vs_idx[2]),
                            _mm512_loadu_si512(vs_idx[3])};
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps(), acc2 = _mm512_setzero_ps(), acc3 = _mm512_setzero_ps();
    float fix = 0.0f;
    int rank = 0;
    for (long i = 0; i < BLOCK; i += 64) {
        __m512i sm = _mm512_loadu_si512(blk + SM_AT + i);
        __m512i pairs = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(blk + CODES_AT + i / 2)));
        __m512i codes = _mm512_or_si512(_mm512_and_si512(pairs, low4),
                                        _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(pairs, 4), low4), 8));
        __m512i e = _mm512_shuffle_epi8(table, codes);
        __m512i hi = _mm512_or_si512(_mm512_and_si512(sm, sign), _mm512_and_si512(_mm512_srli_epi16(e, 1), mant));
        __m512i lo = _mm512_or_si512(_mm512_and_si512(sm, mant), _mm512_and_si512(_mm512_slli_epi16(e, 7), sign));
        acc0 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_maskz_permutex2var_epi8(upper, lo, idx[0], hi)),
                               _mm512_loadu_ps(x + i), acc0);
        acc1 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_maskz_permutex2var_epi8(upper, lo, idx[1], hi)),
                               _mm512_loadu_ps(x + i + 16), acc1);
        acc2 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_maskz_permutex2var_epi8(upper, lo, idx[2], hi)),
                               _mm512_loadu_ps(x + i + 32), acc2);
        acc3 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_maskz_permutex2var_epi8(upper, lo, idx[3], hi)),
                               _mm512_loadu_ps(x + i + 48), acc3);
        __mmask64 escaped = _mm512_cmpeq_epi8_mask(codes, _mm512_set1_epi8(15));
        while (escaped) {  /* rare: put the word right (its exponent was the flag byte's) */
            int j = __builtin_ctzll(escaped);
            escaped &= escaped - 1;
            uint8_t s = blk[SM_AT + i + j], wrong = blk[15], right = blk[ESC_AT + rank++];
            uint16_t bad = (uint16_t)(((s & 0x80) << 8) | (wrong << 7) | (s & 0x7F));
            uint16_t good = (uint16_t)(((s & 0x80) << 8) | (right << 7) | (s & 0x7F));
            fix += (vs_word_value(good) - vs_word_value(bad)) * x[i + j];
        }
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc0, acc1), _mm512_add_ps(acc2, acc3))) + fix;
}

/* y[r] = sum_k W[r, k] x[k] for N rows of coded blocks (one a row); vs_prepare() first. */
void vs_coded_rows(const uint8_t *coded, long N, const float *x, float *y, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long r = 0; r < N; r++)
        y[r] = vs_coded_dot(coded + r * CODED_BLOCK, x);
}

/* The same product from the raw bf16 rows, the same loop shape (the raw baseline of the same compile). */
void vs_raw_rows(const uint16_t *w, long N, const float *x, float *y, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long r = 0; r < N; r++) {
        const uint16_t *row = w + r * BLOCK;
        __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
        for (long i = 0; i < BLOCK; i += 32) {
            __m512i h = _mm512_loadu_si512(row + i);
            __m512 f0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16));
            __m512 f1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16));
            acc0 = _mm512_fmadd_ps(f0, _mm512_loadu_ps(x + i), acc0);
            acc1 = _mm512_fmadd_ps(f1, _mm512_loadu_ps(x + i + 16), acc1);
        }
        y[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
    }
}
