// Decode attention that reads the paged KV cache in place (a prototype; not used by the engine).
//
// Layout, as raypaged/model/kv_cache.py allocates it and torch_backend.py reads it:
//   query        [n, H, D]                      one decode row per sequence, row b = sequence b
//   key / value  [num_blocks, bs, Hkv, D]       token t of block blk at key[blk][t][h]
//   block_tables [n, max_blocks] int32          sequence b's i-th block id
//   seq_lens     [n] int32                      keys 0 .. seq_lens[b]-1 are visible
// One work item per (sequence, KV head): its G = H / Hkv query heads share one pass over the
// head's blocks (GQA without copying K/V per query head). Scores and the output accumulate in
// fp32 with an online softmax, one block at a time:
//   m' = max(m, max_t s_t);  l = l * e^(m - m') + sum_t e^(s_t - m');  acc likewise, + e^(s_t - m') v_t
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

constexpr int64_t MAX_GROUP = 16;   // query heads per KV head
constexpr int64_t MAX_DIM = 256;    // head dim
constexpr int64_t MAX_BLOCK = 64;   // tokens per block
constexpr int64_t LANES = 16;       // independent partial sums: vectorizable without -ffast-math

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) {  // bf16 is the top half of an fp32: a shift, exact
  uint32_t bits = uint32_t(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename T>
inline void load_row(const T* src, float* dst, int64_t D) {
  for (int64_t d = 0; d < D; ++d) dst[d] = to_float(src[d]);
}

inline float dot(const float* a, const float* b, int64_t D) {  // D % LANES == 0
  float part[LANES] = {0};
  for (int64_t d = 0; d < D; d += LANES)
    for (int64_t j = 0; j < LANES; ++j) part[j] += a[d + j] * b[d + j];
  float s = 0;
  for (int64_t j = 0; j < LANES; ++j) s += part[j];
  return s;
}

// D is a template argument so the row loops are fully unrolled with no remainder handling.
template <typename T, int64_t D>
void decode(const T* q, const T* k, const T* v, const int32_t* tables, const int32_t* lens, T* out,
            int64_t n, int64_t H, int64_t Hkv, int64_t bs, int64_t max_blocks, float scale) {
  const int64_t G = H / Hkv, token_stride = Hkv * D, block_stride = bs * Hkv * D;
  at::parallel_for(0, n * Hkv, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float qf[MAX_GROUP][MAX_DIM], acc[MAX_GROUP][MAX_DIM], row[MAX_DIM];
    float m[MAX_GROUP], l[MAX_GROUP], p[MAX_GROUP][MAX_BLOCK];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / Hkv, h = item % Hkv, len = lens[b];
      for (int64_t g = 0; g < G; ++g) {
        load_row(q + (b * H + h * G + g) * D, qf[g], D);
        for (int64_t d = 0; d < D; ++d) { qf[g][d] *= scale; acc[g][d] = 0.f; }
        m[g] = -1e30f;  // finite: -ffast-math assumes no infinities
        l[g] = 0.f;
      }
      for (int64_t blk = 0; blk * bs < len; ++blk) {
        const int64_t base = int64_t(tables[b * max_blocks + blk]) * block_stride + h * D;
        const int64_t ntok = std::min(bs, len - blk * bs);
        for (int64_t t = 0; t < ntok; ++t) {          // scores: one K row serves G query heads
          load_row(k + base + t * token_stride, row, D);
          for (int64_t g = 0; g < G; ++g) p[g][t] = dot(qf[g], row, D);
        }
        for (int64_t g = 0; g < G; ++g) {             // online softmax over this block
          float top = m[g];
          for (int64_t t = 0; t < ntok; ++t) top = std::max(top, p[g][t]);
          const float rescale = std::exp(m[g] - top);  // 0 on the first block (m = -1e30)
          l[g] *= rescale;
          for (int64_t d = 0; d < D; ++d) acc[g][d] *= rescale;
          for (int64_t t = 0; t < ntok; ++t) { p[g][t] = std::exp(p[g][t] - top); l[g] += p[g][t]; }
          m[g] = top;
        }
        for (int64_t t = 0; t < ntok; ++t) {          // values: one V row serves G query heads
          load_row(v + base + t * token_stride, row, D);
          for (int64_t g = 0; g < G; ++g) {
            const float w = p[g][t];
            for (int64_t d = 0; d < D; ++d) acc[g][d] += w * row[d];
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        T* o = out + (b * H + h * G + g) * D;
        const float inv = 1.f / l[g];
        for (int64_t d = 0; d < D; ++d) o[d] = T(acc[g][d] * inv);
      }
    }
  });
}

}  // namespace

torch::Tensor paged_decode(torch::Tensor query, torch::Tensor key, torch::Tensor value,
                           torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 4 && key.sizes() == value.sizes(), "shapes");
  TORCH_CHECK(query.is_contiguous() && key.is_contiguous() && value.is_contiguous() &&
              block_tables.is_contiguous() && seq_lens.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(key.scalar_type() == query.scalar_type() && value.scalar_type() == query.scalar_type(),
              "query and cache share one dtype (fp8 caches are not supported)");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt, "int32");
  const int64_t n = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t bs = key.size(1), Hkv = key.size(2);
  TORCH_CHECK(key.size(3) == D && H % Hkv == 0 && H / Hkv <= MAX_GROUP && D <= MAX_DIM &&
              D % LANES == 0 && bs <= MAX_BLOCK, "unsupported head layout");
  TORCH_CHECK(block_tables.size(0) >= n && seq_lens.size(0) >= n, "one table row per sequence");
  TORCH_CHECK(D == 64 || D == 128, "head dim 64 or 128 (the ones instantiated)");
  TORCH_CHECK(query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16,
              "fp32 or bf16");
  auto out = torch::empty_like(query);
  const float s = float(scale);
  const int64_t mb = block_tables.size(1);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  auto run = [&](auto zero, auto dim) {
    using T = decltype(zero);
    decode<T, decltype(dim)::value>(query.data_ptr<T>(), key.data_ptr<T>(), value.data_ptr<T>(),
                                    tables, lens, out.data_ptr<T>(), n, H, Hkv, bs, mb, s);
  };
  using D64 = std::integral_constant<int64_t, 64>;
  using D128 = std::integral_constant<int64_t, 128>;
  if (query.scalar_type() == at::kFloat)
    D == 64 ? run(float(), D64()) : run(float(), D128());
  else
    D == 64 ? run(at::BFloat16(), D64()) : run(at::BFloat16(), D128());
  return out;
}
