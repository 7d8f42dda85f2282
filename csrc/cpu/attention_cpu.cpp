// CPU kernels of fused attention (DESIGN.md §2.4), FlashAttention-2 style:
//
//   o = softmax(q kᵀ · scale + mask) v,   q [B, H, Tq, Dh],  k, v [B, Hkv, Tk, Dh],  H % Hkv == 0
//
// Forward: a program owns kBlockQ query rows of one head, keeps their output
// accumulator, running max and running sum, and walks the keys in tiles of
// kTileK (online softmax). Nothing of size T×T is ever stored; the saved lse
// (fp32, fp64 for fp64 inputs) lets the backward recompute the probabilities.
//
// Backward (see "backward" below): pairs of a query tile and a key block,
// computed with the keys on the rows (Sᵀ = K qᵀ, Pᵀ = exp(Sᵀ · scale - lse),
// dPᵀ = V dOᵀ, dSᵀ = Pᵀ ⊙ (dPᵀ - δ)) and consumed by dV += Pᵀ dO, dK += dSᵀ q,
// dQᵀ += Kᵀ dSᵀ (dK, dQ times scale), with δ = rowsum(dO ⊙ O) - dlse from a first
// row pass. No atomics: every output tile is summed by one program in a fixed
// order, so the result does not depend on the number of threads.
//
// Causal masks (query i sees keys j <= i + Tk - Tq) skip every tile above the
// diagonal: a query block stops at its last visible key, a key block starts at
// its first query, and within a diagonal tile the GEMMs are trimmed to the rows
// and columns some query/key of the tile can see. Key padding is an additive
// 0 / -inf bias per key. A query row that sees no key gets output 0,
// lse = -inf and zero gradients.
//
// GEMM operands are fp32 (fp64 for fp64 inputs) [rows, Dh] tiles: fp32 input
// rows are read in place (any row stride), other dtypes are converted into
// per-thread buffers once per tile; transposed operands are always packed.
// Buffer widths are multiples of kAlign. The inner products go through a GEMM
// on those tiles (see gemm() below).
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/Utils.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/zeros.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "../attention.h"
#include "row_math.h"

namespace attnres {
namespace {

template <typename T>
using Vec = at::vec::Vectorized<T>;

// Tile sizes (rows). Forward: kBlockQ query rows per program, keys in tiles of
// kTileK. Backward: pairs of kTileQ queries and kBlockK keys (the split dQ
// pass groups kBlockQ / kTileQ query tiles per program). Buffer widths are
// padded to multiples of kAlign. A problem shorter than a tile uses one tile of
// its own length rounded up to kAlign (Problem::block_q etc.): the same single
// tile, with buffers sized to it (a decode step's one query would otherwise
// allocate and clear a 256 × 256 score tile).
constexpr int64_t kBlockQ = 256;
constexpr int64_t kTileK = 256;
constexpr int64_t kBlockK = 256;
constexpr int64_t kTileQ = 64;
constexpr int64_t kAlign = 16;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// The t-th of n tiles of one head in the order 0, n-1, 1, n-2, ...: at::parallel_for
// hands each thread a contiguous range of work items, and with causal masks the
// cost of a tile grows with its index, so this order balances the threads.
inline int64_t balanced_tile(int64_t t, int64_t n) { return t % 2 == 0 ? t / 2 : n - 1 - t / 2; }

// ---------------------------------------------------------------- problem and inputs

// The shared problem sizes (../attention.h) plus the row length of the packed
// tiles and the tile sizes of this problem.
struct Problem : AttentionProblem {
  int64_t dh_padded;                         // Dh rounded up to kAlign: the row length of every packed [rows, Dh] tile
  int64_t block_q, tile_k, block_k, tile_q;  // kBlockQ, kTileK, kBlockK, kTileQ, or T rounded up when shorter
};

Problem check_problem(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const c10::optional<at::Tensor>& key_padding_mask, bool causal, double scale) {
  const AttentionProblem shared = check_attention_problem(q, k, v, key_padding_mask, causal, scale);
  const int64_t tq_padded = round_up(std::max<int64_t>(shared.tq, 1), kAlign);
  const int64_t tk_padded = round_up(std::max<int64_t>(shared.tk, 1), kAlign);
  return {shared,
          round_up(shared.dh, kAlign),
          std::min(kBlockQ, tq_padded),
          std::min(kTileK, tk_padded),
          std::min(kBlockK, tk_padded),
          std::min(kTileQ, tq_padded)};
}

// The rows of a [B, heads, T, Dh] tensor whose last dim is unit-stride (any other strides).
template <typename scalar_t>
struct HeadRows {
  const scalar_t* data;
  int64_t stride_b, stride_h, stride_t;
  const scalar_t* row(int64_t b, int64_t h, int64_t t) const {
    return data + b * stride_b + h * stride_h + t * stride_t;
  }
};

// A copy only when the last dim is not unit-stride.
inline at::Tensor unit_last_stride(const at::Tensor& t) {
  return t.size(3) <= 1 || t.stride(3) == 1 ? t : t.contiguous();
}

template <typename scalar_t>
HeadRows<scalar_t> head_rows(const at::Tensor& t) {
  return {t.const_data_ptr<scalar_t>(), t.stride(0), t.stride(1), t.stride(2)};
}

// Key padding as an additive bias per key, [B, Tk] in the accumulation dtype
// (0 for a real key, -inf for padding); undefined without a mask.
at::Tensor key_bias(const c10::optional<at::Tensor>& key_padding_mask, at::ScalarType acc) {
  if (!key_padding_mask.has_value()) return at::Tensor();
  at::Tensor bias = at::zeros(key_padding_mask->sizes(), key_padding_mask->options().dtype(acc));
  return bias.masked_fill_(key_padding_mask->logical_not(), -std::numeric_limits<double>::infinity());
}

// ---------------------------------------------------------------- row helpers

// dst[0:n] = mul * src[0:n] in T; dst[n:n_padded] = 0.
template <typename scalar_t, typename T>
inline void load_row(const scalar_t* src, int64_t n, T mul, T* dst, int64_t n_padded) {
  int64_t d = 0;
  if constexpr (std::is_same_v<scalar_t, T>) {
    const Vec<T> vmul(mul);
    for (; d + Vec<T>::size() <= n; d += Vec<T>::size()) (Vec<T>::loadu(src + d) * vmul).store(dst + d);
  } else {
    static_assert(std::is_same_v<T, float>, "half and bfloat16 are computed in float");
    const Vec<float> vmul(mul);
    for (; d + Vec<scalar_t>::size() <= n; d += Vec<scalar_t>::size()) {
      auto [lo, hi] = at::vec::convert_to_float<scalar_t>(Vec<scalar_t>::loadu(src + d));
      (lo * vmul).store(dst + d);
      (hi * vmul).store(dst + d + Vec<float>::size());
    }
  }
  for (; d < n; ++d) dst[d] = mul * static_cast<T>(src[d]);
  std::fill(dst + n, dst + n_padded, T(0));
}

// Rows [t0, t0 + n) of head (b, h) into dst [n, ldd] (scaled by mul; columns Dh..ldd zeroed).
template <typename scalar_t, typename T>
inline void load_rows(const HeadRows<scalar_t>& x, int64_t b, int64_t h, int64_t t0, int64_t n, int64_t dh, T mul,
                      T* dst, int64_t ldd) {
  for (int64_t r = 0; r < n; ++r) load_row(x.row(b, h, t0 + r), dh, mul, dst + r * ldd, ldd);
}

// A [rows, Dh] GEMM operand: the input rows themselves when they already are
// fp32 rows (unit stride, not overlapping), else a copy converted to T in a
// packing buffer. `cols` is what a GEMM may read as its N: Dh in place, Dh
// padded to kAlign in a buffer (gemm_vec works on whole vectors).
template <typename T>
struct Operand {
  const T* data;
  int64_t ld, cols;
};

template <typename scalar_t>
inline bool rows_in_place(const HeadRows<scalar_t>& x, int64_t dh) {
  return std::is_same_v<scalar_t, float> && x.stride_t >= dh;
}

template <typename scalar_t, typename T>
inline Operand<T> rows_operand(const HeadRows<scalar_t>& x, int64_t b, int64_t h, int64_t t0, int64_t n, int64_t dh,
                               int64_t dhp, T* buf) {
  if (rows_in_place(x, dh)) return {reinterpret_cast<const T*>(x.row(b, h, t0)), x.stride_t, dh};
  load_rows(x, b, h, t0, n, dh, T(1), buf, dhp);
  return {buf, dhp, dhp};
}

// dst[0:n] = mul * src[0:n] as scalar_t (src is scaled in place).
template <typename scalar_t, typename T>
inline void store_row(T* src, int64_t n, T mul, scalar_t* dst) {
  if (mul != T(1)) at::vec::map([mul](Vec<T> x) { return x * Vec<T>(mul); }, src, src, n);
  if constexpr (std::is_same_v<scalar_t, T>) {
    std::copy(src, src + n, dst);
  } else {
    at::vec::convert(src, dst, n);
  }
}

// dst[c, r] = src[r, c] for r < rows, c < cols, and dst[c, rows:rows_padded] = 0.
template <typename T>
inline void transpose_padded(const T* src, int64_t ld_src, int64_t rows, int64_t cols, T* dst, int64_t ld_dst,
                             int64_t rows_padded) {
  if constexpr (std::is_same_v<T, float>) {
    at::vec::transpose_mxn<float>(src, ld_src, dst, ld_dst, static_cast<int>(rows), static_cast<int>(cols));
  } else {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) dst[c * ld_dst + r] = src[r * ld_src + c];
  }
  if (rows_padded > rows)
    for (int64_t c = 0; c < cols; ++c) std::fill(dst + c * ld_dst + rows, dst + c * ld_dst + rows_padded, T(0));
}

// dst[d, r] = x[t0 + r, d] for r < n, d < Dh, zero-padded to n_padded columns
// (buf: packing space for inputs that are not fp32 rows).
template <typename scalar_t, typename T>
inline void load_rows_transposed(const HeadRows<scalar_t>& x, int64_t b, int64_t h, int64_t t0, int64_t n, int64_t dh,
                                 int64_t dhp, T* buf, T* dst, int64_t ld_dst, int64_t n_padded) {
  const Operand<T> src = rows_operand(x, b, h, t0, n, dh, dhp, buf);
  transpose_padded(src.data, src.ld, n, dh, dst, ld_dst, n_padded);
}

// exp of finite or -inf arguments (for float at::vec's fast exp, 20 ulp).
template <typename T>
inline Vec<T> exp_finite(const Vec<T>& x) {
  if constexpr (std::is_same_v<T, float>) {
    return x.exp_u20();
  } else {
    return x.exp();
  }
}

// exp that lets NaN through (the fast float exp maps NaN to a finite value).
template <typename T>
inline Vec<T> exp_vec(const Vec<T>& x) {
  return Vec<T>::blendv(exp_finite(x), x, x.isnan());
}

template <typename T>
inline T max_propagating_nan(T a, T b) {
  return (std::isnan(a) || std::isnan(b)) ? std::numeric_limits<T>::quiet_NaN() : std::max(a, b);
}

template <typename T>
inline T reduce_max(const Vec<T>& v) {
  return at::vec::vec_reduce_all<T>([](Vec<T>& a, Vec<T>& b) { return at::vec::maximum(a, b); }, v);
}

template <typename T>
inline T reduce_sum(const Vec<T>& v) {
  return at::vec::vec_reduce_all<T>([](Vec<T>& a, Vec<T>& b) { return a + b; }, v);
}

// x[0:n] += bias[0:n]
template <typename T>
inline void add_bias(T* x, const T* bias, int64_t n) {
  int64_t d = 0;
  for (; d + Vec<T>::size() <= n; d += Vec<T>::size()) (Vec<T>::loadu(x + d) + Vec<T>::loadu(bias + d)).store(x + d);
  for (; d < n; ++d) x[d] += bias[d];
}

// ---------------------------------------------------------------- GEMM

// C[M, N] = A[M, K] · B[K, N] (+ C when `accumulate`); row-major with leading
// dimensions; N is a multiple of kAlign. A register-blocked at::vec kernel:
// MR rows × two vectors of C stay in registers while K is walked.
template <typename T, int MR>
inline void gemm_row_block(int64_t N, int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb, T* C, int64_t ldc,
                           bool accumulate) {
  constexpr int64_t W = Vec<T>::size();
  int64_t j = 0;
  for (; j + 2 * W <= N; j += 2 * W) {
    Vec<T> c0[MR], c1[MR];
    for (int r = 0; r < MR; ++r) {
      c0[r] = accumulate ? Vec<T>::loadu(C + r * ldc + j) : Vec<T>(T(0));
      c1[r] = accumulate ? Vec<T>::loadu(C + r * ldc + j + W) : Vec<T>(T(0));
    }
    for (int64_t k = 0; k < K; ++k) {
      const Vec<T> b0 = Vec<T>::loadu(B + k * ldb + j);
      const Vec<T> b1 = Vec<T>::loadu(B + k * ldb + j + W);
      for (int r = 0; r < MR; ++r) {
        const Vec<T> a(A[r * lda + k]);
        c0[r] = at::vec::fmadd(a, b0, c0[r]);
        c1[r] = at::vec::fmadd(a, b1, c1[r]);
      }
    }
    for (int r = 0; r < MR; ++r) {
      c0[r].store(C + r * ldc + j);
      c1[r].store(C + r * ldc + j + W);
    }
  }
  for (; j < N; j += W) {
    Vec<T> c0[MR];
    for (int r = 0; r < MR; ++r) c0[r] = accumulate ? Vec<T>::loadu(C + r * ldc + j) : Vec<T>(T(0));
    for (int64_t k = 0; k < K; ++k) {
      const Vec<T> b0 = Vec<T>::loadu(B + k * ldb + j);
      for (int r = 0; r < MR; ++r) c0[r] = at::vec::fmadd(Vec<T>(A[r * lda + k]), b0, c0[r]);
    }
    for (int r = 0; r < MR; ++r) c0[r].store(C + r * ldc + j);
  }
}

template <typename T>
inline void gemm_vec(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb, T* C,
                     int64_t ldc, bool accumulate) {
  // 2·MR accumulators + 2 B vectors + 1 broadcast fit the 32 (AVX512) or 16 registers.
  constexpr int MR = sizeof(Vec<T>) >= 64 ? 8 : 4;
  int64_t i = 0;
  for (; i + MR <= M; i += MR) gemm_row_block<T, MR>(N, K, A + i * lda, lda, B, ldb, C + i * ldc, ldc, accumulate);
  for (; i < M; ++i) gemm_row_block<T, 1>(N, K, A + i * lda, lda, B, ldb, C + i * ldc, ldc, accumulate);
}

inline void gemm(int64_t M, int64_t N, int64_t K, const double* A, int64_t lda, const double* B, int64_t ldb, double* C,
                 int64_t ldc, bool accumulate) {
  if (M <= 0) return;
  gemm_vec<double>(M, N, K, A, lda, B, ldb, C, ldc, accumulate);
}

// float tiles go through oneDNN's batch-reduce GEMM micro-kernel
// (at::native::cpublas::brgemm; plain BLAS sgemm where PyTorch is built without
// oneDNN): measured 20-25% faster than gemm_vec on the tile shapes used here
// (benchmarks/results/attention_cpu.md). There is no fp64 brgemm; fp64 (tests,
// gradcheck) uses gemm_vec.
inline void gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
                 int64_t ldc, bool accumulate) {
  if (M <= 0) return;
  if (K == 0) {
    if (!accumulate)
      for (int64_t i = 0; i < M; ++i) std::fill(C + i * ldc, C + i * ldc + N, 0.f);
    return;
  }
  at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, accumulate, A, B, C, /*is_vnni=*/false);
}

