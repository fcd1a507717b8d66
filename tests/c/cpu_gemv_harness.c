/* Drives every entry of layers/cpu_gemv.c over many shapes, strides, routings and thread counts, each
 * weight and input in a buffer of exactly the bytes the call may read, so that a build with
 * -fsanitize=address,undefined reports any read or write outside them (tests/test_cpu_gemv_sanitized.py).
 * It also checks each result against a plain double-precision sum (to float32's rounding, and the
 * activation's one rounding to the half-precision dtype). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int vs_rows_times_weight(int dtype, const uint16_t *W, long ldw, const uint16_t *x, float *y, long T, long N, long K,
                         int threads);
int vs_rows_times_columns(int dtype, const uint16_t *V, long ldv, const uint16_t *x, float *y, long T, long K, long N,
                          int threads, float *scratch);
int vs_routed_experts(int dtype, const uint16_t *GU, long gu_e, long gu_r, const uint16_t *DN, long dn_e, long dn_r,
                      const uint16_t *x, long T, const int64_t *chosen, long chosen_t, long chosen_a,
                      const void *routing, int weights_dtype, long weights_t, long weights_a, const uint8_t *keep,
                      long keep_t, long keep_a, long k, long D, long F, long E, uint16_t *y, int threads);

int vs_decode_attention(int dtype, const uint16_t *q, long H, long D, const uint16_t *K, const uint16_t *V, long L,
                        long Hkv, long ld, long hd, float scale, uint16_t *out, int threads, float *scratch);

int vs_transpose(const uint16_t *src, long lds, uint16_t *dst, long ldd, long R, long C, int threads);

static uint64_t state = 88172645463325252ull;
static uint64_t next(void) { state ^= state << 13; state ^= state >> 7; state ^= state << 17; return state; }
static long below(long n) { return (long)(next() % (uint64_t)n); }

/* A bf16 value of a small float (the harness checks memory, not rounding, so bf16 serves both dtypes' bits
 * loosely; fp16 inputs are made as halves of the same small range). */
static uint16_t half_of(int dtype, float f) {
  if (dtype == 0) { uint32_t b; memcpy(&b, &f, 4); return (uint16_t)(b >> 16); }
  /* fp16 of |f| < 2: sign, exponent, 10 bits of mantissa (truncated) */
  uint32_t b; memcpy(&b, &f, 4);
  uint32_t sign = (b >> 16) & 0x8000u, e = (b >> 23) & 0xff;
  if (e < 103) return (uint16_t)sign;
  return (uint16_t)(sign | ((e - 112) << 10) | ((b >> 13) & 0x3ff));
}
static float value(int dtype, uint16_t h) {
  if (dtype == 0) { uint32_t b = (uint32_t)h << 16; float f; memcpy(&f, &b, 4); return f; }
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, b;
  b = e ? sign | ((e + 112) << 23) | (m << 13) : sign;
  float f; memcpy(&f, &b, 4); return f;
}
static uint16_t *halves(int dtype, long n) {
  uint16_t *p = malloc(sizeof(uint16_t) * (n ? n : 1));
  for (long i = 0; i < n; i++) p[i] = half_of(dtype, (float)((long)below(2001) - 1000) / 1000.0f);
  return p;
}

static int failures = 0;
/* got against want, whose terms' magnitudes sum to `scale`, to `rel` of it. */
static void check(const char *what, double got, double want, double scale, double rel) {
  if (!(fabs(got - want) <= rel * scale + 1e-6)) {
    if (failures++ < 10) fprintf(stderr, "%s: %g against %g\n", what, got, want);
  }
}

/* y [T, N] against x [T, K] times the weight whose element (n, j) is at w[n * n_stride + j * j_stride], in
 * double, each to float32's rounding of its products' magnitudes. */
