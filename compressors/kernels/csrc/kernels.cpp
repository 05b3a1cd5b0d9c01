// Fused magnitude kernels for the threshold sparsifiers (compressors/kernels/cpu.py).
//
// Plain C ABI over raw pointers (no torch headers: compiles in about a second), loaded
// with ctypes. Every kernel reads its input once and writes no full-size output:
//   gc_stats_*    count, Σy, Σy², max, min of y = |x| − shift over {|x| > above} (or all
//                 elements), plus the nonzero count (alone, or with the extremes) and
//                 Σ ln|x| when asked: one read pass.
//   gc_count_*    #{|x| ≥ t} (or > t): one read pass, nothing written.
//   gc_select_*   positions (and optionally |x|, or x itself) of {|x| ≥ t} (or > t),
//                 ascending: one read pass; each thread appends its hits to its own
//                 growing buffer, the caller then allocates the exact-size output and
//                 gc_take copies into it.
//                 Selections expected to keep more than about 1% of a float32 input are
//                 written branch-free instead (select_dense_f32).
//   gc_pool_begin_f32  gc_stats over {|x| > above} and the selection {|x| > t} (or ≥)
//                 with |x| (or x) in the same read (SIDCo's pools); dense pools are
//                 written branch-free.
//   gc_sample_abs_*  |x| at hashed random positions (DGC/DRAGONN's sample), prefetched.
// float32 inputs are compared (and |x|, max, min taken) in float32 lanes; only sums are
// widened to double.
// Comparisons are done in the input's precision with the threshold rounded to it, as
// torch does for `tensor >= python_float`, so selections equal torch's bit for bit.
// Sums are accumulated in double over fixed blocks of BLOCK elements and the block
// partials added in block order, so a result does not depend on the thread count.
// Built without -ffast-math: the compiler may not reassociate, so the lane structure
// below is what vectorises the loops.

#include "common.h"

#include <type_traits>

namespace {

struct Partial {
  double count = 0, sum = 0, sumsq = 0, max = -1, min = std::numeric_limits<double>::infinity();
  double nonzero = 0, log_sum = 0;
};


// Σ ln a over a > 0 of a block, as Σ exponents·ln2 + ln Π mantissas (mantissas in [1, 2)
// multiplied per lane, renormalised every 256 elements so products stay finite); ∞ with
// an infinity. The float is widened to double first, so float denormals are ordinary
// doubles.
template <typename T>
double block_log_sum(const T* x, int64_t n) {
  const v4l mant = {0x000FFFFFFFFFFFFFll, 0x000FFFFFFFFFFFFFll, 0x000FFFFFFFFFFFFFll,
                    0x000FFFFFFFFFFFFFll};
  const v4l one = {0x3FF0000000000000ll, 0x3FF0000000000000ll, 0x3FF0000000000000ll,
                   0x3FF0000000000000ll};
  const v4l bias = {1023, 1023, 1023, 1023};
  const v4d zero = {0, 0, 0, 0}, inf = zero + INFINITY;
  v4d prod = {1, 1, 1, 1};
  v4l expo = {0, 0, 0, 0}, infinite = {0, 0, 0, 0};
  int64_t i = 0;
  while (i < n) {
    const int64_t stop = std::min<int64_t>(n, i + 256);
    for (; i + 4 <= stop; i += 4) {
      const v4d a = vabs(load4(x + i));
      const v4l bits = (v4l)a;
      const v4l pos = a > zero;
      infinite |= a == inf;
      const v4d m = (v4d)((bits & mant) | one);
      prod *= (v4d)(((v4l)m & pos) | (one & ~pos));
      // Logical shift (the sign bit is clear): AVX2 has it for 64-bit lanes.
      expo += ((v4l)((v4u)bits >> 52) - bias) & pos;
    }
    for (; i < stop; ++i) {
      const double a = std::fabs(static_cast<double>(x[i]));
      infinite[0] |= a == INFINITY;
      if (a > 0) {
        int e;
        const double m = std::frexp(a, &e);  // [0.5, 1)
        prod[0] *= 2 * m;
        expo[0] += e - 1;
      }
    }
    for (int l = 0; l < 4; ++l) {
      int e;
      prod[l] = std::frexp(prod[l], &e);
      expo[l] += e;
    }
  }
  double logs = 0;
  int64_t e_total = 0;
  for (int l = 0; l < 4; ++l) {
    if (infinite[l]) return INFINITY;  // ln ∞ (NaNs are left out: not > 0)
    logs += std::log(prod[l]); e_total += expo[l];
  }
  return logs + static_cast<double>(e_total) * 0.69314718055994530942;
}

#if defined(__AVX512F__)
// float32 with AVX-512: Σ ln a = Σ e·ln2 + ln Π m for a = m·2^e, m in [1, 2), with e and m
// taken by getexp and getmant (exact, subnormals included; zeros masked out: e 0, m 1).
// The exponents are added in float32 lanes (integers, exact below 2^24: at most 4096
// elements of |e| ≤ 149 between reductions); the mantissas widened and multiplied in two
// chains of eight double lanes, brought back to [1, 2) every 4096 elements (a lane's
// product of at most 256 numbers in [1, 2) stays finite). An infinity or a NaN makes the
// exponent sum non-finite: such a block is summed by the widening loop above. The
// nonzeros (bits of |x| not zero) are counted on the way, for the caller.
// One block's running sum, 16 elements a step (also used inside SIDCo's speculative read,
// block_spec, where the elements are already loaded: the same steps, so the same bits).
struct LogSum16 {
  __m512d p0 = _mm512_set1_pd(1.0), p1 = _mm512_set1_pd(1.0);
  __m512 e = _mm512_setzero_ps();
  double expo = 0;  // a sum of integers far below 2^53: exact
  int64_t count = 0;
  bool finite = true;

  // a = |x| of 16 elements (zeros in lanes past the end)
  void add(__m512 a) {
    const __mmask16 nz = _mm512_test_epi32_mask(_mm512_castps_si512(a), _mm512_castps_si512(a));
    count += __builtin_popcount(static_cast<unsigned>(nz));
    e = _mm512_add_ps(e, _mm512_maskz_getexp_ps(nz, a));
    const __m512 m = _mm512_mask_getmant_ps(_mm512_set1_ps(1.0f), nz, a, _MM_MANT_NORM_1_2,
                                            _MM_MANT_SIGN_zero);
    p0 = _mm512_mul_pd(p0, _mm512_cvtps_pd(_mm512_castps512_ps256(m)));
    p1 = _mm512_mul_pd(p1, _mm512_cvtps_pd(
                               _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(m), 1))));
  }
  // the same step where a is already widened (y0: lanes 0–7, y1: lanes 8–15, as in
  // block_spec): getmant of a double that holds a float exactly is that float's mantissa,
  // so the same factors go into the same chains (the same bits) without a second widening.
  // (Not the step above for that one too: widening a before getmant costs an op more per
  // 16, 5.09 → 5.27 ms for gc_stats' Σ ln|x| at 26M, alternating in one process.)
  void add(__m512 a, __m512d y0, __m512d y1) {
    const __mmask16 nz = _mm512_test_epi32_mask(_mm512_castps_si512(a), _mm512_castps_si512(a));
    count += __builtin_popcount(static_cast<unsigned>(nz));
    e = _mm512_add_ps(e, _mm512_maskz_getexp_ps(nz, a));
    const __m512d one = _mm512_set1_pd(1.0);
    p0 = _mm512_mul_pd(p0, _mm512_mask_getmant_pd(one, static_cast<__mmask8>(nz), y0,
                                                  _MM_MANT_NORM_1_2, _MM_MANT_SIGN_zero));
    p1 = _mm512_mul_pd(p1, _mm512_mask_getmant_pd(one, static_cast<__mmask8>(nz >> 8), y1,
                                                  _MM_MANT_NORM_1_2, _MM_MANT_SIGN_zero));
  }
  // after each 4096 elements of the block and at its end (again at once: no change)
  void renormalise() {
    const float es = _mm512_reduce_add_ps(e);
    finite = finite && std::isfinite(es);
    expo += static_cast<double>(es) + _mm512_reduce_add_pd(_mm512_getexp_pd(p0)) +
            _mm512_reduce_add_pd(_mm512_getexp_pd(p1));
    p0 = _mm512_getmant_pd(p0, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_zero);
    p1 = _mm512_getmant_pd(p1, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_zero);
    e = _mm512_setzero_ps();
  }
  // the block's Σ ln|x| (x, n: the whole block, read again by the widening loop when an
  // infinity or a NaN was met); its nonzeros into *nonzero_out
  double finish(const float* x, int64_t n, int64_t* nonzero_out) {
    if (!finite) {
      int64_t nonzero = 0;
      for (int64_t i = 0; i < n; ++i) {
        uint32_t bits;
        std::memcpy(&bits, x + i, sizeof bits);
        nonzero += (bits & 0x7FFFFFFFu) != 0;
      }
      if (nonzero_out) *nonzero_out = nonzero;
      return block_log_sum<float>(x, n);
    }
    if (nonzero_out) *nonzero_out = count;
    alignas(64) double pl[16];
    _mm512_store_pd(pl, p0);
    _mm512_store_pd(pl + 8, p1);
    double prod = 1.0;
    for (int l = 0; l < 16; ++l) prod *= pl[l];  // each in [1, 2): below 2^16, finite
    return std::log(prod) + expo * 0.69314718055994530942;
  }
};

inline __m512 abs_tail16(const float* x, int64_t left) {  // the last < 16 elements, zeros after
  return _mm512_abs_ps(_mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << left) - 1), x));
}

