// Native CPU kernels of quantwatch.kernels (see native.py): minifloat quantization, rounding to nearest or
// stochastically, with every error statistic, in at most two passes over a contiguous float32 tensor, written with
// GCC/Clang vector extensions and OpenMP. A vector is one register of the widest unit the build targets: 16 floats with
// AVX-512 (__AVX512F__), 8 with AVX2 (__AVX2__, one ymm register: no mask registers, no VRANGEPS, no 512-bit shuffles,
// so the operations that use them on AVX-512 are written for AVX2 apart), else 16 (two or four registers of a narrower
// unit). The values are bit-exact on every width; the statistics' sums run in other lanes, within the same bounds.
//
// The cast rounds |v| to the format's grid with one float32 addition: c = 2^(e + 23 - m) for the binade exponent e of
// |v| (at least the format's smallest normal exponent), so the sum |v| + c keeps exactly m mantissa bits of |v| and
// rounds the rest to nearest, ties to even, and (|v| + c) - c is the rounded magnitude. The reference computes the same
// value as round(|v| · 2^(m - e)) · 2^(e - m). Stochastic rounding (see round_stochastic) takes the caller's uniform
// draws, one per element, and rounds as the reference does, bit for bit. Every entry point returns 0 on success, or a
// positive code when the tensor holds something these kernels do not handle (non-finite values, a scaled value beyond
// float32); the caller then runs another backend, and the output holds nothing meaningful.
//
// Statistics: float32 products summed over runs of RUN vectors in each lane, the runs' sums added in float64 (within
// (RUN + 1) · 2^-24 ≈ 5.4e-7 of the exact sum of each run's float32 terms, see spill; q − x is itself rounded where
// |q| < |x| / 2, which adds 2 · 2^-24 to Σ(q − x)²: 6.6e-7); maxima and counts exact.

#include <cstdint>
#include <cstring>
#include <vector>
#include <omp.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// GCC before 12 has no __builtin_shufflevector; its __builtin_shuffle takes the same indices as a mask vector.
#if defined(__has_builtin)
#if !__has_builtin(__builtin_shufflevector)
#define QW_SHUFFLE_BY_MASK 1
#endif
#endif
#if defined(QW_SHUFFLE_BY_MASK)
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, vi{__VA_ARGS__})
#else
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#endif

namespace {

#if defined(__AVX2__) && !defined(__AVX512F__)
#define QW_AVX2 1
constexpr int L = 8;
#else
constexpr int L = 16;
#endif
constexpr int RUN = 8;          // vectors per float32 run of the statistics
constexpr int64_t CHUNK = 512;  // elements a thread's range is a multiple of (whole blocks of 16, 32 and 64)
constexpr int MAX_THREADS = 256;
constexpr int NV_PER_BLOCK = 16 / L;  // vectors an NVFP4 block of 16 takes
constexpr int64_t COLUMN_PAD = 16;    // COLUMNS: the columns' scales are padded to a multiple of this (native.py)

typedef float vf __attribute__((vector_size(4 * L)));
typedef int32_t vi __attribute__((vector_size(4 * L)));
typedef uint32_t vu __attribute__((vector_size(4 * L)));
typedef float vh __attribute__((vector_size(2 * L)));
typedef double vd __attribute__((vector_size(4 * L)));  // L / 2 doubles: a run's two halves added (see spill)

enum Mode { PLAIN = 0, TENSOR = 1, MX_BLOCK = 2, NV_BLOCK = 3, CHANNEL = 4, COLUMNS = 5 };
enum Status { OK = 0, NONFINITE = 1, OUT_OF_RANGE = 2, BAD_ARGUMENT = 3 };
constexpr uint32_t EXPONENT_BITS = 0x7F800000u;
constexpr uint32_t MAGNITUDE_BITS = 0x7FFFFFFFu;
constexpr uint32_t SIGN_BIT = 0x80000000u;

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// A load in a pass that walks memory front to back, prefetching 4 KB ahead: here the hardware prefetchers alone read
// a tensor that is not in the caches at 0.8 × the rate of torch's x.sum(), with this at 1.0-1.08 (2-16 KB ahead alike).
constexpr int64_t PREFETCH = 1024;
inline vf load_ahead(const float* p) {
  __builtin_prefetch(p + PREFETCH);
  return load(p);
}

inline void store(float* p, vf v, bool stream) {
#if defined(__AVX512F__)
  if (stream) {
    _mm512_stream_ps(p, (__m512)v);
    return;
  }
#elif defined(QW_AVX2)
  if (stream) {
    _mm256_stream_ps(p, (__m256)v);
    return;
  }
#endif
  (void)stream;
  std::memcpy(p, &v, sizeof v);
}

// x / s, correctly rounded, from the reciprocal r = RN(1/s): y = RN(x · r) is within an ulp of x / s, the residual
// x − y · s is exact in one FMA, and RN(y + r · residual) is the correctly rounded quotient (Markstein) while x, s
// and the quotient are normal floats; the caller keeps s >= 2^-80, so a quotient that is not (or an x below 2^-100)
// is below 2^-20 and rounds to zero in every format here, either way. The sign of -0 / s is lost (+0: the residual's
// sign): `cast` takes the sign from x. vdivps costs 16 cycles a vector on some CPUs.
inline vf divide(vf x, vf s, vf r) {
#if defined(__AVX512F__)
  __m512 y = _mm512_mul_ps((__m512)x, (__m512)r);
  __m512 residual = _mm512_fnmadd_ps(y, (__m512)s, (__m512)x);
  return (vf)_mm512_fmadd_ps(residual, (__m512)r, y);
#elif defined(QW_AVX2) && defined(__FMA__)
  __m256 y = _mm256_mul_ps((__m256)x, (__m256)r);
  __m256 residual = _mm256_fnmadd_ps(y, (__m256)s, (__m256)x);
  return (vf)_mm256_fmadd_ps(residual, (__m256)r, y);
#else
  (void)r;
  return x / s;
#endif
}

inline vf vabs(vf v) { return (vf)((vu)v & MAGNITUDE_BITS); }
// max/min as MAXPS/MINPS define them: a > b ? a : b (and a < b ? a : b), the second operand on ties and NaN.
#if defined(__AVX512F__)
inline vf vmax(vf a, vf b) { return (vf)_mm512_max_ps((__m512)a, (__m512)b); }
inline vf vmin(vf a, vf b) { return (vf)_mm512_min_ps((__m512)a, (__m512)b); }
#elif defined(QW_AVX2)
inline vf vmax(vf a, vf b) { return (vf)_mm256_max_ps((__m256)a, (__m256)b); }
inline vf vmin(vf a, vf b) { return (vf)_mm256_min_ps((__m256)a, (__m256)b); }
#else
inline vf vmax(vf a, vf b) { return a > b ? a : b; }
inline vf vmin(vf a, vf b) { return a < b ? a : b; }
#endif
// max(|a|, |b|) for a non-negative a: one VRANGEPS where AVX512DQ has it (imm 0b1011: larger magnitude, sign cleared).
inline vf max_magnitude(vf a, vf b) {
#if defined(__AVX512DQ__)
  return (vf)_mm512_range_ps((__m512)a, (__m512)b, 0x0B);
#else
  return vmax(a, vabs(b));
#endif
}
// The larger of two unsigned lanes (VPMAXUD on AVX2, which has no unsigned comparison to select with).
inline vu umax(vu a, vu b) {
#if defined(QW_AVX2)
  return (vu)_mm256_max_epu32((__m256i)a, (__m256i)b);
#else
  return a > b ? a : b;
#endif
}
// Lanes of `count` where `where` holds, plus one: a masked add where the target has mask registers, else the
// comparison's all-ones lanes (-1) subtracted.
template <typename Mask>
inline vi count_if(vi count, Mask where) {
#if defined(QW_AVX2)
  return count - (vi)where;
#else
  return where ? count + 1 : count;
#endif
}
// A broadcast (vf{} + f would be an addition: 0 + -0 is +0, so the compiler cannot drop it). Spelled out: one
// VBROADCASTSS from memory, where a broadcast of the bits went through a general register (twice the operations, and
// NVFP4's two per vector cost 18% on AVX-512).
#if defined(QW_AVX2)
inline vf splat(float f) { return vf{f, f, f, f, f, f, f, f}; }
#else
inline vf splat(float f) { return vf{f, f, f, f, f, f, f, f, f, f, f, f, f, f, f, f}; }
#endif
inline vu usplat(uint32_t u) { return vu{} + u; }

// The largest lane (once a thread: a loop, the same maximum as a tree of vmax).
inline float hmax(vf v) {
  float m = v[0];
  for (int j = 1; j < L; j++) m = v[j] > m ? v[j] : m;
  return m;
}

inline uint32_t hmax_bits(vu v) {
  uint32_t m = 0;
  for (int j = 0; j < L; j++) m = v[j] > m ? v[j] : m;
  return m;
}

// The largest lane of each of L vectors, as one vector (lane b: vector b's maximum): a transposing tree of L - 1
// maxima and 2 (L - 1) shuffles, where L horizontal maxima take 4 L operations and L scalar stores.
#if defined(QW_AVX2)
inline vf maxima(const vf* v) {
  // 128-bit halves swapped across (VPERM2F128), then pairs and single lanes within halves (VSHUFPS): the tree's
  // outputs come out in the lane order 0, 2, 4, 6, 1, 3, 5, 7 of its inputs, so it reads them in the order below.
  constexpr int order[8] = {0, 4, 1, 5, 2, 6, 3, 7};
  __m256 half[4], quarter[2];
  for (int k = 0; k < 4; k++) {
    __m256 a = (__m256)v[order[2 * k]], b = (__m256)v[order[2 * k + 1]];
    half[k] = _mm256_max_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
  }
  for (int k = 0; k < 2; k++) {
    __m256 a = half[2 * k], b = half[2 * k + 1];
    quarter[k] = _mm256_max_ps(_mm256_shuffle_ps(a, b, 0x44), _mm256_shuffle_ps(a, b, 0xEE));
  }
  return (vf)_mm256_max_ps(_mm256_shuffle_ps(quarter[0], quarter[1], 0x88),
                           _mm256_shuffle_ps(quarter[0], quarter[1], 0xDD));
}
#else
inline vf maxima(const vf* v) {  // 16 lanes
  vf half[8], quarter[4], eighth[2];
  for (int k = 0; k < 8; k++) {
    vf a = v[2 * k], b = v[2 * k + 1];
    half[k] = vmax(SHUFFLE(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23),
                   SHUFFLE(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31));
  }
  for (int k = 0; k < 4; k++) {
    vf a = half[2 * k], b = half[2 * k + 1];
    quarter[k] = vmax(SHUFFLE(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27),
                      SHUFFLE(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31));
  }
  for (int k = 0; k < 2; k++) {
    vf a = quarter[2 * k], b = quarter[2 * k + 1];
    eighth[k] = vmax(SHUFFLE(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29),
                     SHUFFLE(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31));
  }
  vf a = eighth[0], b = eighth[1];
  return vmax(SHUFFLE(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30),
              SHUFFLE(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31));
}
#endif

// The float32 lanes of a run, added into float64 lanes: with AVX-512 and AVX2, its two halves added in float32 first
// (one more rounding: RUN + 1 of them in a run, within (RUN + 1) · 2^-24) and converted once, where two conversions
// cost four of the vector ports' operations a statistic; else each half converted.
inline void spill(vd& total, vf run) {
  // Without taking run's address: a run whose address is taken lives in memory, loaded and stored every vector.
#if defined(__AVX512F__)
  __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd((__m512)run), 1));
  total += (vd)_mm512_cvtps_pd(_mm256_add_ps(_mm512_castps512_ps256((__m512)run), high));
