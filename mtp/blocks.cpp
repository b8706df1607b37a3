// mtp's CPU kernels (AVX2, float32 sums): products by weights kept in blocks of 32 (`mtp.quantized`), for the few
// input rows of a decoding step, each block's weights unpacked in registers so that a pass streams 4 or 8 bits a
// weight from memory instead of 32; and products by float weights kept only in a compiled pass's blocks
// (`mtp.decoding.constants.PanelLinear`), for any row count. Built once per machine and torch by
// `mtp.quantized.kernels`.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <vector>

namespace {

constexpr int64_t BLOCK = 32;  // weights per block, each block with its own scale (and, 4-bit, its own minimum)
constexpr int64_t AHEAD = 4;  // rows of weights prefetched ahead of the one multiplied
constexpr int64_t ROWS = 8;    // input rows multiplied per walk over the weights (more: several walks)

inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The 32 weights of one block as four vectors of 8 floats (before scale and minimum).
struct Four { __m256 w[4]; };

inline Four unpack4(const uint8_t* q) {  // 16 bytes: weight i in the low half of byte i, weight 16 + i in the high
  __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  __m128i low = _mm_and_si128(bytes, _mm_set1_epi8(15));
  __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(15));
  return {{_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(low)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(low, 8))),
           _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(high)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(high, 8)))}};
}

inline Four unpack8(const int8_t* q) {  // 32 bytes, one signed weight each
  __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  __m128i low = _mm256_castsi256_si128(bytes), high = _mm256_extracti128_si256(bytes, 1);
  return {{_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(low)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(low, 8))),
           _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(high)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(high, 8)))}};
}

// Minimum[n, :] . xsum[r, :] over the blocks of a row: what the blocks' minimums add to out[r, n].
inline float minimums(const float* minimum, const float* xsum, int64_t blocks) {
  __m256 acc = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 8 <= blocks; b += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(minimum + b), _mm256_loadu_ps(xsum + b), acc);
  float sum = sum8(acc);
  for (; b < blocks; ++b) sum += minimum[b] * xsum[b];
  return sum;
}