inline double block_log_sum(const float* x, int64_t n, int64_t* nonzero_out = nullptr) {
  LogSum16 sum;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    sum.add(_mm512_abs_ps(_mm512_loadu_ps(x + i)));
    if ((i + 16) % 4096 == 0) sum.renormalise();
  }
  if (i < n) sum.add(abs_tail16(x + i, n - i));
  sum.renormalise();
  return sum.finish(x, n, nonzero_out);
}
#elif defined(__AVX2__)
// float32 with AVX2: the same sum from the float bits, without widening every element.
// For a normal float a = 1.f·2^(E−127), ln a = ln 1.f + (E − 127)·ln 2: the exponent fields
// E are added in int32 lanes, and the mantissas 1.f (exact as floats) widened and
// multiplied in four chains of double lanes, brought back to [0.5, 1) every 4096 elements
// (a lane's product of at most 256 numbers in [1, 2) stays finite). A zero has E = 0 and
// mantissa 1.0, so it adds nothing once 127 is taken per nonzero. A block with a subnormal,
// an infinity or a NaN (seen as the smallest nonzero bits below 2^23, or the largest at or
// above the infinity's) is summed by the widening loop above instead (which leaves NaNs
// out, as they are not > 0, as the GPU kernel does).
// Also counts the nonzeros (|x| > 0), which the caller may want.
inline double block_log_sum(const float* x, int64_t n, int64_t* nonzero_out = nullptr) {
  const __m256i absmask = _mm256_set1_epi32(0x7FFFFFFF), mmask = _mm256_set1_epi32(0x007FFFFF);
  const __m256i onef = _mm256_set1_epi32(0x3F800000), ones = _mm256_set1_epi32(1);
  const __m256i zero = _mm256_setzero_si256();
  const __m256i dmant = _mm256_set1_epi64x(0x000FFFFFFFFFFFFFll);
  const __m256i half = _mm256_set1_epi64x(0x3FE0000000000000ll);
  __m256i lo = _mm256_set1_epi32(-1), hi = zero, nz = zero;
  __m256d p0 = _mm256_set1_pd(1.0), p1 = p0, p2 = p0, p3 = p0;
  int64_t expo = 0, i = 0;
  while (i + 16 <= n) {
    const int64_t stop = std::min<int64_t>(n, i + 4096);
    __m256i e = zero;
    for (; i + 16 <= stop; i += 16) {
      const __m256i b0 = _mm256_and_si256(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i)), absmask);
      const __m256i b1 = _mm256_and_si256(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i + 8)), absmask);
      // bits − 1 as unsigned: a zero wraps to the top, a subnormal stays below 2^23 − 1
      lo = _mm256_min_epu32(lo, _mm256_min_epu32(_mm256_sub_epi32(b0, ones),
                                                 _mm256_sub_epi32(b1, ones)));
      hi = _mm256_max_epu32(hi, _mm256_max_epu32(b0, b1));
      nz = _mm256_sub_epi32(nz, _mm256_add_epi32(_mm256_cmpgt_epi32(b0, zero),
                                                 _mm256_cmpgt_epi32(b1, zero)));
      e = _mm256_add_epi32(e, _mm256_add_epi32(_mm256_srli_epi32(b0, 23),
                                               _mm256_srli_epi32(b1, 23)));
      const __m256 m0 = _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(b0, mmask), onef));
      const __m256 m1 = _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(b1, mmask), onef));
      p0 = _mm256_mul_pd(p0, _mm256_cvtps_pd(_mm256_castps256_ps128(m0)));
      p1 = _mm256_mul_pd(p1, _mm256_cvtps_pd(_mm256_extractf128_ps(m0, 1)));
      p2 = _mm256_mul_pd(p2, _mm256_cvtps_pd(_mm256_castps256_ps128(m1)));
      p3 = _mm256_mul_pd(p3, _mm256_cvtps_pd(_mm256_extractf128_ps(m1, 1)));
    }
    // the products (normal doubles) back to [0.5, 1), their exponents into `f`
    __m256i f = _mm256_setzero_si256();
    for (__m256d* p : {&p0, &p1, &p2, &p3}) {
      const __m256i bits = _mm256_castpd_si256(*p);
      f = _mm256_add_epi64(f, _mm256_srli_epi64(bits, 52));
      *p = _mm256_castsi256_pd(_mm256_or_si256(_mm256_and_si256(bits, dmant), half));
    }
    alignas(32) int32_t el[8];
    alignas(32) int64_t fl[4];
    _mm256_store_si256(reinterpret_cast<__m256i*>(el), e);
    _mm256_store_si256(reinterpret_cast<__m256i*>(fl), f);
    for (int l = 0; l < 8; ++l) expo += el[l];
    for (int l = 0; l < 4; ++l) expo += fl[l] - 4 * 1022;
  }
  alignas(32) uint32_t lol[8], hil[8];
  alignas(32) int32_t nzl[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lol), lo);
  _mm256_store_si256(reinterpret_cast<__m256i*>(hil), hi);
  _mm256_store_si256(reinterpret_cast<__m256i*>(nzl), nz);
  uint32_t low = 0xFFFFFFFFu, high = 0;
  int64_t count = 0;
  for (int l = 0; l < 8; ++l) {
    low = std::min(low, lol[l]); high = std::max(high, hil[l]); count += nzl[l];
  }
  double prod = 1.0;
  for (; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, x + i, sizeof bits);
    bits &= 0x7FFFFFFFu;
    low = std::min(low, bits - 1u);
    high = std::max(high, bits);
    count += bits != 0;
    expo += bits >> 23;
    const uint32_t mb = (bits & 0x007FFFFFu) | 0x3F800000u;
    float m;
    std::memcpy(&m, &mb, sizeof m);
    prod *= static_cast<double>(m);
  }
  if (nonzero_out) *nonzero_out = count;
  if (low < 0x007FFFFFu || high >= 0x7F800000u) return block_log_sum<float>(x, n);
  alignas(32) double pl[16];
  _mm256_store_pd(pl, p0); _mm256_store_pd(pl + 4, p1);
  _mm256_store_pd(pl + 8, p2); _mm256_store_pd(pl + 12, p3);
  for (int l = 0; l < 16; ++l) prod *= pl[l];  // each in [0.5, 1), prod below 2^15: finite
  return std::log(prod) + static_cast<double>(expo - 127 * count) * 0.69314718055994530942;
}
#endif

// float32, count and Σy over {|x| > above} only (the exponential fits): compared in
// float32 lanes, the excluded lanes zeroed before widening, Σy = Σ|x| − count·shift.
// About half the vector work of the general loop; Σ|x| ≥ Σy > 0 makes the subtraction
// lose at most a few ulps (Σ|x|/Σy is below 10 for the thresholds SIDCo fits).
inline void block_count_sum_f32(const float* x, int64_t n, float above, double shift,
                                Partial& p) {
  const v8f tv = {above, above, above, above, above, above, above, above};
  v4d s0 = {0, 0, 0, 0}, s1 = s0;
  v8i c = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const v8f a = vabs8(load8(x + i));
    const v8i m = a > tv;
    c -= m;
    const v8f am = (v8f)((v8i)a & m);
    v4d w0, w1;
    widen8(am, w0, w1);
    s0 += w0;
    s1 += w1;
  }
  double s = hsum(s0 + s1);
  int64_t cnt = 0;
  for (int l = 0; l < 8; ++l) cnt += c[l];
  for (; i < n; ++i) {
    const float a = std::fabs(x[i]);
    if (a > above) { s += a; cnt += 1; }
  }
  p.count = static_cast<double>(cnt);
  p.sum = s - static_cast<double>(cnt) * shift;
  p.sumsq = 0; p.max = -1; p.min = INFINITY; p.nonzero = 0;
}

// float32, every element: |x| taken and max/min/nonzeros found in float32 lanes (exact),
// only the sums widened; lanes 0-3 and 4-7 of each group of 8 go to the same two
// accumulators as in the general loop, so the sums are the same bit for bit. NZ counts the
// nonzeros without the extremes (SIDCo's fits leave exact zeros out: one compare a lane).
template <bool SQ, bool EXT, bool SHIFT, bool NZ = false>
void block_all_f32(const float* x, int64_t n, double shift, Partial& p) {
  const v4d sh = {shift, shift, shift, shift};
  v4d s0 = {0, 0, 0, 0}, s1 = s0, q0 = s0, q1 = s0;
  const v8f zero = {0, 0, 0, 0, 0, 0, 0, 0};
  v8f mx = zero - 1, mn = zero + INFINITY;
  v8i nz = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const v8f a = vabs8(load8(x + i));
    v4d y0, y1;
    widen8(a, y0, y1);
    if (SHIFT) {  // without a shift y = |x| exactly: the subtraction of 0 is left out
      y0 -= sh;
      y1 -= sh;
    }
    s0 += y0;
    s1 += y1;
    if (SQ) {
      q0 += y0 * y0;
      q1 += y1 * y1;
    }
    if (EXT) {
      mx = a > mx ? a : mx;
      mn = a < mn ? a : mn;
    }
    if (EXT || NZ) nz -= a > zero;
  }
  double s = hsum(s0 + s1), q = hsum(q0 + q1), mxs = -1, mns = INFINITY;
  int64_t nzs = 0;
  for (int l = 0; l < 8; ++l) {
    mxs = std::max(mxs, static_cast<double>(mx[l]));
    mns = std::min(mns, static_cast<double>(mn[l]));
    nzs += nz[l];
  }
  for (; i < n; ++i) {
    const double a = std::fabs(static_cast<double>(x[i]));
    const double y = a - shift;
    s += y; q += y * y; nzs += a > 0;
    mxs = std::max(mxs, a);
    mns = std::min(mns, a);
  }
  p.count = static_cast<double>(n); p.sum = s; p.sumsq = SQ ? q : 0.0;
  p.max = EXT ? mxs : -1; p.min = EXT ? mns : INFINITY; p.nonzero = EXT || NZ ? nzs : 0;
}

// One block's partial: ALL counts every element, else those with |x| > above (compared
// in T's precision: both sides are exact doubles); SQ adds Σy²; EXT max, min, nonzeros;
// NZ the nonzeros alone.
template <typename T, bool ALL, bool SQ, bool EXT, bool NZ = false>
void block_stats(const T* x, int64_t n, double above, double shift, Partial& p) {
  if constexpr (std::is_same<T, float>::value && !ALL && !SQ && !EXT && !NZ) {
    block_count_sum_f32(x, n, static_cast<float>(above), shift, p);
    return;
  }
  if constexpr (std::is_same<T, float>::value && ALL) {
    if (shift == 0.0)
      block_all_f32<SQ, EXT, false, NZ>(x, n, shift, p);
    else
      block_all_f32<SQ, EXT, true, NZ>(x, n, shift, p);
    return;
  }
  const v4d abv = {above, above, above, above};
  const v4d sh = {shift, shift, shift, shift};
  const v4d zero = {0, 0, 0, 0};
  v4d s0 = zero, s1 = zero, q0 = zero, q1 = zero, mx = zero - 1, mn = zero + INFINITY;
  v4l c0 = {0, 0, 0, 0}, c1 = c0, nz = c0;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const v4d a0 = vabs(load4(x + i)), a1 = vabs(load4(x + i + 4));
    v4d y0 = a0 - sh, y1 = a1 - sh;
    if (!ALL) {
      const v4l m0 = a0 > abv, m1 = a1 > abv;
      y0 = (v4d)((v4l)y0 & m0);
      y1 = (v4d)((v4l)y1 & m1);
      c0 -= m0;
      c1 -= m1;
      if (EXT) {
        mn = (m0 & (a0 < mn)) ? a0 : mn;
        mn = (m1 & (a1 < mn)) ? a1 : mn;
      }
    } else if (EXT) {
      mn = a0 < mn ? a0 : mn;
      mn = a1 < mn ? a1 : mn;
    }
    s0 += y0;
    s1 += y1;
    if (SQ) {
      q0 += y0 * y0;
      q1 += y1 * y1;
    }
    if (EXT) {
      mx = a0 > mx ? a0 : mx;
      mx = a1 > mx ? a1 : mx;
    }
    if (EXT || NZ) nz -= (a0 > zero) + (a1 > zero);
  }
  double s = hsum(s0 + s1), q = hsum(q0 + q1), mxs = -1, mns = INFINITY;
  int64_t c = ALL ? i : (c0[0] + c0[1] + c0[2] + c0[3] + c1[0] + c1[1] + c1[2] + c1[3]);
  int64_t nzs = nz[0] + nz[1] + nz[2] + nz[3];
  for (int l = 0; l < 4; ++l) { mxs = std::max(mxs, mx[l]); mns = std::min(mns, mn[l]); }
  for (; i < n; ++i) {
    const double a = std::fabs(static_cast<double>(x[i]));
    const bool in = ALL || a > above;
    if (!in) { nzs += a > 0; mxs = std::max(mxs, a); continue; }
    const double y = a - shift;
    c += 1; s += y; q += y * y; nzs += a > 0;
    mxs = std::max(mxs, a);
    mns = std::min(mns, a);
  }
  p.count = static_cast<double>(c); p.sum = s; p.sumsq = SQ ? q : 0.0;
  p.max = EXT ? mxs : -1; p.min = EXT ? mns : INFINITY; p.nonzero = EXT || NZ ? nzs : 0;
}

template <typename T, bool ALL, bool SQ, bool EXT, bool NZ>
void stats_blocks(const T* x, int64_t n, int threads, double above, double shift, int want_log,
                  std::vector<Partial>& part) {
  parallel_blocks(n, threads, [&](int64_t b0, int64_t b1, int) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t lo = b * BLOCK, hi = std::min(n, lo + BLOCK);
      block_stats<T, ALL, SQ, EXT, NZ>(x + lo, hi - lo, above, shift, part[b]);
      if (want_log) part[b].log_sum = block_log_sum(x + lo, hi - lo);
    }
  });
}

// The block partials added in block order (so independent of the thread count) into
// out[0..6]: count, Σy, Σy², max, min, nonzeros, Σ ln|x|.
inline void write_total(const std::vector<Partial>& part, double* out) {
  Partial total;
  for (const Partial& p : part) {
    total.count += p.count; total.sum += p.sum; total.sumsq += p.sumsq;
    total.nonzero += p.nonzero; total.log_sum += p.log_sum;
    total.max = std::max(total.max, p.max);
    total.min = std::min(total.min, p.min);
  }
  out[0] = total.count; out[1] = total.sum; out[2] = total.sumsq; out[3] = total.max;
  out[4] = total.min; out[5] = total.nonzero; out[6] = total.log_sum;
}

// flags: 1 = Σy², 2 = max/min/nonzeros, 4 = Σ ln|x| (implies nonzeros), 8 = nonzeros.
template <typename T, bool ALL, bool SQ>
void stats_kind(const T* x, int64_t n, int threads, double abv, double shift, bool ext, bool nz,
                int lg, std::vector<Partial>& part) {
  if (ext) stats_blocks<T, ALL, SQ, true, false>(x, n, threads, abv, shift, lg, part);
  else if (nz) stats_blocks<T, ALL, SQ, false, true>(x, n, threads, abv, shift, lg, part);
  else stats_blocks<T, ALL, SQ, false, false>(x, n, threads, abv, shift, lg, part);
}

