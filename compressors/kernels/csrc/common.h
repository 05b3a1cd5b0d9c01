// Shared by the native kernel sources (kernels.cpp, thc_kernels.cpp): threading,
// vector types and huge-page advice. Everything is in an anonymous namespace: each
// source gets its own copy and the library exports only the extern "C" entry points.
#pragma once

#include <algorithm>
#include <cstdlib>
#include <exception>
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
#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__AVX__) || defined(__BMI2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t BLOCK = 1 << 15;
constexpr int LANES = 8;

// f(part) for every part in [0, nth), on up to nth threads. Built with OpenMP (the
// default where the compiler has it), the parts run in an OpenMP team: the library then
// links libgomp.so.1, which resolves to the copy torch has already loaded, so the parts
// run on torch's own worker threads instead of beside them (separate threads compete for
// the cores with torch's workers while those spin after torch's last parallel op), and
// no thread is created per call. Otherwise std::threads. An exception thrown by any part
// is rethrown here, after every part has finished.
template <typename F>
void run_parts(int nth, F&& f) {
  if (nth <= 1) {
    f(0);
    return;
  }
  std::exception_ptr error;
  std::mutex error_mutex;
  auto guarded = [&](int part) {
    try {
      f(part);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
    }
  };
#if defined(_OPENMP)
#pragma omp parallel num_threads(nth)
  {
    // a team smaller than asked (a thread limit, nesting): each thread takes more parts
    const int got = omp_get_num_threads();
    for (int part = omp_get_thread_num(); part < nth; part += got) guarded(part);
  }
#else
  std::vector<std::thread> pool;
  pool.reserve(nth - 1);
  for (int t = 1; t < nth; ++t) pool.emplace_back([&guarded, t] { guarded(t); });
  guarded(0);
  for (auto& th : pool) th.join();
#endif
  if (error) std::rethrow_exception(error);
}

template <typename F>
void parallel_blocks(int64_t n, int threads, F&& body) {
  // body(first_block, last_block, part) over contiguous ranges of blocks, one per part.
  const int64_t blocks = (n + BLOCK - 1) / BLOCK;
  const int nth = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, blocks)));
  run_parts(nth, [&](int t) { body(blocks * t / nth, blocks * (t + 1) / nth, t); });
}

template <typename F>
void parallel_range(int64_t count, int threads, F&& body) {
  const int nth = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, count)));
  run_parts(nth, [&](int t) { body(count * t / nth, count * (t + 1) / nth); });
}

// Per-element work over consecutive groups (a layout's tensors, QSGD's buckets): [0, n)
// in blocks across threads, each block cut where a group ends; run(g, a, b) gets the
// pieces [a, b) of group g in order. off[0..groups]: the group starts and the end.
template <typename F>
void parallel_group_runs(int64_t n, const int64_t* off, int64_t groups, int threads, F&& run) {
  parallel_range((n + BLOCK - 1) / BLOCK, threads, [&](int64_t b0, int64_t b1) {
    const int64_t lo = b0 * BLOCK, hi = std::min(n, b1 * BLOCK);
    int64_t g = std::upper_bound(off, off + groups + 1, lo) - off - 1;
    for (int64_t a = lo; a < hi; ++g) {
      const int64_t b = std::min(hi, off[g + 1]);
      run(g, a, b);
      a = b;
    }
  });
}

// Four lanes of doubles (GCC/Clang vector extensions: AVX2 registers where the CPU has
// them, pairs of SSE2 registers or scalars elsewhere). Float inputs are widened exactly.
typedef double v4d __attribute__((vector_size(32)));
typedef int64_t v4l __attribute__((vector_size(32)));
typedef uint64_t v4u __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));

inline v4d load4(const float* p) {
#if defined(__AVX__)
  // as widen8 below: the intrinsic keeps GCC from splitting the conversion
  return reinterpret_cast<v4d>(_mm256_cvtps_pd(_mm_loadu_ps(p)));
#else
  v4f f;
  std::memcpy(&f, p, sizeof f);
  return __builtin_convertvector(f, v4d);
#endif
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

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

inline v8f vabs8(v8f a) {
  const v8i sign_off = {INT32_MAX, INT32_MAX, INT32_MAX, INT32_MAX,
                        INT32_MAX, INT32_MAX, INT32_MAX, INT32_MAX};
  return (v8f)((v8i)a & sign_off);
}
inline v8f load8(const float* p) { v8f v; std::memcpy(&v, p, sizeof v); return v; }

// Lanes 0-3 and 4-7 of a float32 vector widened to double. With AVX the two conversions
// are written as intrinsics: GCC's lowering of the generic shuffle + convert (tuned for
// Zen 1) splits them into 128-bit pieces and shuffles, about twice the instructions.
// The same values either way.
inline void widen8(v8f a, v4d& lo, v4d& hi) {
#if defined(__AVX__)
  const __m256 v = reinterpret_cast<__m256>(a);
  lo = reinterpret_cast<v4d>(_mm256_cvtps_pd(_mm256_castps256_ps128(v)));
  hi = reinterpret_cast<v4d>(_mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
#else
  lo = __builtin_convertvector(__builtin_shufflevector(a, a, 0, 1, 2, 3), v4d);
  hi = __builtin_convertvector(__builtin_shufflevector(a, a, 4, 5, 6, 7), v4d);
#endif
}

// The counter-based random stream shared by THC (thc_kernels.cpp) and DGC/DRAGONN's
// threshold sample (kernels.cpp); compressors/counter_stream.py counter_hash is its torch twin.
// h(i) = mix(mix(lo32(i) ^ k0) ^ k1 ^ hi32(i)) for the seed words (k0, k1), mix = the
// "lowbias32" finaliser (both multipliers < 2^31: the torch version's int64 products
// never overflow).
constexpr uint32_t HASH_MUL1 = 0x21f0aaadu;
constexpr uint32_t HASH_MUL2 = 0x735a2d97u;

// U: a 32-bit word, or a vector of them (thc_kernels.cpp hashes 8 lanes at once).
template <typename U>
inline U mix32(U x) {
  x ^= x >> 16;
  x *= HASH_MUL1;
  x ^= x >> 15;
  x *= HASH_MUL2;
  x ^= x >> 15;
  return x;
}

inline uint32_t counter_hash(uint64_t i, uint32_t k0, uint32_t k1) {
  const uint32_t a = mix32(static_cast<uint32_t>(i) ^ k0);
  return mix32(a ^ k1 ^ static_cast<uint32_t>(i >> 32));
}

// Bit l set where lane l of a comparison result is true.
inline int mask8(v8i m) {
#if defined(__AVX__)
  return _mm256_movemask_ps((__m256)m);
#else
  int r = 0;
  for (int l = 0; l < 8; ++l) r |= (m[l] != 0) << l;
  return r;
#endif
}
template <typename T> struct Vec;
template <> struct Vec<float> { typedef v8f type; static constexpr int L = 8; };
template <> struct Vec<double> { typedef v4d type; static constexpr int L = 4; };

template <typename V>
inline V vload(const void* p) { V v; std::memcpy(&v, p, sizeof v); return v; }
template <typename V>
inline void vstore(void* p, V v) { std::memcpy(p, &v, sizeof v); }

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
}  // namespace
