// CPU kernels of the depth read (DESIGN.md §2.1): forward and backward of Q
// sites over N sources, optional prefix merge and fused output RMSNorm.
//
// Work is split over rows (the flattened leading dims) with at::parallel_for;
// all arithmetic on a row is vectorized over D with at::vec in the
// accumulation type acc_t (float, or double when the output dtype is fp64).
//
// Dtypes (DESIGN.md §2.5): the kernels are templates over acc_t. Every operand
// (each source, the prefix, the incoming gradient) is read in its own dtype one
// row at a time (load_row: rows already in acc_t are used in place, others are
// converted into a per-thread row buffer) and every output is written in its
// own dtype (store_row), so sources of mixed dtypes need no cast copies and one
// instantiation per accumulation type serves all mixes. The forward has two
// more, for sources that are all bf16 or all fp16: those convert in registers
// as they compute instead of through a row buffer.
//
// Determinism: every per-row result depends only on that row. The reductions
// over rows (grad of query_key and of the out-norm weight) write one double
// partial per fixed chunk of rows (the chunking depends on M only, not on the
// thread count) and the partials are summed in chunk order.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "../depth_attention.h"
#include "row_math.h"

namespace attnres {

const char* cpu_vector_isa() {
#if defined(CPU_CAPABILITY_AVX512)
  return "avx512";
#elif defined(CPU_CAPABILITY_AVX2)
  return "avx2";
#elif defined(__aarch64__)
  return "neon";
#else
  return "default";
#endif
}

namespace {

using at::vec::Vectorized;

// ---------------------------------------------------------------- operands in their own dtype

// The rows of one [M', D] operand: row p starts p * row_bytes bytes after data.
struct InRows {
  const char* data = nullptr;
  int64_t row_bytes = 0;
  at::ScalarType dtype = at::kFloat;
  explicit operator bool() const { return data != nullptr; }
};

struct OutRows {
  char* data = nullptr;
  int64_t row_bytes = 0;
  at::ScalarType dtype = at::kFloat;
};

// Rows of a tensor whose rows are `row_stride` elements apart (D for a contiguous one).
InRows in_rows(const at::Tensor& t, int64_t row_stride) {
  return {static_cast<const char*>(t.const_data_ptr()), row_stride * static_cast<int64_t>(t.element_size()),
          t.scalar_type()};
}

OutRows out_rows(at::Tensor& t, int64_t row_stride) {
  return {static_cast<char*>(t.mutable_data_ptr()), row_stride * static_cast<int64_t>(t.element_size()),
          t.scalar_type()};
}

template <typename T>
constexpr bool is_reduced_float = std::is_same_v<T, at::BFloat16> || std::is_same_v<T, at::Half>;

// `row` as acc_t: the row itself when src_t == acc_t, otherwise converted into `buf`.
template <typename src_t, typename acc_t>
inline const acc_t* row_as_acc(const src_t* row, acc_t* buf, int64_t n) {
  if constexpr (std::is_same_v<src_t, acc_t>) {
    return row;
  } else if constexpr (std::is_same_v<acc_t, float> && is_reduced_float<src_t>) {
    using bVec = Vectorized<src_t>;
    using fVec = Vectorized<float>;
    int64_t d = 0;
    for (; d + bVec::size() <= n; d += bVec::size()) {
      auto [lo, hi] = at::vec::convert_to_float<src_t>(bVec::loadu(row + d));
      lo.store(buf + d);
      hi.store(buf + d + fVec::size());
    }
    for (; d < n; ++d) buf[d] = static_cast<float>(row[d]);
    return buf;
  } else {  // into a double kernel (mixed with fp64); double into a float kernel cannot occur
    for (int64_t d = 0; d < n; ++d) buf[d] = static_cast<acc_t>(row[d]);
    return buf;
  }
}

// Row p of `x` as acc_t (in place or converted into `buf`).
template <typename acc_t>
inline const acc_t* load_row(const InRows& x, int64_t p, acc_t* buf, int64_t n) {
  const char* row = x.data + p * x.row_bytes;
  switch (x.dtype) {
    case at::kFloat:
      return row_as_acc(reinterpret_cast<const float*>(row), buf, n);
    case at::kDouble:
      return row_as_acc(reinterpret_cast<const double*>(row), buf, n);
    case at::kBFloat16:
      return row_as_acc(reinterpret_cast<const at::BFloat16*>(row), buf, n);
    default:
      return row_as_acc(reinterpret_cast<const at::Half*>(row), buf, n);
  }
}

// Copies bytes with non-temporal stores where the vector ISA has them: large
// outputs are written once and not read back soon, and streaming them skips
// the read-for-ownership of every destination line (for the backward, whose
// N source gradients are most of its traffic, that is a third fewer bytes).
inline void stream_bytes(const void* src_ptr, void* dst_ptr, int64_t n) {
  const char* src = static_cast<const char*>(src_ptr);
  char* dst = static_cast<char*>(dst_ptr);
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#if defined(CPU_CAPABILITY_AVX512)
  constexpr int64_t W = 64;
#else
  constexpr int64_t W = 32;
#endif
  const int64_t head = std::min<int64_t>(n, (W - static_cast<int64_t>(reinterpret_cast<uintptr_t>(dst) % W)) % W);
  std::memcpy(dst, src, head);
  int64_t i = head;
  for (; i + W <= n; i += W) {
#if defined(CPU_CAPABILITY_AVX512)
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), _mm512_loadu_si512(src + i));
#else
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
#endif
  }
  std::memcpy(dst + i, src + i, n - i);
#else
  std::memcpy(dst, src, n);
#endif
}

// Outputs at least this large are written with non-temporal stores; smaller
// ones stay in cache for the op that reads them next.
constexpr int64_t kStreamBytes = int64_t(8) << 20;

// The backward prefetches the rows it reads next only for source gradients at least this large.
constexpr int64_t kPrefetchBytes = int64_t(1) << 20;

template <typename acc_t, typename dst_t>
inline void store_as(const acc_t* src, char* dst, int64_t n, bool stream, acc_t* tmp) {
  const void* bytes = src;
  if constexpr (!std::is_same_v<acc_t, dst_t>) {
    dst_t* converted = stream ? reinterpret_cast<dst_t*>(tmp) : reinterpret_cast<dst_t*>(dst);
    if constexpr (std::is_same_v<acc_t, double> || (std::is_same_v<acc_t, float> && is_reduced_float<dst_t>)) {
      at::vec::convert(src, converted, n);
    } else {  // float into double cannot occur (a double output implies a double kernel)
      for (int64_t d = 0; d < n; ++d) converted[d] = static_cast<dst_t>(src[d]);
    }
    if (!stream) return;
    bytes = tmp;
  }
  if (stream) {
    stream_bytes(bytes, dst, n * static_cast<int64_t>(sizeof(dst_t)));
  } else {
    std::memcpy(dst, bytes, n * sizeof(dst_t));
  }
}

// Writes the acc_t row `src` as row p of `x` in x's dtype. `tmp` (n acc_t) holds
// the converted row when it is streamed.
template <typename acc_t>
inline void store_row(const acc_t* src, const OutRows& x, int64_t p, int64_t n, bool stream, acc_t* tmp) {
  char* row = x.data + p * x.row_bytes;
  switch (x.dtype) {
    case at::kFloat:
      return store_as<acc_t, float>(src, row, n, stream, tmp);
    case at::kDouble:
      return store_as<acc_t, double>(src, row, n, stream, tmp);
    case at::kBFloat16:
      return store_as<acc_t, at::BFloat16>(src, row, n, stream, tmp);
    default:
      return store_as<acc_t, at::Half>(src, row, n, stream, tmp);
  }
}

// ---------------------------------------------------------------- row arithmetic

// y += b * x
template <typename T>
inline void axpy(T* y, T b, const T* x, int64_t n) {
  using Vec = Vectorized<T>;
  const Vec vb(b);
  int64_t d = 0;
  for (; d + Vec::size() <= n; d += Vec::size()) {
    at::vec::fmadd(vb, Vec::loadu(x + d), Vec::loadu(y + d)).store(y + d);
  }
  for (; d < n; ++d) y[d] += b * x[d];
}

// bf16 to float without shuffles. Each 32-bit word of a bf16 row holds two
// values, x[2j] in its low half and x[2j+1] in its high half, so the 2W values
// at x, read as W words, are the even-indexed values (word << 16) and the
// odd-indexed ones (word & 0xffff0000) as floats: two single-cycle integer ops
// where convert_to_float spends two lane-crossing shuffles (on the port the
// FMAs also use). Sums over a row do not care about the order; products with a
// float vector use it split the same way (split_even_odd).
// (With the intrinsics where the vector ISA has them: through Vectorized's
// integer operators, GCC stored each loaded vector to the stack and read it back.)
inline std::pair<Vectorized<float>, Vectorized<float>> bf16_even_odd(const at::BFloat16* x) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i words = _mm512_loadu_si512(x);
  return {_mm512_castsi512_ps(_mm512_slli_epi32(words, 16)),
          _mm512_castsi512_ps(_mm512_and_si512(words, _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u))))};
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(words, 16)),
          _mm256_castsi256_ps(_mm256_and_si256(words, _mm256_set1_epi32(static_cast<int32_t>(0xffff0000u))))};
#else
  using iVec = Vectorized<int32_t>;
  const iVec words = iVec::loadu(x);
  return {at::vec::cast<float>(words << iVec(16)),
          at::vec::cast<float>(words & iVec(static_cast<int32_t>(0xffff0000u)))};
#endif
}

// The inverse of bf16_even_odd: the floats `even` and `odd` rounded to bf16 (to nearest even, a
// NaN as 0xffff, the bits at::vec's conversion gives) and packed as the 2W values of a bf16 row,
// each even-indexed value in the low half of its 32-bit word. Rounding each word in place puts the
// halves where they belong: no interleave and no pack, the four lane-crossing shuffles per vector
// pair that interleave2 + convert_from_float spend (on the port the FMAs also use).
inline Vectorized<at::BFloat16> bf16_from_even_odd(const Vectorized<float>& even, const Vectorized<float>& odd) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7fff);
  auto rounded = [&](const __m512 x) {  // the bf16 bits in the high half of each word
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), one);
    const __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(bias, lsb));
    return _mm512_mask_mov_epi32(_mm512_set1_epi32(-1), _mm512_cmp_ps_mask(x, x, _CMP_ORD_Q), r);
  };
  const __m512i low = _mm512_srli_epi32(rounded(even), 16);
  const __m512i high = _mm512_and_si512(rounded(odd), _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u)));
  return _mm512_or_si512(low, high);
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7fff);
  auto rounded = [&](const __m256 x) {  // the bf16 bits in the high half of each word
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), one);
    const __m256i r = _mm256_add_epi32(bits, _mm256_add_epi32(bias, lsb));
    return _mm256_blendv_epi8(_mm256_set1_epi32(-1), r, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_ORD_Q)));
  };
  const __m256i low = _mm256_srli_epi32(rounded(even), 16);
  const __m256i high = _mm256_and_si256(rounded(odd), _mm256_set1_epi32(static_cast<int32_t>(0xffff0000u)));
  return _mm256_or_si256(low, high);
#else
  const auto [lo, hi] = at::vec::interleave2(even, odd);
  return at::vec::convert_from_float<at::BFloat16>(lo, hi);
#endif
}

// A bf16 row as floats in the order split_even_odd gives (through bf16_even_odd: no shuffles).
inline void bf16_row_split(const at::BFloat16* x, int64_t n, float* out) {
  using fVec = Vectorized<float>;
  constexpr int64_t W = fVec::size();
  int64_t d = 0;
  for (; d + 2 * W <= n; d += 2 * W) {
    const auto [even, odd] = bf16_even_odd(x + d);
    even.store(out + d);
    odd.store(out + d + W);
  }
  for (; d < n; ++d) out[d] = static_cast<float>(x[d]);
}

// The 2W values at x as two acc_t vectors for sums over a row: bf16 through
// bf16_even_odd (even-indexed values, then odd: a product with u pairs them
// with u split the same way), other dtypes in order.
template <typename src_t, typename acc_t>
inline std::pair<Vectorized<acc_t>, Vectorized<acc_t>> vectors_for_sums(const src_t* x) {
  using Vec = Vectorized<acc_t>;
  if constexpr (std::is_same_v<src_t, at::BFloat16>) {
    return bf16_even_odd(x);
  } else if constexpr (std::is_same_v<src_t, acc_t>) {
    return {Vec::loadu(x), Vec::loadu(x + Vec::size())};
  } else {
    auto [lo, hi] = at::vec::convert_to_float<src_t>(Vectorized<src_t>::loadu(x));
    return {lo, hi};
  }
}

// Sites that one sweep over bf16 rows serves (their sums in registers: a compile-time count);
// more sites are taken in groups of at most this many.
constexpr int64_t kSweepSites = 4;

// Calls fn(std::integral_constant<int, G>{}) with G = count, 1 <= count <= kSweepSites.
template <typename Fn>
inline void with_site_count(int64_t count, Fn&& fn) {
  switch (count) {
    case 1:
      return fn(std::integral_constant<int, 1>{});
    case 2:
      return fn(std::integral_constant<int, 2>{});
    case 3:
      return fn(std::integral_constant<int, 3>{});
    default:
      return fn(std::integral_constant<int, 4>{});
  }
}