template <typename T>
void stats(const T* x, int64_t n, int threads, int all, double above, double shift, int flags,
           double* out) {
  const int64_t blocks = (n + BLOCK - 1) / BLOCK;
  std::vector<Partial> part(blocks);
  const double abv = static_cast<double>(static_cast<T>(above));
  const bool sq = flags & 1, ext = (flags & 6) != 0, nz = (flags & 8) != 0;
  const int lg = (flags & 4) != 0;
  if (all) {
    if (sq) stats_kind<T, true, true>(x, n, threads, abv, shift, ext, nz, lg, part);
    else stats_kind<T, true, false>(x, n, threads, abv, shift, ext, nz, lg, part);
  } else {
    if (sq) stats_kind<T, false, true>(x, n, threads, abv, shift, ext, nz, lg, part);
    else stats_kind<T, false, false>(x, n, threads, abv, shift, ext, nz, lg, part);
  }
  write_total(part, out);
}

// float32 inputs compare in float32 lanes (8 per vector, no widening); the result is the
// same predicate, so the same count.
template <bool STRICT>
int64_t count_f32(const float* x, int64_t n, int threads, float tt) {
  const v8f tv = {tt, tt, tt, tt, tt, tt, tt, tt};
  std::vector<int64_t> per(std::max(1, threads), 0);
  parallel_blocks(n, threads, [&](int64_t b0, int64_t b1, int tid) {
    int64_t total = 0;
    for (int64_t b = b0; b < b1; ++b) {  // per block: int32 lane counts never overflow
      const int64_t lo = b * BLOCK, hi = std::min(n, lo + BLOCK);
      v8i c0 = {0, 0, 0, 0, 0, 0, 0, 0}, c1 = c0;
      int64_t i = lo;
      for (; i + 16 <= hi; i += 16) {
        const v8f a0 = vabs8(load8(x + i)), a1 = vabs8(load8(x + i + 8));
        c0 -= STRICT ? (a0 > tv) : (a0 >= tv);
        c1 -= STRICT ? (a1 > tv) : (a1 >= tv);
      }
      const v8i c = c0 + c1;
      for (int l = 0; l < 8; ++l) total += c[l];
      for (; i < hi; ++i) total += STRICT ? (std::fabs(x[i]) > tt) : (std::fabs(x[i]) >= tt);
    }
    per[tid] = total;
  });
  int64_t total = 0;
  for (int64_t v : per) total += v;
  return total;
}

template <typename T>
int64_t count(const T* x, int64_t n, int threads, double t, int strict) {
  const T tt = static_cast<T>(t);
  if constexpr (std::is_same<T, float>::value)
    return strict ? count_f32<true>(x, n, threads, tt) : count_f32<false>(x, n, threads, tt);
  const double td = static_cast<double>(tt);
  const v4d tv = {td, td, td, td};
  std::vector<int64_t> per(std::max(1, threads), 0);
  parallel_blocks(n, threads, [&](int64_t b0, int64_t b1, int tid) {
    const int64_t lo = b0 * BLOCK, hi = std::min(n, b1 * BLOCK);
    v4l c0 = {0, 0, 0, 0}, c1 = c0;
    int64_t i = lo;
    if (strict) {
      for (; i + 8 <= hi; i += 8) {
        c0 -= vabs(load4(x + i)) > tv;
        c1 -= vabs(load4(x + i + 4)) > tv;
      }
    } else {
      for (; i + 8 <= hi; i += 8) {
        c0 -= vabs(load4(x + i)) >= tv;
        c1 -= vabs(load4(x + i + 4)) >= tv;
      }
    }
    int64_t total = c0[0] + c0[1] + c0[2] + c0[3] + c1[0] + c1[1] + c1[2] + c1[3];
    for (; i < hi; ++i) total += strict ? (std::fabs(x[i]) > tt) : (std::fabs(x[i]) >= tt);
    per[tid] = total;
  });
  int64_t total = 0;
  for (int64_t v : per) total += v;
  return total;
}


// Scratch buffers kept between calls: a selection's per-thread hit buffers come from here
// and go back when its result has been taken, so a steady state of calls writes into
// memory that is already mapped (fresh memory costs a page fault per page on first touch:
// far more than the writes themselves). At most POOL_KEEP buffers are kept.
struct Buf { void* p = nullptr; size_t bytes = 0; };
std::mutex pool_mutex;
std::vector<Buf> pool_bufs;
constexpr size_t POOL_KEEP = 8;

Buf pool_take(size_t want) {  // the smallest kept buffer of at least `want`, else the largest
  std::lock_guard<std::mutex> lock(pool_mutex);
  if (pool_bufs.empty()) return Buf();
  size_t best = 0;
  for (size_t i = 1; i < pool_bufs.size(); ++i) {
    const bool fits = pool_bufs[i].bytes >= want, best_fits = pool_bufs[best].bytes >= want;
    if ((fits && (!best_fits || pool_bufs[i].bytes < pool_bufs[best].bytes)) ||
        (!fits && !best_fits && pool_bufs[i].bytes > pool_bufs[best].bytes))
      best = i;
  }
  Buf b = pool_bufs[best];
  pool_bufs.erase(pool_bufs.begin() + best);
  return b;
}

void pool_give(Buf b) {
  if (!b.p) return;
  std::lock_guard<std::mutex> lock(pool_mutex);
  pool_bufs.push_back(b);
  if (pool_bufs.size() > POOL_KEEP) {  // drop the smallest
    size_t small = 0;
    for (size_t i = 1; i < pool_bufs.size(); ++i)
      if (pool_bufs[i].bytes < pool_bufs[small].bytes) small = i;
    std::free(pool_bufs[small].p);
    pool_bufs.erase(pool_bufs.begin() + small);
  }
}

void grow(Buf& b, size_t bytes) {
  if (bytes <= b.bytes) return;
  if (!b.p) b = pool_take(bytes);
  if (bytes <= b.bytes) return;
  void* np = std::realloc(b.p, bytes);
  if (!np) throw std::bad_alloc();
  b.p = np;
  b.bytes = bytes;
  advise_huge(np, bytes);
}

// A growable pair of arrays in pooled workspace buffers (no value-initialisation of the
// space reserved for branch-free writes).
template <typename T>
struct Hits {
  int64_t* idx = nullptr;  // positions: int64, or int32 (in the same buffer) when `narrow`
  T* val = nullptr;
  int64_t size = 0, cap = 0;
  bool values = false, narrow = false;
  bool sign = false;  // values are x itself (the sender's values), not |x|
  Buf bi, bv;
  ~Hits() { pool_give(bi); pool_give(bv); }
  Hits() = default;
  Hits(Hits&& o) noexcept { *this = std::move(o); }
  Hits& operator=(Hits&& o) noexcept {
    std::swap(idx, o.idx); std::swap(val, o.val); std::swap(size, o.size);
    std::swap(cap, o.cap); std::swap(values, o.values); std::swap(narrow, o.narrow);
    std::swap(sign, o.sign);
    std::swap(bi, o.bi); std::swap(bv, o.bv);
    return *this;
  }
  int32_t* idx32() const { return reinterpret_cast<int32_t*>(idx); }
  void ensure(int64_t need) {
    if (need <= cap) return;
    const size_t width = narrow ? sizeof(int32_t) : sizeof(int64_t);
    int64_t c = std::max<int64_t>(need, std::max<int64_t>(1024, cap * 2));
    grow(bi, c * width);
    c = std::max<int64_t>(c, bi.bytes / width);
    if (values) {
      grow(bv, c * sizeof(T));
      c = std::min<int64_t>(c, bv.bytes / sizeof(T));
      val = static_cast<T*>(bv.p);
    }
    idx = static_cast<int64_t*>(bi.p);
    cap = c;
  }
};

template <typename T>
struct Selection {
  std::vector<Hits<T>> parts;
  int64_t total = 0;
};

// Hits of one stretch, ascending: groups of 8 with no hit (almost all of them at small
// ratios) are skipped after one vector compare; the others are written branch-free.
// The hits among x[i, end) appended to `out`, branch-free: every element is written and
// the end advances only past those that pass.
template <typename T, bool STRICT>
inline void write_hits(const T* x, const int64_t* map, int64_t i, int64_t end, T tt,
                       Hits<T>& out) {
  out.ensure(out.size + (end - i));
  int64_t k = out.size;
  int64_t* idx = out.idx;
  T* val = out.val;
  const bool sign = out.sign;
  for (int64_t j = i; j < end; ++j) {
    const T a = std::fabs(x[j]);
    idx[k] = map ? map[j] : j;
    if (val) val[k] = sign ? x[j] : a;
    k += STRICT ? (a > tt) : (a >= tt);
  }
  out.size = k;
}

// CHECK: also find whether any element is NaN or ±Inf (|x| ≤ max finite fails for both),
// OR-ed into *bad: the finiteness check folded into the selection's read.
template <bool STRICT, bool CHECK>
void select_range_f32(const float* x, const int64_t* map, int64_t lo, int64_t hi, float tt,
                      Hits<float>& out, int* bad) {
  // float32: groups of 16 tested in float32 lanes (no widening), the rare groups with a
  // hit written branch-free as below.
  const v8f tv = {tt, tt, tt, tt, tt, tt, tt, tt};
  const float fm = std::numeric_limits<float>::max();
  const v8f mv = {fm, fm, fm, fm, fm, fm, fm, fm};
  v8i nonfinite = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = lo;
  for (; i + 16 <= hi; i += 16) {
    const v8f a0 = vabs8(load8(x + i)), a1 = vabs8(load8(x + i + 8));
    if (CHECK) nonfinite |= ~((a0 <= mv) & (a1 <= mv));
    const v8i m = STRICT ? ((a0 > tv) | (a1 > tv)) : ((a0 >= tv) | (a1 >= tv));
    if (!mask8(m)) continue;
    write_hits<float, STRICT>(x, map, i, i + 16, tt, out);
  }
  if (i < hi) {
    if (CHECK)
      for (int64_t j = i; j < hi; ++j) nonfinite[0] |= std::fabs(x[j]) <= fm ? 0 : -1;
    write_hits<float, STRICT>(x, map, i, hi, tt, out);
  }
  if (CHECK && mask8(nonfinite)) *bad = 1;
}

template <typename T, bool STRICT, bool CHECK>
void select_range(const T* x, const int64_t* map, int64_t lo, int64_t hi, double t,
                  Hits<T>& out, int* bad) {
  const T tt = static_cast<T>(t);
  if constexpr (std::is_same<T, float>::value) {
    select_range_f32<STRICT, CHECK>(x, map, lo, hi, tt, out, bad);
    return;
  }
  const double td = static_cast<double>(tt);
  const v4d tv = {td, td, td, td};
  const double dm = std::numeric_limits<double>::max();
  const v4d mv = {dm, dm, dm, dm};
  v4l nonfinite = {0, 0, 0, 0};
  int64_t i = lo;
  for (; i + 8 <= hi; i += 8) {
    const v4d a0 = vabs(load4(x + i)), a1 = vabs(load4(x + i + 4));
    if (CHECK) nonfinite |= ~((a0 <= mv) & (a1 <= mv));
    const v4l m = STRICT ? ((a0 > tv) | (a1 > tv)) : ((a0 >= tv) | (a1 >= tv));
    if (!((m[0] | m[1]) | (m[2] | m[3]))) continue;
    write_hits<T, STRICT>(x, map, i, i + 8, tt, out);
  }
  if (i < hi) {
    if (CHECK)
      for (int64_t j = i; j < hi; ++j) nonfinite[0] |= std::fabs(x[j]) <= dm ? 0 : -1;
    write_hits<T, STRICT>(x, map, i, hi, tt, out);
  }
  if (CHECK && ((nonfinite[0] | nonfinite[1]) | (nonfinite[2] | nonfinite[3]))) *bad = 1;
}

// A selection's frame: the per-thread hit buffers and NaN/Inf flags filled by
// fill(selection, flags) (flags: one int per thread), then merged. nullptr when an
// allocation fails. `check`: *nonfinite set to 1 when any element is NaN or ±Inf (the
// selection is then meaningless; the caller discards it), else 0.
template <typename T, typename F>
void* run_selection(int threads, int* nonfinite, int64_t* total, F&& fill) {
  auto* sel = new (std::nothrow) Selection<T>();
  if (!sel) return nullptr;
  const int nth = std::max(1, threads);
  std::vector<int> bad;
  try {
    bad.assign(nth, 0);
    sel->parts.resize(nth);
    fill(*sel, bad);
  } catch (...) {
    delete sel;
    return nullptr;
  }
  int any = 0;
  for (int v : bad) any |= v;
  if (nonfinite) *nonfinite = any;
  for (auto& h : sel->parts) sel->total += h.size;
  *total = sel->total;
  return sel;
}

