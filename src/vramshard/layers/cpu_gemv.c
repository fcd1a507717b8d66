/* Few-row half-precision products on the CPU that read each weight row once: y = x @ W^T.
 *
 * Built by vramshard/layers/cpu_gemv.py with this machine's C compiler (-O3 -march=native -fopenmp)
 * and called through ctypes (the call leaves the GIL free). OpenMP is the one torch loaded
 * (libgomp.so.1 by soname), so its threads are torch's.
 *
 *   vs_rows_times_weight: y[T, N] = x[T, K] @ W[N, K]^T
 *     W  [N, K] bf16 or fp16, row n at W + n * ldw (ldw >= K: a column slice of a wider weight)
 *     x  [T, K] the same dtype, rows contiguous
 *     y  [T, N] float32, rows contiguous
 *   Each weight row is read once and dotted with every row of x (T <= VS_MAX_ROWS), in float32, four
 *   weight rows by up to four rows of x at a time, asking for the next four rows' cache lines while it
 *   reads (on the development machine that took a one-row product from 85-91% of the host's read rate
 *   to 97-101%: benchmarks/kernel_revisions.py).
 *
 *   vs_rows_times_columns: y[T, N] = x[T, K] @ V[K, N] for T <= 4, V stored by rows (row k at V + k * ldv):
 *   a weight kept transposed, as split FFNs' down projections are in host memory. Each thread sums
 *   its own run of V's rows into scratch[thread, T, N] (every byte of V read once, in order, for all T
 *   rows of x), then the threads add the partial sums up.
 *
 *   vs_routed_experts: y[t] = sum over a < k of weights[t, a] * down_e (silu(gate_e x[t]) * up_e x[t]),
 *   e = experts[t, a]: a few tokens' routed experts of a MoE layer, read where they lie in the layer's
 *   stacked weights (gate_up [E, 2F, D], down [E, D, F], rows contiguous at any expert and row stride).
 *   Grouped by expert, each thread dots its share of every routed expert's gate/up rows with the
 *   tokens routed to it, then (after the team has all of them) takes the activation, rounded once to
 *   the weights' dtype, then its runs of output rows (each expert's rows of a run read in one pass),
 *   each row summed over the experts in float32 and rounded once: every routed expert read once, one
 *   OpenMP team and one call for the layer.
 *   vs_amx_rows_times_weight: vs_rows_times_weight's product for 1 to VS_AMX_ROWS rows of bf16 x through the CPU's
 *   matrix tiles (AMX), where the compiler and the CPU have them and the kernel lets this process use them
 *   (vs_amx_ready): y^T = W x^T sixteen weight rows at a time, each thread its blocks of weight rows, each block's
 *   rows loaded straight from W as the tile A (32 columns a step) and x, rearranged once into column pairs, as
 *   the tiles B; each weight row read once for all rows of x. At 64 rows of x it read an 8B FFN's gate at
 *   24.3 GB/s on the 2-core development machine against torch's 14.4 (the one-row kernel: 29.4).
 *   vs_swiglu: y[T, D] = down(silu(G x) * (U x)) for a few rows: a dense FFN's SwiGLU, or a split FFN's CPU
 *   pieces (G, U [R, D] at their row strides; down [D, R] by rows, or stored transposed as split FFNs keep it),
 *   the products as vs_rows_times_weight / vs_rows_times_columns, the activation rounded once to the dtype,
 *   the output too: one call for the part, where three products and torch's activation took the GIL back
 *   between them.
 *   vs_decode_attention: one new token's attention over a sequence's cached keys and values (a paged cache's
 *   rows [L, Hkv, D], by head; query head h reads key/value head h / (H / Hkv)): each thread a run of
 *   positions for every head (flash-decoding), each key and value row read once, a running maximum and sum
 *   in float32, the runs combined and each output rounded once.
 *   vs_decode_attention_rows: the same for one new token of each of several sequences whose rows lie
 *   consecutively in one pool, in one parallel region (a decode batch on the CPU).
 *   vs_transpose: dst[c, r] = src[r, c], a transposed copy of 2-byte elements (copied as bits) in tiles that
 *   stay in the first-level cache, each thread its own run of dst's rows: a split FFN's down projection, kept
 *   transposed in host memory, copied row-major for the products of many rows (torch's copy of that view
 *   runs on one thread, about 1.2 GB/s).
 *   vs_wait_word: spin until a 64-bit word reaches a number or a time has passed: the run-ahead worker's wait
 *   for the word the GPU writes into pinned host memory once a part's input has landed (through ctypes, with
 *   the GIL free; no arithmetic, but this is the project's one C library).
 *   vs_routed_experts_part: vs_wait_word for a run-ahead part's input, vs_routed_experts, then the part's
 *   ticket raised, in one call: the run-ahead worker's host-expert part with no Python (and no wait for the
 *   GIL) between the GPU's word and the ticket the GPU waits for.
 *   vs_swiglu_part: the same for a split dense FFN's CPU part (vs_swiglu).
 * Three ways to the same sums, chosen when compiled: AVX-512 (with AVX512-BF16's pairwise dot
 * products for bf16 where the CPU has them), AVX2 + F16C, and plain C.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define VS_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define VS_AMX 0
#endif

#define VS_MAX_ROWS 16
#define VS_AMX_ROWS 64     /* rows of x vs_amx_rows_times_weight takes */
#define VS_COLUMN_ROWS 4     /* rows of x vs_rows_times_columns takes */
#define VS_MAX_GROUP 16      /* query heads per key/value head vs_decode_attention takes */
#define VS_ATTN_HEADS 128    /* query heads vs_decode_attention takes */
#define VS_ATTN_RUN 64       /* positions at least in each thread's run of vs_decode_attention */
#define VS_ATTN_BLOCK 32     /* positions whose scores vs_decode_attention takes before their values */
#define VS_TILE 64           /* output rows of the routed experts' down products a thread sums at a time, at most */
#ifndef VS_PREFETCH_ROWS      /* (-DVS_PREFETCH_ROWS=0: no prefetching, to compare; benchmarks/kernel_revisions.py) */
#define VS_PREFETCH_ROWS 4   /* weight rows ahead that a block asks for while it reads its own: the next block */
#endif
#define VS_TRANSPOSE_TILE 64 /* rows and columns of vs_transpose's tiles (2 x 8 KB) */
#define VS_BF16 0
#define VS_FP16 1
#define VS_FP32 2  /* routing weights only */

static inline float vs_scalar(int dtype, uint16_t h) {
  if (dtype == VS_BF16) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
  }
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0x1f) bits = sign | 0x7f800000u | (man << 13);
  else if (exp != 0) bits = sign | ((exp + 112) << 23) | (man << 13);
  else if (man == 0) bits = sign;
  else {  /* subnormal: normalize */
    exp = 113;
    while (!(man & 0x400)) { man <<= 1; exp--; }
    bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
  }
  float f;
  memcpy(&f, &bits, 4);
  return f;
#endif
}

/* Ask for the cache line VS_PREFETCH_ROWS rows of stride ld below p. Blocks of weight rows are read one after
 * another, so that is where the next block reads; hardware prefetchers do not cross the 4 KB pages a row
 * of a few thousand elements spans. An address past the weight is never read (a prefetch does not fault). */
static inline void vs_prefetch(const uint16_t *p, long ld) {
  if (VS_PREFETCH_ROWS > 0) __builtin_prefetch((const void *)((uintptr_t)p + (uintptr_t)(VS_PREFETCH_ROWS * ld) * sizeof(uint16_t)), 0, 3);
}

