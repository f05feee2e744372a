// Decode attention for a bf16 query over a bf16 paged cache on CPUs with AVX512-BF16: what
// cpu_paged_decode.cpp's generic loop computes (same work items, same online softmax in fp32),
// with the q.k products on vdpbf16ps.
//
// Why: a decode step of 16 sequences of ~1,100 tokens reads ~400 MB of KV cache over its 30
// layers, from memory, and the generic loop read it at 5 GB/s on one core (a copy moves ~18):
// it waited on each block, whose place in memory the hardware prefetcher cannot guess. Here the
// next 16 keys' rows are prefetched while these 16 compute (the generic loop now prefetches the
// next block the same way); that is most of the gain. The vector products add ~1.2x on top
// (benchmarks/cpp_paged_decode.py; docs/performance.md).
//
// Per work item (sequence b, KV head h; its G query heads), keys go in groups of 16 positions:
//   scores   one vdpbf16ps chain per (query head, key) over the row's d pairs (exact products of
//            bf16 inputs, fp32 sums), 16 keys' partial vectors summed across lanes at once
//            (hsum16), then x scale
//   softmax  the generic loop's online update, 16 keys at a time, probabilities kept in fp32
//   values   each key's V row widened to fp32 once, then acc += p x v with fp32 FMAs per head
// Differs from the generic loop only in the order of the fp32 additions (and in applying the
// scale after the dot product rather than to the query).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