template <typename T>
void* select_begin(const T* x, const int64_t* map, int64_t n, int threads, double t, int strict,
                   int values, int64_t reserve, int check, int* nonfinite, int64_t* total) {
  const int nth = std::max(1, threads);
  return run_selection<T>(nth, nonfinite, total, [&](Selection<T>& sel, std::vector<int>& bad) {
    parallel_blocks(n, nth, [&](int64_t b0, int64_t b1, int tid) {
      const int64_t lo = b0 * BLOCK, hi = std::min(n, b1 * BLOCK);
      Hits<T>& h = sel.parts[tid];
      h.values = values != 0;
      h.sign = values == 2;
      h.ensure(std::max<int64_t>(1024, reserve / nth + 64));
      int* b = &bad[tid];
      if (strict) {
        if (check) select_range<T, true, true>(x, map, lo, hi, t, h, b);
        else select_range<T, true, false>(x, map, lo, hi, t, h, b);
      } else {
        if (check) select_range<T, false, true>(x, map, lo, hi, t, h, b);
        else select_range<T, false, false>(x, map, lo, hi, t, h, b);
      }
    });
  });
}

// ---------------------------------------------------------------------------------------
// A stage's statistics and the next pool in one read (float32; SIDCo's second pass):
// per block of BLOCK elements, first the same block_stats as gc_stats (so the same
// partials, bit for bit: the statistics do not depend on whether a pool is built), then,
// while the block is still in cache, its elements with |x| > pool_t appended (position,
// |x|) to the thread's hit buffers in ascending order. `dense` (the caller expects more
// than a few percent to pass) writes every group of 8 branch-free through a permutation
// table; otherwise groups of 16 without a hit are skipped after one compare. Positions
// must fit int32 (n < 2^31) on the permutation path; larger inputs use the other one.

#if defined(__AVX2__)
struct PermTable {
  alignas(32) int32_t lanes[256][8];
  PermTable() {
    for (int m = 0; m < 256; ++m) {
      int j = 0;
      for (int b = 0; b < 8; ++b)
        if (m >> b & 1) lanes[m][j++] = b;
      for (; j < 8; ++j) lanes[m][j] = 0;
    }
  }
};
const PermTable perm_table;
#endif

// Below this many elements positions fit int32 lanes, with space for the 8-lane writes
// past the last one (the permutation path and int32 pools/selections).
constexpr int64_t NARROW_LIMIT = (int64_t(1) << 31) - 16;

// NARROW: positions stored as int32 (the caller guarantees n < NARROW_LIMIT): one 256-bit
// store per group of 8 instead of two, about a fifth of the loop's time on Zen 1.
// VALUES: |x| (x itself with out.sign) written beside the positions. CHECK: as
// select_range_f32, a NaN/±Inf anywhere in [lo, hi) sets *bad.
template <bool STRICT, bool NARROW, bool VALUES = true, bool CHECK = false>
void compact_block_dense(const float* x, int64_t lo, int64_t hi, float tt, Hits<float>& out,
                         int* bad = nullptr) {
  out.ensure(out.size + (hi - lo) + 16);
  int64_t k = out.size;
  int64_t* idx = out.idx;
  int32_t* idx32 = out.idx32();
  float* val = out.val;
  const bool sign = out.sign;
  const float fm = std::numeric_limits<float>::max();
  int nonfinite = 0;
  int64_t i = lo;
#if defined(__AVX2__)
  if (hi < NARROW_LIMIT) {
    const __m256 tv = _mm256_set1_ps(tt);
    const __m256 mv = _mm256_set1_ps(fm);
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(INT32_MAX));
    __m256 finite = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    __m256i pos = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                   _mm256_set1_epi32(static_cast<int32_t>(lo)));
    const __m256i eight = _mm256_set1_epi32(8);
    for (; i + 8 <= hi; i += 8) {
      const __m256 xv = _mm256_loadu_ps(x + i);
      const __m256 a = _mm256_and_ps(xv, absmask);
      if (CHECK) finite = _mm256_and_ps(finite, _mm256_cmp_ps(a, mv, _CMP_LE_OQ));
      const int m = _mm256_movemask_ps(_mm256_cmp_ps(a, tv, STRICT ? _CMP_GT_OQ : _CMP_GE_OQ));
      const __m256i p = _mm256_load_si256(reinterpret_cast<const __m256i*>(perm_table.lanes[m]));
      if (VALUES) _mm256_storeu_ps(val + k, _mm256_permutevar8x32_ps(sign ? xv : a, p));
      const __m256i q = _mm256_permutevar8x32_epi32(pos, p);
      if (NARROW) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(idx32 + k), q);
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(idx + k),
                            _mm256_cvtepi32_epi64(_mm256_castsi256_si128(q)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(idx + k + 4),
                            _mm256_cvtepi32_epi64(_mm256_extracti128_si256(q, 1)));
      }
      k += __builtin_popcount(static_cast<unsigned>(m));
      pos = _mm256_add_epi32(pos, eight);
    }
    if (CHECK && _mm256_movemask_ps(finite) != 0xFF) nonfinite = 1;
  }
#endif
  for (; i < hi; ++i) {
    const float a = std::fabs(x[i]);
    if (CHECK && !(a <= fm)) nonfinite = 1;
    if (NARROW)
      idx32[k] = static_cast<int32_t>(i);
    else
      idx[k] = i;
    if (VALUES) val[k] = sign ? x[i] : a;
    k += STRICT ? (a > tt) : (a >= tt);
  }
  out.size = k;
  if (CHECK && nonfinite) *bad = 1;
}

// gc_select_begin's branch-free layout (float32, no index map, n < NARROW_LIMIT): the dense
// compaction per block, positions as int32 (widened by gc_select_take). For selections
// expected to keep more than about 1% (below that, skipping groups without a hit wins:
// select_range_f32). The same positions and values as select_begin, in the same order.
template <bool STRICT, bool VALUES, bool CHECK>
void select_dense_parts(const float* x, int64_t n, int nth, double t, int64_t reserve,
                        bool sign, Selection<float>& sel, std::vector<int>& bad) {
  const float tt = static_cast<float>(t);
  parallel_blocks(n, nth, [&](int64_t b0, int64_t b1, int tid) {
    Hits<float>& h = sel.parts[tid];
    h.values = VALUES;
    h.sign = sign;
    h.narrow = true;
    h.ensure(std::max<int64_t>(1024, reserve / nth + 64));
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t lo = b * BLOCK, hi = std::min(n, lo + BLOCK);
      compact_block_dense<STRICT, true, VALUES, CHECK>(x, lo, hi, tt, h, &bad[tid]);
    }
  });
}

void* select_dense_f32(const float* x, int64_t n, int threads, double t, int strict, int values,
                       int64_t reserve, int check, int* nonfinite, int64_t* total) {
  const int nth = std::max(1, threads);
  const int variant = (strict ? 4 : 0) | (values ? 2 : 0) | (check ? 1 : 0);
  return run_selection<float>(nth, nonfinite, total,
                              [&](Selection<float>& sel, std::vector<int>& bad) {
    switch (variant) {
#define GC_DENSE(V, S, W, C) \
  case V: select_dense_parts<S, W, C>(x, n, nth, t, reserve, values == 2, sel, bad); break;
      GC_DENSE(0, false, false, false) GC_DENSE(1, false, false, true)
      GC_DENSE(2, false, true, false) GC_DENSE(3, false, true, true)
      GC_DENSE(4, true, false, false) GC_DENSE(5, true, false, true)
      GC_DENSE(6, true, true, false) GC_DENSE(7, true, true, true)
#undef GC_DENSE
    }
  });
}

template <typename T>
void* select_any(const T* x, const int64_t* map, int64_t n, int threads, double t, int strict,
                 int values, int64_t reserve, int check, int dense, int* nonfinite,
                 int64_t* total) {
  if constexpr (std::is_same<T, float>::value) {
    if (dense && !map && n < NARROW_LIMIT)
      return select_dense_f32(x, n, threads, t, strict, values, reserve, check, nonfinite,
                              total);
  }
  return select_begin<T>(x, map, n, threads, t, strict, values, reserve, check, nonfinite,
                         total);
}

// `narrow` (dense pools of n < NARROW_LIMIT only): positions kept as int32. flags: bit 0
// Σy², bit 1 extremes, bit 2 the pool's values are x itself rather than |x|.
void* pool_begin(const float* x, int64_t n, int threads, double above, double shift, int flags,
                 int want_stats, double pool_t, int strict, int dense, int64_t reserve, double* out,
                 int64_t* total, int narrow) {
  const int nth = std::max(1, threads);
  const int64_t blocks = (n + BLOCK - 1) / BLOCK;
  const float pt = static_cast<float>(pool_t);
  const double abv = static_cast<double>(static_cast<float>(above));
  const bool sq = flags & 1, ext = (flags & 2) != 0, sign = (flags & 4) != 0;
  const bool narrow32 = narrow && dense && n < NARROW_LIMIT;
  return run_selection<float>(nth, nullptr, total, [&](Selection<float>& sel, std::vector<int>&) {
    std::vector<Partial> part(want_stats ? blocks : 0);
    parallel_blocks(n, nth, [&](int64_t b0, int64_t b1, int tid) {
      Hits<float>& h = sel.parts[tid];
      h.values = true;
      h.sign = sign;
      h.narrow = narrow32;
      h.ensure(std::max<int64_t>(1024, reserve / nth + 64));
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t lo = b * BLOCK, hi = std::min(n, lo + BLOCK);
        if (want_stats) {
          if (sq) {
            if (ext) block_stats<float, false, true, true>(x + lo, hi - lo, abv, shift, part[b]);
            else block_stats<float, false, true, false>(x + lo, hi - lo, abv, shift, part[b]);
          } else {
            if (ext) block_stats<float, false, false, true>(x + lo, hi - lo, abv, shift, part[b]);
            else block_stats<float, false, false, false>(x + lo, hi - lo, abv, shift, part[b]);
          }
        }
        if (narrow32) {
          if (strict) compact_block_dense<true, true>(x, lo, hi, pt, h);
          else compact_block_dense<false, true>(x, lo, hi, pt, h);
        } else if (dense) {
          if (strict) compact_block_dense<true, false>(x, lo, hi, pt, h);
          else compact_block_dense<false, false>(x, lo, hi, pt, h);
        } else {
          if (strict) select_range_f32<true, false>(x, nullptr, lo, hi, pt, h, nullptr);
          else select_range_f32<false, false>(x, nullptr, lo, hi, pt, h, nullptr);
        }
      }
    });
    if (want_stats) write_total(part, out);
  });
}

// #{|x| > 0} of a float32 stretch (the predicate of block_all_f32's nonzero count).
inline int64_t count_nonzero(const float* x, int64_t n) {
  const v8f zero = {0, 0, 0, 0, 0, 0, 0, 0};
  v8i c = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) c -= vabs8(load8(x + i)) > zero;
  int64_t total = 0;
  for (int l = 0; l < 8; ++l) total += c[l];
  for (; i < n; ++i) total += std::fabs(x[i]) > 0.0f;
  return total;
}

// ---------------------------------------------------------------------------------------
// SIDCo's speculative first read (float32, n < NARROW_LIMIT): the first stage's statistics
// and, in the same read, what the next two stages need if the thresholds land where the
// previous step's did (compressors/sidco.py):
//   all:  count, Σ|x| (and Σx² with SQA) of every element: the same lanes, order and block
//         partials as gc_stats (block_all_f32), so η₁ equals the plain path's bit for bit;
//         and the nonzeros (|x| > 0), which every first fit divides by (with LOG from
//         Σ ln|x|'s steps, else one compare a lane);
//   mid:  count and Σ|x| (without SQ), or count, Σz and Σz² of z = |x| − b (with SQ), over
//         |x| ≥ b: the exceedances of η₁ that are not in the window
//         (the AVX-512 loop adds z² with a fused multiply-add, so its Σz² may differ from
//         the AVX2 loop's in the last bits; nothing else compares them bit for bit);
//   window: the x of w ≤ |x| < b, ascending, without positions (never selected: only the
//         second stage's statistics read them);
//   stream: the x (signed: the later stages compare |x|, and the values finally selected
//         are the ones sent) of the pool |x| > g, ascending (compressed in registers, or
//         through the permutation table), and a bitmap of their positions (bit i of byte
//         i/8: x[i] is in the stream), one byte per 8 elements, from which stream_select
//         finds the positions the caller asks for (most of the stream is never selected,
//         so its positions are never written out).
// With w ≤ η₁ < b ≤ g ≤ η₂ (as float32) the second stage's statistics follow exactly from
// mid and the window's elements above η₁, and every later stage only looks at the pool.
// One block's stream is written to val from k on, its window to win from kw on, its
// bitmap bytes in place; k returned, kw updated. The stores are 8 or 16 lanes wide
// whatever the hits: they stay inside the space of the elements read so far plus those
// being read, when the thread's stream and window start at its first element.
constexpr int64_t CHECKPOINT = 512;  // elements between stream checkpoints (64 bitmap bytes)