/* The tail of one row (k from `from` to K) dotted with row t of x, in plain C. */
static inline float vs_tail(int dtype, const uint16_t *w, const uint16_t *x, long from, long K) {
  float s = 0.0f;
  for (long k = from; k < K; k++) s += vs_scalar(dtype, w[k]) * vs_scalar(dtype, x[k]);
  return s;
}

/* One vector layer for the three builds: VS_LANES floats a vector (0: plain C only). vs_wide loads
 * VS_LANES half-precision values as floats; vs_hsum adds a vector's lanes. */
#if defined(__AVX512F__)
#define VS_LANES 16
typedef __m512 vs_vec;
#define vs_zero() _mm512_setzero_ps()
#define vs_set1(v) _mm512_set1_ps(v)
#define vs_fma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vs_ld(p) _mm512_loadu_ps(p)
#define vs_st(p, v) _mm512_storeu_ps(p, v)
#define vs_hsum(v) _mm512_reduce_add_ps(v)
static inline __m512 vs_wide(int dtype, const uint16_t *p) {
  __m256i h = _mm256_loadu_si256((const __m256i *)p);
  if (dtype == VS_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  return _mm512_cvtph_ps(h);
}
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define VS_LANES 8
typedef __m256 vs_vec;
#define vs_zero() _mm256_setzero_ps()
#define vs_set1(v) _mm256_set1_ps(v)
#define vs_fma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vs_ld(p) _mm256_loadu_ps(p)
#define vs_st(p, v) _mm256_storeu_ps(p, v)
static inline __m256 vs_wide(int dtype, const uint16_t *p) {
  __m128i h = _mm_loadu_si128((const __m128i *)p);
  if (dtype == VS_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  return _mm256_cvtph_ps(h);
}
static inline float vs_hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
#else
#define VS_LANES 0
#endif

#if VS_LANES
/* `rows` (up to four) rows of x, row stride K, against `weights` (up to four) weight rows at stride ldw:
 * out[t * ldo + j] = W row j . x row t. Sixteen accumulators at most; each weight vector is loaded once
 * for every row of x and each x vector once for every weight row. With AVX512-BF16, bf16 pairs go
 * through its dot products. Inlined where called with constant counts (vs_block_of), so the loops over
 * them unroll and the accumulators stay in registers. */
static inline __attribute__((always_inline)) void vs_block(int dtype, const uint16_t *w, long ldw, long weights,
                                                           const uint16_t *x, long rows, long K, float *out,
                                                           long ldo) {
  const uint16_t *wr[4], *xr[4];
  for (int j = 0; j < 4; j++) wr[j] = w + (j < weights ? j : 0) * ldw;
  for (int t = 0; t < 4; t++) xr[t] = x + (t < rows ? t : 0) * K;
  vs_vec acc[4][4];
  for (int j = 0; j < 4; j++)
    for (int t = 0; t < 4; t++) acc[j][t] = vs_zero();
  long k = 0;
#if defined(__AVX512BF16__)
  if (dtype == VS_BF16) {
    for (; k + 32 <= K; k += 32) {
      __m512bh xv[4];
      for (int t = 0; t < rows; t++) xv[t] = (__m512bh)_mm512_loadu_si512((const void *)(xr[t] + k));
      for (int j = 0; j < weights; j++) {
        vs_prefetch(wr[j] + k, ldw);
        __m512bh wv = (__m512bh)_mm512_loadu_si512((const void *)(wr[j] + k));
        for (int t = 0; t < rows; t++) acc[j][t] = _mm512_dpbf16_ps(acc[j][t], wv, xv[t]);
      }
    }
  }
#endif
  for (; k + VS_LANES <= K; k += VS_LANES) {
    vs_vec xv[4];
    for (int t = 0; t < rows; t++) xv[t] = vs_wide(dtype, xr[t] + k);
    for (int j = 0; j < weights; j++) {
      if ((k * (long)sizeof(uint16_t)) % 64 == 0) vs_prefetch(wr[j] + k, ldw);  /* once a 64-byte line */
      vs_vec wv = vs_wide(dtype, wr[j] + k);
      for (int t = 0; t < rows; t++) acc[j][t] = vs_fma(wv, xv[t], acc[j][t]);
    }
  }
  for (int j = 0; j < weights; j++)
    for (int t = 0; t < rows; t++) out[t * ldo + j] = vs_hsum(acc[j][t]) + vs_tail(dtype, wr[j], xr[t], k, K);
}
#else
static inline void vs_block(int dtype, const uint16_t *w, long ldw, long weights, const uint16_t *x, long rows, long K,
                            float *out, long ldo) {
  for (long j = 0; j < weights; j++)
    for (long t = 0; t < rows; t++) out[t * ldo + j] = vs_tail(dtype, w + j * ldw, x + t * K, 0, K);
}
#endif

/* vs_block with its counts as constants where it matters: four weight rows by one to four rows of x. */
static void vs_block_of(int dtype, const uint16_t *w, long ldw, long weights, const uint16_t *x, long rows, long K,
                        float *out, long ldo) {
  if (weights == 4 && rows == 1) vs_block(dtype, w, ldw, 4, x, 1, K, out, ldo);
  else if (weights == 4 && rows == 2) vs_block(dtype, w, ldw, 4, x, 2, K, out, ldo);
  else if (weights == 4 && rows == 3) vs_block(dtype, w, ldw, 4, x, 3, K, out, ldo);
  else if (weights == 4 && rows == 4) vs_block(dtype, w, ldw, 4, x, 4, K, out, ldo);
  else vs_block(dtype, w, ldw, weights, x, rows, K, out, ldo);  /* the last block's remainder rows */
}

/* Which of the three ways this build took: 2 AVX-512 (3 with AVX512-BF16), 1 AVX2 + F16C, 0 plain C. */
int vs_isa(void) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  return 3;
#elif defined(__AVX512F__)
  return 2;
#elif VS_LANES
  return 1;
#else
  return 0;
#endif
}

/* y[T, N] = x[T, K] @ W[N, K]^T over `threads` OpenMP threads, four weight rows by up to four rows of x
 * at a time. Returns 0, or -1 for arguments it does not take (the caller checks them first; this is the
 * last guard). */
int vs_rows_times_weight(int dtype, const uint16_t *W, long ldw, const uint16_t *x, float *y, long T, long N,
                         long K, int threads) {
  if ((dtype != VS_BF16 && dtype != VS_FP16) || T < 1 || T > VS_MAX_ROWS || N < 0 || K < 1 || ldw < K ||
      threads < 1)
    return -1;
  long blocks = (N + 3) / 4;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (long b = 0; b < blocks; b++) {
    long weights = N - 4 * b < 4 ? N - 4 * b : 4;
    for (long t = 0; t < T; t += 4)
      vs_block_of(dtype, W + 4 * b * ldw, ldw, weights, x + t * K, T - t < 4 ? T - t : 4, K, y + t * N + 4 * b, N);
  }
  return 0;
}

#if VS_AMX
typedef struct {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} vs_tiles;

static int vs_amx_state = 0;  /* 0: not asked yet, 1: this process may use the tiles, -1: it may not */
#endif

/* 1 where vs_amx_rows_times_weight runs here: built with AMX, and the kernel let this process use the tiles'
 * state (Linux asks for that once per process: arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA); else 0. */
int vs_amx_ready(void) {
#if VS_AMX
  if (vs_amx_state == 0) vs_amx_state = syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
  return vs_amx_state == 1;
#else
  return 0;
#endif
}

/* y[T, N] = x[T, K] @ W[N, K]^T as vs_rows_times_weight (bf16; 1 <= T <= VS_AMX_ROWS) through the matrix tiles:
 * per block of 16 weight rows, C^T[16 n, 16 t] += W[16 n, 32 k] . xv[16 k-pairs, 16 t, 2] for up to four blocks
 * of 16 rows of x, over K in steps of 32; the last K % 32 columns and N % 16 rows by the vector kernel. Returns 0,
 * -1 for arguments it does not take, -2 where its buffer could not be allocated, -3 where the tiles are not there
 * (vs_amx_ready). */
int vs_amx_rows_times_weight(const uint16_t *W, long ldw, const uint16_t *x, float *y, long T, long N, long K,
                             int threads) {
  if (T < 1 || T > VS_AMX_ROWS || N < 0 || K < 1 || ldw < K || threads < 1) return -1;
  if (!vs_amx_ready()) return -3;
#if VS_AMX
  long steps = K / 32, whole = steps * 32, blocks = N / 16, groups = (T + 15) / 16, ld = groups * 16;
  /* x's first `whole` columns as column pairs: xv[kk][t] = (x[t][2kk], x[t][2kk + 1]), t < ld (rows of x past T
   * zero). */
  uint32_t *xv = (uint32_t *)aligned_alloc(64, sizeof(uint32_t) * (whole / 2 > 0 ? whole / 2 : 1) * ld);
  if (!xv) return -2;
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (long kk = 0; kk < whole / 2; kk++)
      for (long t = 0; t < ld; t++) {
        uint32_t pair = 0;
        if (t < T) memcpy(&pair, x + t * K + 2 * kk, sizeof pair);
        xv[kk * ld + t] = pair;
      }
    vs_tiles cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int r = 0; r < 7; r++) {  /* 0-3: C^T [16 n, 16 t] float32; 4: W [16 n, 32 k]; 5, 6: xv [16 k-pairs, 16 t] */
      cfg.rows[r] = 16;
      cfg.colsb[r] = 64;
    }
    _tile_loadconfig(&cfg);
    float c[4][16][16];
#pragma omp for schedule(static)
    for (long b = 0; b < blocks; b++) {
      const uint16_t *w = W + b * 16 * ldw;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (long s = 0; s < steps; s++) {
        const uint32_t *xs = xv + s * 16 * ld;
        _tile_loadd(4, w + s * 32, ldw * (long)sizeof(uint16_t));
        _tile_loadd(5, xs, ld * 4);
        _tile_dpbf16ps(0, 4, 5);
        if (groups > 1) {
          _tile_loadd(6, xs + 16, ld * 4);
          _tile_dpbf16ps(1, 4, 6);
        }
        if (groups > 2) {
          _tile_loadd(5, xs + 32, ld * 4);
          _tile_dpbf16ps(2, 4, 5);
        }
        if (groups > 3) {
          _tile_loadd(6, xs + 48, ld * 4);
          _tile_dpbf16ps(3, 4, 6);
        }
      }
      _tile_stored(0, c[0], 64);
      _tile_stored(1, c[1], 64);
      _tile_stored(2, c[2], 64);
      _tile_stored(3, c[3], 64);
      for (long t = 0; t < T; t++)
        for (int n = 0; n < 16; n++)
          y[t * N + b * 16 + n] = c[t / 16][n][t % 16] + (whole < K ? vs_tail(VS_BF16, w + n * ldw, x + t * K, whole, K)
                                                                   : 0.0f);
    }
    _tile_release();
  }
  free(xv);
  for (long n = blocks * 16; n < N; n += 4)  /* the last N % 16 rows */
    for (long t = 0; t < T; t += 4)
      vs_block_of(VS_BF16, W + n * ldw, ldw, N - n < 4 ? N - n : 4, x + t * K, T - t < 4 ? T - t : 4, K,
                  y + t * N + n, N);
  return 0;