// The sweeps over a row set that the multi-query bf16 and fp32 reads make (sumsq_and_dots_rows,
// weighted_sums_rows, source_grads_rows) read each source row as vector pairs through
// vectors_for_sums: a bf16 pair as its even-indexed values, then its odd ones, an fp32 pair in
// order. "Sum order" names that order; float rows that meet a source row (u, do, du) are kept in it:
// split as split_even_odd splits them for bf16 sources, as they are for fp32 ones.
template <typename src_t>
constexpr bool kSplitSumOrder = std::is_same_v<src_t, at::BFloat16>;

// A float row u in the sum order of src_t rows.
template <typename src_t>
inline void to_sum_order(const float* u, int64_t n, float* out) {
  if constexpr (kSplitSumOrder<src_t>) {
    split_even_odd(u, n, out);
  } else {
    std::copy(u, u + n, out);
  }
}

// sum(x^2) (when kSumSq, else 0) and <y_q, x> for the G sites q < G of one row, in one sweep over
// it; y is [G, n], each row in the sum order. (Converting a bf16 row to float first and taking G + 1
// dot products of the copy left the multi-query bf16 reads at half the copy's rate.) Each sum is
// kept in 2U independent accumulators (U vector pairs per step, two for up to three sites): with one
// accumulator per sum taking both vectors of a pair, every step waited on two dependent
// multiply-adds (4 cycles each); three sites with one pair per step still waited on each sum's last
// step (3 sites, bf16, 2 threads, A/B with the change below: + norm 58-62 -> 63 %, no norm 80-82 -> 83-84 %).
template <int G, typename src_t, bool kSumSq = true>
inline float sumsq_and_dots_rows(const src_t* x, const float* y_sum_order, int64_t n, float* dots) {
  using fVec = Vectorized<float>;
  constexpr int64_t W = fVec::size();
  constexpr int U = G <= 3 ? 2 : 1;
  fVec ss[2 * U], acc[G][2 * U];
  for (int k = 0; k < 2 * U; ++k) {
    ss[k] = fVec(0.f);
    for (int q = 0; q < G; ++q) acc[q][k] = fVec(0.f);
  }
  // Adds the vector pair at d into accumulators 2 pair and 2 pair + 1 (pair < U).
  auto add_pair = [&](int64_t d, int pair) C10_ALWAYS_INLINE_ATTRIBUTE {
    const auto [first, second] = vectors_for_sums<src_t, float>(x + d);
    if constexpr (kSumSq) {
      ss[2 * pair] = at::vec::fmadd(first, first, ss[2 * pair]);
      ss[2 * pair + 1] = at::vec::fmadd(second, second, ss[2 * pair + 1]);
    }
#pragma GCC unroll 4
    for (int q = 0; q < G; ++q) {
      const float* y = y_sum_order + q * n + d;
      acc[q][2 * pair] = at::vec::fmadd(first, fVec::loadu(y), acc[q][2 * pair]);
      acc[q][2 * pair + 1] = at::vec::fmadd(second, fVec::loadu(y + W), acc[q][2 * pair + 1]);
    }
  };
  int64_t d = 0;
  for (; d + 2 * W * U <= n; d += 2 * W * U) {
#pragma GCC unroll 2
    for (int pair = 0; pair < U; ++pair) add_pair(d + 2 * W * pair, pair);
  }
  for (; d + 2 * W <= n; d += 2 * W) add_pair(d, 0);
  auto total = [](const fVec* sums) {
    fVec sum = sums[0];
    for (int k = 1; k < 2 * U; ++k) sum = sum + sums[k];
    return at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return a + b; }, sum);
  };
  float sumsq = kSumSq ? total(ss) : 0.f;
  for (int q = 0; q < G; ++q) dots[q] = total(acc[q]);
  for (; d < n; ++d) {
    const float xd = static_cast<float>(x[d]);
    if constexpr (kSumSq) sumsq += xd * xd;
    for (int q = 0; q < G; ++q) dots[q] += xd * y_sum_order[q * n + d];
  }
  return sumsq;
}

// sum(x^2) and <u, x> of one row for one site, in one sweep over x.
template <typename T>
inline T sumsq_and_dot_row(const T* x, const T* u, int64_t n, T* dot_out) {
  using Vec = Vectorized<T>;
  constexpr int64_t W = Vec::size();
  Vec ss0(T(0)), ss1(T(0)), dt0(T(0)), dt1(T(0));
  int64_t d = 0;
  for (; d + 2 * W <= n; d += 2 * W) {
    const Vec a = Vec::loadu(x + d), b = Vec::loadu(x + d + W);
    ss0 = at::vec::fmadd(a, a, ss0);
    ss1 = at::vec::fmadd(b, b, ss1);
    dt0 = at::vec::fmadd(a, Vec::loadu(u + d), dt0);
    dt1 = at::vec::fmadd(b, Vec::loadu(u + d + W), dt1);
  }
  auto add = [](Vec& p, Vec& q) { return p + q; };
  T ss = at::vec::vec_reduce_all<T>(add, ss0 + ss1);
  T dt = at::vec::vec_reduce_all<T>(add, dt0 + dt1);
  for (; d < n; ++d) {
    ss += x[d] * x[d];
    dt += x[d] * u[d];
  }
  *dot_out = dt;
  return ss;
}

// sum(x^2) and <u_q, x> for q < Q (one site: both in one sweep over x).
template <typename T>
inline T sumsq_and_dots(const T* x, const T* u, int64_t q_count, int64_t n, T* dots) {
  if (q_count == 1) return sumsq_and_dot_row(x, u, n, dots);
  for (int64_t q = 0; q < q_count; ++q) dots[q] = dot(x, u + q * n, n);
  return dot(x, x, n);
}

// The same for a bf16/fp16 row, accumulated in float: converted into `buf` (n
// floats) first. (One site reading rows in place takes the row pipeline.)
template <typename T, typename = std::enable_if_t<is_reduced_float<T>>>
inline float sumsq_and_dots(const T* x, const float* u, int64_t q_count, int64_t n, float* dots, float* buf) {
  return sumsq_and_dots(row_as_acc(x, buf, n), u, q_count, n, dots);
}

template <typename T>
inline T sumsq_and_dots(const T* x, const T* u, int64_t q_count, int64_t n, T* dots, T* /*buf*/) {
  return sumsq_and_dots(x, u, q_count, n, dots);
}

// A weight below the smallest normal number as 0: its terms α x are below
// 2^-126 |x| (fp32) and far under any result's rounding, while a subnormal
// operand makes every vector multiply-add with it take a microcode assist
// (on x86, ~100 cycles each: the logits of a sharp softmax reach such weights).
template <typename T>
inline T flush_subnormal(T a) {
  return a < std::numeric_limits<T>::min() ? T(0) : a;
}

// α_i = softmax(logits)_i for one row (logits i at s[i * stride]), the prefix
// logit lse_a included when given (its weight goes to *alpha_a); returns the
// log-sum-exp of the logits. Computed as exp(s - max) / Σ, in the forward and
// (from the saved logits) in the backward alike, rather than as exp(s - lse):
// the rounding of lse to the accumulation type would cost |lse| ulps in every α.
// A NaN logit makes every weight NaN, as in the reference softmax.
template <typename T>
inline T softmax_weights(const T* s, int64_t stride, int64_t n, const T* lse_a, T* alpha, T* alpha_a) {
  T top = lse_a != nullptr ? *lse_a : -std::numeric_limits<T>::infinity();
  for (int64_t i = 0; i < n; ++i) {
    const T x = s[i * stride];
    if (x > top || std::isnan(x)) top = x;
  }
  T sum = lse_a != nullptr ? std::exp(*lse_a - top) : T(0);
  for (int64_t i = 0; i < n; ++i) sum += (alpha[i] = std::exp(s[i * stride] - top));
  const T inv = T(1) / sum;
  for (int64_t i = 0; i < n; ++i) alpha[i] = flush_subnormal(alpha[i] * inv);
  *alpha_a = lse_a != nullptr ? flush_subnormal(std::exp(*lse_a - top) * inv) : T(0);
  return top + std::log(sum);
}

// Stores v at p (aligned to the vector's size) with a non-temporal store where
// the vector ISA has one.
template <typename T>
inline void store_streaming(const Vectorized<T>& v, T* p) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float>) return _mm512_stream_ps(p, v);
  if constexpr (std::is_same_v<T, double>) return _mm512_stream_pd(p, v);
  if constexpr (is_reduced_float<T>) return _mm512_stream_si512(reinterpret_cast<__m512i*>(p), v);
#elif defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<T, float>) return _mm256_stream_ps(p, v);
  if constexpr (std::is_same_v<T, double>) return _mm256_stream_pd(p, v);
  if constexpr (is_reduced_float<T>) return _mm256_stream_si256(reinterpret_cast<__m256i*>(p), v);
#endif
  v.store(p);
}

// Whether store_streaming issues non-temporal stores (elsewhere it is a plain store).
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
constexpr bool kStreamingStores = true;
#else
constexpr bool kStreamingStores = false;
#endif

// Non-temporal stores of rounded bf16 vector pairs into several rows at once (the multi-site forward's
// output rows), a whole cache line at a time. With AVX2 a pair of float vectors rounds to 32
// bytes, half a line: streamed as they were done, a sweep over N rows left N half-written lines in
// the write-combining buffers before it came back to complete them. On a Zen 3 CPU (N=9, 8192 rows,
// D=1024, bf16, 1 thread) the backward took 13.2-14.1 µs per row at one site that way, 6.6-7.5 with
// regular stores and 6.1-7.9 with these (3 sites + out norm: 23.2-24.8, 12.2-12.5, 11.9-12.2;
// 2 threads, 1 site: 37-38 % of a copy's rate, 57-75 %, 54-57 %; that gradient sweep now takes two
// pairs, a whole line, per step). The first half of each line waits here, in a buffer per row, and
// goes out just before the second. With AVX512 a pair is a whole line and is stored at once. The rows' lines must start
// at column 0 (rows aligned to 64 bytes).
class Bf16LineStreams {
 public:
  using bVec = Vectorized<at::BFloat16>;
  // Only non-temporal stores need whole lines: plain stores (the default ISA, or NEON's 16-byte vectors
  // on Arm, a quarter line) go out as they come.
  static constexpr bool kHalfLines = kStreamingStores && bVec::size() * sizeof(at::BFloat16) < 64;
  static_assert(!kHalfLines || 2 * bVec::size() * sizeof(at::BFloat16) == 64);

  explicit Bf16LineStreams(int64_t rows) : first_halves_(kHalfLines ? rows * bVec::size() : 0) {}

  // Streams v, the vector pair at column d of row `row`, to p.
  C10_ALWAYS_INLINE void store(int64_t row, const bVec& v, at::BFloat16* p, int64_t d) {
    if constexpr (kHalfLines) {
      at::BFloat16* first_half = first_halves_.data() + row * bVec::size();
      if (d % (2 * bVec::size()) == 0) {
        v.store(first_half);
        return;
      }
      store_streaming(bVec::loadu(first_half), p - bVec::size());
    }
    store_streaming(v, p);
  }

 private:
  std::vector<at::BFloat16> first_halves_;
};

// Walks the cache lines of the rows that the forward reads next (each source's
// rows in turn), one prefetch into L2 per step(). One prefetch per inner step,
// spread over the work, puts those rows on their way without a burst that
// fills the core's line-fill buffers (prefetching whole rows at once did: it
// stalled the loads it was meant to speed up; two lines per step was slower
// too). Measured at N=9, 8192 rows, D=1024 (2 threads), without -> with: in
// the row pipeline (the next row, from each sweep), fp32 19.1 -> 17.5 ms,
// bf16 10.5 -> 9.5 ms; in the tiles (the next tile, from pass B), fp32 19.6 ->
// 18.8 ms, bf16 11.2 -> 11.1 ms; in the backward (the next row, from the
// source-gradient loop), fp32 57.4-61.7 -> 53.7-55.0 ms, bf16 48.5-52.4 ->
// 47.4-48.6 ms.
class LinePrefetcher {
 public:
  LinePrefetcher(const std::vector<InRows>& src, int64_t first_row, int64_t rows, int64_t dim)
      : src_(src), first_row_(first_row), rows_(rows), dim_(dim), live_(rows > 0 && !src.empty()) {
    if (live_) start_row();
  }
  // Always inlined: called out of line inside a sweep, the call made GCC spill the sweep's sums to
  // the stack around it (the small reads' backward spent a third of its recomputed h there).
  C10_ALWAYS_INLINE void step() {
    if (!live_) return;
    __builtin_prefetch(line_, 0, 2);
    line_ += 64;
    if (line_ < row_end_) return;
    if (++row_ == rows_) {
      row_ = 0;
      if (++source_ == static_cast<int64_t>(src_.size())) {
        live_ = false;
        return;
      }
    }
    start_row();
  }

 private:
  void start_row() {
    const InRows& x = src_[source_];
    line_ = x.data + (first_row_ + row_) * x.row_bytes;
    row_end_ = line_ + dim_ * static_cast<int64_t>(c10::elementSize(x.dtype));
  }
  const std::vector<InRows>& src_;
  const int64_t first_row_, rows_, dim_;
  int64_t source_ = 0, row_ = 0;
  const char* line_ = nullptr;
  const char* row_end_ = nullptr;
  bool live_;
};