#elif defined(QW_AVX2)  // the same with 8 floats: four doubles
  __m128 high = _mm256_extractf128_ps((__m256)run, 1);
  total += (vd)_mm256_cvtps_pd(_mm_add_ps(_mm256_castps256_ps128((__m256)run), high));
#elif !defined(QW_SHUFFLE_BY_MASK)
  vh low = __builtin_shufflevector(run, run, 0, 1, 2, 3, 4, 5, 6, 7);
  vh high = __builtin_shufflevector(run, run, 8, 9, 10, 11, 12, 13, 14, 15);
  total += __builtin_convertvector(low, vd) + __builtin_convertvector(high, vd);
#else
  vh low, high;
  std::memcpy(&low, &run, sizeof low);
  std::memcpy(&high, reinterpret_cast<const char*>(&run) + sizeof low, sizeof high);
  total += __builtin_convertvector(low, vd) + __builtin_convertvector(high, vd);
#endif
}

inline double hsum(vd v) {
  double s = 0;
  for (int j = 0; j < L / 2; j++) s += v[j];
  return s;
}

// One element format under round to nearest, ties to even.
struct Format {
  vu exponent_shift;  // (23 - m) << 23: added to |v|'s exponent bits gives c's
  vu least_c;         // bits of 2^(emin - m + 23): c below the normal range (the subnormal spacing)
  vf max_value;
  vf ceiling;         // 2^(emax + 2): larger magnitudes overflow either way; clamping keeps c finite
};

Format make_format(int mantissa_bits, int emin, int emax, float max_value) {
  Format f;
  f.exponent_shift = usplat(uint32_t(23 - mantissa_bits) << 23);
  f.least_c = usplat(uint32_t(emin - mantissa_bits + 23 + 127) << 23);
  f.max_value = splat(max_value);
  uint32_t ceiling = uint32_t(emax + 2 + 127) << 23;
  float c;
  std::memcpy(&c, &ceiling, sizeof c);
  f.ceiling = splat(c);
  return f;
}

// |v| rounded to the format's grid, before any clamp to its maximum (MAY_CLIP: |v| may be far beyond it).
template <bool MAY_CLIP>
inline vf round_magnitude(vf a, const Format& f) {
  if (MAY_CLIP) a = vmin(a, f.ceiling);
  vu e = ((vu)a & EXPONENT_BITS) + f.exponent_shift;
  e = umax(e, f.least_c);
  vf c = (vf)e;
  return (a + c) - c;
}

// The rounding of a cast (the `rounding` argument of qw_cast): to nearest; stochastic on a float grid (the magnitude
// rounded down or up, the sign restored); stochastic on an integer grid (the signed value rounded down or up).
enum Round { NEAREST = 0, STOCHASTIC = 1, STOCHASTIC_INTEGER = 2 };

// |v| rounded down to the format's grid, then up by one spacing where the draw `noise` (uniform in [0, 1)) is below
// the fraction of a spacing it lies above: the reference's low + (noise < s − low) on s = |v| · 2^(m − e), whose
// fraction s − floor(s) equals (|v| − low) · 2^(m − e) here exactly (both are power-of-two scalings of exact
// differences). The nearest value r = (|v| + c) − c is the floor or one spacing above it.
template <bool UNBOUNDED>
inline vf round_stochastic(vf a, vf noise, const Format& f) {
  if (UNBOUNDED) a = vmin(a, f.ceiling);
  vu e = ((vu)a & EXPONENT_BITS) + f.exponent_shift;
  e = umax(e, f.least_c);
  vf c = (vf)e;
  vf spacing = c * splat(0x1p-23f);           // 2^(e - m)
  vf inverse = (vf)(usplat(277u << 23) - e);  // 2^(m - e): biased exponent 277 - c's (150 - (e + 23 - m) + 127)
  vf nearest = (a + c) - c;
  vf low = nearest > a ? nearest - spacing : nearest;
  return noise < (a - low) * inverse ? low + spacing : low;
}

// The signed v rounded as the reference rounds integers: low = floor(v), then low + (noise < v − low), every step in
// float32 as there (v − low rounds where v > −1 is negative; the sum makes −0 +0). The floor comes from rounding to
// an integer with 1.5 · 2^23 (|v| < 2^22: the format's ceiling keeps it there).
template <bool UNBOUNDED>
inline vf round_integer_stochastic(vf v, vf noise, const Format& f) {
  if (UNBOUNDED) v = vmin(vmax(v, -f.ceiling), f.ceiling);
  const vf magic = splat(12582912.0f);
  vf nearest = (v + magic) - magic;
  vf low = nearest > v ? nearest - splat(1.0f) : nearest;
  return low + (noise < v - low ? splat(1.0f) : vf{});
}

// Per-thread partial statistics, in the order of ErrorStats.FIELDS after numel.
struct Partial {
  double sum_x2, sum_q2, sum_qx, sum_err2, max_err, amax, nonzero, zeros_q, overflow, nonfinite;
};

void combine(const Partial* parts, int count, double* out) {
  Partial total{};
  for (int t = 0; t < count; t++) {
    const Partial& p = parts[t];
    total.sum_x2 += p.sum_x2;
    total.sum_q2 += p.sum_q2;
    total.sum_qx += p.sum_qx;
    total.sum_err2 += p.sum_err2;
    total.max_err = p.max_err > total.max_err ? p.max_err : total.max_err;
    total.amax = p.amax > total.amax ? p.amax : total.amax;
    total.nonzero += p.nonzero;
    total.zeros_q += p.zeros_q;
    total.overflow += p.overflow;
    total.nonfinite += p.nonfinite;
  }
  std::memcpy(out, &total, sizeof total);
}