#else
  (void)W; (void)x; (void)y;
  return -3;
#endif
}

/* acc[t][0:N] += xs[t][0] * v0[0:N] + xs[t][1] * v1 + xs[t][2] * v2 + xs[t][3] * v3 for each t < T (rows of V;
 * unused ones have x = 0; acc rows at stride N): the four rows of V are read once for all T rows of x. */
static void vs_axpy4(int dtype, const uint16_t *v0, const uint16_t *v1, const uint16_t *v2, const uint16_t *v3,
                     const float xs[][4], long T, long N, float *acc) {
  long n = 0;
#if VS_LANES
  vs_vec b[VS_COLUMN_ROWS][4];
  for (long t = 0; t < T; t++)
    for (int j = 0; j < 4; j++) b[t][j] = vs_set1(xs[t][j]);
  for (; n + VS_LANES <= N; n += VS_LANES) {
    vs_vec w0 = vs_wide(dtype, v0 + n), w1 = vs_wide(dtype, v1 + n), w2 = vs_wide(dtype, v2 + n),
           w3 = vs_wide(dtype, v3 + n);
    for (long t = 0; t < T; t++) {
      vs_vec a = vs_ld(acc + t * N + n);
      a = vs_fma(w0, b[t][0], a);
      a = vs_fma(w1, b[t][1], a);
      a = vs_fma(w2, b[t][2], a);
      a = vs_fma(w3, b[t][3], a);
      vs_st(acc + t * N + n, a);
    }
  }
#endif
  for (; n < N; n++) {
    float w0 = vs_scalar(dtype, v0[n]), w1 = vs_scalar(dtype, v1[n]), w2 = vs_scalar(dtype, v2[n]),
          w3 = vs_scalar(dtype, v3[n]);
    for (long t = 0; t < T; t++) acc[t * N + n] += xs[t][0] * w0 + xs[t][1] * w1 + xs[t][2] * w2 + xs[t][3] * w3;
  }
}

/* y[T, N] = x[T, K] @ V[K, N] (T <= VS_COLUMN_ROWS; V's rows at stride ldv >= N; x, y rows contiguous); scratch
 * holds threads * T * N floats. Returns 0, or -1 for arguments it does not take. */
int vs_rows_times_columns(int dtype, const uint16_t *V, long ldv, const uint16_t *x, float *y, long T, long K, long N,
                          int threads, float *scratch) {
  if ((dtype != VS_BF16 && dtype != VS_FP16) || T < 1 || T > VS_COLUMN_ROWS || K < 1 || N < 1 || ldv < N ||
      threads < 1)
    return -1;
#pragma omp parallel num_threads(threads)
  {
    int u = 0, team = 1;
#ifdef _OPENMP
    u = omp_get_thread_num();
    team = omp_get_num_threads();
#endif
    float *acc = scratch + (long)u * T * N;
    long per = (K + team - 1) / team, first = u * per, last = first + per < K ? first + per : K;
    for (long i = 0; i < T * N; i++) acc[i] = 0.0f;
    for (long k = first; k < last; k += 4) {
      long left = last - k;
      const uint16_t *v0 = V + k * ldv;
      const uint16_t *v1 = left > 1 ? v0 + ldv : v0, *v2 = left > 2 ? v0 + 2 * ldv : v0, *v3 = left > 3 ? v0 + 3 * ldv : v0;
      float xs[VS_COLUMN_ROWS][4];
      for (long t = 0; t < T; t++)
        for (long j = 0; j < 4; j++) xs[t][j] = j < left ? vs_scalar(dtype, x[t * K + k + j]) : 0.0f;
      vs_axpy4(dtype, v0, v1, v2, v3, (const float(*)[4])xs, T, N, acc);
    }
#pragma omp barrier
#pragma omp for schedule(static)
    for (long i = 0; i < T * N; i++) {
      float sum = 0.0f;
      for (int w = 0; w < team; w++) sum += scratch[(long)w * T * N + i];
      y[i] = sum;
    }
  }
  return 0;
}