template <bool SQA, bool SQ, bool LOG>
int64_t block_spec(const float* x, int64_t lo, int64_t hi, float w, float b, float g,
                   Partial& all, Partial& mid, uint8_t* bits, int32_t* checkpoint,
                   float* val, int64_t k, float* win, int64_t& kw) {
  const double shift = SQ ? static_cast<double>(b) : 0.0;
  v4d s0 = {0, 0, 0, 0}, s1 = s0, q0 = s0, q1 = s0;     // all
  v4d m0 = s0, m1 = s0, r0 = s0, r1 = s0;               // mid
  int64_t cnt = 0;
  int64_t i = lo;
  double log_sum = 0;
  int64_t nonzero = 0;
#if defined(__AVX512F__)
  {
    LogSum16 logs;  // with LOG: block_log_sum's steps on the |x| loaded here
    // 16 elements a step: comparisons into mask registers, the sums as masked adds of the
    // widened |x| (adding nothing where the AVX2 loop below adds a zeroed lane: the same
    // bits, as S's halves are s0 and s1 in that loop's order; mid's Σz² alone is a fused
    // multiply-add), the stream and the window compressed in registers (a compress to
    // memory is slow on some CPUs) and stored 16 lanes wide.
    const __m512 wv = _mm512_set1_ps(w), bv = _mm512_set1_ps(b), gv = _mm512_set1_ps(g);
    const __m512d sh = _mm512_set1_pd(shift);
    __m512d S = _mm512_setzero_pd(), Q = S, M = S, R = S;
    for (; i + 16 <= hi; i += 16) {
      if (i % CHECKPOINT == 0) checkpoint[i / CHECKPOINT] = static_cast<int32_t>(k);
      const __m512 xv = _mm512_loadu_ps(x + i);
      const __m512 a = _mm512_abs_ps(xv);
      const __m512d y0 = _mm512_cvtps_pd(_mm512_castps512_ps256(a));
      const __m512d y1 = _mm512_cvtps_pd(
          _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
      if (LOG) {
        logs.add(a, y0, y1);
        if ((i - lo + 16) % 4096 == 0) logs.renormalise();
      } else {
        nonzero += __builtin_popcount(
            static_cast<unsigned>(_mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_GT_OQ)));
      }
      S = _mm512_add_pd(_mm512_add_pd(S, y0), y1);
      if (SQA) Q = _mm512_add_pd(_mm512_add_pd(Q, _mm512_mul_pd(y0, y0)), _mm512_mul_pd(y1, y1));
      const __mmask16 geb = _mm512_cmp_ps_mask(a, bv, _CMP_GE_OQ);
      const __mmask16 gtg = _mm512_cmp_ps_mask(a, gv, _CMP_GT_OQ);
      const unsigned inmid = static_cast<unsigned>(geb);
      cnt += __builtin_popcount(inmid);
      const __mmask8 k0 = static_cast<__mmask8>(inmid), k1 = static_cast<__mmask8>(inmid >> 8);
      if (SQ) {  // z = |x| − b where in mid
        const __m512d z0 = _mm512_sub_pd(y0, sh), z1 = _mm512_sub_pd(y1, sh);
        M = _mm512_mask_add_pd(M, k0, M, z0);
        M = _mm512_mask_add_pd(M, k1, M, z1);
        R = _mm512_mask3_fmadd_pd(z0, z0, R, k0);  // z² unrounded: one op instead of two
        R = _mm512_mask3_fmadd_pd(z1, z1, R, k1);
      } else {  // |x| where in mid
        M = _mm512_mask_add_pd(M, k0, M, y0);
        M = _mm512_mask_add_pd(M, k1, M, y1);
      }
      const __mmask16 gew = _mm512_cmp_ps_mask(a, wv, _CMP_GE_OQ);
      const __mmask16 inw = static_cast<__mmask16>(static_cast<unsigned>(gew) &
                                                   ~static_cast<unsigned>(geb));
      _mm512_storeu_ps(win + kw, _mm512_maskz_compress_ps(inw, xv));
      kw += __builtin_popcount(static_cast<unsigned>(inw));
      _mm512_storeu_ps(val + k, _mm512_maskz_compress_ps(gtg, xv));
      const uint16_t m16 = static_cast<uint16_t>(gtg);
      std::memcpy(bits + (i >> 3), &m16, sizeof m16);
      k += __builtin_popcount(static_cast<unsigned>(gtg));
    }
    s0 = (v4d)_mm512_castpd512_pd256(S); s1 = (v4d)_mm512_extractf64x4_pd(S, 1);
    q0 = (v4d)_mm512_castpd512_pd256(Q); q1 = (v4d)_mm512_extractf64x4_pd(Q, 1);
    m0 = (v4d)_mm512_castpd512_pd256(M); m1 = (v4d)_mm512_extractf64x4_pd(M, 1);
    r0 = (v4d)_mm512_castpd512_pd256(R); r1 = (v4d)_mm512_extractf64x4_pd(R, 1);
    if (LOG) {
      if (i < hi) logs.add(abs_tail16(x + i, hi - i));
      logs.renormalise();
      log_sum = logs.finish(x + lo, hi - lo, &nonzero);
    }
  }
#elif defined(__AVX2__)
  if (LOG) log_sum = block_log_sum(x + lo, hi - lo, &nonzero);
#else
  if (LOG) {
    log_sum = block_log_sum(x + lo, hi - lo);
    nonzero = count_nonzero(x + lo, hi - lo);
  }
#endif
#if defined(__AVX2__)
  {
    const __m256 wv = _mm256_set1_ps(w), bv = _mm256_set1_ps(b), gv = _mm256_set1_ps(g);
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(INT32_MAX));
    const v4d sh = {shift, shift, shift, shift};
    // Each lane of c counts mid's elements in its low 16 bits and (without LOG) the
    // nonzeros in its high 16 bits: one accumulator for both (the loop is short of
    // registers), and a block's lane sees at most BLOCK / 8 elements.
    static_assert(BLOCK / 8 < (1 << 16), "a lane's counts must fit 16 bits");
    __m256i c = _mm256_setzero_si256();
    int64_t kwl = kw;  // (a local: the stores through win may not alias it)
    while (i + 8 <= hi) {  // one checkpoint's elements at a time
      if (i % CHECKPOINT == 0) checkpoint[i / CHECKPOINT] = static_cast<int32_t>(k);
      const int64_t stop = std::min(i + CHECKPOINT - i % CHECKPOINT, hi - (hi - i) % 8);
      uint8_t* byte = bits + (i >> 3);
      for (; i < stop; i += 8) {
        // the stream and the window first, so that x's lanes are done with before the
        // sums need their registers (in the other order the compiler spilled one of them)
        const __m256 xv = _mm256_loadu_ps(x + i);
        const __m256 a = _mm256_and_ps(xv, absmask);
        const int m = _mm256_movemask_ps(_mm256_cmp_ps(a, gv, _CMP_GT_OQ));
        const __m256i p = _mm256_load_si256(reinterpret_cast<const __m256i*>(perm_table.lanes[m]));
        _mm256_storeu_ps(val + k, _mm256_permutevar8x32_ps(xv, p));
        *byte++ = static_cast<uint8_t>(m);
        k += __builtin_popcount(static_cast<unsigned>(m));
        const __m256 geb = _mm256_cmp_ps(a, bv, _CMP_GE_OQ);
        const __m256 inwin = _mm256_andnot_ps(geb, _mm256_cmp_ps(a, wv, _CMP_GE_OQ));
        const int mw = _mm256_movemask_ps(inwin);
        const __m256i pw =
            _mm256_load_si256(reinterpret_cast<const __m256i*>(perm_table.lanes[mw]));
        _mm256_storeu_ps(win + kwl, _mm256_permutevar8x32_ps(xv, pw));
        kwl += __builtin_popcount(static_cast<unsigned>(mw));
        v4d y0, y1;
        widen8(reinterpret_cast<v8f>(a), y0, y1);
        s0 += y0;
        s1 += y1;
        if (SQA) {
          q0 += y0 * y0;
          q1 += y1 * y1;
        }
        const __m256 inmid = geb;
        c = _mm256_sub_epi32(c, _mm256_castps_si256(inmid));
        if (!LOG)
          c = _mm256_sub_epi32(c, _mm256_slli_epi32(_mm256_castps_si256(_mm256_cmp_ps(
                                      a, _mm256_setzero_ps(), _CMP_GT_OQ)), 16));
        if (SQ) {  // z = |x| − b where in mid, else 0
          const __m256i im = _mm256_castps_si256(inmid);
          const v4l k0 = (v4l)_mm256_cvtepi32_epi64(_mm256_castsi256_si128(im));
          const v4l k1 = (v4l)_mm256_cvtepi32_epi64(_mm256_extracti128_si256(im, 1));
          const v4d z0 = (v4d)((v4l)(y0 - sh) & k0), z1 = (v4d)((v4l)(y1 - sh) & k1);
          m0 += z0;
          m1 += z1;
          r0 += z0 * z0;
          r1 += z1 * z1;
        } else {  // |x| where in mid, else 0
          v4d z0, z1;
          widen8(reinterpret_cast<v8f>(_mm256_and_ps(a, inmid)), z0, z1);
          m0 += z0;
          m1 += z1;
        }
      }
    }
    kw = kwl;
    alignas(32) uint32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), c);
    for (int l = 0; l < 8; ++l) {
      cnt += lanes[l] & 0xffff;
      nonzero += lanes[l] >> 16;
    }
  }
#endif
  double s = hsum(s0 + s1), q = hsum(q0 + q1), ms = hsum(m0 + m1), mq = hsum(r0 + r1);
#if !defined(__AVX2__)
  // no merged loop: the first statistics as gc_stats computes them, then the rest below
  block_all_f32<SQA, false, false>(x + lo, hi - lo, 0.0, all);
#endif
  uint8_t byte = 0;  // i is a multiple of 8 here
  for (; i < hi; ++i) {  // as block_all_f32's tail (y = |x| − 0 is |x|)
    if (i % CHECKPOINT == 0) checkpoint[i / CHECKPOINT] = static_cast<int32_t>(k);
    const float af = std::fabs(x[i]);
    const double a = static_cast<double>(af);
    s += a;
    q += a * a;
    if (!LOG) nonzero += af > 0.0f;
    if (af >= b) {
      const double z = a - shift;
      cnt += 1; ms += z; mq += z * z;
    }
    win[kw] = x[i];
    kw += af >= w && af < b;
    val[k] = x[i];
    const bool in = af > g;
    k += in;
    byte |= static_cast<uint8_t>(in) << (i & 7);
    if ((i & 7) == 7 || i + 1 == hi) {
      bits[i >> 3] = byte;
      byte = 0;
    }
  }
#if defined(__AVX2__)
  all.count = static_cast<double>(hi - lo); all.sum = s; all.sumsq = SQA ? q : 0.0;
  all.max = -1; all.min = INFINITY;
#endif
  all.nonzero = static_cast<double>(nonzero);  // as gc_stats counts them
  if (LOG) all.log_sum = log_sum;  // the gamma fit's Σ ln|x|, as gc_stats has it
  mid.count = static_cast<double>(cnt); mid.sum = ms; mid.sumsq = SQ ? mq : 0.0;
  return k;
}