// out[r, n] = sum_b scale[n, b] (q[n, block b] . x[r, block b]) + minimum[n, b] sum(x[r, block b]), for R rows,
// each block unpacked once for all of them. Up to 3 rows, each row's dot product is scaled (one FMA a row and
// block); from 4, the block's weights are (four multiplications a block, shared), and each row's product is taken
// into A accumulators, so that 4 rows still keep the FMA units busy.
template <int64_t R, bool FOUR>
void rows(const float* x, const float* xsum, const uint8_t* q, const float* scale, const float* minimum,
          float* out, int64_t K, int64_t N, int64_t begin, int64_t end) {
  constexpr bool LATE = R <= 3;
  constexpr int A = R == 4 ? 2 : 1;
  const int64_t blocks = K / BLOCK, bytes = FOUR ? BLOCK / 2 : BLOCK;
  for (int64_t n = begin; n < end; ++n) {
    __m256 acc[R][A];
    for (int64_t r = 0; r < R; ++r)
      for (int a = 0; a < A; ++a) acc[r][a] = _mm256_setzero_ps();
    const uint8_t* qn = q + n * blocks * bytes;
    if (n + AHEAD < end) {  // the rows a few ahead on their way from memory while this one is multiplied
      for (int64_t at = 0; at < blocks * bytes; at += 64) _mm_prefetch(reinterpret_cast<const char*>(qn + AHEAD * blocks * bytes + at), _MM_HINT_T0);
      for (int64_t at = 0; at < blocks; at += 16) {
        _mm_prefetch(reinterpret_cast<const char*>(scale + (n + AHEAD) * blocks + at), _MM_HINT_T0);
        if (FOUR) _mm_prefetch(reinterpret_cast<const char*>(minimum + (n + AHEAD) * blocks + at), _MM_HINT_T0);
      }
    }
    for (int64_t b = 0; b < blocks; ++b) {
      Four w = FOUR ? unpack4(qn + b * bytes) : unpack8(reinterpret_cast<const int8_t*>(qn + b * bytes));
      const __m256 d = _mm256_set1_ps(scale[n * blocks + b]);
      if constexpr (LATE) {
        for (int64_t r = 0; r < R; ++r) {
          const float* xr = x + r * K + b * BLOCK;
          __m256 dot = _mm256_mul_ps(w.w[0], _mm256_loadu_ps(xr));
          for (int i = 1; i < 4; ++i) dot = _mm256_fmadd_ps(w.w[i], _mm256_loadu_ps(xr + 8 * i), dot);
          acc[r][0] = _mm256_fmadd_ps(d, dot, acc[r][0]);
        }
      } else {
        for (int i = 0; i < 4; ++i) w.w[i] = _mm256_mul_ps(w.w[i], d);
        for (int64_t r = 0; r < R; ++r) {
          const float* xr = x + r * K + b * BLOCK;
          for (int i = 0; i < 4; ++i)
            acc[r][i % A] = _mm256_fmadd_ps(w.w[i], _mm256_loadu_ps(xr + 8 * i), acc[r][i % A]);
        }
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      __m256 total = acc[r][0];
      for (int a = 1; a < A; ++a) total = _mm256_add_ps(total, acc[r][a]);
      out[r * N + n] = sum8(total) + (FOUR ? minimums(minimum + n * blocks, xsum + r * blocks, blocks) : 0.f);
    }
  }
}

template <bool FOUR>
at::Tensor blocks_mm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& minimum) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be (rows, in) float32");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), blocks = K / BLOCK;
  TORCH_CHECK(K % BLOCK == 0 && scale.size(0) == N && scale.size(1) == blocks && q.size(1) * (FOUR ? 2 : 1) == K,
              "blocks and input widths do not match");
  TORCH_CHECK(q.scalar_type() == at::kByte && scale.scalar_type() == at::kFloat && q.is_contiguous() &&
              scale.is_contiguous() && (!FOUR || (minimum.scalar_type() == at::kFloat && minimum.is_contiguous())),
              "blocks must be contiguous uint8, scales and minimums contiguous float32");
  at::Tensor xc = x.contiguous();
  const float* xs = xc.data_ptr<float>();
  std::vector<float> sums(FOUR ? M * blocks : 0);  // each block's sum of x, for the minimums' part
  for (int64_t i = 0; i < (int64_t)sums.size(); ++i) {
    float sum = 0.f;
    for (int64_t k = 0; k < BLOCK; ++k) sum += xs[i * BLOCK + k];
    sums[i] = sum;
  }
  at::Tensor out = at::empty({M, N}, x.options());
  const float* mins = FOUR ? minimum.data_ptr<float>() : nullptr;
  for (int64_t start = 0; start < M; start += ROWS) {
    const int64_t count = std::min(ROWS, M - start);
    const float* xr = xs + start * K;
    const float* sr = FOUR ? sums.data() + start * blocks : nullptr;
    float* o = out.data_ptr<float>() + start * N;
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
      switch (count) {
#define ROWS_CASE(R) case R: rows<R, FOUR>(xr, sr, q.data_ptr<uint8_t>(), scale.data_ptr<float>(), mins, o, K, N, begin, end); break;
        ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4) ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7) ROWS_CASE(8)
      }
    });
  }
  return out;
}

at::Tensor q4_mm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& minimum) {
  return blocks_mm<true>(x, q, scale, minimum);
}
at::Tensor q8_mm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale) {
  return blocks_mm<false>(x, q, scale, scale);
}

constexpr int TILE = 12;  // rows of x packed together (k-major), so that a tile's inputs are one stream

// out[:, c0 .. c0 + 8S) for R rows of x by one panel's strips s0 .. s0 + S: `xp` the rows' inputs within their
// packed tile (row r's input k at xp[k * TILE + r]); a panel is K rows of `bn` weights (the compiled pass's blocked
// layout, (N / bn, K, bn)), a strip 8 of its columns; R x S accumulators.
template <int R, int S>
inline void panel_tile(const float* xp, int64_t K, const float* w, int64_t bn, float* out, int64_t N, int64_t c0) {
  __m256 acc[R][S];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int s = 0; s < S; ++s) acc[r][s] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {  // (unrolled, so that GCC keeps the accumulators in registers)
    __m256 wv[S];
#pragma GCC unroll 2
    for (int s = 0; s < S; ++s) wv[s] = _mm256_loadu_ps(w + k * bn + 8 * s);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(xp + k * TILE + r);
#pragma GCC unroll 2
      for (int s = 0; s < S; ++s) acc[r][s] = _mm256_fmadd_ps(xv, wv[s], acc[r][s]);
    }
  }
