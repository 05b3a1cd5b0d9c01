// Kernels for THC (compressors/thc.py): the fast Walsh–Hadamard transform and the fused
// grid encoding. Same conventions as kernels.cpp (plain C ABI, loaded with ctypes).

#include "common.h"

namespace {

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

void gc_thc_encode_f32(const float* x, const float* noise, int64_t n, int threads, float t,
                       float s, float g, const float* table, const float* gaps,
                       const int32_t* lut, int32_t* z) {
  thc_encode(x, noise, n, threads, t, s, g, table, gaps, lut, z);
}

void gc_fwht_f32(float* x, int64_t rows, int64_t d, int threads) { fwht<float>(x, rows, d, threads); }
void gc_fwht_f64(double* x, int64_t rows, int64_t d, int threads) { fwht<double>(x, rows, d, threads); }

}  // extern "C"