// This thread's share of [0, n), a whole number of `granule`s long (the last share excepted).
void thread_range(int64_t n, int64_t granule, int64_t* lo, int64_t* hi) {
  int t = omp_get_thread_num(), k = omp_get_num_threads();
  int64_t chunks = (n + granule - 1) / granule;
  int64_t per = ((chunks + k - 1) / k) * granule;
  *lo = per * t < n ? per * t : n;
  *hi = *lo + per < n ? *lo + per : n;
}

// The last partial vector of a range, zero-padded (zeros add nothing to any statistic but the zeros of q).
inline vf load_tail(const float* p, int64_t count) {
  float buffer[L] = {0};
  std::memcpy(buffer, p, count * sizeof(float));
  return load(buffer);
}

inline void store_tail(float* p, vf v, int64_t count) {
  float buffer[L];
  std::memcpy(buffer, &v, sizeof v);
  std::memcpy(p, buffer, count * sizeof(float));
}

// What RUN vectors add: float32 sums, maxima and 32-bit lane counts, kept in registers while they run.
struct Run {
  vf x2{}, q2{}, qx{}, err2{};
  vf max_err{};
  vu amax_bits{};
  vi nonzero{}, zeros_q{}, overflow{};
};

// One thread's totals: the runs' float32 sums added in float64 lanes, their maxima and counts.
struct Sums {
  vd x2{}, q2{}, qx{}, err2{};
  vf max_err{};
  vu amax_bits{};
  vi nonzero{}, zeros_q{}, overflow{};
  int64_t counted = 0;  // vectors since the 32-bit lane counts were last added into `total`
  Partial total{};

  __attribute__((always_inline)) inline void add(const Run& r) {
    spill(x2, r.x2);
    spill(q2, r.q2);
    spill(qx, r.qx);
    spill(err2, r.err2);
    max_err = vmax(max_err, r.max_err);
    amax_bits = umax(r.amax_bits, amax_bits);
    nonzero += r.nonzero;
    zeros_q += r.zeros_q;
    overflow += r.overflow;
    // Lane counts stay below 2^31: each lane counts one element per vector.
    if ((counted += RUN) >= (int64_t(1) << 30)) count_lanes();
  }

  void count_lanes() {
    for (int j = 0; j < L; j++) {
      total.nonzero += nonzero[j];
      total.zeros_q += zeros_q[j];
      total.overflow += overflow[j];
    }
    nonzero = zeros_q = overflow = vi{};
    counted = 0;
  }

  Partial finish() {
    count_lanes();
    total.sum_x2 += hsum(x2);
    total.sum_q2 += hsum(q2);
    total.sum_qx += hsum(qx);
    total.sum_err2 += hsum(err2);
    total.max_err = hmax(max_err);
    uint32_t largest = hmax_bits(amax_bits);
    float amax;
    std::memcpy(&amax, &largest, sizeof amax);
    total.amax = amax;
    total.nonfinite += largest >= EXPONENT_BITS;  // one or more: the caller declines the tensor either way
    return total;
  }
};

// body(run, k) for vectors k = 0 … count − 1, in runs of RUN vectors handed to the totals after each: an inner loop
// without the totals in it, so that the run's accumulators, not the totals, get the registers.
template <typename Body>
__attribute__((always_inline)) inline void in_runs(Sums& totals, int64_t count, Body body) {
  for (int64_t first = 0; first < count; first += RUN) {
    Run run;
    int64_t end = first + RUN < count ? first + RUN : count;
    for (int64_t k = first; k < end; k++) body(run, k);
    totals.add(run);
  }
}

// What the scan pass adds per vector: the largest bit pattern of |x| (the amax when below infinity's, which ordered
// as unsigned integers the magnitudes of floats are; NaN and ±inf above it), Σx² and the non-zero count.
inline void scan_vector(Run& s, vf x) {
  s.amax_bits = umax((vu)x & MAGNITUDE_BITS, s.amax_bits);
  s.nonzero = count_if(s.nonzero, x != 0.0f);
  s.x2 += x * x;
}

// Σq², Σqx, Σ(q−x)², and max |q − x| (cast_vector: also the zeros of q, all the cast pass adds per vector).
inline void compare_vector(Run& s, vf x, vf q) {
  vf err = q - x;
  s.q2 += q * q;
  s.qx += q * x;
  s.err2 += err * err;
  s.max_err = max_magnitude(s.max_err, err);
}

inline void cast_vector(Run& s, vf x, vf q) {
  compare_vector(s, x, q);
  s.zeros_q = count_if(s.zeros_q, q == 0.0f);
}

// sum + a · b, rounded once where the unit has a fused multiply-add.
inline vf fused_add(vf sum, vf a, vf b) {
#if defined(__AVX512F__)
  return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)sum);
#elif defined(QW_AVX2) && defined(__FMA__)
  return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)sum);
#else
  return sum + a * b;
#endif
}

// What qw_stats adds per vector of x and q, but the clipped: every sum, the largest |x|, the non-zero x, the
// underflows (x != 0 and q == 0) in place of the zeros of q, and the largest bit pattern of |q| into `q_largest`.
// The sums are scan_vector's and compare_vector's with each product and addition fused as -ffp-contract=fast fuses
// them in qw_stats, spelled out: a kernel whose q comes from a gather and a division gets the compiler to fuse one
// sum less, and its figures must be qw_stats' bit for bit.
inline void stats_vector(Run& s, vf x, vf q, vu& q_largest) {
  s.amax_bits = umax((vu)x & MAGNITUDE_BITS, s.amax_bits);
  s.nonzero = count_if(s.nonzero, x != 0.0f);
  vf err = q - x;
  s.x2 = fused_add(s.x2, x, x);
  s.q2 = fused_add(s.q2, q, q);
  s.qx = fused_add(s.qx, q, x);
  s.err2 = fused_add(s.err2, err, err);
  s.max_err = max_magnitude(s.max_err, err);
  s.zeros_q = count_if(s.zeros_q, (x != 0.0f) & (q == 0.0f));
  q_largest = umax((vu)q & MAGNITUDE_BITS, q_largest);
}

// A thread's non-finite q (its lanes' largest bit patterns at or above infinity's) into its totals.
inline void count_nonfinite(Sums& totals, vu q_largest) {
  for (int j = 0; j < L; j++) totals.total.nonfinite += q_largest[j] >= EXPONENT_BITS;
}

// The float32 values of the 256 codes of a one-byte float whose code b | 0x80 is -(code b), each divided by a
// divisor (correctly rounded, as torch divides), as a decoder holds them: with AVX-512 the 128 magnitudes in eight
// registers (codes decoded by permutes: a gather of 16 takes as long as the statistics of the vector), else a table.
struct Codebook {
#if defined(__AVX512F__)
  __m512 part[8];
  Codebook(const float* table, float divisor) {
    for (int k = 0; k < 8; k++) part[k] = _mm512_div_ps(_mm512_loadu_ps(table + 16 * k), _mm512_set1_ps(divisor));
  }
#else
  float values[256];
  Codebook(const float* table, float divisor) {
    for (int k = 0; k < 256; k++) values[k] = table[k] / divisor;
  }
#endif
};

// L one-byte codes decoded: four two-register permutes pick each code's magnitude among the 32 of its quarter (the
// code's bits 0-4), two blends the quarter (bits 5 and 6), the code's sign bit the sign.
inline vf decode(const uint8_t* codes, const Codebook& book) {
#if defined(__AVX512F__)
  __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
  __m512 q0 = _mm512_permutex2var_ps(book.part[0], b, book.part[1]);
  __m512 q1 = _mm512_permutex2var_ps(book.part[2], b, book.part[3]);
  __m512 q2 = _mm512_permutex2var_ps(book.part[4], b, book.part[5]);
  __m512 q3 = _mm512_permutex2var_ps(book.part[6], b, book.part[7]);
  __mmask16 bit5 = _mm512_test_epi32_mask(b, _mm512_set1_epi32(32));
  __mmask16 bit6 = _mm512_test_epi32_mask(b, _mm512_set1_epi32(64));
  __m512 magnitude =
      _mm512_mask_blend_ps(bit6, _mm512_mask_blend_ps(bit5, q0, q1), _mm512_mask_blend_ps(bit5, q2, q3));
  __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
  return (vf)_mm512_xor_si512(_mm512_castps_si512(magnitude), sign);
#elif defined(QW_AVX2)
  __m256i index = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes)));
  return (vf)_mm256_i32gather_ps(book.values, index, 4);