// `squares`: bit 0 asks for every element's Σy², bit 1 for mid's Σz and Σz² (a gamma first
// stage followed by GP fits needs only the latter).
// out[0..6]: the first stage's totals (as gc_stats over every element, Σy² with bit 0,
// the nonzeros always, Σ ln|x| with `logs`);
// out[7..9]: mid's count, Σ (Σ|x|, or Σz with bit 1) and Σz² (with bit 1).
// The stream's values are written straight into val (space for n) and read there by the
// caller, as val[0, *total), and the window's into win (space for n), as win[0, *wtotal):
// no per-thread buffers to copy them out of. Thread t writes its values forwards from R_t,
// the first of its elements (space for all of them is there); then each thread's run is
// moved down to follow the one before: by all threads at once where the run's new place
// does not overlap its old one (a run of less than about half the elements), else by one
// memmove. The bitmap (space for ⌈n/64⌉ 64-bit words) is written in place, the bits past n
// cleared; after it, one int32 per CHECKPOINT elements: the stream's size before them
// (where stream_select starts its walk). Returns 0, or -1 when no memory could be had.
int sidco_spec(const float* x, int64_t n, int threads, int squares, int logs, double w,
               double b, double g, uint8_t* bits, float* val, float* win, double* out,
               int64_t* total, int64_t* wtotal) {
  const int64_t blocks = (n + BLOCK - 1) / BLOCK;
  const int nth = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, blocks)));
  const float wf = static_cast<float>(w), bf = static_cast<float>(b), gf = static_cast<float>(g);
  std::vector<Partial> all, mid;
  std::vector<int64_t> first(nth), count(nth), wcount(nth), last_block(nth);  // thread runs
  const int64_t words = (n + 63) / 64;
  int32_t* checkpoint = reinterpret_cast<int32_t*>(bits + 8 * words);
  // squares' bit 0: every element's Σy², bit 1: mid's
  typedef int64_t (*Spec)(const float*, int64_t, int64_t, float, float, float, Partial&,
                          Partial&, uint8_t*, int32_t*, float*, int64_t, float*, int64_t&);
  static const Spec kinds[8] = {
      block_spec<false, false, false>, block_spec<true, false, false>,
      block_spec<false, true, false>,  block_spec<true, true, false>,
      block_spec<false, false, true>,  block_spec<true, false, true>,
      block_spec<false, true, true>,   block_spec<true, true, true>};
  const Spec spec = kinds[(squares & 3) | (logs ? 4 : 0)];
  try {
    all.resize(blocks);
    mid.resize(blocks);
    parallel_blocks(n, nth, [&](int64_t b0, int64_t b1, int t) {
      const int64_t r0 = b0 * BLOCK;
      int64_t k = r0, kw = r0;
      for (int64_t blk = b0; blk < b1; ++blk) {
        const int64_t lo = blk * BLOCK, hi = std::min(n, lo + BLOCK);
        k = spec(x, lo, hi, wf, bf, gf, all[blk], mid[blk], bits, checkpoint, val, k, win, kw);
      }
      first[t] = r0;
      count[t] = k - r0;
      wcount[t] = kw - r0;
      last_block[t] = b1;
    });
  } catch (...) {
    return -1;
  }
  // thread t's run of `len` values at p + from, moved down to p + end
  const auto move_run = [&](float* p, int64_t from, int64_t end, int64_t len) {
    if (!len || from == end) return;
    if (end + len <= from) {
      parallel_range(len, nth, [&](int64_t a, int64_t e) {
        std::memcpy(p + end + a, p + from + a, (e - a) * sizeof(float));
      });
    } else {
      std::memmove(p + end, p + from, len * sizeof(float));
    }
  };
  int64_t end = count[0], wend = wcount[0];
  const int64_t checkpoints = (n + CHECKPOINT - 1) / CHECKPOINT;
  for (int t = 1; t < nth; ++t) {
    const int64_t from = first[t], len = count[t];
    // this thread's checkpoints counted from its run's old start
    const int64_t c0 = from / CHECKPOINT,
                  c1 = std::min(checkpoints, last_block[t] * (BLOCK / CHECKPOINT));
    for (int64_t c = c0; c < c1; ++c) checkpoint[c] -= static_cast<int32_t>(from - end);
    move_run(val, from, end, len);
    move_run(win, from, wend, wcount[t]);
    end += len;
    wend += wcount[t];
  }
  *total = end;
  *wtotal = wend;
  const int64_t used = (n + 7) / 8;
  std::memset(bits + used, 0, static_cast<size_t>(words * 8 - used));
  write_total(all, out);
  double m[7];
  write_total(mid, m);
  out[7] = m[0]; out[8] = m[1]; out[9] = m[2];
  return 0;
}

// The positions of stream entries q[0..m) (ascending, each below the stream's size `total`)
// from sidco_spec's bitmap of n bits and its checkpoints, the entries split among the
// threads: each part finds its first entry's checkpoint by bisection and walks the later
// ones forwards; within a checkpoint's 8 words the entry's word is the number of their
// running bit counts at or below it (no branch to mispredict; the words past the bitmap's
// end are read from the bitmap's padding and never counted), and its bit is deposited by
// pdep where BMI2 is fast, else found by clearing the lower ones. Returns 0, -1 when q is
// not ascending or holds a negative, -2 when an entry is past the stream's end.
int stream_select(const uint8_t* bits, int64_t n, int64_t total, const int32_t* q, int64_t m,
                  int32_t* out, int threads) {
  const int64_t words = (n + 63) / 64, checkpoints = (n + CHECKPOINT - 1) / CHECKPOINT;
  const int32_t* checkpoint = reinterpret_cast<const int32_t*>(bits + 8 * words);
  for (int64_t j = 0; j < m; ++j) {
    if (q[j] < 0 || (j && q[j] <= q[j - 1])) return -1;
  }
  if (m && q[m - 1] >= total) return -2;
  parallel_range(m, m < 4096 ? 1 : threads, [&](int64_t a, int64_t e) {
    // the last checkpoint at or before q[a]
    int64_t c = std::upper_bound(checkpoint, checkpoint + checkpoints, q[a]) - checkpoint - 1;
    for (int64_t j = a; j < e; ++j) {
      const int64_t want = q[j];
      while (c + 1 < checkpoints && checkpoint[c + 1] <= want) ++c;
      const int64_t r = want - checkpoint[c];
      uint64_t w[CHECKPOINT / 64];
      std::memcpy(w, bits + 8 * c * (CHECKPOINT / 64), sizeof w);
      int64_t run = 0, word = 0, before = 0;
      for (int l = 0; l < CHECKPOINT / 64; ++l) {
        run += __builtin_popcountll(w[l]);
        const bool past = run <= r;  // the entry lies in a later word
        word += past;
        before = past ? run : before;
      }
      uint64_t v = w[word];
#if defined(__BMI2__) && !defined(__znver1__) && !defined(__znver2__)
      v = _pdep_u64(uint64_t(1) << (r - before), v);  // its bit alone (slow before Zen 3)
#else
      for (int64_t k = r - before; k > 0; --k) v &= v - 1;
#endif
      out[j] = static_cast<int32_t>(64 * (c * (CHECKPOINT / 64) + word) + __builtin_ctzll(v));
    }
  });
  return 0;
}

// DGC/DRAGONN's threshold sample without a positions tensor: out[i] = |x[p_i]| with
// p_i = (h(i)·n) >> 32 (h: the counter hash keyed by k0, k1; n < 2^31, so the torch twin
// in compressors/dgc.py computes the same p_i in int64). The reads are cache misses: the
// position PREFETCH draws ahead is computed and prefetched first.
template <typename T>
void sample_abs(const T* x, int64_t n, int64_t s, uint32_t k0, uint32_t k1, int threads,
                T* out) {
  constexpr int64_t PREFETCH = 16;
  const uint64_t un = static_cast<uint64_t>(n);
  parallel_range(s, threads, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) {
      if (i + PREFETCH < b)
        __builtin_prefetch(x + ((uint64_t(counter_hash(i + PREFETCH, k0, k1)) * un) >> 32));
      out[i] = std::fabs(x[(uint64_t(counter_hash(i, k0, k1)) * un) >> 32]);
    }
  });
}

// DRAGONN's memory (compressors/dragonn.py write_slots, for numel ≤ 2^32 and m < 2^31):
// each key (a candidate index) hashes to slot (h·m) >> 32 with the seeded murmur-style
// finaliser h; among keys in one slot the largest (h' << index_bits) | key survives,
// h' = h's top priority_bits bits. Writes the surviving key per slot (−1 where empty)
// and, unless `values` is null, acc at it (0 where empty). The same integer operations
// as the torch path. With `key_values` (the values at the keys, which must ascend: the
// selection wrote both) a slot keeps the key's ordinal q in place of the key (the same
// order, so the same survivor) and the values come from key_values[q], not from acc's
// scattered lines. Returns 0, or -1 when key_values is given and the keys do not ascend.
template <typename T>
int dragonn_slots(const int64_t* keys, int64_t nk, int64_t m, int index_bits,
                  int priority_bits, uint32_t s0, uint32_t s1, const T* acc, int64_t* slots,
                  T* values, const T* key_values) {
  if (key_values)
    for (int64_t q = 1; q < nk; ++q)
      if (keys[q] <= keys[q - 1]) return -1;
  for (int64_t j = 0; j < m; ++j) slots[j] = -1;
  for (int64_t q = 0; q < nk; ++q) {
    uint64_t h = static_cast<uint32_t>(keys[q]) ^ s0;
    h ^= h >> 16; h = (h * 0x7FEB352Dull) & 0xFFFFFFFFull;
    h ^= s1;
    h ^= h >> 15; h = (h * 0x5BD1E995ull) & 0xFFFFFFFFull;
    h ^= h >> 16;
    const int64_t slot = static_cast<int64_t>((h * static_cast<uint64_t>(m)) >> 32);
    const int64_t pri = static_cast<int64_t>((h >> (32 - priority_bits)) << index_bits) |
                        (key_values ? q : keys[q]);
    if (pri > slots[slot]) slots[slot] = pri;
  }
  const int64_t mask = (int64_t(1) << index_bits) - 1;
  for (int64_t j = 0; j < m; ++j) {
    if (key_values) {
      const int64_t q = slots[j] >= 0 ? slots[j] & mask : -1;
      slots[j] = q >= 0 ? keys[q] : -1;
      if (values) values[j] = q >= 0 ? key_values[q] : T(0);
      continue;
    }
    if (slots[j] >= 0) slots[j] &= mask;
    if (values) values[j] = slots[j] >= 0 ? acc[slots[j]] : T(0);
  }
  return 0;
}

// Whether every element is finite (no NaN, no ±Inf): exponent bits not all ones, tested
// on the integer bits in 8 lanes; one read, nothing written, stops at the first block
// that holds a non-finite value.
template <typename T>
int all_finite(const T* x, int64_t n, int threads) {
  typedef typename std::conditional<sizeof(T) == 4, uint32_t, uint64_t>::type U;
  const U expo = sizeof(T) == 4 ? U(0x7F800000u) : U(0x7FF0000000000000ull);
  std::vector<int> ok(std::max(1, threads), 1);
  parallel_blocks(n, threads, [&](int64_t b0, int64_t b1, int tid) {
    for (int64_t b = b0; b < b1 && ok[tid]; ++b) {
      const int64_t lo = b * BLOCK, hi = std::min(n, lo + BLOCK);
      const U* u = reinterpret_cast<const U*>(x);
      U bad = 0;  // any lane whose exponent field is all ones
      for (int64_t i = lo; i < hi; ++i) bad |= ((u[i] & expo) == expo);
      if (bad) ok[tid] = 0;
    }
  });
  for (int v : ok)
    if (!v) return 0;
  return 1;
}

// Batched sparse decoding (compressors.base.sparse_mean on the CPU): out[0, n) = 0, then
// out[idx[j]] += val[j] for j = 0, 1, ... in order, then out /= divisor (when above 1):
// the same additions in the same order as torch's index_add_, and the same true division
// as its div_, so the same bits. The pairs are visited region by region (REGION elements
// each): where they form at most MERGE_RUNS ascending runs (each rank's selection is one
// for every threshold sparsifier) by a cursor per run, runs in order; else after a stable
// counting sort by region (each thread counts and places its own share, shares in order).
// Either way an element's additions keep their pair order. Each region is built in a
// thread's zeroed workspace, which stays in L2: its pairs added; for a power-of-two divisor
// the whole region scaled by its exact inverse as it is written out, for any other its
// touched elements divided, each once (a bitmap marks them; the rest hold +0.0, and
// +0.0 / divisor is +0.0); the region written to out in one pass, with non-temporal
// stores for a large out (no read of its lines first), after which the touched elements
// of the workspace are zeroed again. So out is written once and never read: the additions
// hit L2 instead of lines of out that a zeroing pass has already pushed out of the cache.
// Returns -1, or the position of the first index outside [0, n) (then nothing has been
// written). (scatter_mean itself follows its helpers below.)