/* float to the half-precision dtype, rounded to nearest even (as torch rounds). */
static inline uint16_t vs_half(int dtype, float f) {
  uint32_t bits;
  memcpy(&bits, &f, 4);
  if (dtype == VS_BF16) {
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);  /* NaN stays NaN */
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
  }
#if defined(__F16C__)
  return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
  uint32_t sign = (bits >> 16) & 0x8000u, abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);  /* NaN */
  if (abs >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  /* rounds past 65504: infinity */
  if (abs < 0x38800000u) {  /* below the smallest normal half: a subnormal (or zero) */
    if (abs < 0x33000000u) return (uint16_t)sign;
    uint32_t man = (abs & 0x7fffffu) | 0x800000u, shift = 126 - (abs >> 23);  /* 14..24 */
    uint32_t half = man >> shift, rest = man & ((1u << shift) - 1), mid = 1u << (shift - 1);
    if (rest > mid || (rest == mid && (half & 1u))) half++;
    return (uint16_t)(sign | half);
  }
  uint32_t half = ((abs - 0x38000000u) >> 13), rest = abs & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) half++;
  return (uint16_t)(sign | half);
#endif
}

/* A few tokens' routed experts (see the top of the file): x [T, D] (rows contiguous), the experts' weights
 * and y [T, D] (rows contiguous) in `dtype`; experts [T, k] (each in [0, E)) and their routing weights
 * [T, k] in `weights_dtype` (VS_BF16, VS_FP16 or VS_FP32), each at its strides (token, assignment); `keep`
 * [T, k] (at its strides; NULL: all) the assignments computed, the others counting zero and their experts
 * not read. The assignments are grouped by expert, so each expert's rows are read once for all the tokens
 * routed to it. Returns 0, -1 for arguments it does not take, -2 where the scratch could not be allocated. */
int vs_routed_experts(int dtype, const uint16_t *GU, long gu_e, long gu_r, const uint16_t *DN, long dn_e, long dn_r,
                      const uint16_t *x, long T, const int64_t *chosen, long chosen_t, long chosen_a,
                      const void *routing, int weights_dtype, long weights_t, long weights_a, const uint8_t *keep,
                      long keep_t, long keep_a, long k, long D, long F, long E, uint16_t *y, int threads) {
  if ((dtype != VS_BF16 && dtype != VS_FP16) || T < 1 || T > VS_MAX_ROWS || k < 1 || T * k > 4096 || D < 1 ||
      F < 1 || E < 1 || gu_r < D || dn_r < F || threads < 1 ||
      (weights_dtype != VS_BF16 && weights_dtype != VS_FP16 && weights_dtype != VS_FP32))
    return -1;
  for (long t = 0; t < T; t++)
    for (long a = 0; a < k; a++)
      if (chosen[t * chosen_t + a * chosen_a] < 0 || chosen[t * chosen_t + a * chosen_a] >= E) return -1;
  /* The kept assignments, grouped by expert (a counting sort): assignment i of group g is token[i]'s, with
   * weight[i]; group g is expert[g]'s, its assignments from first[g] to first[g + 1]. */
  long *count = (long *)calloc(E + 1, sizeof(long));
  long *token = (long *)malloc(sizeof(long) * T * k), *first = (long *)malloc(sizeof(long) * (T * k + 1));
  int64_t *expert = (int64_t *)malloc(sizeof(int64_t) * T * k);
  float *weight = (float *)malloc(sizeof(float) * T * k);
  uint16_t *xs = (uint16_t *)malloc(sizeof(uint16_t) * T * k * D);  /* [A, D]: each assignment's token */
  float *both = (float *)malloc(sizeof(float) * T * k * 2 * F);  /* [A, 2F]: gate then up */
  uint16_t *act = (uint16_t *)malloc(sizeof(uint16_t) * T * k * F);  /* [A, F] */
  int status = 0;
  if (!count || !token || !first || !expert || !weight || !xs || !both || !act) {
    status = -2;
    goto done;
  }
  for (long t = 0; t < T; t++)
    for (long a = 0; a < k; a++)
      if (!keep || keep[t * keep_t + a * keep_a]) count[chosen[t * chosen_t + a * chosen_a] + 1]++;
  for (long e = 0; e < E; e++) count[e + 1] += count[e];  /* count[e]: where expert e's assignments start */
  long groups = 0, assignments = count[E];
  for (long e = 0; e < E; e++)
    if (count[e + 1] > count[e]) {
      expert[groups] = e;
      first[groups++] = count[e];
    }
  first[groups] = assignments;
  for (long t = 0; t < T; t++)
    for (long a = 0; a < k; a++) {
      if (keep && !keep[t * keep_t + a * keep_a]) continue;
      long i = count[chosen[t * chosen_t + a * chosen_a]]++;
      long w = t * weights_t + a * weights_a;
      token[i] = t;
      weight[i] = weights_dtype == VS_FP32 ? ((const float *)routing)[w]
                                           : vs_scalar(weights_dtype, ((const uint16_t *)routing)[w]);
      memcpy(xs + i * D, x + t * D, sizeof(uint16_t) * D);
    }
  long gate_blocks = (2 * F + 3) / 4;
  long quads = (D + 3) / 4;  /* the down products' output rows by fours, shared out evenly over the threads */
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (long i = 0; i < groups * gate_blocks; i++) {  /* each expert's gate/up rows, once for its tokens */
      long g = i / gate_blocks, b = i % gate_blocks, rows = 2 * F - 4 * b < 4 ? 2 * F - 4 * b : 4;
      const uint16_t *w = GU + expert[g] * gu_e + 4 * b * gu_r;
      for (long s = first[g]; s < first[g + 1]; s += 4) {
        long n = first[g + 1] - s < 4 ? first[g + 1] - s : 4;
        vs_block_of(dtype, w, gu_r, rows, xs + s * D, n, D, both + s * 2 * F + 4 * b, 2 * F);
      }
    }
#pragma omp for schedule(static)
    for (long i = 0; i < assignments * F; i++) {
      long s = i / F, f = i % F;
      float gate = both[s * 2 * F + f], up = both[s * 2 * F + F + f];
      act[i] = vs_half(dtype, gate / (1.0f + expf(-gate)) * up);
    }
#pragma omp for schedule(static)
    for (long c = 0; c < threads; c++) {  /* share c of the output rows (at most one quad more than another's) */
      long end = 4 * (quads * (c + 1) / threads);
      end = end < D ? end : D;
      for (long r0 = 4 * (quads * c / threads); r0 < end; r0 += VS_TILE) {  /* in runs: every expert's rows once */
        long span = end - r0 < VS_TILE ? end - r0 : VS_TILE;
        float sum[VS_MAX_ROWS][VS_TILE], part[4 * 4];
        for (long t = 0; t < T; t++)
          for (long j = 0; j < span; j++) sum[t][j] = 0.0f;
        for (long g = 0; g < groups; g++) {  /* the expert's `span` rows in one run: the next block prefetched */
          const uint16_t *w = DN + expert[g] * dn_e + r0 * dn_r;
          for (long b = 0; b < span; b += 4) {
            long rows = span - b < 4 ? span - b : 4;
            for (long s = first[g]; s < first[g + 1]; s += 4) {
              long n = first[g + 1] - s < 4 ? first[g + 1] - s : 4;
              vs_block_of(dtype, w + b * dn_r, dn_r, rows, act + s * F, n, F, part, 4);
              for (long u = 0; u < n; u++)
                for (long j = 0; j < rows; j++) sum[token[s + u]][b + j] += weight[s + u] * part[u * 4 + j];
            }
          }
        }
        for (long t = 0; t < T; t++)
          for (long j = 0; j < span; j++) y[t * D + r0 + j] = vs_half(dtype, sum[t][j]);
      }
    }
  }