// h_q = Σ_i a[q * n + i] x_i for the G sites q < G over n rows, in one sweep over the rows
// (each vector of a row loaded once for all the sites); h is [G, dim], in order (in the sum order
// with kSumOrderH). `prefetch` (if any) steps once per row and vector pair. With `out` (bf16 rows
// only: G row pointers), h_q is not stored but rounded to bf16 into out[q] straight from the sum
// order, streamed through `streams` when given (rows aligned to 64 bytes): no float row to
// interleave and convert (the 3-site bf16 forward spent a fifth of its time converting and storing
// its float rows).
template <int G, typename src_t, bool kSumOrderH = false>
inline void weighted_sums_rows(const src_t* const* x, const float* a, int64_t n, int64_t dim, float* h,
                               LinePrefetcher* prefetch, at::BFloat16* const* out = nullptr,
                               Bf16LineStreams* streams = nullptr) {
  using fVec = Vectorized<float>;
  constexpr int64_t W = fVec::size();
  int64_t d = 0;
  // Up to three sites sum the even and the odd rows in separate sets of accumulators (S = 2), added
  // at the end: with 2G accumulators each row's multiply-adds waited on the last row's.
  constexpr int S = G <= 3 ? 2 : 1;
  for (; d + 2 * W <= dim; d += 2 * W) {
    fVec first_sums[S][G], second_sums[S][G];
    for (int set = 0; set < S; ++set) {
      for (int q = 0; q < G; ++q) first_sums[set][q] = second_sums[set][q] = fVec(0.f);
    }
    auto add_row = [&](int64_t i, int set) C10_ALWAYS_INLINE_ATTRIBUTE {
      if (prefetch != nullptr) prefetch->step();
      const auto [first, second] = vectors_for_sums<src_t, float>(x[i] + d);
#pragma GCC unroll 4
      for (int q = 0; q < G; ++q) {
        const fVec aq(a[q * n + i]);
        first_sums[set][q] = at::vec::fmadd(aq, first, first_sums[set][q]);
        second_sums[set][q] = at::vec::fmadd(aq, second, second_sums[set][q]);
      }
    };
    int64_t i = 0;
    for (; i + S <= n; i += S) {
#pragma GCC unroll 2
      for (int set = 0; set < S; ++set) add_row(i + set, set);
    }
    if (i < n) add_row(i, 0);
    for (int q = 0; q < G; ++q) {
      fVec first = first_sums[0][q], second = second_sums[0][q];
      if constexpr (S == 2) {
        first = first + first_sums[1][q];
        second = second + second_sums[1][q];
      }
      if constexpr (kSplitSumOrder<src_t>) {
        if (out != nullptr) {
          const Vectorized<at::BFloat16> rounded = bf16_from_even_odd(first, second);
          if (streams != nullptr) {
            streams->store(q, rounded, out[q] + d, d);
          } else {
            rounded.store(out[q] + d);
          }
          continue;
        }
        if constexpr (!kSumOrderH) std::tie(first, second) = at::vec::interleave2(first, second);
      }
      first.store(h + q * dim + d);
      second.store(h + q * dim + d + W);
    }
  }
  for (; d < dim; ++d) {
    for (int q = 0; q < G; ++q) {
      float sum = 0.f;
      for (int64_t i = 0; i < n; ++i) sum += a[q * n + i] * static_cast<float>(x[i][d]);
      if (out != nullptr) {
        out[q][d] = static_cast<at::BFloat16>(sum);
      } else {
        h[q * dim + d] = sum;
      }
    }
  }
}

// h = Σ_i a_i x_i, plus b y when y is given: each vector of h is summed in a
// register over the n rows and stored once (4 vectors per pass over the row
// pointers, so each pointer and weight is loaded once per 4 vectors). With
// kStream, h is an output row aligned to the vector size, written with
// non-temporal stores as its vectors are done: spread over the sums, they
// drain while the loads go on (streamed after the row is complete, they
// stalled the core on full write-combining buffers: ~12 % of the fp32 forward).
template <bool kStream = false, typename T>
inline void weighted_sum(const T* const* x, const T* a, int64_t n, const T* y, T b, int64_t dim, T* h,
                         LinePrefetcher* prefetch = nullptr) {
  using Vec = Vectorized<T>;
  constexpr int64_t W = Vec::size();
  int64_t d = 0;
  for (; d + 4 * W <= dim; d += 4 * W) {
    Vec h0(T(0)), h1(T(0)), h2(T(0)), h3(T(0));
    if (y != nullptr) {
      const Vec vb(b);
      h0 = Vec::loadu(y + d) * vb;
      h1 = Vec::loadu(y + d + W) * vb;
      h2 = Vec::loadu(y + d + 2 * W) * vb;
      h3 = Vec::loadu(y + d + 3 * W) * vb;
    }
    for (int64_t i = 0; i < n; ++i) {
      if (prefetch != nullptr) prefetch->step();
      const T* xi = x[i] + d;
      const Vec ai(a[i]);
      h0 = at::vec::fmadd(ai, Vec::loadu(xi), h0);
      h1 = at::vec::fmadd(ai, Vec::loadu(xi + W), h1);
      h2 = at::vec::fmadd(ai, Vec::loadu(xi + 2 * W), h2);
      h3 = at::vec::fmadd(ai, Vec::loadu(xi + 3 * W), h3);
    }
    if constexpr (kStream) {
      store_streaming(h0, h + d);
      store_streaming(h1, h + d + W);
      store_streaming(h2, h + d + 2 * W);
      store_streaming(h3, h + d + 3 * W);
    } else {
      h0.store(h + d);
      h1.store(h + d + W);
      h2.store(h + d + 2 * W);
      h3.store(h + d + 3 * W);
    }
  }
  for (; d + W <= dim; d += W) {
    Vec acc = y != nullptr ? Vec::loadu(y + d) * Vec(b) : Vec(T(0));
    for (int64_t i = 0; i < n; ++i) acc = at::vec::fmadd(Vec(a[i]), Vec::loadu(x[i] + d), acc);
    acc.store(h + d);
  }
  for (; d < dim; ++d) {
    T acc = y != nullptr ? y[d] * b : T(0);
    for (int64_t i = 0; i < n; ++i) acc += a[i] * x[i][d];
    h[d] = acc;
  }
}

// weighted_sum over bf16/fp16 rows, converted to float in registers (2 x 32
// elements per pass over the row pointers; bf16 through bf16_even_odd, the
// sums then interleaved back once per output vector: the same products and
// sums, in the same order, as the plain conversion). With kStream the sums are
// rounded to T and streamed into `out` (aligned to the vector size; dim a
// multiple of 2 B), not stored in h.
template <bool kStream = false, typename T, typename = std::enable_if_t<is_reduced_float<T>>>
inline void weighted_sum(const T* const* x, const float* a, int64_t n, const float* y, float b, int64_t dim, float* h,
                         LinePrefetcher* prefetch = nullptr, T* out = nullptr) {
  using bVec = Vectorized<T>;
  using fVec = Vectorized<float>;
  constexpr int64_t B = bVec::size(), W = fVec::size();
  int64_t d = 0;
  for (; d + 2 * B <= dim; d += 2 * B) {
    fVec h0(0.f), h1(0.f), h2(0.f), h3(0.f);
    if (y != nullptr) {
      const fVec vb(b);
      h0 = fVec::loadu(y + d) * vb;
      h1 = fVec::loadu(y + d + W) * vb;
      h2 = fVec::loadu(y + d + 2 * W) * vb;
      h3 = fVec::loadu(y + d + 3 * W) * vb;
    }
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      std::tie(h0, h1) = at::vec::deinterleave2(h0, h1);  // even, odd of the first 2W
      std::tie(h2, h3) = at::vec::deinterleave2(h2, h3);
    }
    for (int64_t i = 0; i < n; ++i) {
      if (prefetch != nullptr) prefetch->step();
      const T* xi = x[i] + d;
      const fVec ai(a[i]);
      fVec x0, x1, x2, x3;
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        std::tie(x0, x1) = bf16_even_odd(xi);
        std::tie(x2, x3) = bf16_even_odd(xi + B);
      } else {
        std::tie(x0, x1) = at::vec::convert_to_float<T>(bVec::loadu(xi));
        std::tie(x2, x3) = at::vec::convert_to_float<T>(bVec::loadu(xi + B));
      }
      h0 = at::vec::fmadd(ai, x0, h0);
      h1 = at::vec::fmadd(ai, x1, h1);
      h2 = at::vec::fmadd(ai, x2, h2);
      h3 = at::vec::fmadd(ai, x3, h3);
    }
    if constexpr (kStream && std::is_same_v<T, at::BFloat16>) {  // rounded into place from the sum order
      store_streaming(bf16_from_even_odd(h0, h1), out + d);
      store_streaming(bf16_from_even_odd(h2, h3), out + d + B);
      continue;
    }
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      std::tie(h0, h1) = at::vec::interleave2(h0, h1);
      std::tie(h2, h3) = at::vec::interleave2(h2, h3);
    }
    if constexpr (kStream) {
      store_streaming(at::vec::convert_from_float<T>(h0, h1), out + d);
      store_streaming(at::vec::convert_from_float<T>(h2, h3), out + d + B);
    } else {
      h0.store(h + d);
      h1.store(h + d + W);
      h2.store(h + d + 2 * W);
      h3.store(h + d + 3 * W);
    }
  }
  for (; d + B <= dim; d += B) {
    fVec h0 = y != nullptr ? fVec::loadu(y + d) * fVec(b) : fVec(0.f);
    fVec h1 = y != nullptr ? fVec::loadu(y + d + W) * fVec(b) : fVec(0.f);
    for (int64_t i = 0; i < n; ++i) {
      auto [x0, x1] = at::vec::convert_to_float<T>(bVec::loadu(x[i] + d));
      h0 = at::vec::fmadd(fVec(a[i]), x0, h0);
      h1 = at::vec::fmadd(fVec(a[i]), x1, h1);
    }
    h0.store(h + d);
    h1.store(h + d + W);
  }
  for (; d < dim; ++d) {
    float acc = y != nullptr ? y[d] * b : 0.f;
    for (int64_t i = 0; i < n; ++i) acc += a[i] * static_cast<float>(x[i][d]);
    h[d] = acc;
  }
}

// One step of the forward's row pipeline (pipelined_row) at element d: for
// each source i, K acc_t vectors of the next row set into that row's sums
// (pass A: S[i] += x², T[i] += u x) and of the current row set into the
// weighted sum h (pass B: Σ_i w_i x_i), which is then stored into h or, with
// kStream, rounded to src_t and streamed into `out`. A null `next` or `cur`
// skips that pass (the first and last row of a block). Sums over a row take
// bf16 values through vectors_for_sums (even, then odd), so bf16 sums are
// interleaved back before they are stored.
template <int K, bool kStream, typename src_t, typename acc_t>
inline void pipeline_step(int64_t d, const src_t* const* next, const src_t* const* cur, int64_t n, const acc_t* u_dot,
                          const acc_t* w, const acc_t* y, acc_t b, Vectorized<acc_t>* S, Vectorized<acc_t>* T, acc_t* h,
                          src_t* out, LinePrefetcher& prefetch) {
  using Vec = Vectorized<acc_t>;
  constexpr int64_t W = Vec::size();
  constexpr bool bf16 = std::is_same_v<src_t, at::BFloat16>;
  static_assert(K % 2 == 0, "vectors_for_sums reads pairs of vectors");
  Vec hv[K], uv[K];
#pragma GCC unroll 4
  for (int j = 0; j < K; ++j) {
    hv[j] = cur != nullptr && y != nullptr ? Vec::loadu(y + d + j * W) * Vec(b) : Vec(acc_t(0));
    uv[j] = Vec::loadu(u_dot + d + j * W);
  }
  if constexpr (bf16) {
#pragma GCC unroll 2
    for (int j = 0; j < K; j += 2) std::tie(hv[j], hv[j + 1]) = at::vec::deinterleave2(hv[j], hv[j + 1]);
  }
  for (int64_t i = 0; i < n; ++i) {
    prefetch.step();
    if (next != nullptr) {
      Vec s_i = S[i], t_i = T[i];
#pragma GCC unroll 2
      for (int j = 0; j < K; j += 2) {
        const auto [x0, x1] = vectors_for_sums<src_t, acc_t>(next[i] + d + j * W);
        s_i = at::vec::fmadd(x1, x1, at::vec::fmadd(x0, x0, s_i));
        t_i = at::vec::fmadd(x1, uv[j + 1], at::vec::fmadd(x0, uv[j], t_i));
      }
      S[i] = s_i;
      T[i] = t_i;
    }
    if (cur != nullptr) {
      const Vec wi(w[i]);
#pragma GCC unroll 2
      for (int j = 0; j < K; j += 2) {
        const auto [x0, x1] = vectors_for_sums<src_t, acc_t>(cur[i] + d + j * W);
        hv[j] = at::vec::fmadd(wi, x0, hv[j]);
        hv[j + 1] = at::vec::fmadd(wi, x1, hv[j + 1]);
      }
    }
  }
  if (cur == nullptr) return;
#pragma GCC unroll 2
  for (int j = 0; j < K; j += 2) {
    if constexpr (bf16 && kStream) {  // rounded into place from the sum order
      store_streaming(bf16_from_even_odd(hv[j], hv[j + 1]), out + d + j * W);
      continue;
    }
    if constexpr (bf16) std::tie(hv[j], hv[j + 1]) = at::vec::interleave2(hv[j], hv[j + 1]);
    if constexpr (!kStream) {
      hv[j].store(h + d + j * W);
      hv[j + 1].store(h + d + (j + 1) * W);
    } else if constexpr (std::is_same_v<src_t, acc_t>) {
      store_streaming(hv[j], out + d + j * W);
      store_streaming(hv[j + 1], out + d + (j + 1) * W);
    } else {
      store_streaming(at::vec::convert_from_float<src_t>(hv[j], hv[j + 1]), out + d + j * W);
    }
  }
}

