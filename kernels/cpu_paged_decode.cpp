// Decode attention on a CPU that reads the paged KV cache in place (no gathered, padded copy).
//
// Layout, as raypaged/model/kv_cache.py allocates it:
//   query        [n, H, D]                      one decode row per sequence, row b = sequence b
//   key / value  [num_blocks, bs, Hkv, D]       token t of block blk at key[blk][t][h]
//   block_tables [n, max_blocks] int32          sequence b's i-th block id
//   seq_lens     [n] int32                      keys 0 .. seq_lens[b]-1 are visible (>= 1)
// One work item per (sequence, KV head): its G = H / Hkv query heads share one pass over the
// head's blocks (GQA without copying K/V per query head). Scores and the output accumulate in
// fp32 with an online softmax, one block at a time:
//   m' = max(m, max_t s_t);  l = l * e^(m - m') + sum_t e^(s_t - m');  acc likewise, + e^(s_t - m') v_t
// fp8 (e4m3) caches hold value / scale: k_scale folds into the query, v_scale into the output.
// A bf16 query over a bf16 cache runs cpu_paged_decode_bf16.cpp instead where the build has
// AVX512-BF16 (the same computation on vector units).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

// The limits cpu_paged_decode.py's `unsupported` checks before choosing this kernel.
constexpr int64_t MAX_GROUP = 16;   // query heads per KV head
constexpr int64_t MAX_DIM = 256;    // head dim
constexpr int64_t MAX_BLOCK = 64;   // tokens per block
constexpr int64_t LANES = 16;       // independent partial sums in a dot product

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) {  // bf16 is the top half of an fp32: a shift, exact
  uint32_t bits = uint32_t(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
// e4m3 has 256 values: a table lookup, exact.
const std::array<float, 256>& fp8_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i)
      t[i] = float(c10::Float8_e4m3fn(uint8_t(i), c10::Float8_e4m3fn::from_bits()));
    return t;
  }();
  return table;
}
inline float to_float(c10::Float8_e4m3fn x) { return fp8_table()[x.x]; }

template <typename T>
inline void load_row(const T* src, float* dst, int64_t D) {
  for (int64_t d = 0; d < D; ++d) dst[d] = to_float(src[d]);
}

inline float dot(const float* a, const float* b, int64_t D) {
  float part[LANES] = {0};
  const int64_t body = D - D % LANES;
  for (int64_t d = 0; d < body; d += LANES)
    for (int64_t j = 0; j < LANES; ++j) part[j] += a[d + j] * b[d + j];
  float s = 0;
  for (int64_t d = body; d < D; ++d) s += a[d] * b[d];
  for (int64_t j = 0; j < LANES; ++j) s += part[j];
  return s;
}

// T: query/output type, C: cache type. DIM > 0 fixes the head dim at compile time, so the row
// loops unroll with no remainder handling (the common 64 and 128); DIM == 0 reads it at run time.
template <typename T, typename C, int64_t DIM>
void decode(const T* q, const C* k, const C* v, const int32_t* tables, const int32_t* lens, T* out,
            int64_t n, int64_t H, int64_t Hkv, int64_t D_runtime, int64_t bs, int64_t max_blocks,
            float q_scale, float out_scale) {
  const int64_t D = DIM > 0 ? DIM : D_runtime;
  const int64_t G = H / Hkv, token_stride = Hkv * D, block_stride = bs * Hkv * D;
  at::parallel_for(0, n * Hkv, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float qf[MAX_GROUP][MAX_DIM], acc[MAX_GROUP][MAX_DIM], row[MAX_DIM];
    float m[MAX_GROUP], l[MAX_GROUP], p[MAX_GROUP][MAX_BLOCK];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / Hkv, h = item % Hkv, len = lens[b];
      for (int64_t g = 0; g < G; ++g) {
        load_row(q + (b * H + h * G + g) * D, qf[g], D);
        for (int64_t d = 0; d < D; ++d) { qf[g][d] *= q_scale; acc[g][d] = 0.f; }
        m[g] = -1e30f;  // finite: -ffast-math assumes no infinities
        l[g] = 0.f;
      }
      for (int64_t blk = 0; blk * bs < len; ++blk) {
        const int64_t base = int64_t(tables[b * max_blocks + blk]) * block_stride + h * D;
        const int64_t ntok = std::min(bs, len - blk * bs);
        if ((blk + 1) * bs < len) {  // the next block's rows, fetched while this one computes
          const int64_t next = int64_t(tables[b * max_blocks + blk + 1]) * block_stride + h * D;
          for (int64_t t = 0; t < std::min(bs, len - (blk + 1) * bs); ++t)
            for (int64_t x = 0; x < D * int64_t(sizeof(C)); x += 64) {
              __builtin_prefetch(reinterpret_cast<const char*>(k + next + t * token_stride) + x);
              __builtin_prefetch(reinterpret_cast<const char*>(v + next + t * token_stride) + x);
            }
        }
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
        const float inv = out_scale / l[g];
        for (int64_t d = 0; d < D; ++d) o[d] = T(acc[g][d] * inv);
      }
    }
  });
}