static void check_products(const char *what, int dtype, const float *y, const uint16_t *x, long T, long K, long N,
                           const uint16_t *w, long n_stride, long j_stride) {
  for (long t = 0; t < T; t++)
    for (long n = 0; n < N; n++) {
      double s = 0, m = 0;
      for (long j = 0; j < K; j++) {
        double p = (double)value(dtype, w[n * n_stride + j * j_stride]) * value(dtype, x[t * K + j]);
        s += p;
        m += fabs(p);
      }
      check(what, y[t * N + n], s, m, 1e-5);
    }
}

static void rows_times_weight(int dtype, int threads) {
  long T = 1 + below(16), N = 1 + below(70), K = 1 + below(300), ldw = K + below(3);
  long size = (N - 1) * ldw + K;  /* the last row ends the buffer */
  uint16_t *W = halves(dtype, size), *x = halves(dtype, T * K);
  float *y = malloc(sizeof(float) * T * N);
  if (vs_rows_times_weight(dtype, W, ldw, x, y, T, N, K, threads) != 0) failures++;
  check_products("rows_times_weight", dtype, y, x, T, K, N, W, ldw, 1);
  free(W); free(x); free(y);
}

static void rows_times_columns(int dtype, int threads) {
  long T = 1 + below(4), K = 1 + below(300), N = 1 + below(70), ldv = N + below(3);
  uint16_t *V = halves(dtype, (K - 1) * ldv + N), *x = halves(dtype, T * K);
  float *y = malloc(sizeof(float) * T * N), *scratch = malloc(sizeof(float) * threads * T * N);
  if (vs_rows_times_columns(dtype, V, ldv, x, y, T, K, N, threads, scratch) != 0) failures++;
  check_products("rows_times_columns", dtype, y, x, T, K, N, V, 1, ldv);
  free(V); free(x); free(y); free(scratch);
}

static void routed_experts(int dtype, int threads) {
  long E = 1 + below(20), F = 1 + below(40), D = 1 + below(150), T = 1 + below(16), k = 1 + below(E < 8 ? E : 8);
  long gu_r = D + below(3), gu_e = 2 * F * gu_r + below(5), dn_r = F + below(3), dn_e = D * dn_r + below(5);
  uint16_t *GU = halves(dtype, (E - 1) * gu_e + (2 * F - 1) * gu_r + D);
  uint16_t *DN = halves(dtype, (E - 1) * dn_e + (D - 1) * dn_r + F);
  uint16_t *x = halves(dtype, T * D), *y = malloc(sizeof(uint16_t) * T * D);
  int64_t *chosen = malloc(sizeof(int64_t) * T * k);
  float *routing = malloc(sizeof(float) * T * k);
  uint8_t *keep = malloc(T * k);
  int masked = (int)below(2);
  for (long t = 0; t < T; t++)
    for (long a = 0; a < k; a++) {
      chosen[t * k + a] = below(E);  /* repeats allowed: a tie routed twice */
      routing[t * k + a] = (float)below(1000) / 1000.0f;
      keep[t * k + a] = (uint8_t)below(2);
    }
  if (vs_routed_experts(dtype, GU, gu_e, gu_r, DN, dn_e, dn_r, x, T, chosen, k, 1, routing, 2, k, 1,
                        masked ? keep : NULL, k, 1, k, D, F, E, y, threads) != 0)
    failures++;
  double *act = malloc(sizeof(double) * F);
  for (long t = 0; t < T; t++) {
    double *want = calloc(D, sizeof(double)), *size = calloc(D, sizeof(double));
    for (long a = 0; a < k; a++) {
      if (masked && !keep[t * k + a]) continue;
      long e = chosen[t * k + a];
      for (long f = 0; f < F; f++) {
        double g = 0, u = 0;
        for (long j = 0; j < D; j++) {
          g += (double)value(dtype, GU[e * gu_e + f * gu_r + j]) * value(dtype, x[t * D + j]);
          u += (double)value(dtype, GU[e * gu_e + (F + f) * gu_r + j]) * value(dtype, x[t * D + j]);
        }
        act[f] = g / (1 + exp(-g)) * u;
      }
      for (long d = 0; d < D; d++) {
        double s = 0, m = 0;
        for (long f = 0; f < F; f++) {
          double p = (double)value(dtype, DN[e * dn_e + d * dn_r + f]) * act[f];
          s += p;
          m += fabs(p);
        }
        want[d] += routing[t * k + a] * s;
        size[d] += routing[t * k + a] * m;
      }
    }
    /* the activation and the output are each rounded once to the dtype (bf16: 2^-8) */
    for (long d = 0; d < D; d++) check("routed_experts", value(dtype, y[t * D + d]), want[d], size[d], 1e-2);
    free(want);
    free(size);
  }
  free(act); free(GU); free(DN); free(x); free(y); free(chosen); free(routing); free(keep);
}

