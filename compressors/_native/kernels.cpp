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

#include "common.h"

namespace {

struct Partial {
  double count = 0, sum = 0, sumsq = 0, max = -1, min = std::numeric_limits<double>::infinity();
  double nonzero = 0, log_sum = 0;
};


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

}  // namespace

extern "C" {

int gc_abi_version() { return 1; }

void gc_advise_huge(void* p, int64_t bytes) { advise_huge(p, static_cast<size_t>(bytes)); }

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
  }

GC_DEFINE(f32, float)
GC_DEFINE(f64, double)

}  // extern "C"