// ---------------------------------------------------------------- softmax rows

// One query row of the forward against one key tile (online softmax).
// s[0:valid] holds the row's scaled scores for the keys of the tile it may see;
// columns [valid, width) are hidden from it. `bias` is the key-padding bias of
// the tile's keys or null. Overwrites s[0:width] with exp(s - m_new) (0 where
// hidden; zeros up to width rounded up to the vector width, within the row's
// kAlign-padded buffer), updates the running max m and sum l, and returns exp(m_old - m_new),
// the factor by which the row's output accumulator must be rescaled.
template <typename T>
inline T softmax_update_row(T* s, int64_t valid, int64_t width, const T* bias, T& m, T& l) {
  constexpr int64_t W = Vec<T>::size();
  constexpr T kNegInf = -std::numeric_limits<T>::infinity();
  if (bias != nullptr) add_bias(s, bias, valid);
  const int64_t full = round_up(valid, W);  // within the row's kAlign-padded buffer
  if (full > valid) {  // one vector store: scalar stores read back by a vector load stall store forwarding
    Vec<T>::set(Vec<T>(kNegInf), Vec<T>::loadu(s + full - W), valid - (full - W)).store(s + full - W);
  }
  Vec<T> vmax(kNegInf);
  for (int64_t d = 0; d < full; d += W) vmax = at::vec::maximum(vmax, Vec<T>::loadu(s + d));
  const T m_new = max_propagating_nan(m, reduce_max(vmax));
  if (std::isnan(m_new) || m_new == -kNegInf) {  // NaN or +inf scores make the row NaN, as in the reference
    std::fill(s, s + width, std::numeric_limits<T>::quiet_NaN());
    l = m = std::numeric_limits<T>::quiet_NaN();
    return l;
  }
  const T m_safe = m_new == kNegInf ? T(0) : m_new;  // no visible key yet: exp(-inf - 0) = 0
  const Vec<T> vm(m_safe);
  Vec<T> vsum(T(0));
  for (int64_t d = 0; d < full; d += W) {
    const Vec<T> e = exp_finite(Vec<T>::loadu(s + d) - vm);
    e.store(s + d);
    vsum = vsum + e;
  }
  for (int64_t d = full; d < width; d += W) Vec<T>(T(0)).store(s + d);  // up to width rounded up to W
  const T alpha = m_new == m ? T(1) : std::exp(m - m_safe);             // the max rarely moves after the first tiles
  l = l * alpha + reduce_sum(vsum);
  m = m_new;
  return alpha;
}

// One key row of a backward pair (keys on the rows): Pᵀ = exp(s · scale - lse[c])
// over the columns (queries) [first, width), 0 on [0, first); dSᵀ = Pᵀ ⊙ (dp -
// delta[c]) over dp. Padding columns have lse = +inf and delta = 0: they come out 0.
template <typename T>
inline void dscores_key_row(T* s, T* dp, int64_t first, int64_t width, T scale, const T* lse, const T* delta) {
  constexpr int64_t W = Vec<T>::size();
  const Vec<T> vscale(scale);
  for (int64_t c = first / W * W; c < width; c += W) {
    const Vec<T> p = exp_vec(at::vec::fmsub(Vec<T>::loadu(s + c), vscale, Vec<T>::loadu(lse + c)));
    p.store(s + c);
    (p * (Vec<T>::loadu(dp + c) - Vec<T>::loadu(delta + c))).store(dp + c);
  }
  std::fill(s, s + first, T(0));
  std::fill(dp, dp + first, T(0));
}

// ---------------------------------------------------------------- forward

template <typename scalar_t>
void attention_forward(const Problem& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& bias_t, at::Tensor& out, at::Tensor& lse) {
  using T = at::opmath_type<scalar_t>;
  const auto Q = head_rows<scalar_t>(q), K = head_rows<scalar_t>(k), V = head_rows<scalar_t>(v);
  const T* key_bias = bias_t.defined() ? bias_t.const_data_ptr<T>() : nullptr;
  scalar_t* out_data = out.mutable_data_ptr<scalar_t>();
  T* lse_data = lse.mutable_data_ptr<T>();
  const int64_t dh = p.dh, dhp = p.dh_padded, blocks = ceil_div(p.tq, p.block_q);
  const T scale = static_cast<T>(p.scale);
  constexpr T kNegInf = -std::numeric_limits<T>::infinity();

  at::parallel_for(0, p.batch * p.heads * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> qs(p.block_q * dhp), acc(p.block_q * dhp), s(p.block_q * p.tile_k), m(p.block_q), l(p.block_q);
    std::vector<T> krows(p.tile_k * dhp), kt(dhp * p.tile_k), vrows(p.tile_k * dhp);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t bh = item / blocks, b = bh / p.heads, h = bh % p.heads, hk = h / p.group;
      const int64_t i0 = balanced_tile(item % blocks, blocks) * p.block_q, rows = std::min(p.block_q, p.tq - i0);
      load_rows(Q, b, h, i0, rows, dh, scale, qs.data(), dhp);
      std::fill(acc.begin(), acc.end(), T(0));
      std::fill(m.begin(), m.end(), kNegInf);
      std::fill(l.begin(), l.end(), T(0));
      const int64_t kv_end = p.key_end(i0 + rows - 1);
      for (int64_t k0 = 0; k0 < kv_end; k0 += p.tile_k) {
        const int64_t n = std::min(p.tile_k, kv_end - k0), n_padded = round_up(n, kAlign);
        // Rows above r0 see none of these keys (rounded down to keep GEMM shapes few).
        const int64_t r0 = (p.query_begin(k0) > i0 ? p.query_begin(k0) - i0 : 0) / kAlign * kAlign;
        load_rows_transposed(K, b, hk, k0, n, dh, dhp, krows.data(), kt.data(), p.tile_k, n_padded);
        const Operand<T> v_rows = rows_operand(V, b, hk, k0, n, dh, dhp, vrows.data());
        gemm(rows - r0, n_padded, dh, qs.data() + r0 * dhp, dhp, kt.data(), p.tile_k, s.data() + r0 * p.tile_k,
             p.tile_k, false);
        const T* bias = key_bias != nullptr ? key_bias + b * p.tk + k0 : nullptr;
        for (int64_t r = r0; r < rows; ++r) {
          const int64_t valid = std::min(p.key_end(i0 + r) - k0, n);
          const T alpha = softmax_update_row(s.data() + r * p.tile_k, std::max<int64_t>(valid, 0), n, bias, m[r], l[r]);
          if (alpha != T(1)) {
            at::vec::map([alpha](Vec<T> x) { return x * Vec<T>(alpha); }, acc.data() + r * dhp, acc.data() + r * dhp,
                         dhp);
          }
        }
        gemm(rows - r0, v_rows.cols, n, s.data() + r0 * p.tile_k, p.tile_k, v_rows.data, v_rows.ld,
             acc.data() + r0 * dhp, dhp, true);
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t row = bh * p.tq + i0 + r;
        const T inv = l[r] == T(0) ? T(0) : T(1) / l[r];  // no visible key: output 0
        lse_data[row] = l[r] == T(0) ? kNegInf : m[r] + std::log(l[r]);
        store_row(acc.data() + r * dhp, dh, inv, out_data + row * dh);
      }
    }
  });
}

