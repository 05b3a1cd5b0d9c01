// Fused magnitude kernels for the threshold sparsifiers (compressors/_native/__init__.py).
//
// Plain C ABI over raw pointers (no torch headers: compiles in about a second), loaded
// with ctypes. Every kernel reads its input once and writes no full-size output:
//   gc_stats_*    count, Σy, Σy², max, min of y = |x| − shift over {|x| > above} (or all
//                 elements), plus the nonzero count and Σ ln|x| when asked: one read pass.
//   gc_count_*    #{|x| ≥ t} (or > t): one read pass, nothing written.
//   gc_select_*   positions (and optionally |x|) of {|x| ≥ t} (or > t), ascending: one
//                 read pass; each thread appends its hits to its own growing buffer, the
//                 caller then allocates the exact-size output and gc_take copies into it.
// Comparisons are done in the input's precision with the threshold rounded to it, as
// torch does for `tensor >= python_float`, so selections equal torch's bit for bit.
// Sums are accumulated in double over fixed blocks of BLOCK elements and the block
// partials added in block order, so a result does not depend on the thread count.
// Built without -ffast-math: the compiler may not reassociate, so the lane structure
// below is what vectorises the loops.

#include <algorithm>
#include <cstdlib>
#include <cmath>
#include <climits>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <new>
#include <thread>
#include <vector>
#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace {

constexpr int64_t BLOCK = 1 << 15;
constexpr int LANES = 8;

template <typename F>
void parallel_blocks(int64_t n, int threads, F&& body) {
  // body(first_block, last_block) over contiguous ranges of blocks, one per thread.
  const int64_t blocks = (n + BLOCK - 1) / BLOCK;
  int nth = std::max<int64_t>(1, std::min<int64_t>(threads, blocks));
  if (nth == 1) {
    body(0, blocks, 0);
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(nth - 1);
  for (int t = 1; t < nth; ++t) {
    const int64_t b0 = blocks * t / nth, b1 = blocks * (t + 1) / nth;
    pool.emplace_back([&body, b0, b1, t] { body(b0, b1, t); });
  }
  body(0, blocks / nth, 0);
  for (auto& th : pool) th.join();
}

struct Partial {
  double count = 0, sum = 0, sumsq = 0, max = -1, min = std::numeric_limits<double>::infinity();
  double nonzero = 0, log_sum = 0;
};

// Four lanes of doubles (GCC/Clang vector extensions: AVX2 registers where the CPU has
// them, pairs of SSE2 registers or scalars elsewhere). Float inputs are widened exactly.
typedef double v4d __attribute__((vector_size(32)));
typedef int64_t v4l __attribute__((vector_size(32)));
typedef uint64_t v4u __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));

inline v4d load4(const float* p) {
  v4f f;
  std::memcpy(&f, p, sizeof f);
  return __builtin_convertvector(f, v4d);
}
inline v4d load4(const double* p) {
  v4d d;
  std::memcpy(&d, p, sizeof d);
  return d;
}
inline v4d vabs(v4d a) {
  const v4l sign_off = {INT64_MAX, INT64_MAX, INT64_MAX, INT64_MAX};
  return (v4d)((v4l)a & sign_off);
}
inline double hsum(v4d v) { return (v[0] + v[1]) + (v[2] + v[3]); }

