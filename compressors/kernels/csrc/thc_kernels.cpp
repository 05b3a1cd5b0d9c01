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

// Stages 1, 2, 4, ... (in row units) over m rows B elements apart, W wide, two stages per
// sweep: the cross-block stages of one column strip (rows B apart), or a block's stages
// from L on (rows of L elements, B = W = L).
template <typename T>
inline void strip_stages(T* col, int64_t m, int64_t B, int64_t W) {
  int64_t h = 1;
  while (h < m) {
    const bool two = 2 * h < m;
    sweep(col, m, h, two, B, W);
    h *= two ? 4 : 2;
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
  strip_stages(x, n / L, L, L);
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
      for (int64_t s = a; s < b; ++s) strip_stages(base + s * W, m, B, W);
    });
  }
}

// ---------------------------------------------------------------------------------------
// THC's counter-based random stream (compressors/counter_stream.py counter_hash: the torch
// fallback computes the same function with int64 tensor ops). Element i of the stream keyed by a
// 64-bit seed (k0 = low word, k1 = high word) is
//   h(i) = mix(mix(lo32(i) ^ k0) ^ k1 ^ hi32(i)),
// mix = the "lowbias32" finaliser x ^= x>>16; x *= 0x21f0aaad; x ^= x>>15;
// x *= 0x735a2d97; x ^= x>>15 (both multipliers < 2^31, so the torch version's int64
// products never overflow). Derived variables: the rounding noise u_i = (h(i) >> 8)·2^-24
// (24 random bits, exact in float32, in [0, 1)) and the Rademacher sign s_i = −1 where
// bit (i mod 32) of h(⌊i/32⌋) is set (32 signs per hash). Nothing here depends on the
// thread count or on how the range is split.
// The loops run on 8 lanes of 32-bit words (vector extensions: AVX2 where the CPU has
// it); every range starts at a multiple of BLOCK, so 8 consecutive indices share hi32(i).
// (mix32 and the scalar counter_hash live in common.h: DGC's sample uses them too.)
typedef uint32_t v8u __attribute__((vector_size(32)));

// h(i), ..., h(i + 7) for i a multiple of 8.
inline v8u counter_hash8(uint64_t i, uint32_t k0, uint32_t k1) {
  const v8u lane = {0, 1, 2, 3, 4, 5, 6, 7};
  const v8u lo = static_cast<uint32_t>(i) + lane;
  return mix32(mix32(lo ^ k0) ^ (k1 ^ static_cast<uint32_t>(i >> 32)));
}

inline float hash_noise(uint32_t h) {  // (h >> 8)·2^-24, exact
  return static_cast<float>(static_cast<int32_t>(h >> 8)) * 0x1p-24f;
}
inline v8f hash_noise(v8u h) {
  return __builtin_convertvector((v8i)(h >> 8), v8f) * 0x1p-24f;
}

// The sign stream: s_i = −1 where bit (i mod 32) of h(⌊i/32⌋) is set (one hash per 32
// signs; the sign bit to xor in: 0x80000000 or 0).
inline uint32_t sign_mask(uint64_t i, uint32_t k0, uint32_t k1) {
  return ((counter_hash(i >> 5, k0, k1) >> (i & 31)) & 1u) << 31;
}
inline v8u sign_mask8(uint64_t i, uint32_t k0, uint32_t k1) {  // i % 8 == 0
  const v8u lane = {0, 1, 2, 3, 4, 5, 6, 7};
  const uint32_t h = counter_hash(i >> 5, k0, k1);
  return ((h >> (static_cast<uint32_t>(i & 31) + lane)) & 1u) << 31;
}

inline float flip(float v, uint32_t mask) {  // v·s by the sign bit: exactly v * s
  uint32_t b;
  std::memcpy(&b, &v, sizeof b);
  b ^= mask;
  std::memcpy(&v, &b, sizeof v);
  return v;
}
inline v8f flip(v8f v, v8u mask) { return (v8f)((v8u)v ^ mask); }