// ---------------------------------------------------------------- decode forward
//
// A few query rows against many keys (a decode step: Tq = 1 or a short chunk,
// over a long cache). The tiles above would re-read every key and value row
// once per query head, transpose each key tile and run GEMMs one row tall (the
// profile of a decode step: the key transposes and 1-row GEMMs took most of the
// time, at a third of SDPA's speed). Here a program owns the R = G · Tq query
// rows of one kv head (all G query heads that share it, all Tq queries) and one
// span of kDecodeSplit keys, and reads each key and value row of the span once:
// scores are dot products over Dh, up to 4 query rows per loaded key vector and
// 16 (AVX2: 8) (row, key) sums reduced together; online softmax per chunk of kDecodeChunk
// keys; the output accumulators of up to 4 rows gather each loaded value
// vector. Rows are read in place in their own dtype when they are whole vectors
// (converted to fp32 as they are loaded); with more than kDecodeDirectRows
// query rows, half/bf16 rows are converted once per chunk into a buffer
// instead, unless the bf16 scores take AMX tiles (decode_scores16_amx: all
// rows at once, keys read in place). Programs of one kv head that got
// different spans write their (max, sum, accumulator), and a second pass
// merges them by their max in ascending span order. The spans depend on Tk alone, so the result does not depend on the
// number of threads; a kv head whose keys fit one span writes its output
// directly. The saved lse and output are those of the tile path, so the
// backward (tiles, below) serves both.

constexpr int64_t kDecodeMaxRows = 16;    // at most G · Tq query rows per kv head take this path
constexpr int64_t kDecodeDirectRows = 4;  // up to this many rows convert half/bf16 rows where they are used
constexpr int64_t kDecodeChunk = 64;      // keys per online-softmax step
// Keys per program (a multiple of kDecodeChunk). Against 256 (B = 1 and 4, 8 heads, Dh = 64, 64-2048
// keys, A/B in alternating processes): SDPA / ours 1 thread bf16 1.01-1.11 -> 1.02-1.16, 2 threads bf16
// 1.20-1.41 -> 1.25-1.52, fp32 within the noise; 1024 measured as 512. Each kv head still gets a
// program per 512 keys for the threads of a larger machine.
constexpr int64_t kDecodeSplit = 512;
constexpr int64_t kDecodePrefetchBytes = int64_t(32) << 20;  // K/V of a call beyond this: prefetched
constexpr int64_t kDecodeGrain = 1 << 16;                    // multiply-adds per thread at least (see decode_forward)

inline bool use_decode_path(const Problem& p) { return p.tq >= 1 && p.group * p.tq <= kDecodeMaxRows; }

// Loads of a row of Src as vectors of T: blocks of 2W elements (W = Vec<T>::size())
// as two vectors, a last single vector on its own. Blocks of bf16 (with AVX512)
// come out as (even elements, odd elements): two integer ops per block, no
// cross-lane widening. The dot products and the output accumulator only need
// q, the keys, the values and the accumulator in one order (see LoadOrder).
template <typename Src, typename T>
struct RowLoad {
  static constexpr bool kPermuted = false;
  static void block(const Src* p, Vec<T>& a, Vec<T>& b) {
    if constexpr (std::is_same_v<Src, T>) {
      a = Vec<T>::loadu(p);
      b = Vec<T>::loadu(p + Vec<T>::size());
    } else {
      at::vec::load_to_float<Src>(p, a);
      at::vec::load_to_float<Src>(p + Vec<T>::size(), b);
    }
  }
  static Vec<T> single(const Src* p) {
    if constexpr (std::is_same_v<Src, T>) {
      return Vec<T>::loadu(p);
    } else {
      Vec<T> a;
      at::vec::load_to_float<Src>(p, a);
      return a;
    }
  }
};

#if defined(CPU_CAPABILITY_AVX512)
template <>
struct RowLoad<c10::BFloat16, float> {
  static constexpr bool kPermuted = true;
  static void block(const c10::BFloat16* p, Vec<float>& even, Vec<float>& odd) {
    const __m512i x = _mm512_loadu_si512(p);
    even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    odd = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
  }
  static Vec<float> single(const c10::BFloat16* p) {
    Vec<float> a;
    at::vec::load_to_float<c10::BFloat16>(p, a);
    return a;
  }
};
#endif

// A row of `cols` columns into the order RowLoad<Src, T> loads rows in (LoadOrder::to), and back
// (LoadOrder::from): with bf16 rows each block of 2W elements is (its even elements, its odd ones);
// a last single vector keeps its order. Two permutes per block (a scalar scatter of a decode step's
// query and output rows cost ~1 µs per call).
template <typename Src, typename T>
struct LoadOrder {
  static void to(const T* src, T* dst, int64_t cols) { std::copy(src, src + cols, dst); }
  static void from(const T* src, T* dst, int64_t cols) { std::copy(src, src + cols, dst); }
};

#if defined(CPU_CAPABILITY_AVX512)
template <>
struct LoadOrder<c10::BFloat16, float> {  // blocks of 2W = 32: the order of split_even_odd
  static void to(const float* src, float* dst, int64_t cols) { split_even_odd(src, cols, dst); }
  static void from(const float* src, float* dst, int64_t cols) { merge_even_odd(src, cols, dst); }
};
#endif

// <q[0:cols], x[0:cols]> (cols a multiple of W), x loaded by RowLoad<Src, T>.
template <typename T, typename Src>
inline T decode_dot(const T* q, const Src* x, int64_t cols) {
  constexpr int64_t W = Vec<T>::size();
  Vec<T> s0(T(0)), s1(T(0)), a, b;
  int64_t d = 0;
  for (; d + 2 * W <= cols; d += 2 * W) {
    RowLoad<Src, T>::block(x + d, a, b);
    s0 = at::vec::fmadd(Vec<T>::loadu(q + d), a, s0);
    s1 = at::vec::fmadd(Vec<T>::loadu(q + d + W), b, s1);
  }
  if (d < cols) s0 = at::vec::fmadd(Vec<T>::loadu(q + d), RowLoad<Src, T>::single(x + d), s0);
  return reduce_sum(s0 + s1);
}

// A compiler-only barrier (no instruction) between the loads of two key rows in the score functions
// below: the rows are then read in order, 16 keys one after the other. Without it GCC interleaves the
// loads of the keys of a block in an order of its own, which the hardware prefetchers do not follow:
// on Zen 4 (one thread, fp32, Dh = 64, 8 x 4 heads of 8192 keys from memory) the scores alone streamed
// the keys at 9.6 GB/s against 20 GB/s for the value gather, and a standalone copy of the score block
// took 44 ns per key with the interleaved loads against 25 ns in order (9.1 against 7.2 ns from L3).
// The AVX2 build's fp32 steps from memory gained as much (SDPA / ours 1.09-1.29 -> 1.46-1.83).
C10_ALWAYS_INLINE void keys_in_order() { std::atomic_signal_fence(std::memory_order_seq_cst); }

#if defined(CPU_CAPABILITY_AVX2)
// The horizontal sums of 8 vectors, in order, as one vector: 9 ops instead of 8 separate reductions.
__attribute__((always_inline)) inline __m256 sum8(const __m256* acc) {
  // Per 128-bit lane: pairs, then the sums of accumulators 0-3 (u0) and 4-7 (u1) over that lane.
  const __m256 t0 = _mm256_hadd_ps(acc[0], acc[1]), t1 = _mm256_hadd_ps(acc[2], acc[3]);
  const __m256 t2 = _mm256_hadd_ps(acc[4], acc[5]), t3 = _mm256_hadd_ps(acc[6], acc[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// s[r · lds + j] = <q_r[0:cols], x_j[0:cols]> for RB query rows q_r = q + r · ldq and 8 / RB key rows
// x_j = x + j · ld (cols a multiple of 8): one accumulator per (row, key), each key vector loaded once for
// the RB rows (the query vectors are operands of the multiply-adds), then sum8. Steps of 64 columns:
// each key's lines are read one after the other, as decode_dot reads them (steps of 16 columns through
// the 8 rows cost the one-thread fp32 steps over 2048+ keys from memory ~10 %). A key's score took ~60
// instructions one key at a time (decode_dot: 4 steps of 16 values, then its own horizontal sum; one
// row, Dh=64, bf16 keys), ~31 here: the step over 4 x 8 heads of 2048 keys 106 -> 77 instructions per key
// (callgrind). Zen 3, one thread, SDPA's time / ours, three runs alternating with decode_dot: 512 keys
// 1.19-1.42 -> 1.41-1.59 (fp32, B=1), 8.40-8.87 -> 9.31-10.50 (bf16); 8192 keys, from memory, 1.35-1.59
// -> 1.44-1.50, 4.72-5.22 -> 4.68-5.06.
template <typename Src, int RB>
inline void decode_scores8(const float* q, int64_t ldq, const Src* x, int64_t ld, int64_t cols, float* s, int64_t lds) {
  constexpr int64_t W = 8;
  constexpr int KB = 8 / RB;
  __m256 acc[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
  int64_t d = 0;
  const auto step = [&](auto blocks) C10_ALWAYS_INLINE_ATTRIBUTE {
    constexpr int B = decltype(blocks)::value;
#pragma GCC unroll 8
    for (int j = 0; j < KB; ++j) {
#pragma GCC unroll 4
      for (int i = 0; i < B; ++i) {
        Vec<float> a, b;
        RowLoad<Src, float>::block(x + j * ld + d + 2 * i * W, a, b);
#pragma GCC unroll 4
        for (int r = 0; r < RB; ++r) {
          const float* qr = q + r * ldq + d + 2 * i * W;
          acc[r * KB + j] = _mm256_fmadd_ps(_mm256_loadu_ps(qr), a, acc[r * KB + j]);
          acc[r * KB + j] = _mm256_fmadd_ps(_mm256_loadu_ps(qr + W), b, acc[r * KB + j]);
        }
      }
      // fp32 keys only: AVX2 build on Zen 4, one thread, bf16 keys with the barrier were 10-20 % slower
      // from L3 (B = 1, 8192 keys: 725-810 against 613-691 µs) and the same from memory.
      if constexpr (std::is_same_v<Src, float>) keys_in_order();
    }
    d += 2 * B * W;
  };
  while (d + 8 * W <= cols) step(std::integral_constant<int, 4>{});
  while (d + 2 * W <= cols) step(std::integral_constant<int, 1>{});
  if (d < cols) {
#pragma GCC unroll 8
    for (int j = 0; j < KB; ++j) {
      const __m256 a = RowLoad<Src, float>::single(x + j * ld + d);
#pragma GCC unroll 4
      for (int r = 0; r < RB; ++r)
        acc[r * KB + j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * ldq + d), a, acc[r * KB + j]);
    }
  }
  alignas(32) float out[8];
  _mm256_store_ps(out, sum8(acc));
#pragma GCC unroll 4
  for (int r = 0; r < RB; ++r) std::copy(out + r * KB, out + (r + 1) * KB, s + r * lds);
}
#endif

// Whether scores of T rows are taken 16 (row, key) pairs at a time (decode_scores16).
#if defined(CPU_CAPABILITY_AVX512)
template <typename T>
constexpr bool kScores16 = std::is_same_v<T, float>;
#else
template <typename T>
constexpr bool kScores16 = false;
#endif

#if defined(CPU_CAPABILITY_AVX512)
// The horizontal sums of 16 vectors, in order, as one vector: one shuffle-and-add tree (45 ops
// instead of 16 separate reductions). Here and in the score functions below the loops over
// accumulators are unrolled by pragma: otherwise GCC keeps the accumulator array in memory and
// stores all 16 of them at every block of columns.
__attribute__((always_inline)) inline __m512 sum16(const __m512* acc) {
  // Pairs: per 128-bit lane (a0+a2, b0+b2, a1+a3, b1+b3).
  __m512 c[8];
#pragma GCC unroll 16
  for (int i = 0; i < 8; ++i) {
    c[i] =
        _mm512_add_ps(_mm512_unpacklo_ps(acc[2 * i], acc[2 * i + 1]), _mm512_unpackhi_ps(acc[2 * i], acc[2 * i + 1]));
  }
  // Quads: per 128-bit lane the partial sums of accumulators 4i..4i+3 in order.
  __m512 e[4];
#pragma GCC unroll 16
  for (int i = 0; i < 4; ++i) {
    const __m512d x0 = _mm512_castps_pd(c[2 * i]), x1 = _mm512_castps_pd(c[2 * i + 1]);
    e[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x0, x1)), _mm512_castpd_ps(_mm512_unpackhi_pd(x0, x1)));
  }
  // Across the 128-bit lanes: (lanes 0+1, lanes 2+3) of two quads, twice.
  const auto fold = [](__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xdd));
  };
  return fold(fold(e[0], e[1]), fold(e[2], e[3]));
}