// copy_out: bytes (a multiple of the element size) from src to dst: with `stream`, non-temporal
// 32-byte stores where dst is 32-byte aligned (both are, region by region, for torch's
// allocations), the rest by memcpy.
inline void copy_out(void* dst, const void* src, int64_t bytes, bool stream) {
#if defined(__AVX__)
  if (stream && (reinterpret_cast<uintptr_t>(dst) & 31) == 0) {
    const int64_t vec = bytes & ~int64_t(31);
    auto* d = static_cast<__m256i*>(dst);
    const auto* s = static_cast<const __m256i*>(src);
    for (int64_t i = 0; i < vec / 32; ++i) _mm256_stream_si256(d + i, _mm256_loadu_si256(s + i));
    std::memcpy(static_cast<char*>(dst) + vec, static_cast<const char*>(src) + vec, bytes - vec);
    return;
  }
#endif
  (void)stream;
  std::memcpy(dst, src, bytes);
}

// dst[i] = src[i]·s, where s is the exact inverse of a power-of-two divisor: the same bits as
// src[i] / divisor (both are the correctly rounded value of the same quotient). Streamed
// as copy_out streams.
template <typename T>
void copy_out_scaled(T* dst, const T* src, int64_t len, T s, bool stream) {
  int64_t i = 0;
#if defined(__AVX__)
  if (stream && (reinterpret_cast<uintptr_t>(dst) & 31) == 0) {
    typedef typename Vec<T>::type V;
    constexpr int L = Vec<T>::L;
    const V sv = V{} + s;
    for (; i + L <= len; i += L)
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i),
                          reinterpret_cast<__m256i>(vload<V>(src + i) * sv));
  }
#endif
  (void)stream;
  for (; i < len; ++i) dst[i] = src[i] * s;
}

constexpr int REGION_BITS = 16;
constexpr int64_t REGION = int64_t(1) << REGION_BITS;

// Scratch from the pool, back to it however the caller returns.
struct PoolScratch {
  Buf b;
  PoolScratch() = default;
  PoolScratch(PoolScratch&& o) noexcept : b(o.b) { o.b = Buf(); }
  ~PoolScratch() { pool_give(b); }
};

// Up to this many ascending runs in the pairs (each rank's selection is one, ascending)
// are merged region by region instead of counting-sorted.
constexpr int64_t MERGE_RUNS = 64;

// The regions [0, regions) of out built and written by `parts` threads, each a contiguous
// range of them: pairs.start(r0) gives a walk whose each(r, f) calls f(position in the
// region, value) for region r's pairs in pair order, regions asked for in increasing order
// from r0 (a copy of a walk replays from where it was copied).
template <typename T, typename Pairs>
void write_regions(T* out, int64_t n, int64_t regions, double divisor, int parts,
                   std::vector<PoolScratch>& bufs, Pairs&& pairs) {
  const bool stream = n * static_cast<int64_t>(sizeof(T)) >= (int64_t(8) << 20);
  const T d = static_cast<T>(divisor);
  // A power-of-two divisor (K = 2, 4, 8, ... ranks) scales the region as it is written
  // out; any other divides each element that was added to, once (a bitmap of them).
  int exponent = 0;
  const bool scale = divisor > 1.0 && std::frexp(divisor, &exponent) == 0.5;
  const bool divide = divisor > 1.0 && !scale;
  const T inverse = static_cast<T>(1.0 / divisor);
  run_parts(parts, [&](int t) {
    T* buf = static_cast<T*>(bufs[t].b.p);
    std::memset(buf, 0, std::min(REGION, n) * sizeof(T));  // (a small out uses less)
    std::vector<uint64_t> done(divide ? REGION / 64 : 0, 0);
    const int64_t r0 = regions * t / parts, r1 = regions * (t + 1) / parts;
    auto walk = pairs.start(r0);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t base = r << REGION_BITS, len = std::min(REGION, n - base);
      const auto from = walk;
      walk.each(r, [&](uint32_t e, T v) { buf[e] += v; });
      if (divide) {
        auto again = from;
        again.each(r, [&](uint32_t e, T) {
          const uint64_t bit = uint64_t(1) << (e & 63);
          if (!(done[e >> 6] & bit)) {
            done[e >> 6] |= bit;
            buf[e] = buf[e] / d;
          }
        });
      }
      if (scale)
        copy_out_scaled(out + base, buf, len, inverse, stream);
      else
        copy_out(out + base, buf, len * static_cast<int64_t>(sizeof(T)), stream);
      auto clear = from;  // the workspace back to zeros (and the bitmap to none)
      if (divide)
        clear.each(r, [&](uint32_t e, T) { buf[e] = T(0); done[e >> 6] = 0; });
      else
        clear.each(r, [&](uint32_t e, T) { buf[e] = T(0); });
    }
#if defined(__AVX__)
    if (stream) _mm_sfence();  // the streamed lines are visible before the join
#endif
  });
}

// Region walks over the pairs: cursors into ascending runs (merged, runs in order), or
// the counting sort's region-major arrays.
template <typename T, typename I>
struct RunWalk {
  const I* idx; const T* val;
  const std::vector<int64_t>* bounds;  // run k is [bounds[k], bounds[k + 1])
  int64_t at[MERGE_RUNS];  // each run's next pair (a copy of the walk allocates nothing)
  template <typename F>
  void each(int64_t r, F&& f) {
    const int64_t end = (r + 1) << REGION_BITS;
    const size_t runs = bounds->size() - 1;
    for (size_t k = 0; k < runs; ++k) {
      int64_t j = at[k];
      const int64_t stop = (*bounds)[k + 1];
      for (; j < stop && static_cast<int64_t>(idx[j]) < end; ++j)
        f(static_cast<uint32_t>(static_cast<int64_t>(idx[j]) & (REGION - 1)), val[j]);
      at[k] = j;
    }
  }
};

template <typename T, typename I>
struct RunPairs {
  const I* idx; const T* val;
  const std::vector<int64_t>* bounds;
  RunWalk<T, I> start(int64_t r0) const {
    RunWalk<T, I> w{idx, val, bounds, {}};
    const int64_t from = r0 << REGION_BITS;
    for (size_t k = 0; k + 1 < bounds->size(); ++k)  // first pair of the run at or after r0
      w.at[k] = std::lower_bound(idx + (*bounds)[k], idx + (*bounds)[k + 1], from,
                                 [](I a, int64_t v) { return static_cast<int64_t>(a) < v; })
                - idx;
    return w;
  }
};

template <typename T>
struct SortedWalk {
  const uint32_t* local; const T* sorted; const int64_t* first;  // region r: [first[r], first[r + 1])
  template <typename F>
  void each(int64_t r, F&& f) {
    for (int64_t j = first[r]; j < first[r + 1]; ++j) f(local[j], sorted[j]);
  }
};

template <typename T>
struct SortedPairs {
  const uint32_t* local; const T* sorted; const int64_t* first;
  SortedWalk<T> start(int64_t) const { return {local, sorted, first}; }
};

// An index vector's type and lanes (32 bytes: four int64 or eight int32 indices).
template <typename I> struct IndexLanes;
template <> struct IndexLanes<int64_t> { typedef v4l V; static constexpr int L = 4; };
template <> struct IndexLanes<int32_t> { typedef v8i V; static constexpr int L = 8; };

template <typename T, typename I>
int64_t scatter_mean(const I* idx, const T* val, int64_t m, T* out, int64_t n, double divisor,
                     int threads) {
  const int64_t regions = (n + REGION - 1) >> REGION_BITS;
  // Sharing the pairs only pays when there are many of them.
  const int pt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, m >> 15)));
  // One read of the indices: bounds, and where an ascending run ends (a descent), up to
  // MERGE_RUNS + 1 of them per share. Checked a vector at a time (an index below zero, at
  // or past n, or below the one before it); a vector where one is found is gone through
  // again one index at a time. A share with more descents than are merged (pairs in no
  // order) goes on as the counting sort needs: bounds and each region's count, one index
  // at a time from its start.
  std::vector<int64_t> first_bad(pt, -1);
  std::vector<std::vector<int64_t>> descents(pt);
  std::vector<int64_t> counts(static_cast<size_t>(pt) * regions + 1, 0);
  std::vector<char> counted(pt, 0);
  // Share t's count per region, with the bounds checked too when `check` (first_bad[t]
  // noted at the first index outside them).
  auto count_share = [&](int t, bool check) {
    int64_t* c = counts.data() + static_cast<size_t>(t) * regions;
    for (int64_t j = m * t / pt, e = m * (t + 1) / pt; j < e; ++j) {
      const int64_t i = static_cast<int64_t>(idx[j]);
      if (check && (i < 0 || i >= n)) {
        first_bad[t] = j;
        return;
      }
      ++c[i >> REGION_BITS];
    }
    counted[t] = 1;
  };
  run_parts(pt, [&](int t) {
    std::vector<int64_t>& down = descents[t];
    const int64_t j0 = m * t / pt, e = m * (t + 1) / pt;
    auto one_by_one = [&](int64_t a, int64_t b) {  // false: a bad index (noted)
      for (int64_t j = a; j < b; ++j) {
        const int64_t i = static_cast<int64_t>(idx[j]);
        if (i < 0 || i >= n) {
          first_bad[t] = j;
          return false;
        }
        if (j > 0 && i < static_cast<int64_t>(idx[j - 1]) &&
            static_cast<int64_t>(down.size()) <= MERGE_RUNS)
          down.push_back(j);
      }
      return true;
    };
    typedef typename IndexLanes<I>::V V;
    constexpr int L = IndexLanes<I>::L;
    constexpr int64_t STEP = 4 * L;
    const I top = static_cast<I>(std::min<int64_t>(n - 1, std::numeric_limits<I>::max()));
    const V vtop = V{} + top, vzero = V{};
    int64_t j = std::max<int64_t>(j0, 1);
    if (!one_by_one(j0, std::min(j, e))) return;
    for (; j + STEP <= e; j += STEP) {
      V any = vzero;
      for (int u = 0; u < 4; ++u) {
        V cur, before;
        std::memcpy(&cur, idx + j + u * L, sizeof cur);
        std::memcpy(&before, idx + j + u * L - 1, sizeof before);
        any |= (cur < before) | (cur < vzero) | (cur > vtop);
      }
      bool hit = false;
      for (int l = 0; l < L; ++l) hit |= any[l] != 0;
      if (hit) {
        if (!one_by_one(j, j + STEP)) return;
        if (static_cast<int64_t>(down.size()) > MERGE_RUNS) return count_share(t, true);
      }
    }
    if (one_by_one(j, e) && static_cast<int64_t>(down.size()) > MERGE_RUNS)
      count_share(t, true);
  });
  for (int64_t b : first_bad)
    if (b >= 0) return b;
  const int parts = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, regions)));
  std::vector<PoolScratch> bufs(parts);  // had before anything is written to out
  for (PoolScratch& sb : bufs) grow(sb.b, REGION * sizeof(T));
  std::vector<int64_t> bounds{0};
  for (const auto& down : descents) bounds.insert(bounds.end(), down.begin(), down.end());
  bounds.push_back(m);
  if (static_cast<int64_t>(bounds.size()) - 1 <= MERGE_RUNS) {
    write_regions(out, n, regions, divisor, parts, bufs, RunPairs<T, I>{idx, val, &bounds});
    return -1;
  }
  // Each region's count per share (where the first read did not take them), then
  // exclusive offsets, region-major and share order within a region: start[r] is where
  // region r's pairs begin; counts become each share's next write position.
  run_parts(pt, [&](int t) {
    if (!counted[t]) count_share(t, false);
  });
  std::vector<int64_t> start(regions + 1);
  int64_t at = 0;
  for (int64_t r = 0; r < regions; ++r) {
    start[r] = at;
    for (int t = 0; t < pt; ++t) {
      int64_t& c = counts[static_cast<size_t>(t) * regions + r];
      const int64_t k = c;
      c = at;
      at += k;
    }
  }
  start[regions] = at;
  PoolScratch bl, bv;
  grow(bl.b, std::max<int64_t>(m, 1) * sizeof(uint32_t));
  grow(bv.b, std::max<int64_t>(m, 1) * sizeof(T));
  auto* local = static_cast<uint32_t*>(bl.b.p);  // position within the region
  auto* sorted = static_cast<T*>(bv.b.p);
  run_parts(pt, [&](int t) {
    int64_t* c = counts.data() + static_cast<size_t>(t) * regions;
    for (int64_t j = m * t / pt, e = m * (t + 1) / pt; j < e; ++j) {
      const int64_t i = static_cast<int64_t>(idx[j]);
      const int64_t w = c[i >> REGION_BITS]++;
      local[w] = static_cast<uint32_t>(i & (REGION - 1));
      sorted[w] = val[j];
    }
  });
  write_regions(out, n, regions, divisor, parts, bufs, SortedPairs<T>{local, sorted, start.data()});
  return -1;
}