// f(vector start i) on the multiples of 8 in [lo, hi), g(i) on the rest (lo % 8 == 0).
template <typename F8, typename F1>
inline void lanes8(int64_t lo, int64_t hi, F8&& f8, F1&& f1) {
  int64_t i = lo;
  for (; i + 8 <= hi; i += 8) f8(i);
  for (; i < hi; ++i) f1(i);
}

// The stream itself, materialised (tests; signs on the CPU when someone asks for them):
// kind 0: noise u_i, kind 1: signs ±1.0f, for i in [start, start + n); start % 8 == 0
// is not required (the scalar path handles any start).
void rng_fill(int64_t start, int64_t n, uint32_t k0, uint32_t k1, int kind, float* out,
              int threads) {
  parallel_range((n + BLOCK - 1) / BLOCK, threads, [&](int64_t b0, int64_t b1) {
    const int64_t lo = b0 * BLOCK, hi = std::min(n, b1 * BLOCK);
    const bool vec = start % 8 == 0;
    for (int64_t i = lo; i < hi; ++i) {
      if (vec && i % 8 == 0 && i + 8 <= hi) {
        const uint64_t at = static_cast<uint64_t>(start + i);
        const v8f v = kind == 0 ? hash_noise(counter_hash8(at, k0, k1))
                                : flip(v8f{1, 1, 1, 1, 1, 1, 1, 1}, sign_mask8(at, k0, k1));
        vstore(out + i, v);
        i += 7;
        continue;
      }
      const uint64_t at = static_cast<uint64_t>(start + i);
      out[i] = kind == 0 ? hash_noise(counter_hash(at, k0, k1))
                         : flip(1.0f, sign_mask(at, k0, k1));
    }
  });
}

// In place x[i] ·= s_i for i < n (the decode's D after the inverse transform).
void thc_apply_signs(float* x, int64_t n, uint32_t k0, uint32_t k1, int threads) {
  parallel_range((n + BLOCK - 1) / BLOCK, threads, [&](int64_t b0, int64_t b1) {
    const int64_t lo = b0 * BLOCK, hi = std::min(n, b1 * BLOCK);
    lanes8(lo, hi,
           [&](int64_t i) { vstore(x + i, flip(load8(x + i), sign_mask8(i, k0, k1))); },
           [&](int64_t i) { x[i] = flip(x[i], sign_mask(i, k0, k1)); });
  });
}

// thc_encode with the noise generated in the pass (u_i from the stream keyed by k0, k1)
// instead of read from a tensor. Writes z (int32) and/or the table values T[z] as the
// sum's integer type (value_bytes 1: uint8, 4: int32, 8: int64), either may be null;
// counts #{|x| > t} (the clamped count).
// Scalar element: the same float32 operations as the torch path (thc.py table_encode).
// Tables of at most 16 values (b ≤ 4, THC's default) also run 8 lanes at a time, with the
// interval found by comparisons instead of the lookups: the table holds increasing
// integers and lut = interval_lut(table), so lut[int(v)] = #{1 ≤ k ≤ K−2 : T[k] ≤ v} for
// v ≥ 0, and T[j], T[j+1] − T[j] (exact integer differences) are the same floats: the
// same bits.
// With g ≤ 31 (THC's default g = 30) the interval of v is a function of c = int(v) < 32:
// the word packed[c] = T[j] | T[j+1] << 8 | j << 16 (j = lut[c]) is found for 8 lanes by
// four in-register permutes (AVX2), cheaper than the comparisons.
struct EncodeArgs {
  float t, s, g;
  const float* table;
  int K;
  const float* gaps;
  const int32_t* lut;
  uint32_t k0, k1;
  int32_t* z;
  void* values;
  int value_bytes;
  bool use_packed = false;
  alignas(32) int32_t packed[32] = {};