// s[r · lds + j] = <q_r[0:cols], x_j[0:cols]> for RB query rows q_r = q + r · ldq and 16 / RB key rows
// x_j = x + j · ld (cols a multiple of 16): each key vector is loaded once for the RB rows, one
// accumulator per (row, key), then sum16.
template <typename Src, int RB>
inline void decode_scores16(const float* q, int64_t ldq, const Src* x, int64_t ld, int64_t cols, float* s,
                            int64_t lds) {
  constexpr int64_t W = 16;
  constexpr int KB = 16 / RB;
  __m512 acc[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  // Column steps of NB blocks of 2W: one or two query rows take 4W columns of each key at a time (a
  // 64-value fp32 key row's four lines one after the other, not every other pair of lines), more rows
  // 2W (their query vectors fill the registers).
  constexpr int NB = RB <= 2 ? 2 : 1;
  int64_t d = 0;
  const auto step = [&](auto blocks) C10_ALWAYS_INLINE_ATTRIBUTE {
    constexpr int B = decltype(blocks)::value;
    __m512 qv[RB][2 * B];
#pragma GCC unroll 16
    for (int r = 0; r < RB; ++r)
      for (int i = 0; i < 2 * B; ++i) qv[r][i] = _mm512_loadu_ps(q + r * ldq + d + i * W);
#pragma GCC unroll 16
    for (int j = 0; j < KB; ++j) {
      Vec<float> kv[2 * B];
      for (int b = 0; b < B; ++b) RowLoad<Src, float>::block(x + j * ld + d + 2 * b * W, kv[2 * b], kv[2 * b + 1]);
#pragma GCC unroll 16
      for (int r = 0; r < RB; ++r)
        for (int i = 0; i < 2 * B; ++i) acc[r * KB + j] = _mm512_fmadd_ps(qv[r][i], kv[i], acc[r * KB + j]);
      keys_in_order();
    }
    d += 2 * B * W;
  };
  while (d + 2 * NB * W <= cols) step(std::integral_constant<int, NB>{});
  while (d + 2 * W <= cols) step(std::integral_constant<int, 1>{});
  if (d < cols) {
#pragma GCC unroll 16
    for (int j = 0; j < KB; ++j) {
      const __m512 a = RowLoad<Src, float>::single(x + j * ld + d);
#pragma GCC unroll 16
      for (int r = 0; r < RB; ++r)
        acc[r * KB + j] = _mm512_fmadd_ps(_mm512_loadu_ps(q + r * ldq + d), a, acc[r * KB + j]);
    }
  }
  alignas(64) float out[16];
  _mm512_store_ps(out, sum16(acc));
#pragma GCC unroll 16
  for (int r = 0; r < RB; ++r) std::copy(out + r * KB, out + (r + 1) * KB, s + r * lds);
}

// decode_scores16 of bf16 rows on a CPU with AVX512-BF16, times `scale`: q_r the raw bf16 query rows
// (unscaled, in element order, as the key rows), each 32-column block of a (query, key) pair one
// vdpbf16ps (the bf16 products are exact in fp32, summed in fp32; subnormal bf16 count as 0). A
// 64-column key row costs 2 loads and 2 of them instead of 2 loads, 4 conversions and 4 FMAs. The two
// 64-byte lines of a key's 128 bytes are read one after the other (taking each column block over all
// 16 keys first read every other line: 4-5 % slower over 512 cached keys, B=1, 8 heads, Dh=64).
// Compiled for that target alone and called only when use_avx512_bf16().
template <int RB>
__attribute__((target("avx512bf16"), noinline)) void decode_scores16_bf16_dot(const c10::BFloat16* q, int64_t ldq,
                                                                              const c10::BFloat16* x, int64_t ld,
                                                                              int64_t cols, float scale, float* s,
                                                                              int64_t lds) {
  constexpr int KB = 16 / RB;
  __m512 acc[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  // Lanes of the 32 columns at d: all, the 16 of a last half block (the rest load 0), or none.
  const auto lanes_at = [cols](int64_t d) {
    return d + 32 <= cols ? ~__mmask32(0) : d < cols ? __mmask32(0xffff) : __mmask32(0);
  };
  for (int64_t d = 0; d < cols; d += 64) {  // both 64-byte lines of each key's 128 bytes in turn
    const __mmask32 first = lanes_at(d), second = lanes_at(d + 32);
    __m512bh q_first[RB], q_second[RB];
#pragma GCC unroll 16
    for (int r = 0; r < RB; ++r) {
      q_first[r] = (__m512bh)_mm512_maskz_loadu_epi16(first, q + r * ldq + d);
      q_second[r] = (__m512bh)_mm512_maskz_loadu_epi16(second, q + r * ldq + d + 32);
    }
#pragma GCC unroll 16
    for (int j = 0; j < KB; ++j) {
      const __m512bh k_first = (__m512bh)_mm512_maskz_loadu_epi16(first, x + j * ld + d);
      const __m512bh k_second = (__m512bh)_mm512_maskz_loadu_epi16(second, x + j * ld + d + 32);
#pragma GCC unroll 16
      for (int r = 0; r < RB; ++r) {
        acc[r * KB + j] =
            _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[r * KB + j], q_first[r], k_first), q_second[r], k_second);
      }
      keys_in_order();
    }
  }
  alignas(64) float out[16];
  _mm512_store_ps(out, _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale)));
#pragma GCC unroll 16
  for (int r = 0; r < RB; ++r) std::copy(out + r * KB, out + (r + 1) * KB, s + r * lds);
}

// Whether the bf16 decode scores take AMX tiles: the CPU has AMX-BF16 and AMX-TILE (CPUID.(7,0):
// EDX[22] and [24]) and the OS grants this process the tile state (at::cpu::init_amx asks for it),
// asked once per process. ATTNRES_CPU_AMX=0 turns their use off (the tests run both paths on a
// machine that has it).
bool use_amx_bf16() {
  static const bool use = [] {
    const char* env = std::getenv("ATTNRES_CPU_AMX");
    if (env != nullptr && std::string(env) == "0") return false;
    return cpuid_leaf7_bit(0, 3, 22) && cpuid_leaf7_bit(0, 3, 24) && at::cpu::init_amx();
  }();
  return use;
}

// The scores of R <= 16 bf16 query rows against 16 keys at a time on AMX tiles (Dh a multiple of 32),
// as Sᵀ = K Qᵀ: tile 1 holds 32 columns of the 16 key rows, read in place (the A operand: one key
// per tile row); tile 2 the same 32 columns of the R query rows as 16 column pairs x R rows (the B
// operand in AMX's pair layout, packed once per program by amx_query_pairs); tile 0 sums the 16 x R
// products over the Dh / 32 column steps in fp32 (TDPBF16PS: bf16 products exact in fp32, subnormal
// bf16 as 0, as vdpbf16ps). Against vdpbf16ps, the step's per-key sums of 16 lanes and their
// shuffle-and-add tree are gone, and one tile product serves all R rows. Taken for 2-16 rows (grouped
// query heads, or a few queries): 1 thread, B = 1, 8 query heads, Dh = 64, SDPA / ours at 512-2048
// keys, 4 rows (2 kv heads) 1.43-1.51 -> 1.92-2.37, 2 rows 1.23-1.31 -> 1.50-1.77 (the same at 4 x 2048
// keys from memory), 8 rows 1.22-1.40 -> 1.81-1.95 (their bf16 keys and values read in place instead
// of fp32 copies of every chunk); one row (a kv head per query head) was as fast or slower (0.94-1.00
// vs 1.02-1.06 at 4 x 2048 keys): it keeps vdpbf16ps.
struct alignas(64) AmxTileConfig {  // the 64-byte operand of LDTILECFG (palette 1)
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};  // bytes per row of each tile
  uint8_t rows[16] = {};
};

// LDTILECFG with the whole 64-byte config as its memory operand: GCC 12's _tile_loadconfig names only
// the first 8 bytes, and the stores of the tile shapes were dropped as dead.
__attribute__((target("amx-tile"), noinline)) void amx_load_tile_config(const AmxTileConfig* config) {
  __asm__ volatile("ldtilecfg %0" : : "m"(*config));
}

__attribute__((target("amx-tile"), noinline)) void amx_release_tiles() { _tile_release(); }

// Configures this thread's tiles for the scores of `rows` query rows while it lives (a decode program's
// body), then releases them, so that the OS need not save the tile state of a thread that is done.
class AmxScoreTiles {
 public:
  explicit AmxScoreTiles(int64_t rows) {
    AmxTileConfig config;
    const auto set = [&](int tile, int64_t tile_rows, int64_t bytes) {
      config.rows[tile] = static_cast<uint8_t>(tile_rows);
      config.colsb[tile] = static_cast<uint16_t>(bytes);
    };
    set(0, 16, rows * 4);  // Sᵀ: 16 keys x R fp32 sums
    set(1, 16, 64);        // 16 keys x 32 bf16 columns
    set(2, 16, rows * 4);  // 16 column pairs x R query rows
    amx_load_tile_config(&config);
  }
  ~AmxScoreTiles() { amx_release_tiles(); }
  AmxScoreTiles(const AmxScoreTiles&) = delete;
  AmxScoreTiles& operator=(const AmxScoreTiles&) = delete;
};

// Query row r of R into the B operand of decode_scores16_amx: pairs[P · R + r] = columns (2P, 2P + 1)
// of the row (raw bf16, unscaled), P < cols / 2.
inline void amx_query_pairs(const c10::BFloat16* q_row, int64_t r, int64_t rows, int64_t cols, uint32_t* pairs) {
  for (int64_t pair = 0; pair < cols / 2; ++pair) std::memcpy(pairs + pair * rows + r, q_row + 2 * pair, 4);
}

// Tile 0 = Σ over the column steps of (tile 1: 32 columns of the 16 key rows x + j · ld) x (tile 2: the
// same columns of the `rows` query rows in `pairs`), cols a multiple of 32.
__attribute__((target("amx-tile,amx-bf16"), always_inline)) inline void amx_score_tile(const c10::BFloat16* x,
                                                                                       int64_t ld,
                                                                                       const uint32_t* pairs,
                                                                                       int64_t rows, int64_t cols) {
  _tile_zero(0);
  for (int64_t d = 0; d < cols; d += 32) {
    _tile_loadd(1, x + d, ld * int64_t(sizeof(c10::BFloat16)));
    _tile_loadd(2, pairs + d / 2 * rows, rows * 4);
    _tile_dpbf16ps(0, 1, 2);
  }
}