done:
  free(count);
  free(token);
  free(first);
  free(expert);
  free(weight);
  free(xs);
  free(both);
  free(act);
  return status;
}

#define VS_SILU_RUN 256  /* activations a thread takes at a time in vs_swiglu */
static inline void vs_exp_block(float *x, long n);

/* y[T, D] = down(silu(x G^T) * (x U^T)) in `dtype`: G, U [R, D] (row r at G + r * ldg, U + r * ldu; ldg, ldu >= D);
 * down [D, R] by rows (row d at DN + d * ldd, ldd >= R: a column slice of a wider weight), or where `dn_columns`
 * stored transposed (DN [R, D], row r at DN + r * ldd, ldd >= D; T <= VS_COLUMN_ROWS); x, y [T, D] rows
 * contiguous. The gate and up products in float32, the activation rounded once to `dtype`, the down product
 * in float32 rounded once. Returns 0, -1 for arguments it does not take, -2 where its buffers could not be
 * allocated. */
int vs_swiglu(int dtype, const uint16_t *G, long ldg, const uint16_t *U, long ldu, const uint16_t *DN, long ldd,
              int dn_columns, const uint16_t *x, long T, long D, long R, uint16_t *y, int threads) {
  /* Past VS_COLUMN_ROWS rows of bf16, down by rows: the products through the matrix tiles, where they are here. */
  int tiles = dtype == VS_BF16 && T > VS_COLUMN_ROWS && !dn_columns && vs_amx_ready();
  if ((dtype != VS_BF16 && dtype != VS_FP16) || T < 1 || T > (tiles ? VS_AMX_ROWS : VS_MAX_ROWS) || D < 1 || R < 1 ||
      ldg < D || ldu < D || threads < 1 || (dn_columns ? (T > VS_COLUMN_ROWS || ldd < D) : ldd < R))
    return -1;
  float *both = (float *)malloc(sizeof(float) * (2 * T * R + T * D));  /* gate [T, R], up [T, R], out [T, D] */
  uint16_t *act = (uint16_t *)malloc(sizeof(uint16_t) * T * R);
  float *scratch = dn_columns ? (float *)malloc(sizeof(float) * threads * T * D) : NULL;
  int status = 0;
  if (!both || !act || (dn_columns && !scratch)) {
    status = -2;
    goto done;
  }
  float *gate = both, *up = both + T * R, *out = both + 2 * T * R;
  if (tiles) {
    if ((status = vs_amx_rows_times_weight(G, ldg, x, gate, T, R, D, threads)) != 0 ||
        (status = vs_amx_rows_times_weight(U, ldu, x, up, T, R, D, threads)) != 0)
      goto done;
  } else {
    vs_rows_times_weight(dtype, G, ldg, x, gate, T, R, D, threads);
    vs_rows_times_weight(dtype, U, ldu, x, up, T, R, D, threads);
  }
  long runs = (T * R + VS_SILU_RUN - 1) / VS_SILU_RUN;
  /* silu(gate) * up, exp by vectors (with scalar expf a 64-row part ran at 17.9 GB/s here, 21.6 so) */
#pragma omp parallel for num_threads(threads) schedule(static)
  for (long c = 0; c < runs; c++) {
    float e[VS_SILU_RUN];
    long first = c * VS_SILU_RUN, n = T * R - first < VS_SILU_RUN ? T * R - first : VS_SILU_RUN;
    for (long i = 0; i < n; i++) e[i] = -gate[first + i];
    vs_exp_block(e, n);
    for (long i = 0; i < n; i++) act[first + i] = vs_half(dtype, gate[first + i] / (1.0f + e[i]) * up[first + i]);
  }
  if (dn_columns)
    vs_rows_times_columns(dtype, DN, ldd, act, out, T, R, D, threads, scratch);
  else if (tiles && (status = vs_amx_rows_times_weight(DN, ldd, act, out, T, D, R, threads)) != 0)
    goto done;
  else if (!tiles)
    vs_rows_times_weight(dtype, DN, ldd, act, out, T, D, R, threads);
#pragma omp parallel for num_threads(threads) schedule(static)
  for (long i = 0; i < T * D; i++) y[i] = vs_half(dtype, out[i]);
done:
  free(both);
  free(act);
  free(scratch);
  return status;
}

/* a[0:D] (float32) . b[0:D] (dtype). */
static inline float vs_dot_f(int dtype, const float *a, const uint16_t *b, long D) {
  long d = 0;
  float s = 0.0f;
#if VS_LANES
  vs_vec acc = vs_zero();
  for (; d + VS_LANES <= D; d += VS_LANES) acc = vs_fma(vs_ld(a + d), vs_wide(dtype, b + d), acc);
  s = vs_hsum(acc);
#endif
  for (; d < D; d++) s += a[d] * vs_scalar(dtype, b[d]);
  return s;
}

#if VS_LANES
/* 2^f for |f| <= 1/2 (Taylor to degree 6 of exp(f ln 2)). */
static inline vs_vec vs_exp2_fraction(vs_vec f) {
  vs_vec p = vs_set1(1.5403530393381606e-4f);
  p = vs_fma(p, f, vs_set1(1.3333558146428443e-3f));
  p = vs_fma(p, f, vs_set1(9.6181291076284772e-3f));
  p = vs_fma(p, f, vs_set1(5.5504108664821580e-2f));
  p = vs_fma(p, f, vs_set1(2.4022650695910071e-1f));
  p = vs_fma(p, f, vs_set1(6.9314718055994531e-1f));
  return vs_fma(p, f, vs_set1(1.0f));
}
#endif

/* x[0:n] = exp(x[0:n]) in place (scores less their maximum; vs_swiglu's -gate): a polynomial of 2^f after
 * x * log2(e) = i + f, |f| <= 1/2 (Taylor to degree 6: relative error under 1e-7), vector by vector; below
 * -87 it gives about 0, as expf does, and past 88 infinity (AVX-512) or exp(88) (AVX2). */
static inline void vs_exp_block(float *x, long n) {
  long i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    __m512 t = _mm512_mul_ps(_mm512_max_ps(_mm512_loadu_ps(x + i), _mm512_set1_ps(-87.0f)),
                             _mm512_set1_ps(1.44269504088896341f));
    __m512 r = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm512_storeu_ps(x + i, _mm512_scalef_ps(vs_exp2_fraction(_mm512_sub_ps(t, r)), r));
  }
#elif VS_LANES
  for (; i + 8 <= n; i += 8) {
    __m256 t = _mm256_mul_ps(_mm256_min_ps(_mm256_max_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(-87.0f)),
                                           _mm256_set1_ps(88.0f)),
                             _mm256_set1_ps(1.44269504088896341f));
    __m256 r = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(r), _mm256_set1_epi32(127)), 23);
    _mm256_storeu_ps(x + i, _mm256_mul_ps(vs_exp2_fraction(_mm256_sub_ps(t, r)), _mm256_castsi256_ps(e)));
  }