// Σ ln a over a > 0 of a block, as Σ exponents·ln2 + ln Π mantissas (mantissas in [1, 2)
// multiplied per lane, renormalised every 256 elements so products stay finite). The
// float is widened to double first, so float denormals are ordinary doubles.
template <typename T>
double block_log_sum(const T* x, int64_t n) {
  const v4l mant = {0x000FFFFFFFFFFFFFll, 0x000FFFFFFFFFFFFFll, 0x000FFFFFFFFFFFFFll,
                    0x000FFFFFFFFFFFFFll};
  const v4l one = {0x3FF0000000000000ll, 0x3FF0000000000000ll, 0x3FF0000000000000ll,
                   0x3FF0000000000000ll};
  const v4l bias = {1023, 1023, 1023, 1023};
  const v4d zero = {0, 0, 0, 0};
  v4d prod = {1, 1, 1, 1};
  v4l expo = {0, 0, 0, 0};
  int64_t i = 0;
  while (i < n) {
    const int64_t stop = std::min<int64_t>(n, i + 256);
    for (; i + 4 <= stop; i += 4) {
      const v4d a = vabs(load4(x + i));
      const v4l bits = (v4l)a;
      const v4l pos = a > zero;
      const v4d m = (v4d)((bits & mant) | one);
      prod *= (v4d)(((v4l)m & pos) | (one & ~pos));
      // Logical shift (the sign bit is clear): AVX2 has it for 64-bit lanes.
      expo += ((v4l)((v4u)bits >> 52) - bias) & pos;
    }
    for (; i < stop; ++i) {
      const double a = std::fabs(static_cast<double>(x[i]));
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
  for (int l = 0; l < 4; ++l) { logs += std::log(prod[l]); e_total += expo[l]; }
  return logs + static_cast<double>(e_total) * 0.69314718055994530942;
}

// One block's partial: ALL counts every element, else those with |x| > above (compared
// in T's precision: both sides are exact doubles); SQ adds Σy²; EXT max, min, nonzeros.
template <typename T, bool ALL, bool SQ, bool EXT>
void block_stats(const T* x, int64_t n, double above, double shift, Partial& p) {
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
      nz -= (a0 > zero) + (a1 > zero);
    }
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
  p.max = EXT ? mxs : -1; p.min = EXT ? mns : INFINITY; p.nonzero = EXT ? nzs : 0;
}

template <typename T, bool ALL, bool SQ, bool EXT>
void stats_blocks(const T* x, int64_t n, int threads, double above, double shift, int want_log,
                  std::vector<Partial>& part) {
  parallel_blocks(n, threads, [&](int64_t b0, int64_t b1, int) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t lo = b * BLOCK, hi = std::min(n, lo + BLOCK);
      block_stats<T, ALL, SQ, EXT>(x + lo, hi - lo, above, shift, part[b]);
      if (want_log) part[b].log_sum = block_log_sum(x + lo, hi - lo);
    }
  });
}