// s[r · lds + j] = scale · <q_r, x_j> for the R (2-4) query rows packed in `pairs` and the 16 key rows
// x_j = x + j · ld (cols a multiple of 32), with this thread's tiles set by AmxScoreTiles(R).
template <int R>
__attribute__((target("amx-tile,amx-bf16"), noinline)) void decode_scores16_amx(const c10::BFloat16* x, int64_t ld,
                                                                                const uint32_t* pairs, int64_t cols,
                                                                                float scale, float* s, int64_t lds) {
  static_assert(R >= 2 && R <= 4);
  alignas(64) float sums[16 * R];  // sums[j · R + r]
  amx_score_tile(x, ld, pairs, R, cols);
  _tile_stored(0, sums, R * 4);
  // Row r's 16 sums are every R-th value from r: lanes from the first two and the last two vectors.
  const __m512 scale_v = _mm512_set1_ps(scale);
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512 b0 = _mm512_load_ps(sums), b1 = _mm512_load_ps(sums + 16);
  const __m512 b2 = R > 2 ? _mm512_load_ps(sums + 32) : b0;
  const __m512 b3 = R > 3 ? _mm512_load_ps(sums + 48) : b2;
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const __m512i index = _mm512_add_epi32(_mm512_mullo_epi32(lane, _mm512_set1_epi32(R)), _mm512_set1_epi32(r));
    const __m512 low = _mm512_permutex2var_ps(b0, index, b1), high = _mm512_permutex2var_ps(b2, index, b3);
    const __mmask16 from_high = _mm512_cmpge_epi32_mask(index, _mm512_set1_epi32(32));
    _mm512_storeu_ps(s + r * lds, _mm512_mul_ps(_mm512_mask_blend_ps(from_high, low, high), scale_v));
  }
}

// decode_scores16_amx for 5-16 rows: the 16 x rows sums stored as rows of 16 floats (`sums`, 256
// floats, initialized by the caller: the columns from `rows` on are left as they were) and transposed
// in registers, 64 shuffles per 16 keys: pairs of keys interleaved within each 128-bit lane, then
// quads, then the four quads of each lane brought together. (2-4 rows keep their permutes above: with
// this transpose their steps took 5-15 % longer, 1 thread, B = 1 and 4, 512-2048 keys.)
__attribute__((target("amx-tile,amx-bf16"), noinline)) void decode_scores16_amx_wide(const c10::BFloat16* x, int64_t ld,
                                                                                     const uint32_t* pairs,
                                                                                     int64_t rows, int64_t cols,
                                                                                     float scale, float* sums, float* s,
                                                                                     int64_t lds) {
  amx_score_tile(x, ld, pairs, rows, cols);
  _tile_stored(0, sums, 64);
  __m512 a[16], t[16];
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) a[j] = _mm512_loadu_ps(sums + 16 * j);  // a[j], lane r: key j, query row r
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]);
  }
#pragma GCC unroll 4
  for (int g = 0; g < 4; ++g) {
    const __m512d lo = _mm512_castps_pd(t[4 * g]), hi = _mm512_castps_pd(t[4 * g + 1]);
    const __m512d lo2 = _mm512_castps_pd(t[4 * g + 2]), hi2 = _mm512_castps_pd(t[4 * g + 3]);
    a[4 * g] = _mm512_castpd_ps(_mm512_unpacklo_pd(lo, lo2));
    a[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(lo, lo2));
    a[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(hi, hi2));
    a[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(hi, hi2));
  }
  // a[4g + c], lane L: keys 4g..4g+3 at row 4L + c. Gather the four key groups of each lane.
  const __m512 scale_v = _mm512_set1_ps(scale);
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {
    const __m512 p0 = _mm512_shuffle_f32x4(a[c], a[4 + c], 0x44), p1 = _mm512_shuffle_f32x4(a[c], a[4 + c], 0xee);
    const __m512 q0 = _mm512_shuffle_f32x4(a[8 + c], a[12 + c], 0x44);
    const __m512 q1 = _mm512_shuffle_f32x4(a[8 + c], a[12 + c], 0xee);
    const __m512 row[4] = {_mm512_shuffle_f32x4(p0, q0, 0x88), _mm512_shuffle_f32x4(p0, q0, 0xdd),
                           _mm512_shuffle_f32x4(p1, q1, 0x88), _mm512_shuffle_f32x4(p1, q1, 0xdd)};
#pragma GCC unroll 4
    for (int lane = 0; lane < 4; ++lane) {
      const int64_t r = 4 * lane + c;
      if (r < rows) _mm512_storeu_ps(s + r * lds, _mm512_mul_ps(row[lane], scale_v));
    }
  }
}
#endif