// One sweep of the forward's row pipeline, for one site whose source rows are
// all read in place: pass A of the row set `next` (ss[i] = Σ x², dt[i] = <u, x>
// of source i's row; u_dot is u in the order of vectors_for_sums) and pass B of
// the row set `cur` (h = Σ_i w_i x_i + b y) in one pass over the elements, 128
// bytes of every source row per step. The sweep's loads from memory are pass
// A's; pass B re-reads rows loaded in the previous sweep, from cache, in between,
// so the loads from memory never wait for a pass B of their own (two passes
// one after the other left the memory idle while pass B ran). `prefetch` walks
// the row set after `next`, one line per step. `acc` holds 2n vectors. With
// kStream, h goes to `out` as in pipeline_step; otherwise into `h`.
template <bool kStream, typename src_t, typename acc_t>
void pipelined_row(const src_t* const* next, const src_t* const* cur, int64_t n, const acc_t* u_dot, const acc_t* w,
                   const acc_t* y, acc_t b, int64_t dim, LinePrefetcher& prefetch, Vectorized<acc_t>* acc, acc_t* ss,
                   acc_t* dt, acc_t* h, src_t* out) {
  using Vec = Vectorized<acc_t>;
  constexpr int64_t W = Vec::size();
  constexpr int K = sizeof(src_t) == 2 ? 4 : 2;  // acc_t vectors of each row per step: 128 bytes of src_t
  Vec* S = acc;
  Vec* T = acc + n;
  if (next != nullptr) std::fill(acc, acc + 2 * n, Vec(acc_t(0)));
  int64_t d = 0;
  for (; d + K * W <= dim; d += K * W) {
    pipeline_step<K, kStream>(d, next, cur, n, u_dot, w, y, b, S, T, h, out, prefetch);
  }
  if constexpr (K > 2) {  // a last run of 2W values (u_dot is split in runs of 2W)
    if (d + 2 * W <= dim) {
      pipeline_step<2, kStream>(d, next, cur, n, u_dot, w, y, b, S, T, h, out, prefetch);
      d += 2 * W;
    }
  }
  if (next != nullptr) {
    auto add = [](Vec& p, Vec& q) { return p + q; };
    for (int64_t i = 0; i < n; ++i) {
      ss[i] = at::vec::vec_reduce_all<acc_t>(add, S[i]);
      dt[i] = at::vec::vec_reduce_all<acc_t>(add, T[i]);
      for (int64_t e = d; e < dim; ++e) {
        const acc_t x = static_cast<acc_t>(next[i][e]);
        ss[i] += x * x;
        dt[i] += x * u_dot[e];
      }
    }
  }
  if (cur != nullptr) {
    for (int64_t e = d; e < dim; ++e) {
      acc_t sum = y != nullptr ? y[e] * b : acc_t(0);
      for (int64_t i = 0; i < n; ++i) sum += w[i] * static_cast<acc_t>(cur[i][e]);
      if constexpr (kStream) {
        out[e] = static_cast<src_t>(sum);
      } else {
        h[e] = sum;
      }
    }
  }
}

// Parallel work is cut into blocks of at least kBlockWork multiply-adds, and a
// thread is started only for at least kMinTaskWork of them: below that, waking
// a second thread costs more than the work it takes over, so small reads run on
// one thread.
constexpr int64_t kBlockWork = int64_t(1) << 15;
constexpr int64_t kMinTaskWork = int64_t(1) << 18;

// Units (rows) per block, for units of `work_per_unit` multiply-adds.
inline int64_t block_units(int64_t work_per_unit) {
  return std::max<int64_t>(1, kBlockWork / std::max<int64_t>(1, work_per_unit));
}

// Hands out blocks 0 .. count-1 one at a time to the threads of a parallel
// region: each thread of at::parallel_for ignores the range it was given and
// takes blocks until none is left. On a busy machine a thread that gets less
// CPU time then takes fewer blocks, instead of every call waiting for an even
// share to finish on it. (Results do not depend on which thread runs a block.)
class BlockQueue {
 public:
  explicit BlockQueue(int64_t count) : count_(count) {}
  bool next(int64_t& block) {
    block = next_.fetch_add(1, std::memory_order_relaxed);
    return block < count_;
  }
  // The at::parallel_for grain: blocks per thread started.
  static int64_t grain(int64_t work_per_block) {
    return std::max<int64_t>(1, kMinTaskWork / std::max<int64_t>(1, work_per_block));
  }

 private:
  std::atomic<int64_t> next_{0};
  const int64_t count_;
};

// ---------------------------------------------------------------- forward

// Operands of one read as row views: the sources ([M, D] each), the prefix
// h_a ([Q*M, D], absent without a merge).
struct ReadRows {
  std::vector<InRows> src;
  InRows h_a;
};

ReadRows read_rows(const SourceRows& in, const at::Tensor& h_a) {
  ReadRows r;
  r.src.reserve(in.rows.size());
  for (const auto& s : in.rows) r.src.push_back(in_rows(s, s.stride(0)));
  if (h_a.defined()) r.h_a = in_rows(h_a, in.dim);
  return r;
}

// Row slots for the sources that are not stored in T: each gets D elements of a
// row buffer, where load_row converts its current row; rows in T need none.
struct RowSlots {
  std::vector<int64_t> offset;  // per source: offset into buf, or -1
  int64_t size = 0;
};

template <typename T>
RowSlots row_slots(const std::vector<InRows>& src, int64_t dim) {
  RowSlots slots;
  for (const auto& s : src) {
    const bool in_place = s.dtype == c10::CppTypeToScalarType<T>::value;
    slots.offset.push_back(in_place ? -1 : slots.size);
    slots.size += in_place ? 0 : dim;
  }
  return slots;
}

// Rows of a forward tile: pass A streams this many consecutive rows of each
// source from memory (runs of several pages of one source, which the hardware
// prefetchers follow, instead of one page of each of N sources in turn) and
// pass B re-reads them from L2: the tile's source rows take at most kTileBytes
// (256 KiB measured as good as 128 or 512 KiB at N=9, D=1024).
constexpr int64_t kTileBytes = int64_t(256) << 10;
constexpr int64_t kMaxTileRows = 16;
constexpr int64_t kTilesPerBlock = 4;
// Rows per block of the row pipeline (its first and last sweep do one pass only).
constexpr int64_t kPipelineBlockRows = 256;