#else
  vf v;
  for (int j = 0; j < L; j++) v[j] = book.values[codes[j]];
  return v;
#endif
}

// The value of v's magnitude with x's sign (x: the unscaled input; scales are positive) under the rounding ROUND,
// counting the clipped; STOCHASTIC_INTEGER rounds the signed v, whose sign the rounded value keeps. NEAREST ignores
// `noise` (its callers load none). UNBOUNDED: |v| may be anywhere up to float32's maximum (else it is known to stay
// within 2^(emax + 2)).
template <int ROUND, bool MAY_CLIP, bool UNBOUNDED = MAY_CLIP>
inline vf cast(vf v, vf x, vf noise, const Format& f, vi& overflow) {
  if constexpr (ROUND == STOCHASTIC_INTEGER) {
    vf r = round_integer_stochastic<UNBOUNDED>(v, noise, f);
    if (MAY_CLIP) {
      overflow = count_if(overflow, vabs(r) > f.max_value);
      r = vmin(vmax(r, -f.max_value), f.max_value);
    }
    return r;
  } else {
    vu sign = (vu)x & SIGN_BIT;
    vf r = ROUND == NEAREST ? round_magnitude<UNBOUNDED>(vabs(v), f) : round_stochastic<UNBOUNDED>(vabs(v), noise, f);
    if (MAY_CLIP) {
      overflow = count_if(overflow, r > f.max_value);
      r = vmin(r, f.max_value);
    }
    return (vf)((vu)r | sign);
  }
}

// The draws for the `count` elements at offset i (none under NEAREST: no load).
template <int ROUND>
inline vf noise_at(const float* noise, int64_t i, int64_t count = L) {
  if constexpr (ROUND == NEAREST) {
    return vf{};
  } else {
    return count == L ? load_ahead(noise + i) : load_tail(noise + i, count);
  }
}

// OCP MX shared scales of blocks whose largest |x| are `amax` (finite, non-negative):
// 2^clamp(floor(log2 amax) − emax, −127, 127). Zero and subnormal amaxes have exponents below -126, so -127 after the
// clamp; 2^-127 is the subnormal 0x00400000.
inline vf mx_scales(vf amax, int emax) {
  vi biased = (vi)((vu)amax >> 23);
  vi exponent = (biased == 0 ? vi{} - 127 : biased - 127) - emax;
  exponent = exponent < -127 ? vi{} - 127 : exponent;
  exponent = exponent > 127 ? vi{} + 127 : exponent;
  return (vf)(exponent >= -126 ? (exponent + 127) << 23 : vi{} + 0x00400000);
}

struct Job {
  const float* x;
  float* q;
  const float* noise;  // stochastic rounding: one uniform draw in [0, 1) per element of x; else null
  int64_t n;
  Format fmt;
  int mode;
  int64_t block;      // 16, 32 or 64 for the block modes; CHANNEL: the length of a segment of one channel;
                      // COLUMNS: the number of columns (channels) of a row
  int emax;           // the element format's emax (MX)
  float scale;        // TENSOR: the element scale; NV_BLOCK: the FP32 tensor scale
  const float* block_in;    // NV_BLOCK: each block's largest |x|, from the scan; CHANNEL: each segment's scale;
                            // COLUMNS: the columns' scales, then their reciprocals, each padded to whole vectors
  float* block_scale;       // MX_BLOCK / NV_BLOCK: per block, written
  Format e4m3;        // NV_BLOCK: the block scales' format
  bool stream;
  bool may_clip;
};

template <int MODE, bool MAY_CLIP, int ROUND, int PER_BLOCK = 1>
void cast_range(const Job& job_in, int64_t lo, int64_t hi, Sums& sums) {
  // Local copies: the stores to q could alias anything reached through a pointer, which would make the compiler
  // write the accumulators back and reload the job's fields on every vector.
  const Job job = job_in;
  Sums totals = sums;
  const vf tensor_scale = splat(job.scale);
  const vf tensor_inverse = splat(1.0f / job.scale);
  if constexpr (MODE == MX_BLOCK) {  // groups of L blocks: their scales as one vector
    constexpr int per_block = PER_BLOCK;  // vectors a block: 1, 2 or 4 (16 lanes); 2, 4 or 8 (8 lanes)
    auto block_magnitude = [&](const float* x) {
      vf a = vabs(load_ahead(x));
      for (int k = 1; k < per_block; k++) a = vmax(a, vabs(load_ahead(x + k * L)));
      return a;
    };
    for (int64_t i = lo; i < hi; i += int64_t(per_block) * L * L) {
      int64_t blocks = (hi - i) / (per_block * L) < L ? (hi - i) / (per_block * L) : L;
      vf block_max[L] = {};
      if (blocks == L) {  // unrolled: the 16 magnitudes stay in registers for the maxima tree
#pragma GCC unroll 16
        for (int b = 0; b < L; b++) block_max[b] = block_magnitude(job.x + i + b * per_block * L);
      } else {
        for (int b = 0; b < blocks; b++) block_max[b] = block_magnitude(job.x + i + b * per_block * L);
      }
      float scales[L], inverses[L];
      vf scale_vector = mx_scales(maxima(block_max), job.emax);
      store(scales, scale_vector, false);
      store(inverses, 1.0f / scale_vector, false);  // exact: powers of two from 2^-127 to 2^127
      store_tail(job.block_scale + i / (per_block * L), scale_vector, blocks);
      in_runs(totals, blocks * per_block, [&](Run& run, int64_t k) {
        int64_t b = k / per_block;
        vf x = load(job.x + i + k * L);
        vf noise = noise_at<ROUND>(job.noise, i + k * L);
        // |x / scale| < 2^(emax + 1): past the maximum (so clipped and counted) but never far, no ceiling needed.
        vf v = x * splat(inverses[b]);
        vf q = cast<ROUND, MAY_CLIP, false>(v, x, noise, job.fmt, run.overflow) * splat(scales[b]);
        store(job.q + i + k * L, q, job.stream);
        scan_vector(run, x);
        cast_vector(run, x, q);
      });
    }
  } else if constexpr (MODE == NV_BLOCK) {  // blocks of 16, NV_PER_BLOCK vectors each: L blocks at a time
    for (int64_t i = lo; i < hi; i += 16 * L) {
      int64_t blocks = (hi - i) / 16 < L ? (hi - i) / 16 : L;
      vf amax = blocks == L ? load(job.block_in + i / 16) : load_tail(job.block_in + i / 16, blocks);
      vi ignored{};
      vf raw = vmin(vmax(amax / job.fmt.max_value / tensor_scale, splat(0.015625f)), splat(448.0f));
      vf block_scale = cast<NEAREST, false>(raw, raw, vf{}, job.e4m3, ignored);
      float element[L], inverses[L];
      store(element, tensor_scale * block_scale, false);
      store(inverses, 1.0f / (tensor_scale * block_scale), false);
      store_tail(job.block_scale + i / 16, block_scale, blocks);
      in_runs(totals, blocks * NV_PER_BLOCK, [&](Run& run, int64_t k) {
        vf x = load_ahead(job.x + i + k * L);
        int64_t b = k / NV_PER_BLOCK;
        vf scale = splat(element[b]);
        // The block scale is the block's largest |x| over the format's maximum (in units of the tensor scale, amax /
        // 2688) rounded to E4M3, down by at most 1/17, raised to 2^-6 or lowered to 448: |x / scale| stays below
        // max(6, 1.0625 × the maximum) < 7, so c stays finite without the ceiling clamp (past the maximum: clipped).
        vf v = divide(x, scale, splat(inverses[b]));
        vf q = cast<ROUND, MAY_CLIP, false>(v, x, noise_at<ROUND>(job.noise, i + k * L), job.fmt, run.overflow) * scale;
        store(job.q + i + k * L, q, job.stream);
        cast_vector(run, x, q);
      });
    }
  } else {
    // [from, to) (none for PLAIN) with the scales and reciprocals `scales(j, scale, inverse)` gives the vector at
    // offset j: TENSOR's whole range, a CHANNEL segment, or a row of COLUMNS.
    auto scaled_range = [&](int64_t from, int64_t to, auto scales) {
      auto one = [&](Run& run, int64_t i, int64_t count) {
        vf x = count == L ? load_ahead(job.x + i) : load_tail(job.x + i, count);
        vf scale, inverse;
        scales(i - from, scale, inverse);
        vf v = MODE == PLAIN ? x : divide(x, scale, inverse);
        vf q = cast<ROUND, MAY_CLIP>(v, x, noise_at<ROUND>(job.noise, i, count), job.fmt, run.overflow);
        if (MODE != PLAIN) q = q * scale;
        if (count == L) {
          store(job.q + i, q, job.stream);
        } else {
          store_tail(job.q + i, q, count);
        }
        if (MODE == PLAIN) scan_vector(run, x);
        cast_vector(run, x, q);
      };
      int64_t whole = (to - from) / L;
      in_runs(totals, whole, [&](Run& run, int64_t k) { one(run, from + k * L, L); });
      int64_t rest = to - from - whole * L;
      if (rest) {
        Run run;
        one(run, from + whole * L, rest);
        totals.add(run);
        totals.total.zeros_q -= double(L - rest);  // the padding's zeros
      }
    };
    if constexpr (MODE == CHANNEL) {  // the thread's range is whole segments
      for (int64_t i = lo; i < hi; i += job.block) {
        const vf scale = splat(job.block_in[i / job.block]), inverse = splat(1.0f / job.block_in[i / job.block]);
        scaled_range(i, i + job.block, [&](int64_t, vf& s, vf& r) {
          s = scale;
          r = inverse;
        });
      }
    } else if constexpr (MODE == COLUMNS) {  // the thread's range is whole rows
      const float* inverses = job.block_in + (job.block + COLUMN_PAD - 1) / COLUMN_PAD * COLUMN_PAD;
      for (int64_t i = lo; i < hi; i += job.block) {
        scaled_range(i, i + job.block, [&](int64_t j, vf& s, vf& r) {
          s = load(job.block_in + j);
          r = load(inverses + j);
        });
      }
    } else {
      scaled_range(lo, hi, [&](int64_t, vf& s, vf& r) {
        s = tensor_scale;
        r = tensor_inverse;
      });
    }
  }
  sums = totals;
}