// acc_r[0:NB·2W] += Σ_j p_r[j] · rows[j · ld + (0:NB·2W)] over j < n for RB rows (acc_r = acc + r · lda,
// p_r = p + r · ldp): each value vector is loaded once for the RB rows, the accumulators kept in registers.
template <typename T, typename Src, int RB, int NB>
inline void decode_gather_blocks(T* acc, int64_t lda, const T* p, int64_t ldp, const Src* rows, int64_t ld, int64_t n) {
  constexpr int64_t W = Vec<T>::size();
  Vec<T> a[RB][2 * NB], x[2 * NB];
  for (int r = 0; r < RB; ++r)
    for (int i = 0; i < 2 * NB; ++i) a[r][i] = Vec<T>::loadu(acc + r * lda + i * W);
  for (int64_t j = 0; j < n; ++j) {
    const Src* row = rows + j * ld;
    for (int i = 0; i < NB; ++i) RowLoad<Src, T>::block(row + 2 * i * W, x[2 * i], x[2 * i + 1]);
    for (int r = 0; r < RB; ++r) {
      const Vec<T> pj(p[r * ldp + j]);
      for (int i = 0; i < 2 * NB; ++i) a[r][i] = at::vec::fmadd(pj, x[i], a[r][i]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int i = 0; i < 2 * NB; ++i) a[r][i].store(acc + r * lda + i * W);
}

// decode_gather_blocks for the last `blocks` (< NB) blocks of the rows.
template <typename T, typename Src, int RB, int NB>
inline void decode_gather_tail(int64_t blocks, T* acc, int64_t lda, const T* p, int64_t ldp, const Src* rows,
                               int64_t ld, int64_t n) {
  if constexpr (NB > 0) {
    if (blocks == NB) return decode_gather_blocks<T, Src, RB, NB>(acc, lda, p, ldp, rows, ld, n);
    decode_gather_tail<T, Src, RB, NB - 1>(blocks, acc, lda, p, ldp, rows, ld, n);
  }
}

// acc_r[0:cols] += Σ_j p_r[j] · rows[j · ld + (0:cols)] over j < n for RB rows (cols a multiple of W).
template <typename T, typename Src, int RB>
inline void decode_gather(T* acc, int64_t lda, const T* p, int64_t ldp, const Src* rows, int64_t ld, int64_t n,
                          int64_t cols) {
  constexpr int64_t W = Vec<T>::size();
  constexpr int kGroup = (sizeof(Vec<T>) >= 64 ? 8 : 4) / RB;  // blocks per pass: 16 (8) accumulators
  int64_t d = 0;
  for (; d + 2 * kGroup * W <= cols; d += 2 * kGroup * W) {
    decode_gather_blocks<T, Src, RB, kGroup>(acc + d, lda, p, ldp, rows + d, ld, n);
  }
  const int64_t blocks = (cols - d) / (2 * W);
  if (blocks > 0) decode_gather_tail<T, Src, RB, kGroup - 1>(blocks, acc + d, lda, p, ldp, rows + d, ld, n);
  d += blocks * 2 * W;
  for (int r = 0; d < cols && r < RB; ++r) {  // one last vector: two chains over even and odd keys
    const T* pr = p + r * ldp;
    T* ar = acc + r * lda + d;
    Vec<T> a0 = Vec<T>::loadu(ar), a1(T(0));
    int64_t j = 0;
    for (; j + 2 <= n; j += 2) {
      a0 = at::vec::fmadd(Vec<T>(pr[j]), RowLoad<Src, T>::single(rows + j * ld + d), a0);
      a1 = at::vec::fmadd(Vec<T>(pr[j + 1]), RowLoad<Src, T>::single(rows + (j + 1) * ld + d), a1);
    }
    if (j < n) a0 = at::vec::fmadd(Vec<T>(pr[j]), RowLoad<Src, T>::single(rows + j * ld + d), a0);
    (a0 + a1).store(ar);
  }
}

// The per-thread state of decode programs: R query rows (scaled, in the order
// RowLoad<Src, T> loads rows), their accumulators, scores of one chunk, running
// max and sum; `cols` columns are read (Dh, or Dh padded when packed). With
// `bf16_dot` (bf16 rows read in place on a CPU with AVX512-BF16) the scores of
// whole groups of 16 keys come from decode_scores16_bf16_dot: q_bf16 holds the raw
// query rows (`cols` each) and `scale` multiplies their sums; with `amx` (the same rows
// with Dh a multiple of 32, on a CPU with AMX-BF16) from decode_scores16_amx, the same
// buffer holding amx_query_pairs' layout (q_pairs). kbuf, vbuf: a chunk's
// keys and values packed as T rows (`packed` only); tmp: one row of dhp values.
// The buffers lie in a per-thread scratch kept from call to call: a decode step is a
// few µs of work, and allocating and freeing its nine buffers on every call cost
// ~0.3 µs of a one-thread bf16 step over 64 keys (8 heads, Dh=64).
template <typename T>
struct DecodeRows {
  T *q, *acc, *s, *m, *l, *kbuf, *vbuf, *tmp;
  c10::BFloat16* q_bf16;
  uint32_t* q_pairs;
  T* amx_sums;  // 16 x 16 floats for decode_scores16_amx_wide
  bool bf16_dot, amx;
  T scale;
  DecodeRows(int64_t rows, int64_t dhp, int64_t cols, bool bf16_dot, bool amx, bool packed, T scale)
      : bf16_dot(bf16_dot), amx(amx), scale(scale) {
    const int64_t chunk_values = packed ? kDecodeChunk * dhp : 0;
    const int64_t bf16_values =
        bf16_dot || amx ? ceil_div(rows * cols * int64_t(sizeof(c10::BFloat16)), int64_t(sizeof(T))) : 0;
    T** buffers[] = {&q, &acc, &s, &m, &l, &kbuf, &vbuf, &tmp, &amx_sums};
    const int64_t sizes[] = {rows * dhp,   rows * dhp, rows * kDecodeChunk, rows, rows, chunk_values,
                             chunk_values, dhp,        amx ? 256 : 0};
    int64_t total = round_up(bf16_values, kAlign);
    for (const int64_t n : sizes) total += round_up(n, kAlign);  // each one padded to kAlign values
    static thread_local std::vector<T> scratch;
    if (static_cast<int64_t>(scratch.size()) < total) scratch.resize(total);
    T* next = scratch.data();
    for (int i = 0; i < 9; ++i) {
      *buffers[i] = next;
      next += round_up(sizes[i], kAlign);
    }
    q_bf16 = reinterpret_cast<c10::BFloat16*>(next);
    q_pairs = reinterpret_cast<uint32_t*>(next);
  }
};

// Keys [c0, c0 + n) of the chunk (rows of Src: in place, or packed as T) against every query row,
// the rows taken up to 4 at a time. `prefetch`: ask for the next chunk's rows (AVX512 builds).
template <typename T, typename Src>
inline void decode_chunk(const Problem& p, DecodeRows<T>& st, int64_t rows, int64_t dhp, const Src* k_rows,
                         int64_t k_ld, const Src* v_rows, int64_t v_ld, int64_t cols, int64_t c0, int64_t n,
                         const T* bias, bool prefetch) {
  constexpr int64_t C = kDecodeChunk;
  // Scores.
#if defined(CPU_CAPABILITY_AVX512)
  // The next chunk's keys and values j0 + C .. j0 + C + count (a prefetch never faults).
  const auto prefetch_next = [&](int64_t j0, int64_t count) {
    for (int64_t jj = j0 + C; jj < j0 + C + count; ++jj) {
      for (int64_t d = 0; d < cols; d += 64 / int64_t(sizeof(Src))) {
        __builtin_prefetch(k_rows + jj * k_ld + d);
        __builtin_prefetch(v_rows + jj * v_ld + d);
      }
    }
  };
  if constexpr (std::is_same_v<Src, c10::BFloat16>) {
    if (st.amx) {  // every row against 16 keys at a time, the keys after the last 16 one by one
      int64_t j = 0;
      for (; j + 16 <= n; j += 16) {
        if (prefetch) prefetch_next(j, 16);
        const c10::BFloat16* x = k_rows + j * k_ld;
        if (rows > 4) {
          decode_scores16_amx_wide(x, k_ld, st.q_pairs, rows, cols, st.scale, st.amx_sums, st.s + j, C);
        } else {
          const auto scores = rows == 4   ? decode_scores16_amx<4>
                              : rows == 3 ? decode_scores16_amx<3>
                                          : decode_scores16_amx<2>;
          scores(x, k_ld, st.q_pairs, cols, st.scale, st.s + j, C);
        }
      }
      for (; j < n; ++j)
        for (int64_t r = 0; r < rows; ++r) st.s[r * C + j] = decode_dot(st.q + r * dhp, k_rows + j * k_ld, cols);
    }
  }
#endif
  for (int64_t r0 = 0; r0 < rows && !st.amx;) {
    const int64_t rb = rows - r0 >= 4 ? 4 : rows - r0 >= 2 ? 2 : 1;
    const T* q = st.q + r0 * dhp;
    T* s = st.s + r0 * C;
    int64_t j = 0;
#if defined(CPU_CAPABILITY_AVX512)
    if constexpr (kScores16<T>) {
      const int64_t kb = 16 / rb;
      for (; j + kb <= n; j += kb) {
        const Src* x = k_rows + j * k_ld;
        if (prefetch && r0 == 0) prefetch_next(j, kb);
        if constexpr (std::is_same_v<Src, c10::BFloat16>) {
          if (st.bf16_dot) {
            const c10::BFloat16* qs = st.q_bf16 + r0 * cols;
            if (rb == 4) {
              decode_scores16_bf16_dot<4>(qs, cols, x, k_ld, cols, st.scale, s + j, C);
            } else if (rb == 2) {
              decode_scores16_bf16_dot<2>(qs, cols, x, k_ld, cols, st.scale, s + j, C);
            } else {
              decode_scores16_bf16_dot<1>(qs, cols, x, k_ld, cols, st.scale, s + j, C);
            }
            continue;
          }
        }
        if (rb == 4) {
          decode_scores16<Src, 4>(q, dhp, x, k_ld, cols, s + j, C);
        } else if (rb == 2) {
          decode_scores16<Src, 2>(q, dhp, x, k_ld, cols, s + j, C);
        } else {
          decode_scores16<Src, 1>(q, dhp, x, k_ld, cols, s + j, C);
        }
      }
    }
#elif defined(CPU_CAPABILITY_AVX2)
    if constexpr (std::is_same_v<T, float>) {
      const int64_t kb = 8 / rb;
      for (; j + kb <= n; j += kb) {
        const Src* x = k_rows + j * k_ld;
        if (rb == 4) {
          decode_scores8<Src, 4>(q, dhp, x, k_ld, cols, s + j, C);
        } else if (rb == 2) {
          decode_scores8<Src, 2>(q, dhp, x, k_ld, cols, s + j, C);
        } else {
          decode_scores8<Src, 1>(q, dhp, x, k_ld, cols, s + j, C);
        }
      }
    }
#endif
    for (; j < n; ++j)
      for (int64_t r = 0; r < rb; ++r) s[r * C + j] = decode_dot(q + r * dhp, k_rows + j * k_ld, cols);
    r0 += rb;
  }
  // Online softmax per row.
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t valid = std::clamp<int64_t>(p.key_end(r % p.tq) - c0, 0, n);
    T* acc = st.acc + r * dhp;
    const T alpha = softmax_update_row(st.s + r * C, valid, round_up(n, Vec<T>::size()), bias, st.m[r], st.l[r]);
    if (alpha != T(1)) at::vec::map([alpha](Vec<T> x) { return x * Vec<T>(alpha); }, acc, acc, dhp);
  }
  // Outputs.
  for (int64_t r0 = 0; r0 < rows;) {
    const int64_t rb = rows - r0 >= 4 ? 4 : rows - r0 >= 2 ? 2 : 1;
    T* acc = st.acc + r0 * dhp;
    const T* s = st.s + r0 * C;
    if (rb == 4) {
      decode_gather<T, Src, 4>(acc, dhp, s, C, v_rows, v_ld, n, cols);
    } else if (rb == 2) {
      decode_gather<T, Src, 2>(acc, dhp, s, C, v_rows, v_ld, n, cols);
    } else {
      decode_gather<T, Src, 1>(acc, dhp, s, C, v_rows, v_ld, n, cols);
    }
    r0 += rb;
  }
}

template <typename scalar_t>
void decode_forward(const Problem& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& bias_t, at::Tensor& out, at::Tensor& lse) {
  using T = at::opmath_type<scalar_t>;
  constexpr int64_t W = Vec<T>::size(), C = kDecodeChunk;
  constexpr T kNegInf = -std::numeric_limits<T>::infinity();
  at::RecordFunction decode_event(at::RecordScope::FUNCTION);
  if (decode_event.isActive()) decode_event.before("attnres::attn_fwd_decode");
  const auto Q = head_rows<scalar_t>(q), K = head_rows<scalar_t>(k), V = head_rows<scalar_t>(v);
  const T* key_bias = bias_t.defined() ? bias_t.const_data_ptr<T>() : nullptr;
  scalar_t* out_data = out.mutable_data_ptr<scalar_t>();
  T* lse_data = lse.mutable_data_ptr<T>();
  const int64_t dh = p.dh, dhp = p.dh_padded, rows = p.group * p.tq;
  const T scale = static_cast<T>(p.scale);
  const int64_t kv_len = p.key_end(p.tq - 1);  // no query sees a key beyond
  const int64_t splits = std::max<int64_t>(ceil_div(kv_len, kDecodeSplit), 1), units = p.batch * p.kv_heads;
  // How key/value rows are read: in place as scalar_t (whole vectors; fp32/fp64 always, half/bf16 with
  // few query rows, bf16 whose scores take AMX tiles), else packed per chunk into T rows (converted by
  // RowLoad when whole vectors, so in the same order, else zero-padded to dhp in element order).
  const bool whole = dh % W == 0;
#if defined(CPU_CAPABILITY_AVX512)
  const bool amx = std::is_same_v<scalar_t, c10::BFloat16> && rows >= 2 && dh % 32 == 0 && use_amx_bf16();
#else
  const bool amx = false;
#endif
  const bool in_place = whole && (std::is_same_v<scalar_t, T> || rows <= kDecodeDirectRows || amx);
  const bool permuted = whole && RowLoad<scalar_t, T>::kPermuted;
#if defined(CPU_CAPABILITY_AVX512)
  const bool bf16_dot = std::is_same_v<scalar_t, c10::BFloat16> && in_place && !amx && use_avx512_bf16();
#else
  const bool bf16_dot = false;
#endif
  std::optional<at::RecordFunction> scores_event;  // tells the tests which scores ran
  if ((bf16_dot || amx) && decode_event.isActive()) {
    scores_event.emplace(at::RecordScope::FUNCTION);
    if (scores_event->isActive()) {
      scores_event->before(amx ? "attnres::attn_fwd_decode_amx_scores" : "attnres::attn_fwd_decode_bf16_dot");
    }
  }
  const int64_t cols = whole ? dh : dhp;
  const int64_t kv_bytes = 2 * units * p.tk * dh * static_cast<int64_t>(sizeof(scalar_t));
  // Caches that come from memory rather than a cache level: ask for the next chunk's rows ahead (measured
  // 14-16 % faster at 67-134 MB, 5-9 % slower at 16-32 MB, where the hardware prefetch suffices).
  const bool prefetch = in_place && kv_bytes > kDecodePrefetchBytes;
  std::vector<T> part_ml(splits > 1 ? units * splits * rows * 2 : 0);
  std::vector<T> part_acc(splits > 1 ? units * splits * rows * dhp : 0);

  // Writes the output row and lse of query row r (= g · Tq + t) of kv head (b, hk) from its
  // accumulator acc[0:dhp] (in load order; scaled in place), running max m and sum l; tmp: dhp values.
  const auto finish_row = [&](int64_t b, int64_t hk, int64_t r, T* acc, T m, T l, T* tmp) {
    const int64_t row = (b * p.heads + hk * p.group + r / p.tq) * p.tq + r % p.tq;
    lse_data[row] = l == T(0) ? kNegInf : m + std::log(l);
    if (permuted) {
      LoadOrder<scalar_t, T>::from(acc, tmp, dh);
      acc = tmp;
    }
    store_row(acc, dh, l == T(0) ? T(0) : T(1) / l, out_data + row * dh);  // no visible key: output 0
  };

  // Packs n rows starting at x.row(b, h, c0) as T rows of dhp columns in load order.
  const auto pack = [&](const HeadRows<scalar_t>& x, int64_t b, int64_t h, int64_t c0, int64_t n, T* buf) {
    if (!whole) return load_rows(x, b, h, c0, n, dh, T(1), buf, dhp);
    for (int64_t j = 0; j < n; ++j) {
      const scalar_t* src = x.row(b, h, c0 + j);
      T* dst = buf + j * dhp;
      int64_t d = 0;
      Vec<T> a, c;
      for (; d + 2 * W <= dh; d += 2 * W) {
        RowLoad<scalar_t, T>::block(src + d, a, c);
        a.store(dst + d);
        c.store(dst + d + W);
      }
      if (d < dh) RowLoad<scalar_t, T>::single(src + d).store(dst + d);
    }
  };

  // Items of about kDecodeGrain multiply-adds or more per thread: a short step runs on one thread
  // (forking costs more than its work).
  const int64_t item_work = std::min(kv_len, kDecodeSplit) * rows * dh;
  const int64_t grain = std::max<int64_t>(1, ceil_div(kDecodeGrain, std::max<int64_t>(item_work, 1)));
  at::parallel_for(0, units * splits, grain, [&](int64_t begin, int64_t end) {
    DecodeRows<T> st(rows, dhp, cols, bf16_dot, amx, !in_place, scale);
#if defined(CPU_CAPABILITY_AVX512)
    std::optional<AmxScoreTiles> tiles;
    if (amx) tiles.emplace(rows);
#endif
    for (int64_t item = begin; item < end; ++item) {
      const int64_t unit = item / splits, split = item % splits, b = unit / p.kv_heads, hk = unit % p.kv_heads;
      for (int64_t r = 0; r < rows; ++r) {
        const scalar_t* q_row = Q.row(b, hk * p.group + r / p.tq, r % p.tq);
        if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
          if (bf16_dot) std::copy(q_row, q_row + dh, st.q_bf16 + r * cols);
#if defined(CPU_CAPABILITY_AVX512)
          if (amx) amx_query_pairs(q_row, r, rows, cols, st.q_pairs);
#endif
        }
        load_row(q_row, dh, scale, st.tmp, dhp);
        T* qr = st.q + r * dhp;
        if (permuted) {  // padding columns are 0
          LoadOrder<scalar_t, T>::to(st.tmp, qr, dhp);
        } else {
          std::copy(st.tmp, st.tmp + dhp, qr);
        }
      }
      std::fill(st.acc, st.acc + rows * dhp, T(0));
      std::fill(st.m, st.m + rows, kNegInf);
      std::fill(st.l, st.l + rows, T(0));
      const int64_t k_end = std::min((split + 1) * kDecodeSplit, kv_len);
      for (int64_t c0 = split * kDecodeSplit; c0 < k_end; c0 += C) {
        const int64_t n = std::min(C, k_end - c0);
        const T* bias = key_bias != nullptr ? key_bias + b * p.tk + c0 : nullptr;
        if (in_place) {
          decode_chunk(p, st, rows, dhp, K.row(b, hk, c0), K.stride_t, V.row(b, hk, c0), V.stride_t, cols, c0, n, bias,
                       prefetch);
        } else {
          pack(K, b, hk, c0, n, st.kbuf);
          pack(V, b, hk, c0, n, st.vbuf);
          decode_chunk(p, st, rows, dhp, st.kbuf, dhp, st.vbuf, dhp, cols, c0, n, bias, false);
        }
      }
      if (splits == 1) {
        for (int64_t r = 0; r < rows; ++r) {
          finish_row(b, hk, r, st.acc + r * dhp, st.m[r], st.l[r], st.tmp);
        }
        continue;
      }
      for (int64_t r = 0; r < rows; ++r) {
        part_ml[(item * rows + r) * 2] = st.m[r];
        part_ml[(item * rows + r) * 2 + 1] = st.l[r];
      }
      std::copy(st.acc, st.acc + rows * dhp, part_acc.begin() + item * rows * dhp);
    }
  });
  if (splits == 1) return;

  // Merge the spans of every (kv head, row): weights exp(m_s - max_s m_s), in ascending span order.
  at::parallel_for(0, units * rows, ceil_div(kDecodeGrain, splits * dhp), [&](int64_t begin, int64_t end) {
    std::vector<T> acc(dhp), tmp(dhp);
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t unit = idx / rows, r = idx % rows;
      const auto part = [&](int64_t split) { return (unit * splits + split) * rows + r; };
      T m = kNegInf;
      for (int64_t split = 0; split < splits; ++split) m = max_propagating_nan(m, part_ml[part(split) * 2]);
      std::fill(acc.begin(), acc.end(), T(0));
      T l = T(0);
      if (m != kNegInf) {  // else no visible key in any span: l = 0, output 0
        for (int64_t split = 0; split < splits; ++split) {
          const T m_s = part_ml[part(split) * 2];
          if (m_s == kNegInf) continue;
          const T w = std::exp(m_s - m);
          l += w * part_ml[part(split) * 2 + 1];
          at::vec::map2([w](Vec<T> x, Vec<T> y) { return at::vec::fmadd(Vec<T>(w), y, x); }, acc.data(), acc.data(),
                        part_acc.data() + part(split) * dhp, dhp);
        }
      }
      finish_row(unit / p.kv_heads, unit % p.kv_heads, r, acc.data(), m, l, tmp.data());
    }
  });
}