// Forward. Pass A reads each source row once from memory: its key-norm scale
// r_i and its Q logits; then the row's softmax weights, and pass B forms
// h_q = Σ_i α_qi v_i (+ α_qa h_a for a merge) from the rows, now in cache, in
// registers, applies the fused output norm and writes it. One site whose rows
// are all read in place (the common read) runs the two passes as a row
// pipeline (pipelined_row: pass A of row p with pass B of row p - 1); other
// reads run them one tile of rows at a time (pass A over the tile, then pass B:
// weighted_sum). src_t is the sources' dtype when they all share one (bf16,
// fp16: both passes convert in registers); otherwise src_t = acc_t and each
// row not stored in acc_t is converted once into its slot of the tile's row
// buffer.
template <typename acc_t, typename src_t>
void depth_attn_fwd_impl(const SourceRows& in, const at::Tensor& u_t, const at::Tensor& h_a_t,
                         const at::Tensor& lse_a_t, const at::Tensor& g_t, const ReadOptions& options,
                         at::Tensor& out_t, at::Tensor& lse_t, at::Tensor& logits_t, at::Tensor& rinv_t) {
  const int64_t M = in.num_rows, D = in.dim, N = static_cast<int64_t>(in.rows.size()), Q = u_t.size(0);
  const acc_t eps = static_cast<acc_t>(options.eps), out_eps = static_cast<acc_t>(options.out_norm_eps);
  const bool normalize_values = options.normalize_values;
  const ReadRows rows = read_rows(in, h_a_t);
  const RowSlots slots = row_slots<src_t>(rows.src, D);
  const OutRows out = out_rows(out_t, D);
  const bool stream = out_t.nbytes() >= kStreamBytes;
  const acc_t* u = u_t.const_data_ptr<acc_t>();
  const acc_t* lse_a = lse_a_t.defined() ? lse_a_t.const_data_ptr<acc_t>() : nullptr;
  const acc_t* g = g_t.defined() ? g_t.const_data_ptr<acc_t>() : nullptr;
  acc_t* lse = lse_t.mutable_data_ptr<acc_t>();
  acc_t* logits = logits_t.mutable_data_ptr<acc_t>();
  acc_t* rinv = rinv_t.mutable_data_ptr<acc_t>();

  // bf16 rows: u split for bf16_even_odd (one site: the row pipeline; several sites without a
  // merge prefix: sweeps over the rows for kSweepSites sites at a time, sweep_sites).
  constexpr bool bf16_rows = std::is_same_v<src_t, at::BFloat16>;
  const bool sweep_sites = bf16_rows && Q > 1 && !rows.h_a;
  std::vector<float> u_split(bf16_rows && (Q == 1 || sweep_sites) ? Q * D : 0);
  const acc_t* u_dot = u;  // u in the order of vectors_for_sums
  if constexpr (bf16_rows) {
    for (int64_t q = 0; q < static_cast<int64_t>(u_split.size()) / D; ++q) {
      split_even_odd(u + q * D, D, u_split.data() + q * D);
    }
    if (Q == 1) u_dot = u_split.data();
  }
  int64_t row_set_bytes = 0;  // one row of every source
  for (const auto& s : rows.src) row_set_bytes += D * static_cast<int64_t>(c10::elementSize(s.dtype));
  const int64_t tile = std::clamp<int64_t>(kTileBytes / row_set_bytes, 1, kMaxTileRows);
  const int64_t row_work = (N + 1) * Q * D;
  // Without an output norm, an output in the sources' dtype src_t is written by
  // weighted_sum itself (streamed as its vectors are done) when its rows are
  // aligned for that (and, for bf16/fp16, hold whole vectors).
  constexpr int64_t kVecBytes = Vectorized<src_t>::size() * static_cast<int64_t>(sizeof(src_t));
  const bool whole_vectors = std::is_same_v<src_t, acc_t> || D % (2 * Vectorized<src_t>::size()) == 0;
  const bool stream_sums = stream && g == nullptr && out.dtype == c10::CppTypeToScalarType<src_t>::value &&
                           whole_vectors && reinterpret_cast<uintptr_t>(out.data) % kVecBytes == 0 &&
                           out.row_bytes % kVecBytes == 0;
  auto row_of = [&](int64_t i, int64_t p) {
    return reinterpret_cast<const src_t*>(rows.src[i].data + p * rows.src[i].row_bytes);
  };
  // h (row p of site q's output) normalized by the fused output norm and stored.
  auto write_row = [&](acc_t* h, int64_t q, int64_t p, acc_t* tmp) {
    if (g != nullptr) {
      const acc_t rstd = acc_t(1) / std::sqrt(dot(h, h, D) / static_cast<acc_t>(D) + out_eps);
      at::vec::map2<acc_t>([rstd](auto x, auto w) { return x * w * decltype(x)(rstd); }, h, h, g + q * D, D);
    }
    store_row(h, out, q * M + p, D, stream, tmp);
  };

  if (Q == 1 && slots.size == 0) {
    // One site, every row read in place: the row pipeline. Sweep p of a block
    // does pass A of row p and pass B of row p - 1 (pipelined_row). Measured at
    // N=9, 8192 rows, D=1024 (2 threads, interleaved runs) against the tiles
    // below: fp32 18.0-18.3 -> 17.1-17.2 ms, bf16 10.2-10.4 -> 9.4-9.7 ms.
    const int64_t block = std::max(block_units(row_work), kPipelineBlockRows), num_blocks = (M + block - 1) / block;
    BlockQueue blocks(num_blocks);
    at::parallel_for(0, num_blocks, BlockQueue::grain(block * row_work), [&](int64_t, int64_t) {
      std::vector<acc_t> h(D), habuf(D), tmp(D), ss(N), dt(N), s(N), alpha(N);
      std::vector<Vectorized<acc_t>> sums(2 * N);
      std::vector<const src_t*> cur(N), next(N);
      acc_t alpha_a = 0;
      for (int64_t b; blocks.next(b);) {
        const int64_t first = b * block, end = std::min(M, first + block);
        for (int64_t p = first; p <= end; ++p) {
          const bool read = p < end;     // pass A of row p
          const bool write = p > first;  // pass B of row p - 1
          for (int64_t i = 0; read && i < N; ++i) next[i] = row_of(i, p);
          LinePrefetcher prefetch(rows.src, p + 1, p + 1 < end ? 1 : 0, D);
          const acc_t* ha = write && rows.h_a ? load_row(rows.h_a, p - 1, habuf.data(), D) : nullptr;
          src_t* out_row = write ? reinterpret_cast<src_t*>(out.data + (p - 1) * out.row_bytes) : nullptr;
          const src_t* const* next_rows = read ? next.data() : nullptr;
          const src_t* const* cur_rows = write ? cur.data() : nullptr;
          if (stream_sums) {
            pipelined_row<true>(next_rows, cur_rows, N, u_dot, alpha.data(), ha, alpha_a, D, prefetch, sums.data(),
                                ss.data(), dt.data(), h.data(), out_row);
          } else {
            pipelined_row<false>(next_rows, cur_rows, N, u_dot, alpha.data(), ha, alpha_a, D, prefetch, sums.data(),
                                 ss.data(), dt.data(), h.data(), out_row);
            if (write) write_row(h.data(), 0, p - 1, tmp.data());
          }
          if (read) {  // row p's key-norm scales, logits and softmax weights
            for (int64_t i = 0; i < N; ++i) {
              const acc_t r = acc_t(1) / std::sqrt(ss[i] / static_cast<acc_t>(D) + eps);
              rinv[i * M + p] = r;
              s[i] = logits[i * M + p] = r * dt[i];
            }
            lse[p] = softmax_weights(s.data(), 1, N, lse_a != nullptr ? lse_a + p : nullptr, alpha.data(), &alpha_a);
            if (normalize_values) {  // the values are r_i v_i: pass B weighs v_i by α_i r_i
              for (int64_t i = 0; i < N; ++i) alpha[i] *= rinv[i * M + p];
            }
            std::swap(cur, next);
          }
        }
      }
      if (stream) fence_streaming_stores();
    });
    return;
  }

  // A block holds several tiles, so that pass B of one tile can prefetch the next.
  const int64_t block = std::max(block_units(row_work), kTilesPerBlock * tile), num_blocks = (M + block - 1) / block;
  // The sweeps of bf16 rows round a bf16 output without an output norm straight into its rows.
  const bool bf16_out = bf16_rows && g == nullptr && out.dtype == at::kBFloat16;
  // The site sweeps stream their bf16 rows a cache line at a time (Bf16LineStreams).
  const bool stream_site_rows =
      bf16_out && stream_sums && reinterpret_cast<uintptr_t>(out.data) % 64 == 0 && out.row_bytes % 64 == 0;
  BlockQueue blocks(num_blocks);
  at::parallel_for(0, num_blocks, BlockQueue::grain(block * row_work), [&](int64_t, int64_t) {
    // Per tile row k: v[k * N + i] is source i's row (in place or in its slot
    // of rowbuf), s[(k * Q + q) * N + i] its logit for site q.
    std::vector<src_t> rowbuf(tile * slots.size);
    std::vector<acc_t> h(D), habuf(D), vbuf(D), tmp(D), dots(Q), s(tile * Q * N), alpha(N);
    std::vector<acc_t> site_alpha(sweep_sites ? Q * N : 0), site_h(sweep_sites ? Q * D : 0);
    std::vector<at::BFloat16*> out_rows(sweep_sites ? Q : 0);          // row p of every site's output (bf16_out)
    Bf16LineStreams site_streams(stream_site_rows ? kSweepSites : 0);  // (a sweep's sites in turn)
    std::vector<const src_t*> v(tile * N);
    for (int64_t b; blocks.next(b);) {
      const int64_t block_end = std::min(M, (b + 1) * block);
      for (int64_t p0 = b * block; p0 < block_end; p0 += tile) {
        const int64_t rows_in_tile = std::min(tile, block_end - p0);
        // Pass A, source by source over the tile's rows.
        auto keep = [&](int64_t i, int64_t k, acc_t ss) {  // dots[q]: the row's <u_q, v>
          const int64_t p = p0 + k;
          const acc_t r = acc_t(1) / std::sqrt(ss / static_cast<acc_t>(D) + eps);
          rinv[i * M + p] = r;
          for (int64_t q = 0; q < Q; ++q) s[(k * Q + q) * N + i] = logits[(q * N + i) * M + p] = r * dots[q];
        };
        for (int64_t i = 0; i < N; ++i) {
          for (int64_t k = 0; k < rows_in_tile; ++k) {
            const int64_t p = p0 + k;
            const src_t*& vi = v[k * N + i];
            if constexpr (std::is_same_v<src_t, acc_t>) {
              acc_t* slot = slots.offset[i] < 0 ? nullptr : rowbuf.data() + k * slots.size + slots.offset[i];
              vi = load_row(rows.src[i], p, slot, D);
            } else {
              vi = row_of(i, p);
            }
            if constexpr (bf16_rows) {
              if (sweep_sites) {  // kSweepSites sites per sweep over the row (in L1 after the first)
                acc_t ss = 0;
                for (int64_t q0 = 0; q0 < Q; q0 += kSweepSites) {
                  with_site_count(std::min(kSweepSites, Q - q0), [&](auto sites) {
                    const acc_t group_ss =
                        sumsq_and_dots_rows<decltype(sites)::value>(vi, u_split.data() + q0 * D, D, dots.data() + q0);
                    if (q0 == 0) ss = group_ss;
                  });
                }
                keep(i, k, ss);
                continue;
              }
            }
            keep(i, k, sumsq_and_dots(vi, u, Q, D, dots.data(), vbuf.data()));
          }
        }
        LinePrefetcher next_tile(rows.src, p0 + rows_in_tile, std::min(tile, block_end - p0 - rows_in_tile), D);
        for (int64_t k = 0; k < rows_in_tile; ++k) {
          const int64_t p = p0 + k;
          if constexpr (bf16_rows) {
            if (sweep_sites) {  // pass B of every site, kSweepSites sites per sweep over the rows
              for (int64_t q = 0; q < Q; ++q) {
                acc_t* a = site_alpha.data() + q * N;
                acc_t unused;
                lse[q * M + p] =
                    softmax_weights(s.data() + (k * Q + q) * N, 1, N, static_cast<const acc_t*>(nullptr), a, &unused);
                for (int64_t i = 0; normalize_values && i < N; ++i) a[i] *= rinv[i * M + p];
              }
              for (int64_t q = 0; bf16_out && q < Q; ++q) {
                out_rows[q] = reinterpret_cast<at::BFloat16*>(out.data + (q * M + p) * out.row_bytes);
              }
              for (int64_t q0 = 0; q0 < Q; q0 += kSweepSites) {
                with_site_count(std::min(kSweepSites, Q - q0), [&](auto sites) {
                  weighted_sums_rows<decltype(sites)::value>(
                      v.data() + k * N, site_alpha.data() + q0 * N, N, D, site_h.data() + q0 * D, &next_tile,
                      bf16_out ? out_rows.data() + q0 : nullptr, stream_site_rows ? &site_streams : nullptr);
                });
              }
              for (int64_t q = 0; !bf16_out && q < Q; ++q) write_row(site_h.data() + q * D, q, p, tmp.data());
              continue;
            }
          }
          for (int64_t q = 0; q < Q; ++q) {
            acc_t alpha_a;
            const acc_t* lse_a_q = lse_a != nullptr ? lse_a + q * M + p : nullptr;
            lse[q * M + p] = softmax_weights(s.data() + (k * Q + q) * N, 1, N, lse_a_q, alpha.data(), &alpha_a);
            if (normalize_values) {
              for (int64_t i = 0; i < N; ++i) alpha[i] *= rinv[i * M + p];
            }
            const acc_t* ha = rows.h_a ? load_row(rows.h_a, q * M + p, habuf.data(), D) : nullptr;
            if (stream_sums) {
              src_t* out_row = reinterpret_cast<src_t*>(out.data + (q * M + p) * out.row_bytes);
              if constexpr (std::is_same_v<src_t, acc_t>) {
                weighted_sum<true>(v.data() + k * N, alpha.data(), N, ha, alpha_a, D, out_row, &next_tile);
              } else {
                weighted_sum<true>(v.data() + k * N, alpha.data(), N, ha, alpha_a, D, h.data(), &next_tile, out_row);
              }
              continue;
            }
            weighted_sum(v.data() + k * N, alpha.data(), N, ha, alpha_a, D, h.data(), &next_tile);
            write_row(h.data(), q, p, tmp.data());
          }
        }
      }
    }
    if (stream) fence_streaming_stores();
  });
}

// ---------------------------------------------------------------- backward

// The source-gradient sweep (source_grads_rows) reads and writes the same columns of every source's row
// at each step. The op's outputs start on page boundaries and PyTorch's large tensors 64 bytes after
// one, so the lines of a step fall into one or two sets of the 8-way L1 cache (and the next row's, which
// the step prefetches, into the same ones): our reading of why many sources at once ran slowly (this
// VM has no cache counters). The sweep takes the sources in groups of at most this many. Zen 3, 8192
// rows, D=1024, fp32, 2 threads, alternating runs: N=33, one site 244 / 233 -> 134 / 135 ms (52 / 47 %
// -> 90 / 80 % of a copy's rate); N=17, 3 sites + out norm 143 / 147 -> 121 / 128 ms; N=9, N=17 at one
// site and bf16 within the noise. (Groups of 4 measured the same as of 8.)
constexpr int64_t kSourcesPerSweep = 8;

// source_grads_rows over the sources i0 <= i < i1 of n.
template <int G, typename src_t>
C10_ALWAYS_INLINE void sweep_source_group(const src_t* const* v, int64_t i0, int64_t i1, int64_t n, const float* a,
                                          const float* c1, const float* neg_c2, const float* do_sum_order,
                                          const float* u_sum_order, float* du_sum_order, int64_t dim, src_t* const* dv,
                                          bool stream, const int64_t* next_row_bytes) {
  using fVec = Vectorized<float>;
  constexpr int64_t W = fVec::size();
  int64_t d = 0;
  // Steps of P vector pairs from column d: P = 1, or 2 over bf16 rows where a pair is half a cache line
  // (AVX2): the two pairs of a line share each source's bookkeeping (its pointers, coefficients and
  // prefetch) and go out as a whole line. Zen 3, N=9, D=1024: one site, one thread, 29 % fewer
  // instructions (callgrind: 32.1 k -> 22.8 k per row), 6.1-7.3 -> 4.5-4.9 µs per row with 128 rows in
  // cache, 8192 rows from memory within the noise (6.1-7.0 vs 5.6-6.5; 2 threads 61-75 vs 66-76 % of
  // a copy). With 2-4 sites do, u and du of two pairs do not fit in AVX2's 16 registers and GCC keeps
  // some on the stack, yet the sweep runs 5-8 % fewer instructions (128 rows; 3 sites 23.7 -> 22.4 M)
  // and, from memory (8192 rows, 2 threads, alternating runs), 2 sites 39.4 / 42.5 -> 34.5 / 32.8 ms,
  // 3 sites 46.8 / 53.2 / 48.4 -> 40.4 / 44.6 / 41.4 ms, 3 sites + out norm 56.9 / 66.3 / 67.9 -> 50.3 /
  // 52.8 / 74.9 ms, 4 sites 56.1 / 57.2 -> 49.8 / 56.2 ms (with 128 rows in cache, 3 sites + norm, one
  // thread: 12.6-13.7 -> 13.3-15.1 µs per row).
  // (Always inlined: out of line, as GCC left it for 3 and 4 sites with AVX512, every captured value
  // would be reloaded after each store that might alias it.)
  auto steps = [&](auto pairs) C10_ALWAYS_INLINE_ATTRIBUTE {
    constexpr int P = decltype(pairs)::value;
    constexpr int K = 2 * P;  // float vectors per step
    for (; d + K * W <= dim; d += K * W) {
      // These vectors of every site's do and u, loaded once for the group's sources.
      fVec du_v[G][K], do_v[G][K], u_v[G][K];
#pragma GCC unroll 4
      for (int q = 0; q < G; ++q) {
        for (int k = 0; k < K; ++k) {
          du_v[q][k] = fVec(0.f);
          do_v[q][k] = fVec::loadu(do_sum_order + q * dim + d + k * W);
          u_v[q][k] = fVec::loadu(u_sum_order + q * dim + d + k * W);
        }
      }
      for (int64_t i = i0; i < i1; ++i) {
        if (next_row_bytes != nullptr) {
          const char* next = reinterpret_cast<const char*>(v[i] + d) + next_row_bytes[i];
          for (int64_t line = 0; line < int64_t(K * W * sizeof(src_t)); line += 64) {
            __builtin_prefetch(next + line, 0, 2);
          }
        }
        fVec x[K], g[K];
        for (int p = 0; p < P; ++p)
          std::tie(x[2 * p], x[2 * p + 1]) = vectors_for_sums<src_t, float>(v[i] + d + p * 2 * W);
        for (int k = 0; k < K; ++k) g[k] = x[k] * fVec(neg_c2[i]);
#pragma GCC unroll 4
        for (int q = 0; q < G; ++q) {
          const int64_t qi = q * n + i;
          const fVec aq(a[qi]), cq(c1[qi]);
          for (int k = 0; k < K; ++k) {
            g[k] = at::vec::fmadd(aq, do_v[q][k], at::vec::fmadd(cq, u_v[q][k], g[k]));
            du_v[q][k] = at::vec::fmadd(cq, x[k], du_v[q][k]);
          }
        }
        src_t* out = dv[i] + d;
        if constexpr (kSplitSumOrder<src_t>) {
          for (int p = 0; p < P; ++p) {
            const Vectorized<at::BFloat16> rounded = bf16_from_even_odd(g[2 * p], g[2 * p + 1]);
            if (stream) {  // whole lines: two pairs with AVX2 (P = 2 whenever rows are streamed), one with AVX512
              store_streaming(rounded, out + p * 2 * W);
            } else {
              rounded.store(out + p * 2 * W);
            }
          }
        } else {
          for (int k = 0; k < K; ++k) {
            if (stream) {
              store_streaming(g[k], out + k * W);
            } else {
              g[k].store(out + k * W);
            }
          }
        }
      }
      for (int q = 0; q < G; ++q) {
        float* du = du_sum_order + q * dim + d;
        for (int k = 0; k < K; ++k) (fVec::loadu(du + k * W) + du_v[q][k]).store(du + k * W);
      }
    }
  };
  if constexpr (Bf16LineStreams::kHalfLines && kSplitSumOrder<src_t>) steps(std::integral_constant<int, 2>{});
  steps(std::integral_constant<int, 1>{});  // (the last pair of a row of an odd count of pairs)
  for (; d < dim; ++d) {
    for (int64_t i = i0; i < i1; ++i) {
      const float x = static_cast<float>(v[i][d]);
      float g = neg_c2[i] * x;
      for (int q = 0; q < G; ++q) {
        const int64_t qi = q * n + i;
        g += a[qi] * do_sum_order[q * dim + d] + c1[qi] * u_sum_order[q * dim + d];
        du_sum_order[q * dim + d] += c1[qi] * x;
      }
      dv[i][d] = static_cast<src_t>(g);
    }
  }
}