#endif
  for (; i < n; i++) x[i] = expf(x[i]);
}

/* The G query heads' scores of one key/value head for the block's positions: w[g * VS_ATTN_BLOCK + p] =
 * q_g . (key row p at k + p * ld), q_g at qf + g * D (float32, scaled). With G constant (vs_scores_of) each key
 * row is read once for the G heads. */
static inline __attribute__((always_inline)) void vs_scores(int dtype, long G, const float *qf, const uint16_t *k,
                                                            long ld, long count, float *w, long D) {
  for (long p = 0; p < count; p++) {
    const uint16_t *row = k + p * ld;
    long d = 0;
    float sums[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
#if VS_LANES
    vs_vec acc[8];
    for (long g = 0; g < G; g++) acc[g] = vs_zero();
    for (; d + VS_LANES <= D; d += VS_LANES) {
      vs_vec x = vs_wide(dtype, row + d);
      for (long g = 0; g < G; g++) acc[g] = vs_fma(vs_ld(qf + g * D + d), x, acc[g]);
    }
    for (long g = 0; g < G; g++) sums[g] = vs_hsum(acc[g]);
#endif
    for (; d < D; d++) {
      float x = vs_scalar(dtype, row[d]);
      for (long g = 0; g < G; g++) sums[g] += qf[g * D + d] * x;
    }
    for (long g = 0; g < G; g++) w[g * VS_ATTN_BLOCK + p] = sums[g];
  }
}

/* The G query heads' outputs of one key/value head (out0 + g * (D + 2), D floats each) += sum over p < count of
 * w[g * VS_ATTN_BLOCK + p] * (value row p at v + p * ld). With G constant (vs_values_of) the G outputs' lanes
 * stay in registers over the block. */
static inline __attribute__((always_inline)) void vs_values(int dtype, long G, const uint16_t *v, long ld, long count,
                                                            const float *w, float *out0, long D) {
  long d = 0;
#if VS_LANES
  for (; d + VS_LANES <= D; d += VS_LANES) {
    vs_vec acc[8];
    for (long g = 0; g < G; g++) acc[g] = vs_ld(out0 + g * (D + 2) + d);
    for (long p = 0; p < count; p++) {
      vs_vec x = vs_wide(dtype, v + p * ld + d);
      for (long g = 0; g < G; g++) acc[g] = vs_fma(vs_set1(w[g * VS_ATTN_BLOCK + p]), x, acc[g]);
    }
    for (long g = 0; g < G; g++) vs_st(out0 + g * (D + 2) + d, acc[g]);
  }
#endif
  for (; d < D; d++)
    for (long p = 0; p < count; p++) {
      float x = vs_scalar(dtype, v[p * ld + d]);
      for (long g = 0; g < G; g++) out0[g * (D + 2) + d] += w[g * VS_ATTN_BLOCK + p] * x;
    }
}

/* vs_scores and vs_values with G as a constant where it is 1, 2, 4 or 8; another G (up to VS_MAX_GROUP) eight
 * heads at a time. */
static void vs_scores_of(int dtype, long G, const float *qf, const uint16_t *k, long ld, long count, float *w, long D) {
  switch (G) {
    case 1: vs_scores(dtype, 1, qf, k, ld, count, w, D); return;
    case 2: vs_scores(dtype, 2, qf, k, ld, count, w, D); return;
    case 4: vs_scores(dtype, 4, qf, k, ld, count, w, D); return;
    case 8: vs_scores(dtype, 8, qf, k, ld, count, w, D); return;
  }
  for (long g = 0; g < G; g += 8)
    vs_scores(dtype, G - g < 8 ? G - g : 8, qf + g * D, k, ld, count, w + g * VS_ATTN_BLOCK, D);
}

static void vs_values_of(int dtype, long G, const uint16_t *v, long ld, long count, const float *w, float *out0,
                         long D) {
  switch (G) {
    case 1: vs_values(dtype, 1, v, ld, count, w, out0, D); return;
    case 2: vs_values(dtype, 2, v, ld, count, w, out0, D); return;
    case 4: vs_values(dtype, 4, v, ld, count, w, out0, D); return;
    case 8: vs_values(dtype, 8, v, ld, count, w, out0, D); return;
  }
  for (long g = 0; g < G; g += 8)
    vs_values(dtype, G - g < 8 ? G - g : 8, v, ld, count, w + g * VS_ATTN_BLOCK, out0 + g * (D + 2), D);
}

/* One run of positions [first, last) of one sequence's attention (see vs_decode_attention): each query head's
 * running maximum, sum and output (mine + h * (D + 2): maximum, sum, D floats), from qf (q * scale in float32). */
static void vs_attention_run(int dtype, long H, long D, long Hkv, const float *qf, const uint16_t *K, const uint16_t *V,
                             long ld, long hd, long first, long last, float *mine) {
  long G = H / Hkv;
  float w[VS_ATTN_HEADS * VS_ATTN_BLOCK];  /* the block's scores, then weights, by query head */
  for (long h = 0; h < H; h++) {
    mine[h * (D + 2)] = -INFINITY;
    mine[h * (D + 2) + 1] = 0.0f;
    for (long d = 0; d < D; d++) mine[h * (D + 2) + 2 + d] = 0.0f;
  }
  for (long b = first; b < last; b += VS_ATTN_BLOCK) {
    long count = last - b < VS_ATTN_BLOCK ? last - b : VS_ATTN_BLOCK;
    /* The next block's key and value rows, asked for now: the heads below read each row in pieces of D elements at
     * the row's stride, which the hardware's prefetchers do not follow across pages. */
    long ahead = last - (b + count) < VS_ATTN_BLOCK ? last - (b + count) : VS_ATTN_BLOCK;
    for (long p = 0; p < ahead; p++)
      for (long e = 0; e < Hkv * hd; e += 32) {  /* 64-byte lines */
        __builtin_prefetch((const void *)(K + (b + count + p) * ld + e), 0, 3);
        __builtin_prefetch((const void *)(V + (b + count + p) * ld + e), 0, 3);
      }
    for (long j = 0; j < Hkv; j++)  /* the scores: each key row once for the head's G query heads */
      vs_scores_of(dtype, G, qf + j * G * D, K + b * ld + j * hd, ld, count, w + j * G * VS_ATTN_BLOCK, D);
    for (long h = 0; h < H; h++) {  /* their weights against each head's running maximum */
      float *state = mine + h * (D + 2), *acc = state + 2, *wh = w + h * VS_ATTN_BLOCK, top = state[0];
      for (long p = 0; p < count; p++) top = wh[p] > top ? wh[p] : top;
      float keep = expf(state[0] - top), sum = 0.0f;  /* (the first block: exp(-inf) = 0) */
      for (long p = 0; p < count; p++) wh[p] -= top;
      vs_exp_block(wh, count);
      for (long p = 0; p < count; p++) sum += wh[p];
      state[0] = top;
      state[1] = state[1] * keep + sum;
      if (keep != 1.0f)
        for (long d = 0; d < D; d++) acc[d] *= keep;
    }
    for (long j = 0; j < Hkv; j++)  /* the values: each value row once for the head's G query heads */
      vs_values_of(dtype, G, V + b * ld + j * hd, ld, count, w + j * G * VS_ATTN_BLOCK,
                   mine + j * G * (D + 2) + 2, D);
  }
}

/* Query head h's output from the states of `runs` runs (state of run t at states + t * stride + h * (D + 2)),
 * rounded once into out [D]. */
static void vs_attention_combine(int dtype, long D, const float *states, long stride, long runs, long h,
                                 uint16_t *out) {
  float top = -INFINITY, sum = 0.0f;
  for (long t = 0; t < runs; t++) {
    const float *state = states + t * stride + h * (D + 2);
    if (state[0] > top) top = state[0];
  }
  for (long t = 0; t < runs; t++) {
    const float *state = states + t * stride + h * (D + 2);
    if (state[1] > 0.0f) sum += state[1] * expf(state[0] - top);
  }
  for (long d = 0; d < D; d++) {
    float y = 0.0f;
    for (long t = 0; t < runs; t++) {
      const float *state = states + t * stride + h * (D + 2);
      if (state[1] > 0.0f) y += state[2 + d] * expf(state[0] - top);
    }
    out[d] = vs_half(dtype, y / sum);
  }
}

/* One new token's attention over a sequence's cached keys and values:
 *   out[h] = sum over l < L of softmax_l(scale * q[h] . K[l, h / G]) V[l, h / G],  G = H / Hkv,
 * q [H, D] and out [H, D] rows contiguous in dtype; K and V element (l, j, d) at K + l * ld + j * hd + d (a paged
 * cache's rows [L, Hkv, D], by head). Each thread takes a run of positions for every head (flash-decoding),
 * block by block: for each key/value head the block's scores of its G query heads (each key row read once for
 * them), their exponentials against a running maximum, then the values' weighted sums (each value row read
 * once), keeping a running maximum, sum and output per query head in float32. The runs are then combined, each
 * head's output rounded once. scratch: threads * H * (D + 2) floats. Returns 0, -1 for arguments it does not
 * take, -2 where its copy of q could not be allocated. */
int vs_decode_attention(int dtype, const uint16_t *q, long H, long D, const uint16_t *K, const uint16_t *V, long L,
                        long Hkv, long ld, long hd, float scale, uint16_t *out, int threads, float *scratch) {
  if ((dtype != VS_BF16 && dtype != VS_FP16) || H < 1 || D < 1 || L < 1 || Hkv < 1 || H % Hkv != 0 ||
      H / Hkv > VS_MAX_GROUP || H > VS_ATTN_HEADS || threads < 1)
    return -1;
  float *qf = (float *)malloc(sizeof(float) * H * D);  /* q * scale in float32 */
  if (!qf) return -2;
  for (long i = 0; i < H * D; i++) qf[i] = vs_scalar(dtype, q[i]) * scale;
  int team = threads;
  if (team > L / VS_ATTN_RUN) team = L / VS_ATTN_RUN > 0 ? (int)(L / VS_ATTN_RUN) : 1;  /* runs worth a thread */
#pragma omp parallel num_threads(team)
  {
    int u = 0, n = 1;
#ifdef _OPENMP
    u = omp_get_thread_num();
    n = omp_get_num_threads();
#endif
    long per = (L + n - 1) / n, first = u * per, last = first + per < L ? first + per : L;
    vs_attention_run(dtype, H, D, Hkv, qf, K, V, ld, hd, first, last, scratch + (long)u * H * (D + 2));
#pragma omp barrier
#pragma omp for schedule(static)
    for (long h = 0; h < H; h++) vs_attention_combine(dtype, D, scratch, H * (D + 2), n, h, out + h * D);
  }
  free(qf);
  return 0;
}

/* One new token of each of B sequences, every sequence's rows consecutive in one pool: sequence b's keys and
 * values start at row starts[b] (K + starts[b] * ld, likewise V) and hold lengths[b] positions; q [B, H, D] and
 * out [B, H, D] rows contiguous. As vs_decode_attention for each, in one parallel region: each sequence split
 * into `runs` runs of positions (at least VS_ATTN_RUN each where it has them), the threads taking the B * runs
 * pieces in turn, then each sequence's heads combined. A batch of decode steps on the CPU reads every cached row
 * once with no fork and join per sequence. Returns 0, -1 for arguments it does not take, -2 where its scratch
 * could not be allocated. */
int vs_decode_attention_rows(int dtype, const uint16_t *q, long B, long H, long D, const uint16_t *K,
                             const uint16_t *V, const int64_t *starts, const int64_t *lengths, long Hkv, long ld,
                             long hd, float scale, uint16_t *out, int threads) {
  if ((dtype != VS_BF16 && dtype != VS_FP16) || B < 1 || H < 1 || D < 1 || Hkv < 1 || H % Hkv != 0 ||
      H / Hkv > VS_MAX_GROUP || H > VS_ATTN_HEADS || threads < 1)
    return -1;
  long longest = 0;
  for (long b = 0; b < B; b++) {
    if (lengths[b] < 1 || starts[b] < 0) return -1;
    if (lengths[b] > longest) longest = lengths[b];
  }
  long runs = (threads + B - 1) / B;  /* pieces a sequence splits into: enough for every thread */
  if (runs > longest / VS_ATTN_RUN) runs = longest / VS_ATTN_RUN > 0 ? longest / VS_ATTN_RUN : 1;
  long stride = H * (D + 2);
  float *qf = (float *)malloc(sizeof(float) * B * H * D);  /* q * scale in float32 */
  float *states = (float *)malloc(sizeof(float) * B * runs * stride);
  if (!qf || !states) {
    free(qf);
    free(states);
    return -2;
  }
  for (long i = 0; i < B * H * D; i++) qf[i] = vs_scalar(dtype, q[i]) * scale;
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(dynamic, 1)
    for (long piece = 0; piece < B * runs; piece++) {
      long b = piece / runs, t = piece % runs, L = lengths[b];
      long per = (L + runs - 1) / runs, first = t * per, last = first + per < L ? first + per : L;
      float *mine = states + piece * stride;
      if (first >= last) {  /* a short sequence's empty run: no weight in the combination */
        for (long h = 0; h < H; h++) mine[h * (D + 2) + 1] = 0.0f, mine[h * (D + 2)] = -INFINITY;
        continue;
      }
      vs_attention_run(dtype, H, D, Hkv, qf + b * H * D, K + starts[b] * ld, V + starts[b] * ld, ld, hd, first,
                       last, mine);
    }
#pragma omp for schedule(static)
    for (long bh = 0; bh < B * H; bh++) {
      long b = bh / H, h = bh % H;
      vs_attention_combine(dtype, D, states + b * runs * stride, stride, runs, h, out + b * H * D + h * D);
    }
  }
  free(qf);
  free(states);
  return 0;
}