  EncodeArgs(float t_, float s_, float g_, const float* table_, int K_, const float* gaps_,
             const int32_t* lut_, uint32_t k0_, uint32_t k1_, int32_t* z_, void* values_,
             int value_bytes_)
      : t(t_), s(s_), g(g_), table(table_), K(K_), gaps(gaps_), lut(lut_), k0(k0_), k1(k1_),
        z(z_), values(value_bytes_ ? values_ : nullptr), value_bytes(value_bytes_) {
#if defined(__AVX2__)
    const int top = static_cast<int>(g);
    use_packed = g >= 1 && g <= 31 && static_cast<float>(top) == g && K >= 2;
    for (int c = 0; use_packed && c <= top; ++c) {
      const int32_t j = lut[c];
      const float lo = table[j], hi = table[j + 1];
      if (j < 0 || j > K - 2 || lo != static_cast<float>(static_cast<int>(lo)) ||
          hi != static_cast<float>(static_cast<int>(hi)) || lo < 0 || hi > 255) {
        use_packed = false;
        break;
      }
      packed[c] = static_cast<int32_t>(lo) | static_cast<int32_t>(hi) << 8 | j << 16;
    }
#endif
  }
};

template <typename V>
inline void store_values(V* values, int64_t i, v8i val) {
  if constexpr (sizeof(V) == 4) {
    vstore(values + i, val);
  } else if constexpr (sizeof(V) == 1) {
    typedef uint8_t v8b __attribute__((vector_size(8)));
    vstore(values + i, __builtin_convertvector(val, v8b));
  } else {
    for (int l = 0; l < 8; ++l) values[i + l] = static_cast<V>(val[l]);
  }
}

// Encodes p[0 .. len) = the elements i0 .. i0 + len of the rotated vector; returns the
// clamped count among them.
template <typename V>
int64_t encode_run(const float* p, int64_t i0, int64_t len, const EncodeArgs& e) {
  const float t = e.t, s = e.s, g = e.g;
  const float* table = e.table;
  const int K = e.K;
  int32_t* z = e.z;
  V* values = static_cast<V*>(e.values);
  int64_t count = 0;
  auto one = [&](int64_t k) {
    const int64_t i = i0 + k;
    const float xi = p[k];
    count += std::fabs(xi) > t;
    float v = std::min(std::max(xi, -t), t);
    v = v + t;
    v = v * s;
    v = std::min(std::max(v, 0.0f), g);
    if (!(v >= 0.0f)) v = 0.0f;  // NaN (non-finite input): never index the table with it
    const int32_t j = e.lut[static_cast<int32_t>(v)];
    const float frac = (v - table[j]) / e.gaps[j];
    const int32_t zz = j + (hash_noise(counter_hash(i, e.k0, e.k1)) < frac ? 1 : 0);
    if (z) z[i] = zz;
    if (values) values[i] = static_cast<V>(table[zz]);
  };
  if (!(e.use_packed || (K >= 2 && K <= 16)) || i0 % 8 != 0) {
    for (int64_t k = 0; k < len; ++k) one(k);
    return count;
  }
#if defined(__AVX2__)
  __m256i pk[4];
  for (int r = 0; r < 4; ++r) pk[r] = vload<__m256i>(e.packed + 8 * r);
#endif
  const v8f tv = t - v8f{}, ntv = -t - v8f{}, sv = s - v8f{}, gv = g - v8f{};
  const v8f zero = v8f{};
  v8i cnt = v8i{};
  lanes8(0, len, [&](int64_t k) {
    const int64_t i = i0 + k;
    const v8f xv = load8(p + k);
    cnt -= (v8i)(vabs8(xv) > tv);
    v8f v = xv < ntv ? ntv : xv;  // std::max(x, −t)
    v = tv < v ? tv : v;          // std::min(·, t)
    v = v + tv;
    v = v * sv;
    v = v < zero ? zero : v;
    v = gv < v ? gv : v;
    v8i j = v8i{};
    v8f low, up;
#if defined(__AVX2__)
    if (e.use_packed) {
      const v8i c = __builtin_convertvector(v, v8i);  // int(v), 0 ≤ c ≤ g ≤ 31
      const v8i a = (v8i)_mm256_permutevar8x32_epi32(pk[0], (__m256i)c);
      const v8i b = (v8i)_mm256_permutevar8x32_epi32(pk[1], (__m256i)c);
      const v8i d = (v8i)_mm256_permutevar8x32_epi32(pk[2], (__m256i)c);
      const v8i f = (v8i)_mm256_permutevar8x32_epi32(pk[3], (__m256i)c);
      const v8i upper8 = (c & 8) != 0;
      const v8i w = c > 15 ? (upper8 ? f : d) : (upper8 ? b : a);
      low = __builtin_convertvector(w & 255, v8f);
      up = __builtin_convertvector((w >> 8) & 255, v8f);
      j = w >> 16;
    } else
#endif
    {
      low = table[0] - v8f{};
      up = table[1] - v8f{};
      for (int q = 1; q <= K - 2; ++q) {
        const v8i m = (v8i)(table[q] - v8f{} <= v);
        j -= m;
        low = m ? table[q] - v8f{} : low;
        up = m ? table[q + 1] - v8f{} : up;
      }
    }
    const v8f frac = (v - low) / (up - low);
    const v8i take = (v8i)(hash_noise(counter_hash8(i, e.k0, e.k1)) < frac);
    if (z) vstore(z + i, j - take);
    if (values) store_values(values, i, __builtin_convertvector(take ? up : low, v8i));
  }, one);
  for (int l = 0; l < 8; ++l) count += cnt[l];
  return count;
}