// ---------------------------------------------------------------- backward
//
// The backward works on pairs (query tile i: kTileQ rows of one head; key block
// j: kBlockK keys of its kv head) of a fixed grid (i0 a multiple of kTileQ, k0
// of kBlockK), always with the keys on the rows:
//   Sᵀ = K_j q_iᵀ, Pᵀ = exp(Sᵀ · scale - lse_i), dPᵀ = V_j dO_iᵀ, dSᵀ = Pᵀ ⊙ (dPᵀ - δ_i),
// consumed by dV_j += Pᵀ dO_i, dK_j += dSᵀ q_i and dQ_iᵀ += K_jᵀ dSᵀ (dK, dQ · scale at
// the end). Two schedules give bit-identical results: every pair is computed by
// the same code, and dQ_i sums its pairs in ascending j with the same GEMMs.
//   fused: one program per (batch, kv head) runs each pair once (5 GEMMs); it
//     packs every query tile of its head group once and keeps them and dQᵀ in
//     per-thread buffers (3·G·Tq·Dh values; 5 for half/bf16 inputs);
//   split: one program per (batch, kv head, key block) for dK/dV (4 GEMMs per
//     pair) and one per (batch, head, kBlockQ queries) for dQ (3 GEMMs per pair:
//     Sᵀ and dPᵀ are recomputed).
// The fused schedule does 5/7 of the work in B·Hkv programs; the split one has
// more programs to spread over the threads. The choice depends on the thread
// count; the result does not.

template <typename T>
struct KeyBlock {  // p.block_k keys of one kv head: K and V rows, and Kᵀ for the dQ GEMM
  std::vector<T> k_buf, v_buf, kt;
  Operand<T> k{}, v{};
  int64_t k0 = 0, n = 0;
  explicit KeyBlock(const Problem& p)
      : k_buf(p.block_k * p.dh_padded), v_buf(p.block_k * p.dh_padded), kt(p.dh_padded * p.block_k) {}
};

template <typename T>
struct QueryTile {  // p.tile_q queries of one head: q and dO as rows and transposed, lse and δ
  std::vector<T> q_buf, qt, do_buf, d_ot, lse, delta;  // q_buf, do_buf: only for rows that are not fp32 in place
  Operand<T> q{}, d_o{};
  int64_t i0 = 0, m = 0, m_padded = 0;
  explicit QueryTile(const Problem& p)
      : qt(p.dh_padded * p.tile_q), d_ot(p.dh_padded * p.tile_q), lse(p.tile_q), delta(p.tile_q) {}
};

template <typename T>
struct PairTiles {  // Pᵀ and dSᵀ of one pair, [p.block_k, p.tile_q]
  std::vector<T> pt, dst;
  explicit PairTiles(const Problem& p) : pt(p.block_k * p.tile_q), dst(p.block_k * p.tile_q) {}
};

template <typename scalar_t>
struct BackwardInputs {
  using T = at::opmath_type<scalar_t>;
  HeadRows<scalar_t> q, k, v, grad_out;
  const T* key_bias;  // [B, Tk] or null
  const T* lse;       // [B, H, Tq], +inf for rows that see no key
  const T* delta;     // [B, H, Tq]
};

// delta[row] = <dO[row], O[row]> - dlse[row] and the lse the backward uses:
// +inf for rows that see no key (lse = -inf), so that their P = exp(s - lse) = 0.
template <typename scalar_t>
void backward_row_terms(const Problem& p, const at::Tensor& grad_out, const at::Tensor& out, const at::Tensor& lse,
                        const at::Tensor& grad_lse, at::Tensor& delta, at::Tensor& lse_used) {
  using T = at::opmath_type<scalar_t>;
  const auto dO = head_rows<scalar_t>(grad_out), O = head_rows<scalar_t>(out);
  const T* lse_in = lse.const_data_ptr<T>();
  const T* dlse = grad_lse.defined() ? grad_lse.const_data_ptr<T>() : nullptr;
  T* delta_out = delta.mutable_data_ptr<T>();
  T* lse_out = lse_used.mutable_data_ptr<T>();
  const int64_t dh = p.dh, dhp = p.dh_padded;
  constexpr T kInf = std::numeric_limits<T>::infinity();
  at::parallel_for(0, p.batch * p.heads * p.tq, 64, [&](int64_t begin, int64_t end) {
    std::vector<T> a(dhp), c(dhp);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t t = row % p.tq, h = (row / p.tq) % p.heads, b = row / (p.tq * p.heads);
      load_row(dO.row(b, h, t), dh, T(1), a.data(), dhp);
      load_row(O.row(b, h, t), dh, T(1), c.data(), dhp);
      Vec<T> acc(T(0));
      for (int64_t d = 0; d < dhp; d += Vec<T>::size())
        acc = at::vec::fmadd(Vec<T>::loadu(a.data() + d), Vec<T>::loadu(c.data() + d), acc);
      delta_out[row] = reduce_sum(acc) - (dlse != nullptr ? dlse[row] : T(0));
      lse_out[row] = lse_in[row] == -kInf ? kInf : lse_in[row];
    }
  });
}

template <typename scalar_t, typename T>
void load_key_block(KeyBlock<T>& kb, const Problem& p, const BackwardInputs<scalar_t>& in, int64_t b, int64_t hk,
                    int64_t k0, bool with_transpose) {
  kb.k0 = k0;
  kb.n = std::min(p.block_k, p.tk - k0);
  kb.k = rows_operand(in.k, b, hk, k0, kb.n, p.dh, p.dh_padded, kb.k_buf.data());
  kb.v = rows_operand(in.v, b, hk, k0, kb.n, p.dh, p.dh_padded, kb.v_buf.data());
  if (with_transpose) transpose_padded(kb.k.data, kb.k.ld, kb.n, p.dh, kb.kt.data(), p.block_k, kb.n);
}

template <typename scalar_t, typename T>
void load_query_tile(QueryTile<T>& qt, const Problem& p, const BackwardInputs<scalar_t>& in, int64_t b, int64_t h,
                     int64_t i0) {
  const int64_t dh = p.dh, dhp = p.dh_padded;
  qt.i0 = i0;
  qt.m = std::min(p.tile_q, p.tq - i0);
  qt.m_padded = round_up(qt.m, kAlign);
  if (!rows_in_place(in.q, dh)) qt.q_buf.resize(p.tile_q * dhp);
  if (!rows_in_place(in.grad_out, dh)) qt.do_buf.resize(p.tile_q * dhp);
  qt.q = rows_operand(in.q, b, h, i0, qt.m, dh, dhp, qt.q_buf.data());
  transpose_padded(qt.q.data, qt.q.ld, qt.m, dh, qt.qt.data(), p.tile_q, qt.m_padded);
  qt.d_o = rows_operand(in.grad_out, b, h, i0, qt.m, dh, dhp, qt.do_buf.data());
  transpose_padded(qt.d_o.data, qt.d_o.ld, qt.m, dh, qt.d_ot.data(), p.tile_q, qt.m_padded);
  const int64_t row0 = (b * p.heads + h) * p.tq + i0;
  std::copy(in.lse + row0, in.lse + row0 + qt.m, qt.lse.begin());  // padding: +inf, so P = 0
  std::fill(qt.lse.begin() + qt.m, qt.lse.end(), std::numeric_limits<T>::infinity());
  std::copy(in.delta + row0, in.delta + row0 + qt.m, qt.delta.begin());
  std::fill(qt.delta.begin() + qt.m, qt.delta.end(), T(0));
}

// Pᵀ and dSᵀ of one pair. Returns n_vis, the number of leading keys of the block
// that some query of the tile sees (0: the pair contributes nothing).
template <typename T>
int64_t pair_dscores(const Problem& p, const T* key_bias, int64_t b, const KeyBlock<T>& kb, const QueryTile<T>& qt,
                     PairTiles<T>& pair) {
  const int64_t n_vis = std::min(p.key_end(qt.i0 + qt.m - 1) - kb.k0, kb.n);
  if (n_vis <= 0) return 0;
  gemm(n_vis, qt.m_padded, p.dh, kb.k.data, kb.k.ld, qt.qt.data(), p.tile_q, pair.pt.data(), p.tile_q, false);
  gemm(n_vis, qt.m_padded, p.dh, kb.v.data, kb.v.ld, qt.d_ot.data(), p.tile_q, pair.dst.data(), p.tile_q, false);
  for (int64_t kk = 0; kk < n_vis; ++kk) {
    T* p_row = pair.pt.data() + kk * p.tile_q;
    T* ds_row = pair.dst.data() + kk * p.tile_q;
    if (key_bias != nullptr && key_bias[b * p.tk + kb.k0 + kk] != T(0)) {  // a padding key
      std::fill(p_row, p_row + qt.m_padded, T(0));
      std::fill(ds_row, ds_row + qt.m_padded, T(0));
      continue;
    }
    const int64_t first = std::clamp<int64_t>(p.query_begin(kb.k0 + kk) - qt.i0, 0, qt.m);
    dscores_key_row(p_row, ds_row, first, qt.m_padded, static_cast<T>(p.scale), qt.lse.data(), qt.delta.data());
  }
  return n_vis;
}