#if defined(__SSE2__)
#include <emmintrin.h>
/* The 8 x 8 block at s (rows at stride lds) transposed into d (rows at stride ldd): three rounds of unpacking. */
static inline void vs_transpose8(const uint16_t *s, long lds, uint16_t *d, long ldd) {
  __m128i a[8], b[8], c[8];
  for (int i = 0; i < 8; i++) a[i] = _mm_loadu_si128((const __m128i *)(s + i * lds));
  for (int i = 0; i < 4; i++) {  /* b[2i]: columns 0-3 of rows 2i, 2i+1 interleaved; b[2i+1]: columns 4-7 */
    b[2 * i] = _mm_unpacklo_epi16(a[2 * i], a[2 * i + 1]);
    b[2 * i + 1] = _mm_unpackhi_epi16(a[2 * i], a[2 * i + 1]);
  }
  for (int h = 0; h < 2; h++) {  /* c[4h + j]: columns 2j, 2j+1 of rows 4h..4h+3 */
    c[4 * h + 0] = _mm_unpacklo_epi32(b[4 * h + 0], b[4 * h + 2]);
    c[4 * h + 1] = _mm_unpackhi_epi32(b[4 * h + 0], b[4 * h + 2]);
    c[4 * h + 2] = _mm_unpacklo_epi32(b[4 * h + 1], b[4 * h + 3]);
    c[4 * h + 3] = _mm_unpackhi_epi32(b[4 * h + 1], b[4 * h + 3]);
  }
  for (int j = 0; j < 4; j++) {  /* column 2j, then 2j+1, of all eight rows */
    _mm_storeu_si128((__m128i *)(d + (2 * j) * ldd), _mm_unpacklo_epi64(c[j], c[4 + j]));
    _mm_storeu_si128((__m128i *)(d + (2 * j + 1) * ldd), _mm_unpackhi_epi64(c[j], c[4 + j]));
  }
}
#endif