inline int64_t encode_any(const float* p, int64_t i0, int64_t len, const EncodeArgs& e) {
  switch (e.value_bytes) {
    case 4: return encode_run<int32_t>(p, i0, len, e);
    case 8: return encode_run<int64_t>(p, i0, len, e);
    default: return encode_run<uint8_t>(p, i0, len, e);  // also: no values
  }
}

int64_t thc_encode_hash(const float* x, int64_t n, int threads, const EncodeArgs& e) {
  const int64_t blocks = (n + BLOCK - 1) / BLOCK;
  std::vector<int64_t> clamped(static_cast<size_t>(blocks), 0);
  parallel_range(blocks, threads, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t lo = b * BLOCK, hi = std::min(n, lo + BLOCK);
      clamped[static_cast<size_t>(b)] = encode_any(x + lo, lo, hi - lo, e);
    }
  });
  int64_t total = 0;
  for (int64_t c : clamped) total += c;
  return total;
}

// The unnormalised FWHT of fwht<float> above (the same passes, the same butterflies in the
// same order: the same bits) with hooks into its passes, for THC's fused steps:
//   fill(out, lo, hi): writes elements lo .. hi of the input into a block just before the
//     block pass transforms it in cache (no separate pass to prepare the input);
//   finish(slot, p, i0, len): called on every run p[0 .. len) = elements i0 .. i0 + len
//     of the result right after its last stage, while it is in cache: per column-strip
//     row in the strip pass (slot = strip), or on the whole vector when it is one block
//     (slot 0). Slots are finished by one thread each; there are fused_slots(d) of them.
inline int64_t fused_block(int64_t d) {
  return std::min<int64_t>(d, (256 * 1024) / static_cast<int64_t>(sizeof(float)));
}
inline int64_t fused_strip_width(int64_t d) {
  const int64_t cache_elems = (256 * 1024) / static_cast<int64_t>(sizeof(float));
  const int64_t B = fused_block(d), m = d / B;
  return std::min<int64_t>(B, std::max<int64_t>(64 / sizeof(float) * 4, cache_elems / m));
}
inline int64_t fused_slots(int64_t d) {
  return d / fused_block(d) == 1 ? 1 : fused_block(d) / fused_strip_width(d);
}

template <typename Fill, typename Finish>
void fused_fwht(float* buf, int64_t d, int threads, Fill&& fill, Finish&& finish) {
  const int64_t B = fused_block(d);
  const int64_t per_row = d / B;
  parallel_range(per_row, threads, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) {
      float* blk = buf + i * B;
      fill(blk, i * B, (i + 1) * B);
      if (B > 1) fwht_block(blk, B);
      if (per_row == 1) finish(int64_t(0), blk, int64_t(0), B);
    }
  });
  if (per_row == 1) return;
  const int64_t m = per_row;  // as in fwht(): stages B, 2B, ... across the rows
  const int64_t W = fused_strip_width(d);
  const int64_t strips = B / W;
  parallel_range(strips, threads, [&](int64_t a, int64_t b) {
    for (int64_t s = a; s < b; ++s) {
      float* col = buf + s * W;
      strip_stages(col, m, B, W);
      for (int64_t r = 0; r < m; ++r) finish(s, col + r * B, r * B + s * W, W);
    }
  });
}