// dQᵀ_i += K_jᵀ dSᵀ for one pair; dqt is the tile's [Dh, p.tile_q] accumulator.
template <typename T>
inline void accumulate_dq(const Problem& p, const KeyBlock<T>& kb, const QueryTile<T>& qt, const PairTiles<T>& pair,
                          int64_t n_vis, T* dqt) {
  gemm(p.dh, qt.m_padded, n_vis, kb.kt.data(), p.block_k, pair.dst.data(), p.tile_q, dqt, p.tile_q, true);
}

// dQ rows [i0, i0 + m) of head (b, h) from the tile's dQᵀ accumulator (times scale).
template <typename scalar_t, typename T>
void store_dq_tile(const Problem& p, T* dqt, int64_t b, int64_t h, int64_t i0, T* rows, scalar_t* grad_q) {
  const int64_t m = std::min(p.tile_q, p.tq - i0), dhp = p.dh_padded;
  transpose_padded(dqt, p.tile_q, p.dh, m, rows, dhp, p.dh);
  for (int64_t r = 0; r < m; ++r) {
    store_row(rows + r * dhp, p.dh, static_cast<T>(p.scale), grad_q + ((b * p.heads + h) * p.tq + i0 + r) * p.dh);
  }
}

// dK and dV of one key block, from every query tile of every head of the group
// that sees it; with dqt ([G, Tq / p.tile_q tiles, Dh, p.tile_q]) also the dQᵀ
// contributions of these pairs. tile_for(g, tile) gives the loaded query tile
// `tile` of head g of the group.
template <typename scalar_t, typename T, typename TileFor>
void key_block_grads(const Problem& p, const BackwardInputs<scalar_t>& in, int64_t b, int64_t hk, int64_t k0,
                     KeyBlock<T>& kb, const TileFor& tile_for, PairTiles<T>& pair, T* dk, T* dv, T* dqt,
                     scalar_t* grad_k, scalar_t* grad_v) {
  const int64_t dh = p.dh, dhp = p.dh_padded, q_tiles = ceil_div(p.tq, p.tile_q);
  load_key_block(kb, p, in, b, hk, k0, dqt != nullptr);
  std::fill(dk, dk + p.block_k * dhp, T(0));
  std::fill(dv, dv + p.block_k * dhp, T(0));
  for (int64_t g = 0; g < p.group; ++g) {
    for (int64_t tile = p.query_begin(k0) / p.tile_q; tile < q_tiles; ++tile) {
      const QueryTile<T>& qt = tile_for(g, tile);
      const int64_t n_vis = pair_dscores(p, in.key_bias, b, kb, qt, pair);
      if (n_vis == 0) continue;
      gemm(n_vis, qt.d_o.cols, qt.m, pair.pt.data(), p.tile_q, qt.d_o.data, qt.d_o.ld, dv, dhp, true);
      gemm(n_vis, qt.q.cols, qt.m, pair.dst.data(), p.tile_q, qt.q.data, qt.q.ld, dk, dhp, true);
      if (dqt != nullptr) accumulate_dq(p, kb, qt, pair, n_vis, dqt + (g * q_tiles + tile) * dhp * p.tile_q);
    }
  }
  for (int64_t r = 0; r < kb.n; ++r) {
    const int64_t row = (b * p.kv_heads + hk) * p.tk + k0 + r;
    store_row(dk + r * dhp, dh, static_cast<T>(p.scale), grad_k + row * dh);
    store_row(dv + r * dhp, dh, T(1), grad_v + row * dh);
  }
}

template <typename scalar_t>
void attention_backward(const Problem& p, const BackwardInputs<scalar_t>& in, at::Tensor& grad_q, at::Tensor& grad_k,
                        at::Tensor& grad_v) {
  using T = at::opmath_type<scalar_t>;
  scalar_t* dq_data = grad_q.mutable_data_ptr<scalar_t>();
  scalar_t* dk_data = grad_k.mutable_data_ptr<scalar_t>();
  scalar_t* dv_data = grad_v.mutable_data_ptr<scalar_t>();
  const int64_t dhp = p.dh_padded, q_tiles = ceil_div(p.tq, p.tile_q), key_blocks = ceil_div(p.tk, p.block_k);
  const int64_t units = p.batch * p.kv_heads, threads = at::get_num_threads();
  const bool fused = ceil_div(units, threads) * 5 * threads <= 7 * units;

  if (fused) {
    at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
      KeyBlock<T> kb(p);
      std::vector<QueryTile<T>> tiles(p.group * q_tiles, QueryTile<T>(p));  // every query tile of the head group
      PairTiles<T> pair(p);
      std::vector<T> dk(p.block_k * dhp), dv(p.block_k * dhp), dqt(p.group * q_tiles * dhp * p.tile_q),
          rows(p.tile_q * dhp);
      const auto loaded = [&](int64_t g, int64_t tile) -> const QueryTile<T>& { return tiles[g * q_tiles + tile]; };
      for (int64_t unit = begin; unit < end; ++unit) {
        const int64_t b = unit / p.kv_heads, hk = unit % p.kv_heads;
        for (int64_t g = 0; g < p.group; ++g) {
          for (int64_t tile = 0; tile < q_tiles; ++tile) {
            load_query_tile(tiles[g * q_tiles + tile], p, in, b, hk * p.group + g, tile * p.tile_q);
          }
        }
        std::fill(dqt.begin(), dqt.end(), T(0));
        for (int64_t block = 0; block < key_blocks; ++block) {
          key_block_grads(p, in, b, hk, block * p.block_k, kb, loaded, pair, dk.data(), dv.data(), dqt.data(), dk_data,
                          dv_data);
        }
        for (int64_t g = 0; g < p.group; ++g) {
          for (int64_t tile = 0; tile < q_tiles; ++tile) {
            store_dq_tile(p, dqt.data() + (g * q_tiles + tile) * dhp * p.tile_q, b, hk * p.group + g, tile * p.tile_q,
                          rows.data(), dq_data);
          }
        }
      }
    });
    return;
  }

  at::parallel_for(0, units * key_blocks, 1, [&](int64_t begin, int64_t end) {
    KeyBlock<T> kb(p);
    QueryTile<T> qt(p);
    PairTiles<T> pair(p);
    std::vector<T> dk(p.block_k * dhp), dv(p.block_k * dhp);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t unit = item / key_blocks, b = unit / p.kv_heads, hk = unit % p.kv_heads;
      const int64_t k0 = balanced_tile(item % key_blocks, key_blocks) * p.block_k;
      const auto load = [&](int64_t g, int64_t tile) -> const QueryTile<T>& {
        load_query_tile(qt, p, in, b, hk * p.group + g, tile * p.tile_q);
        return qt;
      };
      key_block_grads(p, in, b, hk, k0, kb, load, pair, dk.data(), dv.data(), static_cast<T*>(nullptr), dk_data,
                      dv_data);
    }
  });
  const int64_t tiles_per_block = std::min(kBlockQ / kTileQ, q_tiles);
  const int64_t q_blocks = ceil_div(q_tiles, tiles_per_block);
  at::parallel_for(0, p.batch * p.heads * q_blocks, 1, [&](int64_t begin, int64_t end) {
    KeyBlock<T> kb(p);
    std::vector<QueryTile<T>> tiles(tiles_per_block, QueryTile<T>(p));
    PairTiles<T> pair(p);
    std::vector<T> dqt(tiles_per_block * dhp * p.tile_q), rows(p.tile_q * dhp);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t bh = item / q_blocks, b = bh / p.heads, h = bh % p.heads, hk = h / p.group;
      const int64_t first_tile = balanced_tile(item % q_blocks, q_blocks) * tiles_per_block;
      const int64_t count = std::min(tiles_per_block, q_tiles - first_tile);
      for (int64_t t = 0; t < count; ++t) load_query_tile(tiles[t], p, in, b, h, (first_tile + t) * p.tile_q);
      std::fill(dqt.begin(), dqt.end(), T(0));
      const int64_t kv_end = p.key_end(std::min((first_tile + count) * p.tile_q, p.tq) - 1);
      for (int64_t k0 = 0; k0 < kv_end; k0 += p.block_k) {
        load_key_block(kb, p, in, b, hk, k0, true);
        for (int64_t t = 0; t < count; ++t) {
          const int64_t n_vis = pair_dscores(p, in.key_bias, b, kb, tiles[t], pair);
          if (n_vis > 0) accumulate_dq(p, kb, tiles[t], pair, n_vis, dqt.data() + t * dhp * p.tile_q);
        }
      }
      for (int64_t t = 0; t < count; ++t) {
        store_dq_tile(p, dqt.data() + t * dhp * p.tile_q, b, h, (first_tile + t) * p.tile_q, rows.data(), dq_data);
      }
    }
  });
}

// ---------------------------------------------------------------- op entry points

std::tuple<at::Tensor, at::Tensor> attn_fwd_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                const c10::optional<at::Tensor>& key_padding_mask, bool causal,
                                                double scale) {
  const Problem p = check_problem(q, k, v, key_padding_mask, causal, scale);
  const auto acc = accumulation_type(q.scalar_type());
  at::Tensor out = at::empty(q.sizes(), q.options());
  at::Tensor lse = at::empty({p.batch, p.heads, p.tq}, q.options().dtype(acc));
  const at::Tensor bias = key_bias(key_padding_mask, acc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "attn_fwd_cpu", [&] {
    if (use_decode_path(p)) {
      decode_forward<scalar_t>(p, unit_last_stride(q), unit_last_stride(k), unit_last_stride(v), bias, out, lse);
    } else {
      attention_forward<scalar_t>(p, unit_last_stride(q), unit_last_stride(k), unit_last_stride(v), bias, out, lse);
    }
  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attn_bwd_cpu(
    const at::Tensor& grad_out, const c10::optional<at::Tensor>& grad_lse, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const c10::optional<at::Tensor>& key_padding_mask, const at::Tensor& out,
    const at::Tensor& lse, bool causal, double scale) {
  const Problem p = check_problem(q, k, v, key_padding_mask, causal, scale);
  const auto acc = accumulation_type(q.scalar_type());
  const at::Tensor dlse = check_attention_backward(p, grad_out, grad_lse, q, out, lse);
  const std::vector<int64_t> row_shape = {p.batch, p.heads, p.tq};
  at::Tensor grad_q = at::empty(q.sizes(), q.options());
  at::Tensor grad_k = at::empty(k.sizes(), k.options());
  at::Tensor grad_v = at::empty(v.sizes(), v.options());
  at::Tensor delta = at::empty(row_shape, q.options().dtype(acc));
  at::Tensor lse_used = at::empty(row_shape, q.options().dtype(acc));
  const at::Tensor bias = key_bias(key_padding_mask, acc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "attn_bwd_cpu", [&] {
    using T = at::opmath_type<scalar_t>;
    const at::Tensor q_ = unit_last_stride(q), k_ = unit_last_stride(k), v_ = unit_last_stride(v);
    const at::Tensor do_ = unit_last_stride(grad_out);
    backward_row_terms<scalar_t>(p, do_, unit_last_stride(out), lse.contiguous(), dlse, delta, lse_used);
    const BackwardInputs<scalar_t> in{head_rows<scalar_t>(q_),
                                      head_rows<scalar_t>(k_),
                                      head_rows<scalar_t>(v_),
                                      head_rows<scalar_t>(do_),
                                      bias.defined() ? bias.const_data_ptr<T>() : nullptr,
                                      lse_used.const_data_ptr<T>(),
                                      delta.const_data_ptr<T>()};
    attention_backward<scalar_t>(p, in, grad_q, grad_k, grad_v);
  });
  return {grad_q, grad_k, grad_v};
}

}  // namespace

TORCH_LIBRARY_IMPL(attnres, CPU, m) {
  m.impl("attn_fwd", &attn_fwd_cpu);
  m.impl("attn_bwd", &attn_bwd_cpu);
}

}  // namespace attnres