static void decode_attention(int dtype, int threads) {
  long Hkv = 1 + below(6), G = 1 + below(10), H = Hkv * G, D = 1 + below(70), L = 1 + below(400);
  long hd = D + below(3), ld = Hkv * hd + below(5);  /* rows of a paged pool: heads at hd, positions at ld */
  uint16_t *K = halves(dtype, (L - 1) * ld + (Hkv - 1) * hd + D), *V = halves(dtype, (L - 1) * ld + (Hkv - 1) * hd + D);
  uint16_t *q = halves(dtype, H * D), *out = malloc(sizeof(uint16_t) * H * D);
  float *scratch = malloc(sizeof(float) * threads * H * (D + 2));
  float scale = 1.0f / sqrtf((float)D);
  if (vs_decode_attention(dtype, q, H, D, K, V, L, Hkv, ld, hd, scale, out, threads, scratch) != 0) failures++;
  double *score = malloc(sizeof(double) * L);
  for (long h = 0; h < H; h++) {
    long j = h / G;
    double top = -INFINITY, sum = 0;
    for (long l = 0; l < L; l++) {
      double s = 0;
      for (long d = 0; d < D; d++) s += (double)value(dtype, q[h * D + d]) * value(dtype, K[l * ld + j * hd + d]);
      score[l] = s * scale;
      if (score[l] > top) top = score[l];
    }
    for (long l = 0; l < L; l++) sum += (score[l] = exp(score[l] - top));
    for (long d = 0; d < D; d++) {
      double y = 0, m = 0;
      for (long l = 0; l < L; l++) {
        y += score[l] / sum * value(dtype, V[l * ld + j * hd + d]);
        m += score[l] / sum * fabs(value(dtype, V[l * ld + j * hd + d]));
      }
      check("decode_attention", value(dtype, out[h * D + d]), y, m, 1e-2);  /* (the output rounded once) */
    }
  }
  free(score); free(K); free(V); free(q); free(out); free(scratch);
}

static void transpose(int dtype, int threads) {
  long R = 1 + below(200), C = 1 + below(200), lds = C + below(3), ldd = R + below(3);
  uint16_t *src = halves(dtype, (R - 1) * lds + C), *dst = halves(dtype, (C - 1) * ldd + R);
  if (vs_transpose(src, lds, dst, ldd, R, C, threads) != 0) failures++;
  for (long r = 0; r < R; r++)
    for (long c = 0; c < C; c++)
      if (dst[c * ldd + r] != src[r * lds + c]) { failures++; r = R; break; }
  free(src); free(dst);
}

int main(int argc, char **argv) {
  int rounds = argc > 1 ? atoi(argv[1]) : 40;
  for (int r = 0; r < rounds; r++)
    for (int dtype = 0; dtype < 2; dtype++) {
      int threads = 1 + (int)below(5);
      rows_times_weight(dtype, threads);
      rows_times_columns(dtype, threads);
      decode_attention(dtype, threads);
      routed_experts(dtype, threads);
      transpose(dtype, threads);
    }
  if (failures) fprintf(stderr, "%d results wrong\n", failures);
  else printf("all calls in bounds and right\n");
  return failures ? 1 : 0;
}