/* dst[c, r] = src[r, c] for r < R, c < C (2-byte elements: bf16 or fp16 bits), src rows at stride lds, dst rows at
 * stride ldd, over `threads` OpenMP threads, tile by tile. Returns 0, or -1 for arguments it does not take. */
int vs_transpose(const uint16_t *src, long lds, uint16_t *dst, long ldd, long R, long C, int threads) {
  if (R < 0 || C < 0 || lds < C || ldd < R || threads < 1) return -1;
  long tiles_r = (R + VS_TRANSPOSE_TILE - 1) / VS_TRANSPOSE_TILE, tiles_c = (C + VS_TRANSPOSE_TILE - 1) / VS_TRANSPOSE_TILE;
#pragma omp parallel for num_threads(threads) schedule(static) collapse(2)
  for (long tr = 0; tr < tiles_r; tr++)
    for (long tc = 0; tc < tiles_c; tc++) {
      long r0 = tr * VS_TRANSPOSE_TILE, c0 = tc * VS_TRANSPOSE_TILE;
      long r1 = r0 + VS_TRANSPOSE_TILE < R ? r0 + VS_TRANSPOSE_TILE : R;
      long c1 = c0 + VS_TRANSPOSE_TILE < C ? c0 + VS_TRANSPOSE_TILE : C;
      /* src's rows read in order into the tile (rows of src at a power-of-two stride would share cache sets),
       * then dst's rows written in order, eight by eight */
      uint16_t tile[VS_TRANSPOSE_TILE][VS_TRANSPOSE_TILE];
      for (long r = r0; r < r1; r++) memcpy(tile[r - r0], src + r * lds + c0, sizeof(uint16_t) * (c1 - c0));
      long c = c0;
#if defined(__SSE2__)
      for (; c + 8 <= c1; c += 8) {
        long r = r0;
        for (; r + 8 <= r1; r += 8) vs_transpose8(&tile[r - r0][c - c0], VS_TRANSPOSE_TILE, dst + c * ldd + r, ldd);
        for (long j = c; j < c + 8; j++)
          for (long q = r; q < r1; q++) dst[j * ldd + q] = tile[q - r0][j - c0];
      }
#endif
      for (; c < c1; c++)
        for (long r = r0; r < r1; r++) dst[c * ldd + r] = tile[r - r0][c - c0];
    }
  return 0;
}

#if defined(__x86_64__) || defined(__i386__)
#define VS_PAUSE() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define VS_PAUSE() __asm__ __volatile__("yield")
#else
#define VS_PAUSE() ((void)0)
#endif

/* Reads *word (written by another agent: the GPU, over PCIe) until it is >= wanted or `ns` nanoseconds have
 * passed, a pause between reads; returns the last value read. */
int64_t vs_wait_word(const volatile int64_t *word, int64_t wanted, long ns) {
  struct timespec start, now;
  clock_gettime(CLOCK_MONOTONIC, &start);
  int64_t seen = *word;
  for (long polls = 1; seen < wanted; polls++) {
    VS_PAUSE();
    seen = *word;
    if ((polls & 255) == 0) {
      clock_gettime(CLOCK_MONOTONIC, &now);
      if ((now.tv_sec - start.tv_sec) * 1000000000L + (now.tv_nsec - start.tv_nsec) >= ns) break;
    }
  }
  return seen;
}

/* A run-ahead part's wait (as vs_wait_word, up to `ns` nanoseconds) for *ready >= number: 1 once it is (what the
 * word announces is read after it), 0 where it has not come; *waited_ns: the nanoseconds waited. */
static int vs_part_ready(const volatile int64_t *ready, int64_t number, long ns, long *waited_ns) {
  struct timespec start, now;
  clock_gettime(CLOCK_MONOTONIC, &start);
  int64_t seen = vs_wait_word(ready, number, ns);
  clock_gettime(CLOCK_MONOTONIC, &now);
  *waited_ns = (now.tv_sec - start.tv_sec) * 1000000000L + (now.tv_nsec - start.tv_nsec);
  if (seen < number) return 0;
  __atomic_thread_fence(__ATOMIC_ACQUIRE);  /* the input the word announces is read after the word */
  return 1;
}

/* A run-ahead part of routed experts in one call, the GIL free from the wait for its input to the ticket that
 * lets the GPU go on: waits (as vs_wait_word) up to `ns` nanoseconds for *ready >= number; where the word has
 * not come, returns 1 and touches nothing else. Else computes as vs_routed_experts (every other argument is
 * its), then stores `number` into *ticket whatever the kernel's status (the GPU waits for that word, and a part
 * that failed is the host thread's to report), and returns the kernel's status. *waited_ns: the nanoseconds
 * spent waiting for the ready word. */
int vs_routed_experts_part(const volatile int64_t *ready, volatile int64_t *ticket, int64_t number, long ns,
                           long *waited_ns, int dtype, const uint16_t *GU, long gu_e, long gu_r, const uint16_t *DN,
                           long dn_e, long dn_r, const uint16_t *x, long T, const int64_t *chosen, long chosen_t,
                           long chosen_a, const void *routing, int weights_dtype, long weights_t, long weights_a,
                           long k, long D, long F, long E, uint16_t *y, int threads) {
  if (!vs_part_ready(ready, number, ns, waited_ns)) return 1;
  int status = vs_routed_experts(dtype, GU, gu_e, gu_r, DN, dn_e, dn_r, x, T, chosen, chosen_t, chosen_a, routing,
                                 weights_dtype, weights_t, weights_a, NULL, 0, 0, k, D, F, E, y, threads);
  __atomic_store_n(ticket, number, __ATOMIC_RELEASE);  /* after every store of y */
  return status;
}

/* A run-ahead part of a split dense FFN in one call: as vs_routed_experts_part, with vs_swiglu's computing (every
 * argument after waited_ns is vs_swiglu's). */
int vs_swiglu_part(const volatile int64_t *ready, volatile int64_t *ticket, int64_t number, long ns, long *waited_ns,
                   int dtype, const uint16_t *G, long ldg, const uint16_t *U, long ldu, const uint16_t *DN, long ldd,
                   int dn_columns, const uint16_t *x, long T, long D, long R, uint16_t *y, int threads) {
  if (!vs_part_ready(ready, number, ns, waited_ns)) return 1;
  int status = vs_swiglu(dtype, G, ldg, U, ldu, DN, ldd, dn_columns, x, T, D, R, y, threads);
  __atomic_store_n(ticket, number, __ATOMIC_RELEASE);  /* after every store of y */
  return status;
}