// flags: 1 = Σy², 2 = max/min/nonzeros, 4 = Σ ln|x| (implies nonzeros).
template <typename T>
void stats(const T* x, int64_t n, int threads, int all, double above, double shift, int flags,
           double* out) {
  const int64_t blocks = (n + BLOCK - 1) / BLOCK;
  std::vector<Partial> part(blocks);
  const double abv = static_cast<double>(static_cast<T>(above));
  const bool sq = flags & 1, ext = (flags & 6) != 0;
  const int lg = (flags & 4) != 0;
#define GC_STATS(A, S, E) stats_blocks<T, A, S, E>(x, n, threads, abv, shift, lg, part)
  if (all) {
    if (sq) { if (ext) GC_STATS(true, true, true); else GC_STATS(true, true, false); }
    else { if (ext) GC_STATS(true, false, true); else GC_STATS(true, false, false); }
  } else {
    if (sq) { if (ext) GC_STATS(false, true, true); else GC_STATS(false, true, false); }
    else { if (ext) GC_STATS(false, false, true); else GC_STATS(false, false, false); }
  }
#undef GC_STATS
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

template <typename T>
int64_t count(const T* x, int64_t n, int threads, double t, int strict) {
  const T tt = static_cast<T>(t);
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

// Fresh large buffers cost a page fault per 4 KiB page on first touch (measured here:
// about 10x the cost of writing the data). Where transparent huge pages are available
// on request (THP "madvise" mode), ask for them on the 2 MiB-aligned interior of buffers
// of 4 MiB or more before they are first written. Advice only: failures are ignored.
inline void advise_huge(void* p, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t HUGE = uintptr_t(1) << 21;
  if (!p || bytes < 2 * HUGE) return;
  const uintptr_t a = (reinterpret_cast<uintptr_t>(p) + HUGE - 1) & ~(HUGE - 1);
  const uintptr_t e = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(HUGE - 1);
  if (e > a) madvise(reinterpret_cast<void*>(a), e - a, MADV_HUGEPAGE);
#else
  (void)p; (void)bytes;
#endif
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

// A growable pair of arrays in pooled scratch buffers (no value-initialisation of the
// room reserved for branch-free writes).
template <typename T>
struct Hits {
  int64_t* idx = nullptr;
  T* val = nullptr;
  int64_t size = 0, cap = 0;
  bool values = false;
  Buf bi, bv;
  ~Hits() { pool_give(bi); pool_give(bv); }
  Hits() = default;
  Hits(Hits&& o) noexcept { *this = std::move(o); }
  Hits& operator=(Hits&& o) noexcept {
    std::swap(idx, o.idx); std::swap(val, o.val); std::swap(size, o.size);
    std::swap(cap, o.cap); std::swap(values, o.values); std::swap(bi, o.bi); std::swap(bv, o.bv);
    return *this;
  }
  void ensure(int64_t need) {
    if (need <= cap) return;
    int64_t c = std::max<int64_t>(need, std::max<int64_t>(1024, cap * 2));
    grow(bi, c * sizeof(int64_t));
    c = std::max<int64_t>(c, bi.bytes / sizeof(int64_t));
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
template <typename T, bool STRICT>
void select_range(const T* x, const int64_t* map, int64_t lo, int64_t hi, double t,
                  Hits<T>& out) {
  const T tt = static_cast<T>(t);
  const double td = static_cast<double>(tt);
  const v4d tv = {td, td, td, td};
  int64_t i = lo;
  for (; i < hi; i += 8) {
    const int64_t end = std::min(hi, i + 8);
    if (end - i == 8) {
      const v4d a0 = vabs(load4(x + i)), a1 = vabs(load4(x + i + 4));
      const v4l m = STRICT ? ((a0 > tv) | (a1 > tv)) : ((a0 >= tv) | (a1 >= tv));
      if (!((m[0] | m[1]) | (m[2] | m[3]))) continue;
    }
    out.ensure(out.size + 8);
    int64_t k = out.size;
    int64_t* idx = out.idx;
    T* val = out.val;
    for (int64_t j = i; j < end; ++j) {
      const T a = std::fabs(x[j]);
      idx[k] = map ? map[j] : j;
      if (val) val[k] = a;
      k += STRICT ? (a > tt) : (a >= tt);
    }
    out.size = k;
  }
}

template <typename T>
void* select_begin(const T* x, const int64_t* map, int64_t n, int threads, double t, int strict,
                   int values, int64_t reserve, int64_t* total) {
  auto* sel = new (std::nothrow) Selection<T>();
  if (!sel) return nullptr;
  const int nth = std::max(1, threads);
  try {
    sel->parts.resize(nth);
    parallel_blocks(n, nth, [&](int64_t b0, int64_t b1, int tid) {
      const int64_t lo = b0 * BLOCK, hi = std::min(n, b1 * BLOCK);
      Hits<T>& h = sel->parts[tid];
      h.values = values != 0;
      h.ensure(std::max<int64_t>(1024, reserve / nth + 64));
      if (strict)
        select_range<T, true>(x, map, lo, hi, t, h);
      else
        select_range<T, false>(x, map, lo, hi, t, h);
    });
  } catch (...) {
    delete sel;
    return nullptr;
  }
  for (auto& h : sel->parts) sel->total += h.size;
  *total = sel->total;
  return sel;
}

template <typename T>
void select_take(void* handle, int64_t* idx_out, int32_t* idx32_out, T* val_out) {
  auto* sel = static_cast<Selection<T>*>(handle);
  advise_huge(idx_out, sel->total * sizeof(int64_t));
  advise_huge(idx32_out, sel->total * sizeof(int32_t));
  advise_huge(val_out, sel->total * sizeof(T));
  int64_t at = 0;
  for (auto& h : sel->parts) {
    if (idx_out && h.size) std::memcpy(idx_out + at, h.idx, h.size * sizeof(int64_t));
    if (idx32_out)
      for (int64_t j = 0; j < h.size; ++j) idx32_out[at + j] = static_cast<int32_t>(h.idx[j]);
    if (val_out && h.val && h.size) std::memcpy(val_out + at, h.val, h.size * sizeof(T));
    at += h.size;
  }
  delete sel;
}

// ---------------------------------------------------------------------------------------
// In-place unnormalised fast Walsh–Hadamard transform (Sylvester order) of `rows` rows of
// length d (a power of two). Each butterfly computes exactly what the torch reference
// (compressors/thc.py fwht_) computes: a' = a + b, b' = a' − 2b (2b is exact), in the
// same stage order h = 1, 2, 4, ..., so the result equals the reference bit for bit.
// Cache blocking: all stages h < B run on blocks of B contiguous elements that fit L2
// (one read and one write of the data); the remaining log2(d/B) stages run on column
// strips of the (d/B) × B matrix, each strip small enough for L2 (a second read and
// write). Blocks and strips are split between threads; a result never depends on the
// thread count (every element sees the same operations in the same order).

typedef float v8f __attribute__((vector_size(32)));
template <typename T> struct Vec;
template <> struct Vec<float> { typedef v8f type; static constexpr int L = 8; };
template <> struct Vec<double> { typedef v4d type; static constexpr int L = 4; };

template <typename V>
inline V vload(const void* p) { V v; std::memcpy(&v, p, sizeof v); return v; }
template <typename V>
inline void vstore(void* p, V v) { std::memcpy(p, &v, sizeof v); }

template <typename V>
inline void vbfly(V& a, V& b) {  // a' = a + b, b' = a' − 2b: the reference's two ops
  const V s = a + b;
  b = s - (b + b);
  a = s;
}

// The stages h < L inside one vector: lane l pairs with lane l ^ h; the lane with bit h
// set is the "b" of its butterfly. a + b == b + a exactly, so s = x + partner in both.
inline v8f small_stages(v8f x) {
  const v8f* dummy = nullptr; (void)dummy;
  typedef int32_t v8i __attribute__((vector_size(32)));
  v8f p, s;
  p = __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6);
  s = x + p;
  x = (v8i){0, -1, 0, -1, 0, -1, 0, -1} ? s - (x + x) : s;
  p = __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5);
  s = x + p;
  x = (v8i){0, 0, -1, -1, 0, 0, -1, -1} ? s - (x + x) : s;
  p = __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3);
  s = x + p;
  x = (v8i){0, 0, 0, 0, -1, -1, -1, -1} ? s - (x + x) : s;
  return x;
}
inline v4d small_stages(v4d x) {
  v4d p, s;
  p = __builtin_shufflevector(x, x, 1, 0, 3, 2);
  s = x + p;
  x = (v4l){0, -1, 0, -1} ? s - (x + x) : s;
  p = __builtin_shufflevector(x, x, 2, 3, 0, 1);
  s = x + p;
  x = (v4l){0, 0, -1, -1} ? s - (x + x) : s;
  return x;
}

// Stages h (and 2h when `two`) over n elements spaced by `stride` T's between the rows
// of a butterfly: x[j + i], x[j + i + h·stride], ... for a width of `w` elements (a
// multiple of L). Used in blocks (stride 1, w = h) and across blocks (stride B).
template <typename T>
inline void sweep(T* x, int64_t rows, int64_t h, bool two, int64_t stride, int64_t w) {
  typedef typename Vec<T>::type V;
  constexpr int L = Vec<T>::L;
  const int64_t hs = h * stride;
  if (two) {
    for (int64_t j = 0; j < rows; j += 4 * h)
      for (int64_t q = j; q < j + h; ++q) {
        T* p0 = x + q * stride;
        for (int64_t i = 0; i < w; i += L) {
          V a = vload<V>(p0 + i), b = vload<V>(p0 + hs + i);
          V c = vload<V>(p0 + 2 * hs + i), e = vload<V>(p0 + 3 * hs + i);
          vbfly(a, b); vbfly(c, e);
          vbfly(a, c); vbfly(b, e);
          vstore(p0 + i, a); vstore(p0 + hs + i, b);
          vstore(p0 + 2 * hs + i, c); vstore(p0 + 3 * hs + i, e);
        }
      }
  } else {
    for (int64_t j = 0; j < rows; j += 2 * h)
      for (int64_t q = j; q < j + h; ++q) {
        T* p0 = x + q * stride;
        for (int64_t i = 0; i < w; i += L) {
          V a = vload<V>(p0 + i), b = vload<V>(p0 + hs + i);
          vbfly(a, b);
          vstore(p0 + i, a); vstore(p0 + hs + i, b);
        }
      }
  }
}

template <typename T>
void fwht_scalar(T* x, int64_t n) {
  for (int64_t h = 1; h < n; h *= 2)
    for (int64_t j = 0; j < n; j += 2 * h)
      for (int64_t q = j; q < j + h; ++q) {
        const T s = x[q] + x[q + h];
        x[q + h] = s - (x[q + h] + x[q + h]);
        x[q] = s;
      }
}

template <typename T>
void fwht_block(T* x, int64_t n) {
  typedef typename Vec<T>::type V;
  constexpr int L = Vec<T>::L;
  if (n < L) { fwht_scalar(x, n); return; }
  for (int64_t i = 0; i < n; i += L) vstore(x + i, small_stages(vload<V>(x + i)));
  // Stages h = L, 2L, ...: rows of L elements, two stages per sweep. In row units the
  // block has n/L rows; stage h elements = h/L rows.
  const int64_t rows = n / L;
  int64_t h = 1;
  while (h < rows) {
    const bool two = 2 * h < rows;
    sweep(x, rows, h, two, L, L);
    h *= two ? 4 : 2;
  }
}

template <typename F>
void parallel_range(int64_t count, int threads, F&& body) {
  int nth = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, count)));
  if (nth == 1) { body(0, count); return; }
  std::vector<std::thread> pool;
  pool.reserve(nth - 1);
  for (int t = 1; t < nth; ++t) {
    const int64_t a = count * t / nth, b = count * (t + 1) / nth;
    pool.emplace_back([&body, a, b] { body(a, b); });
  }
  body(0, count / nth);
  for (auto& th : pool) th.join();
}