// SignSGD's and EF-SignSGD's packed signs (compressors/quantize.py pack_signs): bit 7 − j
// of byte i is 1 where x[8i + j] ≥ 0 (a NaN gives 0, −0.0 gives 1: the comparison
// torch makes), the last byte padded with zeros. One read of x, n/8 bytes written.
struct BitReverse {
  uint8_t r[256];
  BitReverse() {
    for (int m = 0; m < 256; ++m) {
      int v = 0;
      for (int b = 0; b < 8; ++b) v |= ((m >> b) & 1) << (7 - b);
      r[m] = static_cast<uint8_t>(v);
    }
  }
};
const BitReverse bit_reverse;

template <typename T>
void pack_signs(const T* x, int64_t n, uint8_t* out, int threads) {
  const int64_t bytes = (n + 7) / 8;
  parallel_range((bytes + BLOCK - 1) / BLOCK, threads, [&](int64_t b0, int64_t b1) {
    const int64_t lo = b0 * BLOCK, hi = std::min(bytes, b1 * BLOCK);
    int64_t i = lo;
#if defined(__AVX__)
    if constexpr (std::is_same<T, float>::value) {
      const __m256 zero = _mm256_setzero_ps();
      for (; i < hi && i * 8 + 8 <= n; ++i) {
        const int m = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i * 8), zero,
                                                       _CMP_GE_OQ));
        out[i] = bit_reverse.r[m];
      }
    }
#endif
    for (; i < hi; ++i) {
      const int64_t base = i * 8;
      const int m = static_cast<int>(std::min<int64_t>(8, n - base));
      int v = 0;
      for (int j = 0; j < m; ++j) v |= static_cast<int>(x[base + j] >= T(0)) << (7 - j);
      out[i] = static_cast<uint8_t>(v);
    }
  });
}


// SignSGD's and EF-SignSGD's decode of one rank's packed signs (compressors/quantize.py
// add_signs_): total[i] += w[g] where bit i is set (bit 7 − i mod 8 of byte i / 8), −w[g]
// where it is not, for i in group g ([off[g], off[g + 1])). The torch form adds the
// unpacked ±1 times w[g]; ±1·w is exactly ±w in every type here, so the same bits, without
// the unpacked full-size tensor.
// 8 lanes of T (spelled out per type: GCC drops vector_size on a dependent typedef).
template <typename T> struct Lanes8;
template <> struct Lanes8<float> { typedef float type __attribute__((vector_size(32))); };
template <> struct Lanes8<int8_t> { typedef int8_t type __attribute__((vector_size(8))); };
template <> struct Lanes8<int16_t> { typedef int16_t type __attribute__((vector_size(16))); };
template <> struct Lanes8<int32_t> { typedef int32_t type __attribute__((vector_size(32))); };

template <typename T>
void add_signs(T* total, const uint8_t* packed, int64_t n, const int64_t* off, int64_t groups,
               const T* w, int threads) {
  typedef typename Lanes8<T>::type V;
  static_assert(sizeof(V) == 8 * sizeof(T), "8 lanes");
  // ±1 for the 8 bits of every byte value, most significant bit first
  static const std::vector<V> signs = [] {
    std::vector<V> t(256);
    for (int b = 0; b < 256; ++b) {
      T lanes[8];
      for (int l = 0; l < 8; ++l) lanes[l] = static_cast<T>(((b >> (7 - l)) & 1) ? 1 : -1);
      std::memcpy(&t[b], lanes, sizeof lanes);
    }
    return t;
  }();
  parallel_group_runs(n, off, groups, threads, [&](int64_t g, int64_t i, int64_t end) {
    const T plus = w[g], minus = static_cast<T>(-w[g]);
    const V wv = V{} + w[g];
    for (; i < end && (i & 7); ++i)
      total[i] += ((packed[i >> 3] >> (7 - (i & 7))) & 1) ? plus : minus;
    for (; i + 8 <= end; i += 8) {  // a whole byte: ±1·w is exactly ±w
      V t;
      std::memcpy(&t, total + i, sizeof t);
      t += signs[packed[i >> 3]] * wv;
      std::memcpy(total + i, &t, sizeof t);
    }
    for (; i < end; ++i)
      total[i] += ((packed[i >> 3] >> (7 - (i & 7))) & 1) ? plus : minus;
  });
}

// QSGD's and TernGrad's decode of one rank's signed levels (compressors/quantize.py
// add_levels_): total[i] += float(level[i]) · w[g] for i in group g, float32 total. The
// torch form converts the levels to float32, multiplies by w[g] and adds: two roundings,
// which this loop keeps (no contraction into an FMA: -ffp-contract=off), so the same bits
// without the converted full-size tensor.
template <typename L>
void add_levels(float* total, const L* level, int64_t n, const int64_t* off, int64_t groups,
                const float* w, int threads) {
  parallel_group_runs(n, off, groups, threads, [&](int64_t g, int64_t i, int64_t end) {
    const float wg = w[g];
    for (; i < end; ++i) total[i] += static_cast<float>(level[i]) * wg;
  });
}

template <typename T>
void select_take(void* handle, int64_t* idx_out, int32_t* idx32_out, T* val_out) {
  auto* sel = static_cast<Selection<T>*>(handle);
  advise_huge(idx_out, sel->total * sizeof(int64_t));
  advise_huge(idx32_out, sel->total * sizeof(int32_t));
  advise_huge(val_out, sel->total * sizeof(T));
  int64_t at = 0;
  for (auto& h : sel->parts) {
    if (h.narrow) {
      if (idx32_out && h.size) std::memcpy(idx32_out + at, h.idx32(), h.size * sizeof(int32_t));
      if (idx_out)
        for (int64_t j = 0; j < h.size; ++j) idx_out[at + j] = h.idx32()[j];
    } else {
      if (idx_out && h.size) std::memcpy(idx_out + at, h.idx, h.size * sizeof(int64_t));
      if (idx32_out)
        for (int64_t j = 0; j < h.size; ++j) idx32_out[at + j] = static_cast<int32_t>(h.idx[j]);
    }
    if (val_out && h.val && h.size) std::memcpy(val_out + at, h.val, h.size * sizeof(T));
    at += h.size;
  }
  delete sel;
}

}  // namespace

extern "C" {

int gc_abi_version() { return 18; }

void gc_advise_huge(void* p, int64_t bytes) { advise_huge(p, static_cast<size_t>(bytes)); }

// add_signs on total of type 0: float32, 1: int8, 2: int16, 3: int32 (w of the same type).
void gc_add_signs(void* total, int type, const uint8_t* packed, int64_t n, const int64_t* off,
                  int64_t groups, const void* w, int threads) {
  switch (type) {
    case 1: add_signs(static_cast<int8_t*>(total), packed, n, off, groups,
                      static_cast<const int8_t*>(w), threads); break;
    case 2: add_signs(static_cast<int16_t*>(total), packed, n, off, groups,
                      static_cast<const int16_t*>(w), threads); break;
    case 3: add_signs(static_cast<int32_t*>(total), packed, n, off, groups,
                      static_cast<const int32_t*>(w), threads); break;
    default: add_signs(static_cast<float*>(total), packed, n, off, groups,
                       static_cast<const float*>(w), threads);
  }
}

// add_levels of levels of type 1: int8, 2: int16, 3: int32 into a float32 total.
void gc_add_levels(float* total, const void* level, int type, int64_t n, const int64_t* off,
                   int64_t groups, const float* w, int threads) {
  switch (type) {
    case 2: add_levels(total, static_cast<const int16_t*>(level), n, off, groups, w, threads);
      break;
    case 3: add_levels(total, static_cast<const int32_t*>(level), n, off, groups, w, threads);
      break;
    default: add_levels(total, static_cast<const int8_t*>(level), n, off, groups, w, threads);
  }
}

// Frees the workspace buffers kept between calls (they are kept up to POOL_KEEP, the largest
// ever used: after a very large tensor a process may want the memory back).
void gc_release_workspaces() {
  std::lock_guard<std::mutex> lock(pool_mutex);
  for (Buf& b : pool_bufs) std::free(b.p);
  pool_bufs.clear();
}

int gc_sidco_spec_f32(const float* x, int64_t n, int threads, int squares, int logs, double w,
                      double b, double g, uint8_t* bits, float* val, float* win, double* out,
                      int64_t* total, int64_t* wtotal) {
  return sidco_spec(x, n, threads, squares, logs, w, b, g, bits, val, win, out, total, wtotal);
}

int gc_stream_select(const uint8_t* bits, int64_t n, int64_t total, const int32_t* q,
                     int64_t m, int32_t* out, int threads) {
  return stream_select(bits, n, total, q, m, out, threads);
}

void* gc_pool_begin_f32(const float* x, int64_t n, int threads, double above, double shift,
                        int flags, int want_stats, double pool_t, int strict, int dense,
                        int64_t reserve, double* out, int64_t* total, int narrow) {
  return pool_begin(x, n, threads, above, shift, flags, want_stats, pool_t, strict, dense, reserve,
                    out, total, narrow);
}

#define GC_DEFINE(SUFFIX, T)                                                                 \
  void gc_stats_##SUFFIX(const T* x, int64_t n, int threads, int all, double above,          \
                         double shift, int flags, double* out) {                              \
    stats<T>(x, n, threads, all, above, shift, flags, out);                                   \
  }                                                                                           \
  int64_t gc_count_##SUFFIX(const T* x, int64_t n, int threads, double t, int strict) {        \
    return count<T>(x, n, threads, t, strict);                                                \
  }                                                                                           \
  void* gc_select_begin_##SUFFIX(const T* x, const int64_t* map, int64_t n, int threads,      \
                                 double t, int strict, int values, int64_t reserve,           \
                                 int check, int dense, int* nonfinite, int64_t* total) {      \
    return select_any<T>(x, map, n, threads, t, strict, values, reserve, check, dense,        \
                         nonfinite, total);                                                   \
  }                                                                                           \
  void gc_sample_abs_##SUFFIX(const T* x, int64_t n, int64_t s, uint32_t k0, uint32_t k1,     \
                              int threads, T* out) {                                          \
    sample_abs<T>(x, n, s, k0, k1, threads, out);                                             \
  }                                                                                           \
  int gc_dragonn_slots_##SUFFIX(const int64_t* keys, int64_t nk, int64_t m, int index_bits,   \
                                int priority_bits, uint32_t s0, uint32_t s1, const T* acc,    \
                                int64_t* slots, T* values, const T* key_values) {             \
    return dragonn_slots<T>(keys, nk, m, index_bits, priority_bits, s0, s1, acc, slots,       \
                            values, key_values);                                              \
  }                                                                                           \
  int gc_all_finite_##SUFFIX(const T* x, int64_t n, int threads) {                           \
    return all_finite<T>(x, n, threads);                                                      \
  }                                                                                           \
  void gc_select_take_##SUFFIX(void* h, int64_t* idx, int32_t* idx32, T* val) {              \
    select_take<T>(h, idx, idx32, val);                                                       \
  }                                                                                           \
  void gc_pack_signs_##SUFFIX(const T* x, int64_t n, uint8_t* out, int threads) {             \
    pack_signs<T>(x, n, out, threads);                                                        \
  }                                                                                           \
  int64_t gc_scatter_mean_##SUFFIX(const void* idx, int idx64, const T* val, int64_t m,       \
                                   T* out, int64_t n, double divisor, int threads) {          \
    try {                                                                                     \
      return idx64 ? scatter_mean<T, int64_t>(static_cast<const int64_t*>(idx), val, m, out,  \
                                              n, divisor, threads)                            \
                   : scatter_mean<T, int32_t>(static_cast<const int32_t*>(idx), val, m, out,  \
                                              n, divisor, threads);                           \
    } catch (...) {                                                                           \
      return -2; /* no memory for the sorted pairs: nothing written */                        \
    }                                                                                         \
  }

GC_DEFINE(f32, float)
GC_DEFINE(f64, double)

}  // extern "C"