template <typename T, typename C>
void dispatch_dim(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                  const torch::Tensor& tables, const torch::Tensor& lens, torch::Tensor& out,
                  float q_scale, float out_scale) {
  const int64_t n = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t bs = key.size(1), Hkv = key.size(2), mb = tables.size(1);
  auto run = [&](auto dim) {
    decode<T, C, decltype(dim)::value>(
        query.data_ptr<T>(), key.data_ptr<C>(), value.data_ptr<C>(), tables.data_ptr<int32_t>(),
        lens.data_ptr<int32_t>(), out.data_ptr<T>(), n, H, Hkv, D, bs, mb, q_scale, out_scale);
  };
  if (D == 64) run(std::integral_constant<int64_t, 64>());
  else if (D == 128) run(std::integral_constant<int64_t, 128>());
  else run(std::integral_constant<int64_t, 0>());
}

template <typename T>
void dispatch_cache(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                    const torch::Tensor& tables, const torch::Tensor& lens, torch::Tensor& out,
                    float q_scale, float out_scale) {
  if (key.scalar_type() == at::kFloat8_e4m3fn)
    dispatch_dim<T, c10::Float8_e4m3fn>(query, key, value, tables, lens, out, q_scale, out_scale);
  else
    dispatch_dim<T, T>(query, key, value, tables, lens, out, q_scale, out_scale);
}

}  // namespace

// cpu_paged_decode_bf16.cpp: bf16 over a bf16 cache on AVX512-BF16 (false: not this build or shape)
bool paged_decode_bf16(const torch::Tensor& query, const torch::Tensor& key,
                       const torch::Tensor& value, const torch::Tensor& tables,
                       const torch::Tensor& lens, torch::Tensor& out, float scale);

// scale: the softmax scale; k_scale / v_scale: the cache's per-tensor scales (1 unless fp8).
torch::Tensor paged_decode(torch::Tensor query, torch::Tensor key, torch::Tensor value,
                           torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                           double k_scale, double v_scale) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 4 && key.sizes() == value.sizes(),
              "query [n, H, D], key and value [num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(query.is_contiguous() && key.is_contiguous() && value.is_contiguous() &&
              block_tables.is_contiguous() && seq_lens.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(query.device().is_cpu() && key.device().is_cpu(), "CPU tensors");
  const auto qt = query.scalar_type(), ct = key.scalar_type();
  TORCH_CHECK(qt == at::kFloat || qt == at::kBFloat16, "query fp32 or bf16");
  TORCH_CHECK(value.scalar_type() == ct && (ct == qt || ct == at::kFloat8_e4m3fn),
              "cache in the query's dtype or fp8 e4m3");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens int32");
  const int64_t n = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t bs = key.size(1), Hkv = key.size(2);
  TORCH_CHECK(key.size(3) == D && H % Hkv == 0 && H / Hkv <= MAX_GROUP && D <= MAX_DIM &&
              bs <= MAX_BLOCK, "unsupported head layout");
  TORCH_CHECK(block_tables.size(0) >= n && seq_lens.size(0) >= n, "one table row per sequence");
  auto out = torch::empty_like(query);
  if (ct == at::kBFloat16 && k_scale == 1.0 && v_scale == 1.0 &&
      paged_decode_bf16(query, key, value, block_tables, seq_lens, out, float(scale)))
    return out;
  const float q_scale = float(scale * k_scale), out_scale = float(v_scale);
  if (qt == at::kFloat)
    dispatch_cache<float>(query, key, value, block_tables, seq_lens, out, q_scale, out_scale);
  else
    dispatch_cache<at::BFloat16>(query, key, value, block_tables, seq_lens, out, q_scale, out_scale);
  return out;
}

// cpu_paged_prefill.cpp, built into the same extension
torch::Tensor paged_prefill(torch::Tensor query, torch::Tensor key, torch::Tensor value,
                            torch::Tensor block_table, int64_t seq_len, double scale);
bool paged_prefill_built();
// cpu_layer_ops.cpp, likewise
torch::Tensor rms_norm_bf16(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor rotary_bf16(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm_bf16(torch::Tensor x, torch::Tensor delta,
                                                           torch::Tensor weight, double eps);
void store_kv(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache,
              torch::Tensor value_cache, torch::Tensor slots);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "decode attention over a paged KV cache, read in place");
  m.def("paged_prefill", &paged_prefill, "causal prefill attention over a paged KV cache (bf16)");
  m.def("paged_prefill_built", &paged_prefill_built, "whether this build has the prefill kernel");
  m.def("rms_norm_bf16", &rms_norm_bf16, "RMSNorm of bf16 rows, torch's rounding");
  m.def("add_rms_norm_bf16", &add_rms_norm_bf16, "residual add, then RMSNorm, torch's rounding");
  m.def("store_kv", &store_kv, "key/value rows into their paged cache slots");
  m.def("rotary_bf16", &rotary_bf16, "the rotate-half rotary embedding of bf16 heads, torch's rounding");
}