template <bool MAY_CLIP, int ROUND>
void cast_mode(const Job& job, int64_t lo, int64_t hi, Sums& sums) {
  switch (job.mode) {
    case PLAIN: cast_range<PLAIN, MAY_CLIP, ROUND>(job, lo, hi, sums); break;
    case TENSOR: cast_range<TENSOR, MAY_CLIP, ROUND>(job, lo, hi, sums); break;
    case MX_BLOCK:
      if (job.block == 16) {
        cast_range<MX_BLOCK, MAY_CLIP, ROUND, 16 / L>(job, lo, hi, sums);
      } else if (job.block == 32) {
        cast_range<MX_BLOCK, MAY_CLIP, ROUND, 32 / L>(job, lo, hi, sums);
      } else {
        cast_range<MX_BLOCK, MAY_CLIP, ROUND, 64 / L>(job, lo, hi, sums);
      }
      break;
    case NV_BLOCK: cast_range<NV_BLOCK, MAY_CLIP, ROUND>(job, lo, hi, sums); break;
    case CHANNEL: cast_range<CHANNEL, MAY_CLIP, ROUND>(job, lo, hi, sums); break;
    default: cast_range<COLUMNS, MAY_CLIP, ROUND>(job, lo, hi, sums); break;
  }
}

// Stochastic rounding always may clip: a value within the maximum up to a rounding (x / scale of a scale taken from
// the amax, an NVFP4 block below 1.0625 × 6) rounds up past it with some probability.
void cast_any(const Job& job, int rounding, int64_t lo, int64_t hi, Sums& sums) {
  if (rounding == STOCHASTIC) {
    cast_mode<true, STOCHASTIC>(job, lo, hi, sums);
  } else if (rounding == STOCHASTIC_INTEGER) {
    cast_mode<true, STOCHASTIC_INTEGER>(job, lo, hi, sums);
  } else if (job.may_clip) {
    cast_mode<true, NEAREST>(job, lo, hi, sums);
  } else {
    cast_mode<false, NEAREST>(job, lo, hi, sums);
  }
}

// Runs body(lo, hi, sums) on each of `threads` threads' ranges (whole `granule`s) and combines their partial sums
// into `stats`.
template <typename Body>
void each_thread(int64_t n, int threads, double* stats, Body body, int64_t granule = CHUNK) {
  Partial parts[MAX_THREADS];
  int used = 1;
  threads = threads < 1 ? 1 : (threads > MAX_THREADS ? MAX_THREADS : threads);
#pragma omp parallel num_threads(threads)
  {
    int64_t lo, hi;
    thread_range(n, granule, &lo, &hi);
#pragma omp single
    used = omp_get_num_threads();
    Sums s;
    body(lo, hi, s);
    parts[omp_get_thread_num()] = s.finish();
  }
  combine(parts, used, stats);
}

// qw_weight_grad_rows' register tile: GRAD_ROWS kept rows by GRAD_VECTORS vectors of x's features, GRAD_ROWS ·
// GRAD_VECTORS accumulators (24 of AVX-512's 32 registers: 1.25-1.45 × the speed of 16 on a Zen 4 in a loop). AVX2 has
// 16 registers: 12 accumulators, the GRAD_VECTORS vectors of x and the broadcast dy value fill them; a tile of 16
// accumulators spills two of them to the stack on every token (1.2 × the time of 12 on a Zen 1).
#if defined(__AVX512F__)
constexpr int64_t GRAD_ROWS = 6, GRAD_VECTORS = 4;
#else
constexpr int64_t GRAD_ROWS = 3, GRAD_VECTORS = 4;
#endif

// One tile of R kept rows (columns[t * k + r]: the gathered dy values of token t) by GRAD_VECTORS vectors of x (row
// t at x + t * in_features) into ref (row r at ref + r * in_features): each element a float32 sum over the tokens in
// order.
template <int R>
void grad_tile(const float* columns, const float* x, int64_t tokens, int64_t k, int64_t in_features, float* ref) {
  constexpr int C = GRAD_VECTORS;
  vf acc[R][C] = {};
  for (int64_t t = 0; t < tokens; t++) {
    const float* xt = x + t * in_features;
    const float* gt = columns + t * k;
    vf xv[C];
    for (int c = 0; c < C; c++) xv[c] = load(xt + c * L);
    for (int r = 0; r < R; r++) {
      vf g = splat(gt[r]);
      for (int c = 0; c < C; c++) acc[r][c] = fused_add(acc[r][c], g, xv[c]);
    }
  }
  for (int r = 0; r < R; r++) {
    for (int c = 0; c < C; c++) store(ref + r * in_features + c * L, acc[r][c], false);
  }
}

// grad_tile for the tile's row count (1 to GRAD_ROWS: the last tile of rows may be short).
void grad_tiles(int64_t rows, const float* columns, const float* x, int64_t tokens, int64_t k,
                int64_t in_features, float* ref) {
  static_assert(GRAD_ROWS <= 6, "grad_tiles dispatches up to 6 rows");
  switch (rows) {
    case 1: return grad_tile<1>(columns, x, tokens, k, in_features, ref);
    case 2: return grad_tile<2>(columns, x, tokens, k, in_features, ref);
    case 3: return grad_tile<3>(columns, x, tokens, k, in_features, ref);
    case 4: return grad_tile<4>(columns, x, tokens, k, in_features, ref);
    case 5: return grad_tile<5>(columns, x, tokens, k, in_features, ref);
    default: return grad_tile<GRAD_ROWS>(columns, x, tokens, k, in_features, ref);
  }
}

}  // namespace