// THC's rotation: the padded input (x[i] / norm)·s_i (zeros past n) written inside the
// first pass, transformed into buf[0 .. d); with `enc`, each run is encoded (encode_run)
// in the last pass, and buf is a workspace. Returns the clamped count (0 without `enc`).
int64_t thc_rotate(const float* x, int64_t n, int64_t d, float norm, uint32_t sk0, uint32_t sk1,
                   float* buf, int threads, const EncodeArgs* enc) {
  auto fill = [&](float* out, int64_t lo, int64_t hi) {
    const int64_t mid = std::max(lo, std::min(hi, n));
    if (lo % 8 == 0) {
      lanes8(lo, mid,
             [&](int64_t i) {
               vstore(out + (i - lo), flip(load8(x + i) / norm, sign_mask8(i, sk0, sk1)));
             },
             [&](int64_t i) { out[i - lo] = flip(x[i] / norm, sign_mask(i, sk0, sk1)); });
    } else {
      for (int64_t i = lo; i < mid; ++i)
        out[i - lo] = flip(x[i] / norm, sign_mask(i, sk0, sk1));
    }
    if (hi > mid) std::memset(out + (mid - lo), 0, static_cast<size_t>(hi - mid) * sizeof(float));
  };
  std::vector<int64_t> counts(static_cast<size_t>(fused_slots(d)), 0);
  fused_fwht(buf, d, threads, fill, [&](int64_t slot, float* p, int64_t i0, int64_t len) {
    if (enc) counts[static_cast<size_t>(slot)] += encode_any(p, i0, len, *enc);
  });
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  return total;
}

// THC's decompression (thc.py RotatedGrid.decode with a scalar count, no lost chunks):
// out[i] = float(total[i])·a + b (thc.py _affine: a = scale/divisor, b = offset·count /
// divisor, both rounded to float32 as torch rounds a python scalar) written inside the
// first pass, the FWHT, and the sign flip of the kept elements i < n inside the last.
template <typename I>
void thc_decode(const I* total, int64_t d, int64_t n, float a, float b, uint32_t sk0,
                uint32_t sk1, float* out, int threads) {
  auto fill = [&](float* o, int64_t lo, int64_t hi) {
    int64_t i = lo;
    if constexpr (sizeof(I) <= 4) {  // 8 lanes: the same conversion, product and sum
      typedef I v8s __attribute__((vector_size(8 * sizeof(I))));
      const v8f av = a - v8f{}, bv = b - v8f{};
      for (; i + 8 <= hi; i += 8) {
        const v8f v = __builtin_convertvector(vload<v8s>(total + i), v8f) * av;
        vstore(o + (i - lo), v + bv);
      }
    }
    for (; i < hi; ++i) {
      float v = static_cast<float>(total[i]) * a;
      o[i - lo] = v + b;
    }
  };
  fused_fwht(out, d, threads, fill, [&](int64_t, float* p, int64_t i0, int64_t len) {
    const int64_t keep = std::min(len, n - i0);
    if (keep <= 0) return;
    if (i0 % 8 == 0) {
      lanes8(0, keep,
             [&](int64_t k) { vstore(p + k, flip(load8(p + k), sign_mask8(i0 + k, sk0, sk1))); },
             [&](int64_t k) { p[k] = flip(p[k], sign_mask(i0 + k, sk0, sk1)); });
    } else {
      for (int64_t k = 0; k < keep; ++k) p[k] = flip(p[k], sign_mask(i0 + k, sk0, sk1));
    }
  });
}