// The source gradients of one row set, in one sweep over its rows (in cache after the dot
// products): dv_i = Σ_q (a_qi do_q + c1_qi u_q) + neg_c2_i v_i, rounded to src_t and written to dv[i]
// (streamed when `stream`: rows aligned to the vector size), and du_q += Σ_i c1_qi v_i. do, u
// and du are in the sum order (kSplitSumOrder); bf16 results go back into place through
// bf16_from_even_odd. The G = Q <= kSweepSites sites keep their du sums in registers over the
// sources. (The general path converts every row to acc_t and sums du in a pass of its own: for
// bf16 that conversion and the extra passes cost more than the memory traffic, and for fp32 the
// extra passes over several sites' rows do.) With next_row_bytes (source i's next row starts
// next_row_bytes[i] bytes after its row), each vector pair prefetches the same columns of the next
// row: the lines of the next row set spread over the sweep, as a LinePrefetcher would walk them,
// at one instruction each (a LinePrefetcher's bookkeeping per step cost 10-13 % of the bf16 sweeps).
// Not inlined: inside the row loop's body GCC spilled the 6 G vectors of do, u and du to the stack.
template <int G, typename src_t>
C10_NOINLINE void source_grads_rows(const src_t* const* v, int64_t n, const float* a, const float* c1,
                                    const float* neg_c2, const float* do_sum_order, const float* u_sum_order,
                                    float* du_sum_order, int64_t dim, src_t* const* dv, bool stream,
                                    const int64_t* next_row_bytes) {
  // The sources in groups of at most kSourcesPerSweep (as even as they come), one sweep over the columns
  // per group; du takes each group's sums.
  const int64_t groups = (n + kSourcesPerSweep - 1) / kSourcesPerSweep;
  const int64_t group = (n + groups - 1) / groups;
  for (int64_t i0 = 0; i0 < n; i0 += group) {
    sweep_source_group<G>(v, i0, std::min(n, i0 + group), n, a, c1, neg_c2, do_sum_order, u_sum_order, du_sum_order,
                          dim, dv, stream, next_row_bytes);
  }
}

// dst += x for a float row x in the sum order of src_t rows (dst in order), in double.
template <typename src_t>
inline void accumulate_from_sum_order(double* dst, const float* x, int64_t n) {
  if constexpr (kSplitSumOrder<src_t>) {
    using fVec = Vectorized<float>;
    constexpr int64_t W = fVec::size();
    float natural[2 * W];
    int64_t d = 0;
    for (; d + 2 * W <= n; d += 2 * W) {
      const auto [lo, hi] = at::vec::interleave2(fVec::loadu(x + d), fVec::loadu(x + d + W));
      lo.store(natural);
      hi.store(natural + W);
      for (int64_t e = 0; e < 2 * W; ++e) dst[d + e] += static_cast<double>(natural[e]);
    }
    for (; d < n; ++d) dst[d] += static_cast<double>(x[d]);
  } else {
    accumulate_scaled(dst, 1.f, x, n);
  }
}

// Back through the fused output norm y = rstd h ⊙ g (rstd = 1 / sqrt(mean(h²) + eps)) for one row
// of n values: dg += rstd dy ⊙ h and do = rstd g ⊙ dy + k h, k = -rstd³ <g ⊙ dy, h> / n, written
// over gy (n values of scratch). (A function of its own: in the row loop's lambda, GCC reloaded the
// row length from the closure after every store of its loops.)
template <typename T>
inline void out_norm_backward(const T* h, const T* dy, const T* g, T eps, int64_t n, T* gy, T* dg) {
  using Vec = Vectorized<T>;
  constexpr int64_t W = Vec::size();
  const T rstd = T(1) / std::sqrt(dot(h, h, n) / static_cast<T>(n) + eps);
  // One sweep: dg += rstd dy ⊙ h, gy = g ⊙ dy, gy_h = <g ⊙ dy, h>.
  Vec gy_h_acc(T(0));
  int64_t d = 0;
  for (; d + W <= n; d += W) {
    const Vec dyv = Vec::loadu(dy + d), hv = Vec::loadu(h + d), gyv = dyv * Vec::loadu(g + d);
    at::vec::fmadd(dyv * hv, Vec(rstd), Vec::loadu(dg + d)).store(dg + d);
    gyv.store(gy + d);
    gy_h_acc = at::vec::fmadd(gyv, hv, gy_h_acc);
  }
  T gy_h = at::vec::vec_reduce_all<T>([](Vec& a, Vec& b) { return a + b; }, gy_h_acc);
  for (; d < n; ++d) {
    dg[d] += dy[d] * h[d] * rstd;
    gy[d] = dy[d] * g[d];
    gy_h += gy[d] * h[d];
  }
  const T k = -rstd * rstd * rstd * gy_h / static_cast<T>(n);
  for (d = 0; d + W <= n; d += W) {
    at::vec::fmadd(Vec::loadu(gy + d), Vec(rstd), Vec::loadu(h + d) * Vec(k)).store(gy + d);
  }
  for (; d < n; ++d) gy[d] = gy[d] * rstd + h[d] * k;
}

// out_norm_backward for the sweep rows: h, g, dg and do in the sum order, dy read through
// vectors_for_sums (bf16 rows of dy for bf16 sources in place, float rows already in the sum order),
// in two passes over the row: sum(h²) and <g ⊙ dy, h>, then dg += rstd dy ⊙ h and
// do = rstd g ⊙ dy + k h. do_out may be the float row dy (each vector is read before it is written).
// (The general out_norm_backward spent five passes on a row of a bf16 read: dy converted to floats in
// order, sum(h²), g ⊙ dy stored, do formed, then split into the sum order; with h interleaved back
// into order before them.)
template <typename dy_t>
inline void out_norm_backward_sum_order(const float* h, const dy_t* dy, const float* g, float eps, int64_t n, float* dg,
                                        float* do_out) {
  using fVec = Vectorized<float>;
  constexpr int64_t W = fVec::size();
  fVec sumsq_acc[2] = {fVec(0.f), fVec(0.f)}, gy_h_acc[2] = {fVec(0.f), fVec(0.f)};
  int64_t d = 0;
  for (; d + 2 * W <= n; d += 2 * W) {
    const auto [dy_first, dy_second] = vectors_for_sums<dy_t, float>(dy + d);
    const fVec h_first = fVec::loadu(h + d), h_second = fVec::loadu(h + d + W);
    sumsq_acc[0] = at::vec::fmadd(h_first, h_first, sumsq_acc[0]);
    sumsq_acc[1] = at::vec::fmadd(h_second, h_second, sumsq_acc[1]);
    gy_h_acc[0] = at::vec::fmadd(dy_first * fVec::loadu(g + d), h_first, gy_h_acc[0]);
    gy_h_acc[1] = at::vec::fmadd(dy_second * fVec::loadu(g + d + W), h_second, gy_h_acc[1]);
  }
  auto add = [](fVec& a, fVec& b) { return a + b; };
  float sumsq = at::vec::vec_reduce_all<float>(add, sumsq_acc[0] + sumsq_acc[1]);
  float gy_h = at::vec::vec_reduce_all<float>(add, gy_h_acc[0] + gy_h_acc[1]);
  for (int64_t e = d; e < n; ++e) {
    sumsq += h[e] * h[e];
    gy_h += g[e] * static_cast<float>(dy[e]) * h[e];
  }
  const float rstd = 1.f / std::sqrt(sumsq / static_cast<float>(n) + eps);
  const float k = -rstd * rstd * rstd * gy_h / static_cast<float>(n);
  const fVec rstd_v(rstd), k_v(k);
  for (d = 0; d + 2 * W <= n; d += 2 * W) {
    const auto [dy_first, dy_second] = vectors_for_sums<dy_t, float>(dy + d);
    const fVec h_first = fVec::loadu(h + d), h_second = fVec::loadu(h + d + W);
    at::vec::fmadd(dy_first * h_first, rstd_v, fVec::loadu(dg + d)).store(dg + d);
    at::vec::fmadd(dy_second * h_second, rstd_v, fVec::loadu(dg + d + W)).store(dg + d + W);
    at::vec::fmadd(dy_first * fVec::loadu(g + d), rstd_v, h_first * k_v).store(do_out + d);
    at::vec::fmadd(dy_second * fVec::loadu(g + d + W), rstd_v, h_second * k_v).store(do_out + d + W);
  }
  for (; d < n; ++d) {
    const float dy_d = static_cast<float>(dy[d]);
    dg[d] += dy_d * h[d] * rstd;
    do_out[d] = g[d] * dy_d * rstd + h[d] * k;
  }
}

// The backward's row sums (du, dg) are summed over at most this many rows in the accumulation
// dtype, with vector instructions, then added to the chunk's double partial: the rounding of a sum
// of 32 rows stays far below a gradient's, and the scalar double add per element and row it
// replaces cost 13 % of a small read's backward (N=3, 200 rows, D=128, out norm: 76 -> 66 us).
constexpr int64_t kRowsPerFlush = 32;