extern "C" {

// The vector unit these kernels were built for (native.py's VECTOR_ISAS): 2 AVX-512, 1 AVX2, 0 another (16 floats
// in registers of a narrower unit).
int qw_vector_isa() {
#if defined(__AVX512F__)
  return 2;
#elif defined(QW_AVX2)
  return 1;
#else
  return 0;
#endif
}

// Pass 1: |x|'s maximum, Σx² and the non-zero count into `stats` (10 doubles, `Partial` order: the cast fields stay
// 0; `nonfinite` is 0, or at least 1 with NONFINITE returned); with a `block` length (n a whole number of them), each
// block's largest |x| (its bit pattern's: NaN above infinity) into `block_amax` as well.
int qw_scan(const float* x, int64_t n, int64_t block, float* block_amax, double* stats, int threads) {
  if (block < 0 || (block > 0 && n % block != 0)) return BAD_ARGUMENT;
  if (block > 0 && block != 16) {  // any other length (CHANNEL's segments): whole blocks to each thread
    each_thread(n, threads, stats, [&](int64_t lo, int64_t hi, Sums& totals) {
      for (int64_t i = lo; i < hi; i += block) {
        vu largest{};
        int64_t whole = block / L;
        in_runs(totals, whole, [&](Run& run, int64_t k) {
          vf v = load_ahead(x + i + k * L);
          largest = umax((vu)v & MAGNITUDE_BITS, largest);
          scan_vector(run, v);
        });
        if (block > whole * L) {
          Run run;
          vf v = load_tail(x + i + whole * L, block - whole * L);
          largest = umax((vu)v & MAGNITUDE_BITS, largest);
          scan_vector(run, v);
          totals.add(run);
        }
        uint32_t top = hmax_bits(largest);
        std::memcpy(block_amax + i / block, &top, sizeof top);
      }
    }, block);
    return stats[9] > 0 ? NONFINITE : OK;
  }
  each_thread(n, threads, stats, [&](int64_t lo, int64_t hi, Sums& totals) {
    int64_t i = lo;
    if (block) {  // n is a whole number of blocks of 16, NV_PER_BLOCK vectors each: their maxima L at a time
      for (; i + 16 * L <= hi; i += 16 * L) {  // L blocks, 16 vectors: unrolled, the magnitudes stay in registers
        vf magnitudes[L];
        Run first, second;
#pragma GCC unroll 16
        for (int k = 0; k < 16; k++) {
          vf v = load_ahead(x + i + k * L);
          int b = k / NV_PER_BLOCK;
          magnitudes[b] = k % NV_PER_BLOCK ? vmax(magnitudes[b], vabs(v)) : vabs(v);
          scan_vector(k < RUN ? first : second, v);
        }
        totals.add(first);
        totals.add(second);
        store(block_amax + i / 16, maxima(magnitudes), false);
      }
      if (i < hi) {
        int64_t blocks = (hi - i) / 16;
        vf magnitudes[L] = {};
        in_runs(totals, blocks * NV_PER_BLOCK, [&](Run& run, int64_t k) {
          vf v = load(x + i + k * L);
          int64_t b = k / NV_PER_BLOCK;
          magnitudes[b] = k % NV_PER_BLOCK ? vmax(magnitudes[b], vabs(v)) : vabs(v);
          scan_vector(run, v);
        });
        store_tail(block_amax + i / 16, maxima(magnitudes), blocks);
      }
      return;
    }
    int64_t whole = (hi - lo) / L;
    in_runs(totals, whole, [&](Run& run, int64_t k) { scan_vector(run, load_ahead(x + lo + k * L)); });
    if (hi - lo > whole * L) {
      Run run;
      scan_vector(run, load_tail(x + lo + whole * L, hi - lo - whole * L));
      totals.add(run);
    }
  });
  return stats[9] > 0 ? NONFINITE : OK;
}

// Pass 1 of COLUMNS: as qw_scan, with each column's largest |x| among the rows a thread read into that thread's row
// of `column_amax` (`threads` rows of `columns` rounded up to whole vectors, zeroed by the caller).
int qw_scan_columns(const float* x, int64_t n, int64_t columns, float* column_amax, double* stats, int threads) {
  if (columns < 1 || n % columns != 0) return BAD_ARGUMENT;
  const int64_t padded = (columns + COLUMN_PAD - 1) / COLUMN_PAD * COLUMN_PAD;
  each_thread(n, threads, stats, [&](int64_t lo, int64_t hi, Sums& totals) {
    float* largest = column_amax + omp_get_thread_num() * padded;
    int64_t whole = columns / L, rest = columns - whole * L;
    for (int64_t i = lo; i < hi; i += columns) {
      in_runs(totals, whole, [&](Run& run, int64_t k) {
        vf v = load_ahead(x + i + k * L);
        store(largest + k * L, vmax(load(largest + k * L), vabs(v)), false);
        scan_vector(run, v);
      });
      if (rest) {
        Run run;
        vf v = load_tail(x + i + whole * L, rest);
        store(largest + whole * L, vmax(load(largest + whole * L), vabs(v)), false);
        scan_vector(run, v);
        totals.add(run);
      }
    }
  }, columns);
  return stats[9] > 0 ? NONFINITE : OK;
}

// Pass 2 (the only pass for PLAIN and MX_BLOCK): q = cast(x / scale) · scale and the statistics into `stats`
// (`Partial` order; PLAIN and MX_BLOCK fill the scan's fields too). `rounding` is a `Round`; the stochastic ones read
// one draw in [0, 1) per element from `noise` (n floats, x's layout). CHANNEL: x is n / block segments of `block`
// elements, each of one channel, whose scales `block_in` holds (one a segment). COLUMNS: x is rows of `block`
// channels; `block_in` holds their scales, then the scales' reciprocals, each padded with ones to whole vectors.
int qw_cast(const float* x, float* q, int64_t n, int mantissa_bits, int emin, int emax, float max_value, int mode,
            int64_t block, float scale, const float* block_in, float* block_scale, int may_clip, int stream,
            double* stats, int threads, const float* noise, int rounding) {
  if (rounding < NEAREST || rounding > STOCHASTIC_INTEGER || (rounding != NEAREST && noise == nullptr) ||
      (mode == MX_BLOCK && ((block != 16 && block != 32 && block != 64) || n % block != 0)) ||
      (mode == NV_BLOCK && (block != 16 || n % 16 != 0)) ||
      ((mode == CHANNEL || mode == COLUMNS) && (block < 1 || n % block != 0)) || mode < PLAIN || mode > COLUMNS) {
    return BAD_ARGUMENT;
  }
  // Streaming stores need 64-byte alignment: a CHANNEL segment (a COLUMNS row) of other than whole vectors leaves the
  // next unaligned.
  bool aligned = (mode != CHANNEL && mode != COLUMNS) || block % L == 0;
  const float* draws = rounding != NEAREST ? noise : nullptr;
  Job job{x, q, draws, n, make_format(mantissa_bits, emin, emax, max_value), mode, block, emax, scale, block_in,
          block_scale, make_format(3, -6, 8, 448.0f), stream != 0 && aligned, may_clip != 0};
  each_thread(n, threads, stats, [&](int64_t lo, int64_t hi, Sums& s) {
    cast_any(job, rounding, lo, hi, s);
#if defined(__AVX512F__) || defined(QW_AVX2)
    if (job.stream) _mm_sfence();  // each thread's streaming stores are weakly ordered: fence them before the barrier
#endif
  }, mode == CHANNEL || mode == COLUMNS ? block : CHUNK);
  return stats[9] > 0 ? NONFINITE : OK;
}

// The statistics of q against x (both float32, finite) in one pass, for quantizations done elsewhere: `Partial` order
// into `stats`, with the underflow count (x != 0 and q == 0) in place of the zeros of q, and the clipped inputs counted
// from `overflow` (one byte per element, 0 or 1; null: none). Returns NONFINITE when some x or q is NaN or ±inf.
int qw_stats(const float* x, const float* q, const uint8_t* overflow, int64_t n, double* stats, int threads) {
  typedef uint8_t vb __attribute__((vector_size(L)));
  each_thread(n, threads, stats, [&](int64_t lo, int64_t hi, Sums& totals) {
    vu q_largest{};
    in_runs(totals, (hi - lo + L - 1) / L, [&](Run& run, int64_t k) {
      int64_t i = lo + k * L;
      bool whole = i + L <= hi;
      vf xv = whole ? load_ahead(x + i) : load_tail(x + i, hi - i);
      vf qv = whole ? load_ahead(q + i) : load_tail(q + i, hi - i);
      stats_vector(run, xv, qv, q_largest);
      if (overflow != nullptr) {
        vb bytes{};
        std::memcpy(&bytes, overflow + i, whole ? L : hi - i);
        run.overflow += __builtin_convertvector(bytes, vi);
      }
    });
    count_nonfinite(totals, q_largest);
  });
  return stats[9] > 0 ? NONFINITE : OK;
}

// The statistics of a float8 cast against its high-precision input x, as qw_stats gives them for x, the dequantized
// cast and the mask of the clipped, without either: q = table[codes[i]] / s and the clipped inputs |x · s| >
// max_value, where s is the scale of element i's row (`row` consecutive elements; `scales`: one a row) or, with
// `scales` null, the tensor's `tensor_scale` (the table's 256 values divided by it once, the same divisions);
// `table`: the 256 codes' values, code b | 0x80 the negation of code b (see Codebook).
// Every sum and count is taken in qw_stats's order, from the same float32 values (a correctly rounded division, as
// torch divides), so the figures are those of qw_stats bit for bit.
int qw_float8_stats(const float* x, const uint8_t* codes, const float* table, const float* scales, int64_t row,
                    float tensor_scale, float max_value, int64_t n, double* stats, int threads) {
  if (scales != nullptr && (row < 1 || n % row != 0)) return BAD_ARGUMENT;
  const vf limit = splat(max_value);
  each_thread(n, threads, stats, [&](int64_t lo, int64_t hi, Sums& totals) {
    const Codebook book(table, scales != nullptr ? 1.0f : tensor_scale);
    vu q_largest{};
    int64_t r = scales != nullptr ? lo / row : 0, offset = scales != nullptr ? lo - r * row : 0;
    in_runs(totals, (hi - lo + L - 1) / L, [&](Run& run, int64_t k) {
      int64_t i = lo + k * L, count = hi - i < L ? hi - i : L;
      vf xv = count == L ? load_ahead(x + i) : load_tail(x + i, count);
      vf s = splat(tensor_scale), qv;
      if (scales != nullptr) {
        if (offset + L <= row) {
          s = splat(scales[r]);
        } else {  // a vector across rows (or the last, short one): each lane's row's scale, 1 past the end
          for (int j = 0; j < L; j++) s[j] = j < count ? scales[r + (offset + j) / row] : 1.0f;
        }
        for (offset += L; offset >= row; offset -= row) r++;
      }
      if (count == L) {
        qv = decode(codes + i, book);
        if (scales != nullptr) qv = qv / s;
      } else {  // zero-padded as load_tail pads (a zero x counts in no statistic here)
        float tail[L] = {0};
        for (int64_t j = 0; j < count; j++) tail[j] = table[codes[i + j]] / s[j];
        qv = load(tail);
      }
      stats_vector(run, xv, qv, q_largest);
      run.overflow = count_if(run.overflow, vabs(xv * s) > limit);
    });
    count_nonfinite(totals, q_largest);
  });
  return stats[9] > 0 ? NONFINITE : OK;
}

// One-byte codes (float8 values viewed as bytes) decoded through a 256-entry float32 table: out[i] = table[codes[i]].
int qw_decode_bytes(const uint8_t* codes, const float* table, float* out, int64_t n, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t i = 0; i < n; i++) out[i] = table[codes[i]];
  return OK;
}