#pragma GCC unroll 2
  for (int s = 0; s < S; ++s) {
    const int64_t c = c0 + 8 * s, valid = std::min<int64_t>(8, N - c);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      if (valid == 8) {
        _mm256_storeu_ps(out + r * N + c, acc[r][s]);
      } else if (valid > 0) {  // the last panel's columns past N (zero weights) are not stored
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, acc[r][s]);
        for (int64_t j = 0; j < valid; ++j) out[r * N + c + j] = lanes[j];
      }
    }
  }
}

// Every row of x (packed in tiles) by one panel's strips s0 .. s0 + S: R rows at a time, 12 accumulators in all
// with one strip or two (of 16 vector registers).
template <int S>
void panel_rows(const float* packed, int64_t M, int64_t K, const float* w, int64_t bn, float* out, int64_t N,
                int64_t c0) {
  constexpr int R = TILE / S;
  for (int64_t first = 0; first < M; first += R) {
    const float* xp = packed + first / TILE * TILE * K + first % TILE;
    float* o = out + first * N;
    switch (std::min<int64_t>(R, M - first)) {
#define PANEL_CASE(C) case C: if constexpr (C <= R) panel_tile<C, S>(xp, K, w, bn, o, N, c0); break;
      PANEL_CASE(1) PANEL_CASE(2) PANEL_CASE(3) PANEL_CASE(4) PANEL_CASE(5) PANEL_CASE(6) PANEL_CASE(7)
      PANEL_CASE(8) PANEL_CASE(9) PANEL_CASE(10) PANEL_CASE(11) PANEL_CASE(12)
      default: break;
    }
  }
}

// x (M, K) times a linear layer's weight (N, K) kept only as panels (N / bn, K, bn), rows past N zero: (M, N), each
// output the sum over k in order, so a row's output is the same whatever the rows beside it (a prompt's prefill, a
// tree, a batch).
at::Tensor panel_mm(const at::Tensor& x, const at::Tensor& panels, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be (rows, in) float32");
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == at::kFloat && panels.is_contiguous(),
              "panels must be contiguous float32 (N / bn, K, bn)");
  const int64_t M = x.size(0), K = x.size(1), count = panels.size(0), bn = panels.size(2);
  TORCH_CHECK(panels.size(1) == K && bn % 8 == 0 && (count - 1) * bn < N && N <= count * bn,
              "panels and input widths do not match");
  at::Tensor xc = x.contiguous();
  const float* xs = xc.data_ptr<float>();
  std::vector<float> packed((M + TILE - 1) / TILE * TILE * K, 0.f);  // tile t: [k][r] = x[t * TILE + r][k]
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) packed[m / TILE * TILE * K + k * TILE + m % TILE] = xs[m * K + k];
  at::Tensor out = at::empty({M, N}, x.options());
  const float* ws = panels.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t strips = bn / 8, pairs = (strips + 1) / 2;  // two strips a task where there are two
  at::parallel_for(0, count * pairs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t panel = task / pairs, strip = 2 * (task % pairs);
      const float* w = ws + panel * K * bn + 8 * strip;
      const int64_t c0 = panel * bn + 8 * strip;
      if (strip + 1 < strips) {
        panel_rows<2>(packed.data(), M, K, w, bn, o, N, c0);
      } else {
        panel_rows<1>(packed.data(), M, K, w, bn, o, N, c0);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(mtp, m) {
  m.def("q4_mm(Tensor x, Tensor q, Tensor scale, Tensor minimum) -> Tensor");
  m.def("q8_mm(Tensor x, Tensor q, Tensor scale) -> Tensor");
  m.def("panel_mm(Tensor x, Tensor panels, int n) -> Tensor");
}
TORCH_LIBRARY_IMPL(mtp, CPU, m) {
  m.impl("q4_mm", &q4_mm);
  m.impl("q8_mm", &q8_mm);
  m.impl("panel_mm", &panel_mm);
}