template <typename acc_t>
void depth_attn_bwd_impl(const SourceRows& in, const at::Tensor& dy_t, const at::Tensor& dlse_t,
                         const at::Tensor& dlogits_t, const at::Tensor& u_t, const at::Tensor& h_a_t,
                         const at::Tensor& lse_a_t, const at::Tensor& g_t, const at::Tensor& logits_t,
                         const at::Tensor& rinv_t, const ReadOptions& options, std::vector<at::Tensor>& dsrc_t,
                         at::Tensor& du_t, at::Tensor& dh_a_t, at::Tensor& dlse_a_t, at::Tensor& dg_t) {
  using Vec = Vectorized<acc_t>;
  const int64_t M = in.num_rows, D = in.dim, N = static_cast<int64_t>(in.rows.size()), Q = u_t.size(0);
  const acc_t out_eps = static_cast<acc_t>(options.out_norm_eps);
  const bool normalize_values = options.normalize_values;
  const acc_t inv_d = acc_t(1) / static_cast<acc_t>(D);
  const ReadRows rows = read_rows(in, h_a_t);
  const RowSlots slots = row_slots<acc_t>(rows.src, D);
  const bool has_prefix = static_cast<bool>(rows.h_a);
  std::vector<OutRows> dsrc(N);
  int64_t grad_bytes = 0;
  for (int64_t i = 0; i < N; ++i) {
    dsrc[i] = out_rows(dsrc_t[i], D);
    grad_bytes += dsrc_t[i].nbytes();
  }
  const bool stream = grad_bytes >= kStreamBytes;
  // Small reads, whose rows stay in cache from the forward, gain nothing from prefetching the next
  // row and pay its bookkeeping per vector.
  const bool prefetch = grad_bytes >= kPrefetchBytes;
  const InRows dy = in_rows(dy_t, D);
  const OutRows dh_a = has_prefix ? out_rows(dh_a_t, D) : OutRows{};
  const acc_t* dlse = dlse_t.defined() ? dlse_t.const_data_ptr<acc_t>() : nullptr;
  const acc_t* dlogits = dlogits_t.defined() ? dlogits_t.const_data_ptr<acc_t>() : nullptr;
  const acc_t* u = u_t.const_data_ptr<acc_t>();
  const acc_t* lse_a = has_prefix ? lse_a_t.const_data_ptr<acc_t>() : nullptr;
  const acc_t* g = g_t.defined() ? g_t.const_data_ptr<acc_t>() : nullptr;
  const acc_t* logits = logits_t.const_data_ptr<acc_t>();
  const acc_t* rinv = rinv_t.const_data_ptr<acc_t>();
  acc_t* dlse_a = has_prefix ? dlse_a_t.mutable_data_ptr<acc_t>() : nullptr;

  // Stage 1 writes one [Q, D] double partial of du (and of dg) per chunk of rows.
  const int64_t chunk = rows_per_chunk(M);
  const int64_t num_chunks = (M + chunk - 1) / chunk;
  const auto part_opts = u_t.options().dtype(at::kDouble);
  at::Tensor du_part = at::empty({num_chunks, Q, D}, part_opts);
  at::Tensor dg_part = g != nullptr ? at::empty({num_chunks, Q, D}, part_opts) : at::Tensor();
  double* du_parts = du_part.mutable_data_ptr<double>();
  double* dg_parts = g != nullptr ? dg_part.mutable_data_ptr<double>() : nullptr;

  // bf16 or fp32 sources (all of one dtype) without a merge prefix are read in sweeps over the row
  // set that serve every site at once (sweep_rows: weighted_sums_rows, sumsq_and_dots_rows,
  // source_grads_rows), bf16 rows without a float copy. Measured at N=9, 8192 rows, D=1024
  // (2 threads, interleaved with a copy of the floor's bytes): bf16, one site: 24.3 -> 12.8 ms,
  // 50 % -> 94 % of the copy's rate.
  const at::ScalarType src_dtype = rows.src.front().dtype;
  bool sweep_rows = std::is_same_v<acc_t, float> && !has_prefix && Q <= kSweepSites &&
                    (src_dtype == at::kBFloat16 || src_dtype == at::kFloat);
  for (const auto& src : rows.src) sweep_rows = sweep_rows && src.dtype == src_dtype;
  const bool src_bf16 = src_dtype == at::kBFloat16;
  std::vector<int64_t> src_row_bytes(N);
  for (int64_t i = 0; i < N; ++i) src_row_bytes[i] = rows.src[i].row_bytes;
  bool stream_rows = stream && (D * static_cast<int64_t>(c10::elementSize(src_dtype))) % 64 == 0;
  for (const auto& grad : dsrc_t) stream_rows = stream_rows && reinterpret_cast<uintptr_t>(grad.data_ptr()) % 64 == 0;
  std::vector<float> u_sum_order(sweep_rows ? Q * D : 0), g_sum_order(sweep_rows && g != nullptr ? Q * D : 0);
  if constexpr (std::is_same_v<acc_t, float>) {
    const auto to_sweep_order = src_bf16 ? to_sum_order<at::BFloat16> : to_sum_order<float>;
    for (int64_t q = 0; sweep_rows && q < Q; ++q) {
      to_sweep_order(u + q * D, D, u_sum_order.data() + q * D);
      if (g != nullptr) to_sweep_order(g + q * D, D, g_sum_order.data() + q * D);
    }
  }
  // Calls fn(sites, src_t{}) for the compile-time site count and source dtype of the sweeps.
  auto with_sweep_types = [&](auto&& fn) {
    with_site_count(Q, [&](auto sites) {
      if (src_bf16) {
        fn(sites, at::BFloat16{});
      } else {
        fn(sites, float{});
      }
    });
  };
  // The output gradients of site q as rows of their own, for the prefetch of the next row's
  // (pass 1 steps it, a share of the lines per source): without it a row's first read of
  // dy waited for memory, the hottest instruction of the 3-site bf16 backward.
  std::vector<InRows> dy_sites(Q);
  for (int64_t q = 0; q < Q; ++q) dy_sites[q] = {dy.data + q * M * dy.row_bytes, dy.row_bytes, dy.dtype};
  const int64_t dy_steps_per_source = (Q * D * static_cast<int64_t>(c10::elementSize(dy.dtype)) / 64 + N - 1) / N;
  // Without the out norm the gradient of h_q is dy_q itself, taken straight into the sum order of
  // the sweeps: bf16 rows of dy for bf16 sources by bf16_row_split, without a float copy in order
  // and a split pass. With bf16_from_even_odd's rounding, measured at N=9, 8192 rows, D=1024
  // (2 threads, % of a copy of the floor's bytes, three A/B runs): 3 sites 62-65 -> 69-72 %, 1 site
  // 82-85 -> 89-90 %. (Reading dy's bf16 rows in place in every sweep instead measured the same.)
  // With the out norm, its backward reads dy's rows in place when they are in the sources' dtype.
  const bool norm_reads_dy = sweep_rows && g != nullptr && dy.dtype == src_dtype;
  const bool dy_to_sum_order = sweep_rows && !norm_reads_dy;

  BlockQueue chunks(num_chunks);
  at::parallel_for(0, num_chunks, BlockQueue::grain(chunk * (2 * N + 2) * Q * D), [&](int64_t, int64_t) {
    // v: the row of every source as acc_t (converted once per row into rowbuf
    // when needed; bf16 sweep rows: vb, read in place); do_[q]: gradient w.r.t. the
    // un-normalized read h_q (do_sum_order: in the sum order, for sweep rows);
    // hbuf: recomputed h_q (out-norm only; in the sum order for sweep rows); alpha/dp: softmax weights
    // and the gradient of α_qi (<do_q, value_i>); weight: α_qi, or α_qi r_i for
    // normalised values (the factor of v_i in h_q); c1_qi = ds_qi r_i and neg_c2_i:
    // the coefficients of u_q and v_i in dv_i (neg_c2 = -c2, negated once per row, not per vector); du_sum_order: the
    // sweep rows' du sums of the last rows, before they go to the chunk's double partial.
    std::vector<acc_t> rowbuf(sweep_rows ? 0 : slots.size), do_(Q * D), hbuf(g != nullptr ? Q * D : 0), vbuf(D);
    std::vector<acc_t> dvbuf(D), tmp(D);
    std::vector<acc_t> alpha(Q * N), dp(Q * N), alpha_a(Q), dp_a(Q), delta(Q), c1(Q * N), neg_c2(N), dots(Q);
    std::vector<acc_t> scaled_alpha(normalize_values ? Q * N : 0);
    std::vector<float> do_sum_order(sweep_rows ? Q * D : 0), du_sum_order(sweep_rows ? Q * D : 0);
    const acc_t* weight = normalize_values ? scaled_alpha.data() : alpha.data();
    std::vector<const acc_t*> v(N);
    std::vector<const at::BFloat16*> vb(sweep_rows && src_bf16 ? N : 0);
    std::vector<at::BFloat16*> dvb(sweep_rows && src_bf16 ? N : 0);
    std::vector<float*> dvf(sweep_rows && !src_bf16 ? N : 0);  // fp32 sweep rows' gradients (v: the rows)
    // The sweeps' rows and gradient rows in src_t (a tag value).
    auto sweep_rows_of = [&](auto tag) {
      if constexpr (std::is_same_v<decltype(tag), at::BFloat16>) {
        return std::make_pair(vb.data(), dvb.data());
      } else {
        return std::make_pair(v.data(), dvf.data());
      }
    };
    // du_rows / dg_rows: du and dg summed over the rows since the last flush (kRowsPerFlush); dg_rows
    // in the sum order for sweep rows.
    std::vector<acc_t> du_rows(sweep_rows ? 0 : Q * D), dg_rows(g != nullptr ? Q * D : 0);
    auto flush_rows = [](std::vector<acc_t>& sums, double* partial) {
      accumulate_scaled(partial, acc_t(1), sums.data(), static_cast<int64_t>(sums.size()));
      std::fill(sums.begin(), sums.end(), acc_t(0));
    };
    for (int64_t c; chunks.next(c);) {
      double* du_c = du_parts + c * Q * D;
      double* dg_c = g != nullptr ? dg_parts + c * Q * D : nullptr;
      std::fill(du_c, du_c + Q * D, 0.0);
      if (dg_c != nullptr) std::fill(dg_c, dg_c + Q * D, 0.0);
      const int64_t chunk_end = std::min(M, (c + 1) * chunk);
      for (int64_t p = c * chunk; p < chunk_end; ++p) {
        const bool flush = (p - c * chunk + 1) % kRowsPerFlush == 0 || p + 1 == chunk_end;  // the row sums
        for (int64_t i = 0; i < N; ++i) {
          if (sweep_rows && src_bf16) {
            vb[i] = reinterpret_cast<const at::BFloat16*>(rows.src[i].data + p * rows.src[i].row_bytes);
            dvb[i] = reinterpret_cast<at::BFloat16*>(dsrc[i].data + p * dsrc[i].row_bytes);
            continue;
          }
          v[i] = load_row(rows.src[i], p, slots.offset[i] < 0 ? nullptr : rowbuf.data() + slots.offset[i], D);
          if (sweep_rows) dvf[i] = reinterpret_cast<float*>(dsrc[i].data + p * dsrc[i].row_bytes);
        }
        const int64_t rows_ahead = prefetch && p + 1 < chunk_end ? 1 : 0;
        LinePrefetcher next_row(rows.src, p + 1, rows_ahead, D);
        LinePrefetcher next_dy(dy_sites, p + 1, rows_ahead, D);
        for (int64_t q = 0; q < Q; ++q) {
          softmax_weights(logits + q * N * M + p, M, N, has_prefix ? lse_a + q * M + p : nullptr, alpha.data() + q * N,
                          alpha_a.data() + q);
          if (dy_to_sum_order && src_bf16 && dy.dtype == at::kBFloat16) {
            bf16_row_split(reinterpret_cast<const at::BFloat16*>(dy.data + (q * M + p) * dy.row_bytes), D,
                           do_sum_order.data() + q * D);
          } else if (dy_to_sum_order) {
            const acc_t* dyq = load_row(dy, q * M + p, vbuf.data(), D);
            if constexpr (std::is_same_v<acc_t, float>) {
              (src_bf16 ? to_sum_order<at::BFloat16> : to_sum_order<float>)(dyq, D, do_sum_order.data() + q * D);
            }
          } else if (g == nullptr) {  // (with the out norm, its backward reads dy)
            const acc_t* dyq = load_row(dy, q * M + p, vbuf.data(), D);
            std::copy(dyq, dyq + D, do_.data() + q * D);
          }
          for (int64_t i = 0; normalize_values && i < N; ++i) {
            scaled_alpha[q * N + i] = alpha[q * N + i] * rinv[i * M + p];
          }
        }
        if (g != nullptr) {
          // Recompute h = Σ α v (+ α_a h_a), then back through y = h * rstd(h) * g.
          if constexpr (std::is_same_v<acc_t, float>) {
            if (sweep_rows) {  // every site's h in one sweep over the rows, all in the sum order
              with_sweep_types([&](auto sites, auto tag) {
                using src_t = decltype(tag);
                weighted_sums_rows<decltype(sites)::value, src_t, true>(sweep_rows_of(tag).first, weight, N, D,
                                                                        hbuf.data(), nullptr);
                for (int64_t q = 0; q < Q; ++q) {
                  float* do_q = do_sum_order.data() + q * D;  // dy in the sum order unless norm_reads_dy
                  const float* hq = hbuf.data() + q * D;
                  const float* gq = g_sum_order.data() + q * D;
                  if (norm_reads_dy) {
                    const auto* dyq = reinterpret_cast<const src_t*>(dy.data + (q * M + p) * dy.row_bytes);
                    out_norm_backward_sum_order(hq, dyq, gq, out_eps, D, dg_rows.data() + q * D, do_q);
                  } else {
                    out_norm_backward_sum_order(hq, static_cast<const float*>(do_q), gq, out_eps, D,
                                                dg_rows.data() + q * D, do_q);
                  }
                }
              });
            }
          }
          for (int64_t q = 0; q < Q && !sweep_rows; ++q) {
            acc_t* hq = hbuf.data() + q * D;
            const acc_t* ha = has_prefix ? load_row(rows.h_a, q * M + p, vbuf.data(), D) : nullptr;
            weighted_sum(v.data(), weight + q * N, N, ha, alpha_a[q], D, hq);
            const acc_t* dyq = load_row(dy, q * M + p, vbuf.data(), D);  // in place when in acc_t
            out_norm_backward(hq, dyq, g + q * D, out_eps, D, do_.data() + q * D, dg_rows.data() + q * D);
          }
        }
        // Pass 1: dp_qi = <do_q, value_i> (value_i = v_i, or r_i v_i for normalised
        // values), delta_q = <do_q, h_q> = Σ_i α_qi dp_qi.
        std::fill(delta.begin(), delta.end(), acc_t(0));
        for (int64_t i = 0; i < N; ++i) {
          const acc_t value_scale = normalize_values ? rinv[i * M + p] : acc_t(1);
          if constexpr (std::is_same_v<acc_t, float>) {  // <do_q, v_i> of every site in one sweep over v_i
            if (sweep_rows) {
              with_sweep_types([&](auto sites, auto tag) {
                sumsq_and_dots_rows<decltype(sites)::value, decltype(tag), false>(sweep_rows_of(tag).first[i],
                                                                                  do_sum_order.data(), D, dots.data());
              });
            }
          }
          for (int64_t q = 0; q < Q; ++q) {
            dp[q * N + i] = (sweep_rows ? dots[q] : dot(do_.data() + q * D, v[i], D)) * value_scale;
            delta[q] += alpha[q * N + i] * dp[q * N + i];
          }
          for (int64_t k = 0; k < dy_steps_per_source; ++k) next_dy.step();
        }
        if (has_prefix) {
          for (int64_t q = 0; q < Q; ++q) {
            const acc_t* ha = load_row(rows.h_a, q * M + p, vbuf.data(), D);
            dp_a[q] = dot(do_.data() + q * D, ha, D);
            delta[q] += alpha_a[q] * dp_a[q];
          }
        }
        // Pass 2: ds = α (dp - delta + dlse) + dlogits; c1 = ds r;
        // dv_i = Σ_q α_qi do_q + c1_qi u_q - (Σ_q ds_qi s_qi) r_i^2 v_i / D;  du_q += Σ_i c1_qi v_i.
        // Normalised values add their own norm's gradient: dv_i = Σ_q α_qi r_i do_q + c1_qi u_q
        // - (Σ_q ds_qi s_qi + α_qi dp_qi) r_i^2 v_i / D.
        for (int64_t i = 0; i < N; ++i) {
          const acc_t r = rinv[i * M + p];
          acc_t c2_i = 0;
          for (int64_t q = 0; q < Q; ++q) {
            const int64_t qi = q * N + i;
            acc_t ds = alpha[qi] * (dp[qi] - delta[q] + (dlse != nullptr ? dlse[q * M + p] : acc_t(0)));
            if (dlogits != nullptr) ds += dlogits[qi * M + p];
            c1[qi] = ds * r;
            c2_i += ds * logits[qi * M + p] + (normalize_values ? alpha[qi] * dp[qi] : acc_t(0));
          }
          neg_c2[i] = -(c2_i * r * r * inv_d);
        }
        if constexpr (std::is_same_v<acc_t, float>) {
          if (sweep_rows) {
            with_sweep_types([&](auto sites, auto tag) {
              const auto [src_rows, grad_rows] = sweep_rows_of(tag);
              source_grads_rows<decltype(sites)::value>(
                  src_rows, N, weight, c1.data(), neg_c2.data(), do_sum_order.data(), u_sum_order.data(),
                  du_sum_order.data(), D, grad_rows, stream_rows, rows_ahead > 0 ? src_row_bytes.data() : nullptr);
              for (int64_t q = 0; flush && q < Q; ++q) {
                accumulate_from_sum_order<decltype(tag)>(du_c + q * D, du_sum_order.data() + q * D, D);
                if (g != nullptr) accumulate_from_sum_order<decltype(tag)>(dg_c + q * D, dg_rows.data() + q * D, D);
              }
            });
            if (flush) std::fill(du_sum_order.begin(), du_sum_order.end(), 0.f);
            if (flush) std::fill(dg_rows.begin(), dg_rows.end(), 0.f);
            continue;
          }
        }
        for (int64_t i = 0; i < N; ++i) {
          const acc_t* vi = v[i];
          // The gradient row itself when it is in acc_t and not streamed, else a row buffer.
          const bool in_place = !stream && dsrc[i].dtype == c10::CppTypeToScalarType<acc_t>::value;
          acc_t* dv_row = in_place ? reinterpret_cast<acc_t*>(dsrc[i].data + p * dsrc[i].row_bytes) : dvbuf.data();
          int64_t d = 0;
          for (; d + Vec::size() <= D; d += Vec::size()) {
            next_row.step();
            const Vec vv = Vec::loadu(vi + d);
            Vec dv = vv * Vec(neg_c2[i]);
            for (int64_t q = 0; q < Q; ++q) {
              dv = at::vec::fmadd(Vec(weight[q * N + i]), Vec::loadu(do_.data() + q * D + d), dv);
              dv = at::vec::fmadd(Vec(c1[q * N + i]), Vec::loadu(u + q * D + d), dv);
            }
            dv.store(dv_row + d);
          }
          for (; d < D; ++d) {
            acc_t dv = neg_c2[i] * vi[d];
            for (int64_t q = 0; q < Q; ++q) dv += weight[q * N + i] * do_[q * D + d] + c1[q * N + i] * u[q * D + d];
            dv_row[d] = dv;
          }
          if (!in_place) store_row(dv_row, dsrc[i], p, D, stream, tmp.data());
        }
        // du_q += Σ_i c1_qi v_i: summed over the sources in registers, into the rows' sum.
        for (int64_t q = 0; q < Q; ++q) {
          acc_t* du_q = du_rows.data() + q * D;
          weighted_sum(v.data(), c1.data() + q * N, N, static_cast<const acc_t*>(du_q), acc_t(1), D, du_q);
        }
        if (flush) {
          flush_rows(du_rows, du_c);
          if (g != nullptr) flush_rows(dg_rows, dg_c);
        }
        if (has_prefix) {
          for (int64_t q = 0; q < Q; ++q) {
            const acc_t dl = dlse != nullptr ? dlse[q * M + p] : acc_t(0);
            dlse_a[q * M + p] = alpha_a[q] * (dp_a[q] - delta[q] + dl);
            at::vec::map<acc_t>([a = alpha_a[q]](auto x) { return x * decltype(x)(a); }, dvbuf.data(),
                                do_.data() + q * D, D);
            store_row(dvbuf.data(), dh_a, q * M + p, D, stream, tmp.data());
          }
        }
      }
    }
    if (stream) fence_streaming_stores();
  });

  // Stage 2: sum the chunk partials in chunk order.
  sum_chunks(du_parts, num_chunks, Q * D, du_t.mutable_data_ptr<acc_t>());
  if (g != nullptr) sum_chunks(dg_parts, num_chunks, Q * D, dg_t.mutable_data_ptr<acc_t>());
}