// THC's uniform (Algorithm 1) quantisation with the stream's noise, as the torch path
// computes it: u = clamp((x − lo) / step, 0, L); level = min(floor(u + noise), L).
void thc_uniform_encode(const float* x, int64_t n, int threads, float lo, float step,
                        float levels, uint32_t k0, uint32_t k1, uint8_t* out) {
  parallel_range((n + BLOCK - 1) / BLOCK, threads, [&](int64_t b0, int64_t b1) {
    const int64_t a = b0 * BLOCK, b = std::min(n, b1 * BLOCK);
    const v8f lov = lo - v8f{}, stepv = step - v8f{}, lev = levels - v8f{}, zero = v8f{};
    lanes8(a, b,
           [&](int64_t i) {
             v8f u = (load8(x + i) - lov) / stepv;
             u = u < zero ? zero : u;
             u = lev < u ? lev : u;
             u = u + hash_noise(counter_hash8(i, k0, k1));
             // floor of a non-negative float below 2^24: truncation, then the min
             v8i f = __builtin_convertvector(u, v8i);
             u = __builtin_convertvector(f, v8f);
             u = lev < u ? lev : u;
             const v8i q = __builtin_convertvector(u, v8i);
             for (int l = 0; l < 8; ++l) out[i + l] = static_cast<uint8_t>(q[l]);
           },
           [&](int64_t i) {
             float u = (x[i] - lo) / step;
             u = std::min(std::max(u, 0.0f), levels);
             u = u + hash_noise(counter_hash(i, k0, k1));
             u = std::floor(u);
             u = std::min(u, levels);
             out[i] = static_cast<uint8_t>(u);
           });
  });
}


// QSGD's and TernGrad's stochastic levels (compressors/quantize.py, stochastic_levels):
// for x_i in group g (elements [off[g], off[g + 1])),
//   a = min(|x_i|, bound[g]) · inv[g],  f = floor(a),  l = min(f + (u_i < a − f), s),
//   out_i = l, −l or 0 by the sign of x_i,
// u_i the counter stream's noise at position i; no bound when `bound` is null. One IEEE
// float32 operation per step, as the torch twin does them, so the same bits. One pass:
// no |x|, scaled, noise, floor or sign tensors. 0 ≤ a < 2^31 (the caller keeps s ≤ 2^24),
// so floor is a truncation. out: int8, int16 or int32.
template <typename O>
void stochastic_levels(const float* x, int64_t n, const int64_t* off, int64_t groups,
                       const float* inv, const float* bound, float s, uint32_t k0, uint32_t k1,
                       O* out, int threads) {
  parallel_group_runs(n, off, groups, threads, [&](int64_t g, int64_t i, int64_t end) {
    const float iv = inv[g];
    const float bd = bound ? bound[g] : std::numeric_limits<float>::infinity();
    auto one = [&](int64_t j) {
      float a = std::fabs(x[j]);
      a = bd < a ? bd : a;
      a = a * iv;
      const float f = static_cast<float>(static_cast<int32_t>(a));
      float l = f + (hash_noise(counter_hash(j, k0, k1)) < a - f ? 1.0f : 0.0f);
      l = s < l ? s : l;
      const int32_t q = static_cast<int32_t>(l);
      out[j] = static_cast<O>(x[j] > 0 ? q : (x[j] < 0 ? -q : 0));
    };
    for (; i < end && (i & 7); ++i) one(i);
    const v8f bdv = bd - v8f{}, ivv = iv - v8f{}, sv = s - v8f{}, zero = v8f{};
    for (; i + 8 <= end; i += 8) {  // i % 8 == 0: counter_hash8's lanes
      const v8f v = load8(x + i);
      v8f a = vabs8(v);
      a = bdv < a ? bdv : a;
      a = a * ivv;
      const v8f f = __builtin_convertvector(__builtin_convertvector(a, v8i), v8f);
      const v8i take = (v8i)(hash_noise(counter_hash8(i, k0, k1)) < a - f);  // −1 or 0
      v8f l = f - __builtin_convertvector(take, v8f);  // f + 1 where taken: the same bits
      l = sv < l ? sv : l;
      const v8i q = __builtin_convertvector(l, v8i);
      const v8i r = v > zero ? q : (v < zero ? -q : v8i{});
      for (int k = 0; k < 8; ++k) out[i + k] = static_cast<O>(r[k]);
    }
    for (; i < end; ++i) one(i);
  });
}

}  // namespace