// ---- Statistics against chosen rows of a matrix (kernels/row_stats.py) ------------------------------------------
// qw_stats of x (`count` rows of `row` floats, contiguous) against the rows index[0], …, index[count − 1] of q (a
// matrix of `q_rows` rows of `row` floats) without gathering them: with `row` a multiple of the vector width no vector
// spans two rows, so every vector, run and sum is the one qw_stats takes over the gathered copy, and the figures are
// its, bit for bit. BAD_ARGUMENT for another `row` or an index outside q.
int qw_stats_rows(const float* x, const float* q, const int64_t* index, int64_t count, int64_t row, int64_t q_rows,
                  double* stats, int threads) {
  if (row < 1 || row % L != 0) return BAD_ARGUMENT;
  for (int64_t r = 0; r < count; r++) {
    if (index[r] < 0 || index[r] >= q_rows) return BAD_ARGUMENT;
  }
  each_thread(count * row, threads, stats, [&](int64_t lo, int64_t hi, Sums& totals) {
    vu q_largest{};
    in_runs(totals, (hi - lo + L - 1) / L, [&](Run& run, int64_t k) {
      int64_t i = lo + k * L;
      vf xv = load_ahead(x + i);
      vf qv = load(q + index[i / row] * row + i % row);
      stats_vector(run, xv, qv, q_largest);
    });
    count_nonfinite(totals, q_largest);
  });
  return stats[9] > 0 ? NONFINITE : OK;
}


// A statistics pass's sums `s` (`Partial` order, over `numel` elements) as a comparison's statistics
// (quantwatch.kernels.stats.comparison_fields), written in place: the 11 float64 fields of ErrorStats.FIELDS into
// `fields` — the count and Σx², Σq², Σqx, Σ(q−x)² each multiplied by `weight` (Σ(q−x)² NaN without `error`), max
// |q − x| and amax NaN, the counts 0 — in the float64 operations of pass_fields, comparison_of and the agent's
// weighting in Python, so the same bits. OUT_OF_RANGE (the sums beyond what float32 runs hold: lane_sums_in_range in
// partial_sums.py) leaves `fields` untouched; the caller then compares another way.
static int comparison_into(const double* s, double numel, double weight, int error, double* fields) {
  const double least = numel * 0x1p-100, magnitude = 0x1p40;
  const double sum_x2 = s[0], sum_q2 = s[1], sum_qx = s[2], sum_err2 = s[3], max_err = s[4], amax = s[5];
  bool in_range = max_err <= magnitude && amax <= magnitude && (sum_x2 >= least || amax == 0) &&
                  (sum_err2 >= least || max_err == 0) && (sum_q2 >= least || (max_err == amax && amax == 0));
  if (!in_range) return OUT_OF_RANGE;
  const double nan = __builtin_nan("");
  double out[11] = {numel * weight, sum_x2 * weight, sum_q2 * weight, sum_qx * weight,
                    error ? sum_err2 * weight : nan, nan, nan, 0.0, 0.0, 0.0, 0.0};
  std::memcpy(fields, out, sizeof out);
  return OK;
}

// qw_stats of x against q (n floats each, no overflow mask) as a comparison's fields (comparison_into).
int qw_compare(const float* x, const float* q, int64_t n, double weight, int error, double* fields, int threads) {
  double s[10];
  int status = qw_stats(x, q, nullptr, n, s, threads);
  return status != OK ? status : comparison_into(s, (double)n, weight, error, fields);
}

// qw_stats_rows as a comparison's fields (comparison_into).
int qw_compare_rows(const float* x, const float* q, const int64_t* index, int64_t count, int64_t row, int64_t q_rows,
                    double weight, int error, double* fields, int threads) {
  double s[10];
  int status = qw_stats_rows(x, q, index, count, row, q_rows, s, threads);
  return status != OK ? status : comparison_into(s, (double)(count * row), weight, error, fields);
}

// The rows stratified draws keep (quantwatch.agent.rows): of `n` rows `k` strata, stratum j = [⌊j·n/k⌋, ⌊(j+1)·n/k⌋)
// of size s_j, its row ⌊j·n/k⌋ + min(⌊u_j · s_j⌋, s_j − 1) from the uniform u_j in [0, 1): NumPy's `starts +
// minimum((u * sizes).astype(int64), sizes - 1)`, the same float64 product and truncation. Two draws, the second's
// uniforms after the first's and its rows after the first's in `rows`; a draw of k = 0 takes none.
static void stratified(const double* uniforms, int64_t n, int64_t k, int64_t* rows) {
  for (int64_t j = 0; j < k; j++) {
    int64_t start = j * n / k, size = (j + 1) * n / k - start;
    int64_t offset = (int64_t)(uniforms[j] * (double)size);
    rows[j] = start + (offset < size - 1 ? offset : size - 1);
  }
}

int qw_stratified_rows(const double* uniforms, int64_t n, int64_t k, int64_t n2, int64_t k2, int64_t* rows) {
  if (k < 0 || k > n || k2 < 0 || k2 > n2) return BAD_ARGUMENT;
  stratified(uniforms, n, k, rows);
  stratified(uniforms + k, n2, k2, rows + k);
  return OK;
}

// The FP32 reference weight gradient's kept rows (shadow_rows, agent/layers.py): ref[j][c] = Σ_t dy[t][cols[j]] ·
// x[t][c] for the `k` kept output features cols[] of dy (`tokens` rows of `out_features` floats) and x (`tokens` rows
// of `in_features`, a multiple of the vector width: BAD_ARGUMENT otherwise, or for an index outside dy's columns),
// into ref (`k` rows of `in_features`): dy[:, cols]ᵀ x, each element a float32 sum over the tokens in order (one
// fused multiply-add each where the unit has them), whichever thread computes it.
int qw_weight_grad_rows(const float* dy, const float* x, const int64_t* cols, int64_t tokens, int64_t out_features,
                        int64_t in_features, int64_t k, float* ref, int threads) {
  if (in_features < 1 || in_features % L != 0) return BAD_ARGUMENT;
  for (int64_t j = 0; j < k; j++) {
    if (cols[j] < 0 || cols[j] >= out_features) return BAD_ARGUMENT;
  }
  // dy's kept columns gathered once, token by token (gathered[t][j] = dy[t][cols[j]]): the tiles below read each
  // of them once per vector block, from a few cache lines instead of one line of dy each.
  std::vector<float> gathered((size_t)(tokens * k));
  for (int64_t t = 0; t < tokens; t++) {
    const float* dyt = dy + t * out_features;
    float* gt = gathered.data() + t * k;
    for (int64_t j = 0; j < k; j++) gt[j] = dyt[cols[j]];
  }
  const float* columns = gathered.data();
  const int64_t vectors = in_features / L, row_tiles = (k + GRAD_ROWS - 1) / GRAD_ROWS;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t tile = 0; tile < row_tiles; tile++) {
    const int64_t j0 = tile * GRAD_ROWS, rows = k - j0 < GRAD_ROWS ? k - j0 : GRAD_ROWS;
    for (int64_t v0 = 0; v0 < vectors; v0 += GRAD_VECTORS) {
      const int64_t width = vectors - v0 < GRAD_VECTORS ? vectors - v0 : GRAD_VECTORS;
      if (width == GRAD_VECTORS) {
        grad_tiles(rows, columns + j0, x + v0 * L, tokens, k, in_features, ref + j0 * in_features + v0 * L);
        continue;
      }
      vf acc[GRAD_ROWS][GRAD_VECTORS] = {};  // the last vectors of a row: the same sums, fewer of them
      for (int64_t t = 0; t < tokens; t++) {
        const float* xt = x + t * in_features + v0 * L;
        const float* gt = columns + t * k + j0;
        for (int64_t r = 0; r < rows; r++) {
          vf g = splat(gt[r]);
          for (int64_t c = 0; c < width; c++) acc[r][c] = fused_add(acc[r][c], g, load(xt + c * L));
        }
      }
      for (int64_t r = 0; r < rows; r++) {
        for (int64_t c = 0; c < width; c++) store(ref + (j0 + r) * in_features + (v0 + c) * L, acc[r][c], false);
      }
    }
  }
  return OK;
}