// The gradients of query, norm_weight and out_norm_weight from du ([Q, D], the
// gradient of u = query ⊙ norm_weight) and dg ([Q, D]), each in its parameter's
// shape (a [D] parameter shared by Q sites gets the sum over the sites) and
// dtype: site_param_grads (depth_attention.h) as plain loops, since at the
// sizes of a small read its ATen ops cost more than the kernel.
template <typename acc_t>
std::tuple<at::Tensor, at::Tensor, at::Tensor> site_param_grads_cpu(const at::Tensor& du_t, const at::Tensor& dg_t,
                                                                    const at::Tensor& query,
                                                                    const c10::optional<at::Tensor>& norm_weight,
                                                                    const c10::optional<at::Tensor>& out_norm_weight,
                                                                    double scale) {
  const int64_t Q = du_t.size(0), D = du_t.size(1);
  const auto acc = du_t.scalar_type();
  // A [D] or [Q, D] parameter as contiguous acc_t values, read at (q, j).
  struct Values {
    at::Tensor t;
    const acc_t* data = nullptr;
    int64_t site_stride = 0;
    acc_t operator()(int64_t q, int64_t j) const { return data != nullptr ? data[q * site_stride + j] : acc_t(1); }
  };
  auto values = [&](const c10::optional<at::Tensor>& param) {
    Values v;
    if (!param.has_value()) return v;  // absent: ones
    v.t = param->to(acc).contiguous();
    v.data = v.t.template const_data_ptr<acc_t>();
    v.site_stride = param->dim() == 2 ? D : 0;
    return v;
  };
  auto grad = [&](const at::Tensor& param, auto value) {
    at::Tensor out = at::empty(param.sizes(), param.options().dtype(acc));
    acc_t* o = out.template mutable_data_ptr<acc_t>();
    for (int64_t j = 0; j < D; ++j) {
      if (param.dim() == 1) {
        acc_t sum = 0;
        for (int64_t q = 0; q < Q; ++q) sum += value(q, j);
        o[j] = sum;
      } else {
        for (int64_t q = 0; q < Q; ++q) o[q * D + j] = value(q, j);
      }
    }
    return out.to(param.scalar_type());
  };
  // du is the gradient of u = scale * query ⊙ norm_weight.
  const acc_t* du = du_t.const_data_ptr<acc_t>();
  const acc_t sc = static_cast<acc_t>(scale);
  const Values w = values(query), gamma = values(norm_weight);
  const at::Tensor empty = at::empty({0}, du_t.options());
  at::Tensor d_query = grad(query, [&](int64_t q, int64_t j) { return du[q * D + j] * sc * gamma(q, j); });
  at::Tensor d_norm = norm_weight.has_value()
                          ? grad(*norm_weight, [&](int64_t q, int64_t j) { return du[q * D + j] * sc * w(q, j); })
                          : empty;
  at::Tensor d_g = empty;
  if (out_norm_weight.has_value()) {
    const acc_t* dg = dg_t.const_data_ptr<acc_t>();
    d_g = grad(*out_norm_weight, [&](int64_t q, int64_t j) { return dg[q * D + j]; });
  }
  return {d_query, d_norm, d_g};
}

// ---------------------------------------------------------------- op entry points

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> depth_attn_fwd_cpu(
    at::TensorList sources, const at::Tensor& query, const c10::optional<at::Tensor>& norm_weight,
    const c10::optional<at::Tensor>& prefix_out, const c10::optional<at::Tensor>& prefix_lse,
    const c10::optional<at::Tensor>& out_norm_weight, ATTNRES_READ_OPTIONS_PARAMS) {
  const CheckedRead read =
      check_read(sources, query, norm_weight, prefix_out, prefix_lse, out_norm_weight, ATTNRES_READ_OPTIONS);
  TORCH_CHECK(!read.options.key_rank.has_value(),
              "depth attention (cpu): sliced low-rank keys (key_rank < D) have no CPU kernel yet");
  const SourceRows& in = read.in;
  const SiteParams& site = read.site;
  const auto acc = in.acc_dtype;
  const int64_t n = static_cast<int64_t>(in.rows.size());
  const auto opts = in.rows[0].options();
  std::vector<int64_t> qn = site.q_dims;
  qn.push_back(n);
  at::Tensor out = empty_output(shape_with(site.q_dims, in.lead_shape, {in.dim}), opts.dtype(in.out_dtype));
  at::Tensor lse = at::empty(shape_with(site.q_dims, in.lead_shape), opts.dtype(acc));
  at::Tensor logits = at::empty(shape_with(qn, in.lead_shape), opts.dtype(acc));
  at::Tensor rinv = at::empty(shape_with({n}, in.lead_shape), opts.dtype(acc));
  const auto src_dtype = in.uniform_dtype() ? in.rows[0].scalar_type() : acc;
  auto run = [&](auto acc_zero, auto src_zero) {
    depth_attn_fwd_impl<decltype(acc_zero), decltype(src_zero)>(in, site.u, read.h_a, read.lse_a, site.g, read.options,
                                                                out, lse, logits, rinv);
  };
  if (acc == at::kDouble) {
    run(double(), double());
  } else if (src_dtype == at::kBFloat16) {
    run(float(), at::BFloat16());
  } else if (src_dtype == at::kHalf) {
    run(float(), at::Half());
  } else {
    run(float(), float());
  }
  return {out, lse, logits, rinv};
}

std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> depth_attn_bwd_cpu(
    const at::Tensor& grad_out, const c10::optional<at::Tensor>& grad_lse, const c10::optional<at::Tensor>& grad_logits,
    at::TensorList sources, const at::Tensor& query, const c10::optional<at::Tensor>& norm_weight,
    const c10::optional<at::Tensor>& prefix_out, const c10::optional<at::Tensor>& prefix_lse,
    const c10::optional<at::Tensor>& out_norm_weight, const at::Tensor& logits, const at::Tensor& rinv,
    ATTNRES_READ_OPTIONS_PARAMS) {
  const CheckedRead read =
      check_read(sources, query, norm_weight, prefix_out, prefix_lse, out_norm_weight, ATTNRES_READ_OPTIONS);
  TORCH_CHECK(!read.options.key_rank.has_value(),
              "depth attention (cpu): sliced low-rank keys (key_rank < D) have no CPU kernel yet");
  const SourceRows& in = read.in;
  const SiteParams& site = read.site;
  const at::Tensor &h_a = read.h_a, &lse_a = read.lse_a;
  const int64_t n = static_cast<int64_t>(in.rows.size());
  const auto acc = in.acc_dtype;
  const SavedForBackward saved = check_saved_for_backward(read, grad_out, grad_lse, grad_logits, logits, rinv);

  std::vector<at::Tensor> dsrc;
  dsrc.reserve(n);
  for (int64_t i = 0; i < n; ++i) dsrc.push_back(empty_output(sources[i].sizes(), sources[i].options()));
  at::Tensor du = at::empty_like(site.u);
  at::Tensor dh_a = h_a.defined() ? empty_output(h_a.sizes(), h_a.options()) : at::empty({0}, in.rows[0].options());
  at::Tensor dlse_a = h_a.defined() ? at::empty_like(lse_a) : at::empty({0}, site.u.options());
  at::Tensor dg = site.g.defined() ? at::empty_like(site.g) : at::Tensor();
  at::Tensor d_query, d_norm, d_g;
  auto run = [&](auto acc_zero) {
    using acc_t = decltype(acc_zero);
    depth_attn_bwd_impl<acc_t>(in, saved.grad_out, saved.grad_lse, saved.grad_logits, site.u, h_a, lse_a, site.g,
                               saved.logits, saved.rinv, read.options, dsrc, du, dh_a, dlse_a, dg);
    std::tie(d_query, d_norm, d_g) =
        site_param_grads_cpu<acc_t>(du, dg, query, norm_weight, out_norm_weight, read.options.scale);
  };
  if (acc == at::kDouble) {
    run(double());
  } else {
    run(float());
  }
  return {dsrc, d_query, d_norm, dh_a, dlse_a, d_g};
}

}  // namespace

TORCH_LIBRARY_IMPL(attnres, CPU, m) {
  m.impl("depth_attn_fwd", &depth_attn_fwd_cpu);
  m.impl("depth_attn_bwd", &depth_attn_bwd_cpu);
}

}  // namespace attnres