namespace {

constexpr int64_t GROUP = 16;      // keys per softmax update: one score vector
constexpr int64_t MAX_HEADS = 16;  // query heads per KV head (cpu_paged_decode.py MAX_GROUP)

// lane i of the result = the sum of v[i]'s 16 lanes: a transposing add tree, 45 instructions
// for 16 sums (one horizontal sum alone takes ~8).
inline __m512 hsum16(const __m512* v) {
  __m512 w[8], x[4], s[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int j = 0; j < 4; ++j) {  // per 128-bit lane: vectors 4j..4j+3, that lane's part of each
    const __m512d c = _mm512_castps_pd(w[2 * j]), d = _mm512_castps_pd(w[2 * j + 1]);
    x[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(c, d)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(c, d)));
  }
  for (int j = 0; j < 2; ++j)  // 128-bit lanes: [x0 L0+L1, x0 L2+L3, x1 L0+L1, x1 L2+L3]
    s[j] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * j], x[2 * j + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(x[2 * j], x[2 * j + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s[0], s[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(s[0], s[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

inline __m512 widen(const uint16_t* src) {  // 16 bf16 -> fp32: a shift, exact
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))), 16));
}

template <int64_t D>
void decode(const uint16_t* q, const uint16_t* k, const uint16_t* v, const int32_t* tables,
            const int32_t* lens, uint16_t* out, int64_t n, int64_t H, int64_t Hkv, int64_t bs,
            int64_t max_blocks, float scale) {
  constexpr int64_t DW = D / 32, DV = D / 16;  // vectors per row: bf16 pairs / fp32
  const int64_t G = H / Hkv, token_stride = Hkv * D, block_stride = bs * Hkv * D;
  at::parallel_for(0, n * Hkv, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float acc[MAX_HEADS][D], p[MAX_HEADS][GROUP], vf[GROUP][D];
    float m[MAX_HEADS], l[MAX_HEADS];
    __m512bh qv[MAX_HEADS][DW];
    int64_t row_at[GROUP];  // row_of each key of the group
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / Hkv, h = item % Hkv, len = lens[b];
      const int32_t* table = tables + b * max_blocks;
      auto row_of = [&](int64_t pos) {  // offset of key pos's row of head h, in K and V alike
        return int64_t(table[pos / bs]) * block_stride + pos % bs * token_stride + h * D;
      };
      for (int64_t g = 0; g < G; ++g) {
        for (int64_t x = 0; x < DW; ++x)
          qv[g][x] = (__m512bh)_mm512_loadu_si512(q + (b * H + h * G + g) * D + 32 * x);
        for (int64_t d = 0; d < D; ++d) acc[g][d] = 0.f;
        m[g] = -1e30f;  // finite: -ffast-math assumes no infinities
        l[g] = 0.f;
      }
      for (int64_t t0 = 0; t0 < len; t0 += GROUP) {
        const int64_t nt = std::min(GROUP, len - t0);
        for (int64_t t = 0; t < nt; ++t) row_at[t] = row_of(t0 + t);
        // the next group's rows, fetched while this one computes (its blocks may lie anywhere)
        for (int64_t pos = t0 + GROUP; pos < std::min(len, t0 + 2 * GROUP); ++pos) {
          const int64_t off = row_of(pos);
          for (int64_t x = 0; x < D * 2; x += 64) {
            _mm_prefetch(reinterpret_cast<const char*>(k + off) + x, _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(v + off) + x, _MM_HINT_T0);
          }
        }
        const __mmask16 valid = _cvtu32_mask16((1u << nt) - 1u);
        for (int64_t g = 0; g < G; ++g) {  // scores, then the online softmax update
          __m512 part[GROUP];
          for (int64_t t = 0; t < GROUP; ++t) {
            part[t] = _mm512_setzero_ps();
            if (t < nt) {
              const uint16_t* kr = k + row_at[t];
              for (int64_t x = 0; x < DW; ++x)
                part[t] = _mm512_dpbf16_ps(part[t], qv[g][x],
                                           (__m512bh)_mm512_loadu_si512(kr + 32 * x));
            }
          }
          const __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(-1e30f), valid,
                                              _mm512_mul_ps(hsum16(part), _mm512_set1_ps(scale)));
          const float top = std::max(m[g], _mm512_reduce_max_ps(s));
          const float rescale = top > m[g] ? std::exp(m[g] - top) : 1.f;  // exp(0): 1 exactly
          _mm512_store_ps(p[g], _mm512_sub_ps(s, _mm512_set1_ps(top)));
          for (int64_t t = 0; t < GROUP; ++t) p[g][t] = std::exp(p[g][t]);  // vectorized
          const __m512 pg = _mm512_maskz_mov_ps(valid, _mm512_load_ps(p[g]));
          _mm512_store_ps(p[g], pg);
          l[g] = l[g] * rescale + _mm512_reduce_add_ps(pg);
          m[g] = top;
          if (rescale != 1.f)
            for (int64_t x = 0; x < DV; ++x)
              _mm512_store_ps(acc[g] + 16 * x, _mm512_mul_ps(_mm512_load_ps(acc[g] + 16 * x),
                                                              _mm512_set1_ps(rescale)));
        }
        for (int64_t t = 0; t < nt; ++t) {  // V rows widened once for every head
          const uint16_t* vr = v + row_at[t];
          for (int64_t x = 0; x < DV; ++x) _mm512_store_ps(vf[t] + 16 * x, widen(vr + 16 * x));
        }
        for (int64_t g = 0; g < G; ++g) {
          __m512 o[DV];
          for (int64_t x = 0; x < DV; ++x) o[x] = _mm512_load_ps(acc[g] + 16 * x);
          for (int64_t t = 0; t < nt; ++t) {
            const __m512 w = _mm512_set1_ps(p[g][t]);
            for (int64_t x = 0; x < DV; ++x)
              o[x] = _mm512_fmadd_ps(w, _mm512_load_ps(vf[t] + 16 * x), o[x]);
          }
          for (int64_t x = 0; x < DV; ++x) _mm512_store_ps(acc[g] + 16 * x, o[x]);
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        uint16_t* dst = out + (b * H + h * G + g) * D;
        const __m512 inv = _mm512_set1_ps(1.f / l[g]);
        for (int64_t x = 0; x < DV; ++x)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * x),
                              (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(acc[g] + 16 * x), inv)));
      }
    }
  });
}

}  // namespace

// Runs the bf16 decode and returns true, or returns false (nothing done) where this build or
// shape has no fast path: the caller runs the generic loop.
bool paged_decode_bf16(const torch::Tensor& query, const torch::Tensor& key,
                       const torch::Tensor& value, const torch::Tensor& tables,
                       const torch::Tensor& lens, torch::Tensor& out, float scale) {
  const int64_t n = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t bs = key.size(1), Hkv = key.size(2), mb = tables.size(1);
  auto in = [](const torch::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); };
  auto run = [&](auto dim) {
    decode<decltype(dim)::value>(in(query), in(key), in(value), tables.data_ptr<int32_t>(),
                                 lens.data_ptr<int32_t>(),
                                 reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), n, H,
                                 Hkv, bs, mb, scale);
  };
  if (D == 64) run(std::integral_constant<int64_t, 64>());
  else if (D == 128) run(std::integral_constant<int64_t, 128>());
  else return false;
  return true;
}
#else
bool paged_decode_bf16(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                       const torch::Tensor&, const torch::Tensor&, torch::Tensor&, float) {
  return false;  // no AVX512-BF16 on the machine that built it
}
#endif