// The lane sums of L vectors at once: lane j of the result is the float32 sum of v[j]'s lanes, added as a tree (lane i
// with lane i + L/2, those with their i + L/4, ... down to neighbours), the same order for every j. Each step adds the
// halves of two vectors side by side: L − 1 additions and twice as many shuffles for all L sums, where one sum lane
// by lane takes L − 1 additions and as many lane extractions.
#if defined(QW_AVX2)
inline vf lane_sums(const vf* v) {
  vf h[4], p[2];
  for (int i = 0; i < 4; i++) {
    h[i] = SHUFFLE(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           SHUFFLE(v[2 * i], v[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  }
  for (int i = 0; i < 2; i++) {
    p[i] = SHUFFLE(h[2 * i], h[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           SHUFFLE(h[2 * i], h[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  }
  return SHUFFLE(p[0], p[1], 0, 2, 4, 6, 8, 10, 12, 14) + SHUFFLE(p[0], p[1], 1, 3, 5, 7, 9, 11, 13, 15);
}
#else
inline vf lane_sums(const vf* v) {
  vf h[8], q[4], p[2];
  for (int i = 0; i < 8; i++) {
    h[i] = SHUFFLE(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           SHUFFLE(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  for (int i = 0; i < 4; i++) {
    q[i] = SHUFFLE(h[2 * i], h[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           SHUFFLE(h[2 * i], h[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  }
  for (int i = 0; i < 2; i++) {
    p[i] = SHUFFLE(q[2 * i], q[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           SHUFFLE(q[2 * i], q[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  }
  return SHUFFLE(p[0], p[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         SHUFFLE(p[0], p[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#endif

// The FP32 reference output's kept rows (shadow_rows, agent/layers.py): ref[r][o] = Σ_i x[rows[r]][i] · w[o][i]
// (+ bias[o] when given) for x (`n` rows of `in` floats, a multiple of the vector width), w (`out` rows of `in`) and
// the `k` kept rows rows[] of x: each dot product summed in vector lanes over x's row in order (one fused
// multiply-add each where the unit has them), the lanes added as lane_sums adds them, then the bias; whichever
// thread computes it. Tiles of R rows of x by O rows of w keep R · O accumulators in registers, with the O vectors of
// w and one of x: 4 by 4 in AVX-512's 32 registers, 4 by 3 in AVX2's 16 (4 by 4 spills two accumulators to the stack
// on every vector there: 1.2 × the time on a Zen 1). The accumulators are summed in groups of L, the last one padded
// with zeros (each sum is its own vector's, so the padding changes none). A short edge tile repeats its first row
// (computed, not stored).
static void linear_rows(const float* x, const float* w, const float* bias, const int64_t* rows, int64_t k, int64_t in,
                        int64_t out, float* ref, int threads) {
#if defined(QW_AVX2)
  constexpr int64_t R = 4, O = 3;
#else
  constexpr int64_t R = 4, O = 4;
#endif
  constexpr int64_t SUMS = (R * O + L - 1) / L * L;  // the accumulators rounded up to whole groups of L
  const int64_t vectors = in / L, out_tiles = (out + O - 1) / O;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t tile = 0; tile < out_tiles; tile++) {
    const int64_t o0 = tile * O, outs = out - o0 < O ? out - o0 : O;
    const float* wo[O];
    for (int64_t o = 0; o < O; o++) wo[o] = w + (o0 + (o < outs ? o : 0)) * in;
    for (int64_t r0 = 0; r0 < k; r0 += R) {
      const int64_t kept = k - r0 < R ? k - r0 : R;
      const float* xr[R];
      for (int64_t r = 0; r < R; r++) xr[r] = x + rows[r0 + (r < kept ? r : 0)] * in;
      vf acc[SUMS] = {};
      for (int64_t v = 0; v < vectors; v++) {
        vf wv[O];
        for (int64_t o = 0; o < O; o++) wv[o] = load(wo[o] + v * L);
        for (int64_t r = 0; r < R; r++) {
          vf xv = load(xr[r] + v * L);
          for (int64_t o = 0; o < O; o++) acc[r * O + o] = fused_add(acc[r * O + o], xv, wv[o]);
        }
      }
      float sums[SUMS];
      for (int64_t g = 0; g < SUMS; g += L) {
        vf s = lane_sums(acc + g);
        std::memcpy(sums + g, &s, sizeof s);
      }
      for (int64_t r = 0; r < kept; r++) {
        for (int64_t o = 0; o < outs; o++) {
          float s = sums[r * O + o];
          ref[(r0 + r) * out + o0 + o] = bias != nullptr ? s + bias[o0 + o] : s;
        }
      }
    }
  }
}

// An nn.Linear call's output comparison on its kept rows in one call: the reference rows of linear_rows against
// the same rows of the layer's output y (`n` rows of `out` floats), as qw_compare_rows compares them, into `fields`.
// BAD_ARGUMENT for `in` or `out` not a multiple of the vector width or an index outside x; qw_compare_rows' status
// otherwise (NONFINITE, OUT_OF_RANGE: `fields` untouched, the caller compares another way).
int qw_compare_linear_rows(const float* x, const float* w, const float* bias, const int64_t* rows, int64_t k,
                           int64_t n, int64_t in, int64_t out, const float* y, double weight, double* fields,
                           int threads) {
  if (in < 1 || in % L != 0 || out < 1 || out % L != 0 || k < 1) return BAD_ARGUMENT;
  for (int64_t r = 0; r < k; r++) {
    if (rows[r] < 0 || rows[r] >= n) return BAD_ARGUMENT;
  }
  std::vector<float> ref((size_t)(k * out));
  linear_rows(x, w, bias, rows, k, in, out, ref.data(), threads);
  return qw_compare_rows(ref.data(), y, rows, k, out, n, weight, 1, fields, threads);
}

// The update comparison of an nn.Linear on its weight gradient's kept rows in one call: the reference rows of
// qw_weight_grad_rows (dy[:, cols]ᵀ x) against the same rows cols[] of the quantized path's weight gradient `grad`
// (`out_features` rows of `in_features` floats), as qw_compare_rows compares them, into `fields`: the figures of the
// two calls made one after the other, bit for bit. Their statuses otherwise (`fields` untouched). The reference rows
// are written into `ref` (k rows of `in_features` floats; null: memory of the call's own): after OK, and after the
// comparison declined on the values (NONFINITE, OUT_OF_RANGE), when the caller compares them another way; a
// BAD_ARGUMENT computes nothing.
int qw_compare_weight_grad_rows(const float* dy, const float* x, const int64_t* cols, int64_t tokens,
                                int64_t out_features, int64_t in_features, int64_t k, const float* grad, double weight,
                                double* fields, float* ref, int threads) {
  if (k < 1) return BAD_ARGUMENT;
  std::vector<float> own(ref == nullptr ? (size_t)(k * in_features) : 0);
  float* rows = ref != nullptr ? ref : own.data();
  int status = qw_weight_grad_rows(dy, x, cols, tokens, out_features, in_features, k, rows, threads);
  if (status != OK) return status;
  return qw_compare_rows(rows, grad, cols, k, in_features, out_features, weight, 1, fields, threads);
}
}  // extern "C"