extern "C" {

void gc_fwht_f32(float* x, int64_t rows, int64_t d, int threads) { fwht<float>(x, rows, d, threads); }
void gc_fwht_f64(double* x, int64_t rows, int64_t d, int threads) { fwht<double>(x, rows, d, threads); }

// Counter-hash stream (compressors/kernels/cpu_thc.py declares these).
void gc_thc_rng_fill(int64_t start, int64_t n, uint32_t k0, uint32_t k1, int kind, float* out,
                     int threads) {
  rng_fill(start, n, k0, k1, kind, out, threads);
}
void gc_thc_apply_signs_f32(float* x, int64_t n, uint32_t k0, uint32_t k1, int threads) {
  thc_apply_signs(x, n, k0, k1, threads);
}
// value_bytes: 0 (no values), 1 (uint8), 4 (int32), 8 (int64).
// table_size values in `table` (increasing integers), gaps[j] = table[j+1] − table[j],
// lut = interval_lut(table). value_bytes: 0 (no values), 1 (uint8), 4 (int32), 8 (int64).
int64_t gc_thc_encode_hash_f32(const float* x, int64_t n, int threads, float t, float s, float g,
                               const float* table, int table_size, const float* gaps,
                               const int32_t* lut, uint32_t k0, uint32_t k1, int32_t* z,
                               void* values, int value_bytes) {
  const EncodeArgs e(t, s, g, table, table_size, gaps, lut, k0, k1, z, values, value_bytes);
  return thc_encode_hash(x, n, threads, e);
}
// The padded RHT input, transformed (unnormalised FWHT) into buf[0 .. d).
void gc_thc_rotate_f32(const float* x, int64_t n, int64_t d, float norm, uint32_t sk0,
                       uint32_t sk1, float* buf, int threads) {
  thc_rotate(x, n, d, norm, sk0, sk1, buf, threads, nullptr);
}
// Decompression of summed values (value_bytes 1: uint8, 4: int32, 8: int64) into out[0 .. d)
// (the kept elements i < n sign-flipped).
void gc_thc_decode_f32(const void* total, int value_bytes, int64_t d, int64_t n, float a,
                       float b, uint32_t sk0, uint32_t sk1, float* out, int threads) {
  switch (value_bytes) {
    case 4: thc_decode(static_cast<const int32_t*>(total), d, n, a, b, sk0, sk1, out, threads);
            break;
    case 8: thc_decode(static_cast<const int64_t*>(total), d, n, a, b, sk0, sk1, out, threads);
            break;
    default: thc_decode(static_cast<const uint8_t*>(total), d, n, a, b, sk0, sk1, out, threads);
  }
}
// Rotation and encoding in two passes over buf (a workspace); outputs as gc_thc_encode_hash_f32.
int64_t gc_thc_rotate_encode_f32(const float* x, int64_t n, int64_t d, float norm, uint32_t sk0,
                                 uint32_t sk1, float* buf, int threads, float t, float s,
                                 float g, const float* table, int table_size, const float* gaps,
                                 const int32_t* lut, uint32_t k0, uint32_t k1, int32_t* z,
                                 void* values, int value_bytes) {
  const EncodeArgs e(t, s, g, table, table_size, gaps, lut, k0, k1, z, values, value_bytes);
  return thc_rotate(x, n, d, norm, sk0, sk1, buf, threads, &e);
}
void gc_thc_uniform_encode_f32(const float* x, int64_t n, int threads, float lo, float step,
                               float levels, uint32_t k0, uint32_t k1, uint8_t* out) {
  thc_uniform_encode(x, n, threads, lo, step, levels, k0, k1, out);
}
void gc_stochastic_levels_f32(const float* x, int64_t n, const int64_t* off, int64_t groups,
                              const float* inv, const float* bound, float s, uint32_t k0,
                              uint32_t k1, void* out, int out_bytes, int threads) {
  switch (out_bytes) {
    case 1: stochastic_levels(x, n, off, groups, inv, bound, s, k0, k1,
                              static_cast<int8_t*>(out), threads); break;
    case 2: stochastic_levels(x, n, off, groups, inv, bound, s, k0, k1,
                              static_cast<int16_t*>(out), threads); break;
    default: stochastic_levels(x, n, off, groups, inv, bound, s, k0, k1,
                               static_cast<int32_t*>(out), threads);
  }
}

}  // extern "C"