template <typename T>
void fwht(T* x, int64_t rows, int64_t d, int threads) {
  if (d < 2 || rows < 1) return;
  const int64_t cache_elems = (256 * 1024) / static_cast<int64_t>(sizeof(T));
  const int64_t B = std::min<int64_t>(d, cache_elems);
  const int64_t per_row = d / B;
  parallel_range(rows * per_row, threads, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) fwht_block(x + i * B, B);
  });
  if (per_row == 1) return;
  const int64_t m = per_row;  // rows of the B-wide matrix: stages B, 2B, ... across them
  const int64_t W = std::min<int64_t>(B, std::max<int64_t>(64 / sizeof(T) * 4, cache_elems / m));
  const int64_t strips = B / W;
  for (int64_t r = 0; r < rows; ++r) {
    T* base = x + r * d;
    parallel_range(strips, threads, [&](int64_t a, int64_t b) {
      for (int64_t s = a; s < b; ++s) {
        T* col = base + s * W;
        int64_t h = 1;
        while (h < m) {
          const bool two = 2 * h < m;
          sweep(col, m, h, two, B, W);
          h *= two ? 4 : 2;
        }
      }
    });
  }
}

// THC's grid encoding fused into one pass (compressors/thc.py RotatedGrid.encode and
// table_encode): v = clamp(clamp(x, −t, t) + t)·s, 0, g), j = lut[int(v)],
// frac = (v − T[j]) / gap[j], z = j + (noise < frac). The same float32 operations in the
// same order as the torch reference, so z equals its result exactly; `noise` is the
// caller's torch.rand draw (the same generator stream on both paths).
void thc_encode(const float* x, const float* noise, int64_t n, int threads, float t, float s,
                float g, const float* table, const float* gaps, const int32_t* lut,
                int32_t* z) {
  parallel_range((n + BLOCK - 1) / BLOCK, threads, [&](int64_t b0, int64_t b1) {
    const int64_t lo = b0 * BLOCK, hi = std::min(n, b1 * BLOCK);
    for (int64_t i = lo; i < hi; ++i) {
      float v = std::min(std::max(x[i], -t), t);
      v = v + t;
      v = v * s;
      v = std::min(std::max(v, 0.0f), g);
      const int32_t j = lut[static_cast<int32_t>(v)];
      const float frac = (v - table[j]) / gaps[j];
      z[i] = j + (noise[i] < frac ? 1 : 0);
    }
  });
}

}  // namespace

extern "C" {

int gc_abi_version() { return 1; }

void gc_advise_huge(void* p, int64_t bytes) { advise_huge(p, static_cast<size_t>(bytes)); }

void gc_thc_encode_f32(const float* x, const float* noise, int64_t n, int threads, float t,
                       float s, float g, const float* table, const float* gaps,
                       const int32_t* lut, int32_t* z) {
  thc_encode(x, noise, n, threads, t, s, g, table, gaps, lut, z);
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
                                 int64_t* total) {                                            \
    return select_begin<T>(x, map, n, threads, t, strict, values, reserve, total);            \
  }                                                                                           \
  void gc_select_take_##SUFFIX(void* h, int64_t* idx, int32_t* idx32, T* val) {              \
    select_take<T>(h, idx, idx32, val);                                                       \
  }                                                                                           \
  void gc_fwht_##SUFFIX(T* x, int64_t rows, int64_t d, int threads) {                         \
    fwht<T>(x, rows, d, threads);                                                             \
  }

GC_DEFINE(f32, float)
GC_DEFINE(f64, double)

}  // extern "C"
