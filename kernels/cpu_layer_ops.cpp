// The bf16 glue of a decoder layer on a CPU, one call each: RMSNorm (alone or after the residual
// add), the rotary embedding and the KV cache write.
//
// At a small batch a decode step is mostly the linear layers' weight reads; around them run
// hundreds of small torch ops per step (one RMSNorm is about eight: cast, pow, mean, add, rsqrt,
// mul, cast, mul), each microseconds of dispatch for a few hundred values. These do the same
// arithmetic in one call, rounding where torch's ops round, and add the squares in the order
// torch's sum does (below), so they give torch's bits; tests/model/test_cpu_layer_ops.py compares
// them bit for bit.
//   rms_norm: out = bf16(w * bf16(x * 1 / sqrt(sum(x^2) / H + eps)))   (x, the sum: fp32)
//   add_rms_norm: sum = bf16(x + delta), out = rms_norm(sum)  (torch's bf16 add: fp32, rounded)
//   rotary:   out = [bf16(bf16(x1 c) - bf16(x2 s)), bf16(bf16(x2 c) + bf16(x1 s))]
//   store_kv: key/value rows copied to their cache slots (index_copy_'s bytes, two calls' work)
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

// The extension builds with -ffast-math (for the attention kernels' expf): here it would
// reorder the sums and fuse multiply-adds, and the bits would differ from torch's.
#pragma GCC optimize("no-fast-math", "fp-contract=off")

namespace {

inline float bf16_to_float(uint16_t v) {  // bf16 is the top half of an fp32: exact
  const uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as c10::BFloat16 does
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN: torch's quiet NaN
  return uint16_t((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

inline uint16_t mul(float a, float b) { return float_to_bf16(a * b); }

const uint16_t* bf16_data(const torch::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr());
}

// torch's sum of a contiguous fp32 row (ATen's SumKernel.cpp, cascade_sum -> vectorized_inner_sum,
// whose float vectors are 8 wide on x86: the sum has no AVX512 kernel; the test checks): the row
// as 8-float vectors, those in groups of ILP = 4 summed lane-wise into 4 accumulators, with
// chunks of 2^level_power groups carried up LEVELS
// levels (pairwise-like accuracy); then the leftover vectors into accumulator 0, accumulators
// 1..3 into it, the leftover scalars into a total, and the 8 lanes into the total, in order.
float torch_row_sum(const float* x, int64_t n) {
  constexpr int64_t V = 8, ILP = 4, LEVELS = 4;
  const int64_t vectors = n / V, size = vectors / ILP;
  int64_t ceil_log2 = 0;
  while ((int64_t(1) << ceil_log2) < size) ++ceil_log2;
  const int64_t level_power = std::max<int64_t>(4, ceil_log2 / LEVELS);
  const int64_t level_step = int64_t(1) << level_power, level_mask = level_step - 1;
  float acc[LEVELS][ILP][V] = {};
  int64_t i = 0;
  while (i + level_step <= size) {
    for (int64_t j = 0; j < level_step; ++j, ++i)
      for (int64_t k = 0; k < ILP; ++k)
        for (int64_t l = 0; l < V; ++l) acc[0][k][l] += x[(i * ILP + k) * V + l];
    for (int64_t j = 1; j < LEVELS; ++j) {
      for (int64_t k = 0; k < ILP; ++k)
        for (int64_t l = 0; l < V; ++l) {
          acc[j][k][l] += acc[j - 1][k][l];
          acc[j - 1][k][l] = 0;
        }
      if (i & (level_mask << (j * level_power))) break;
    }
  }
  for (; i < size; ++i)
    for (int64_t k = 0; k < ILP; ++k)
      for (int64_t l = 0; l < V; ++l) acc[0][k][l] += x[(i * ILP + k) * V + l];
  for (int64_t j = 1; j < LEVELS; ++j)
    for (int64_t k = 0; k < ILP; ++k)
      for (int64_t l = 0; l < V; ++l) acc[0][k][l] += acc[j][k][l];
  for (int64_t r = size * ILP; r < vectors; ++r)
    for (int64_t l = 0; l < V; ++l) acc[0][0][l] += x[r * V + l];
  for (int64_t k = 1; k < ILP; ++k)
    for (int64_t l = 0; l < V; ++l) acc[0][0][l] += acc[0][k][l];
  float total = 0;
  for (int64_t r = vectors * V; r < n; ++r) total += x[r];
  for (int64_t l = 0; l < V; ++l) total += acc[0][0][l];
  return total;
}

// out = rms_norm(x) per row; given `delta`, x = bf16(x + delta) first, written to `sum`.
void rms_norm_rows(const uint16_t* xs, const uint16_t* delta, const uint16_t* w, uint16_t* sum,
                   uint16_t* o, int64_t T, int64_t H, float eps) {
  // rows in parallel (a prefill's thousands), each row alone (a decode step's few)
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> squares(H);
    for (int64_t t = begin; t < end; ++t) {
      const uint16_t* row = xs + t * H;
      if (delta != nullptr) {
        for (int64_t i = 0; i < H; ++i)
          sum[t * H + i] = float_to_bf16(bf16_to_float(row[i]) + bf16_to_float(delta[t * H + i]));
        row = sum + t * H;
      }
      for (int64_t i = 0; i < H; ++i) {
        const float v = bf16_to_float(row[i]);
        squares[i] = v * v;
      }
      const float inv = 1.0f / std::sqrt(torch_row_sum(squares.data(), H) / float(H) + eps);
      for (int64_t i = 0; i < H; ++i)
        o[t * H + i] = mul(bf16_to_float(w[i]), bf16_to_float(mul(bf16_to_float(row[i]), inv)));
    }
  });
}

void check_norm_args(const torch::Tensor& x, const torch::Tensor& weight, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.is_contiguous() &&
              x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 &&
              weight.numel() == x.size(1) && x.device().is_cpu(),
              name, ": x [T, H] and weight [H], contiguous bf16 CPU tensors");
}

}  // namespace

torch::Tensor rms_norm_bf16(torch::Tensor x, torch::Tensor weight, double eps) {
  check_norm_args(x, weight, "rms_norm_bf16");
  auto out = torch::empty_like(x);
  rms_norm_rows(bf16_data(x), nullptr, bf16_data(weight), nullptr,
                reinterpret_cast<uint16_t*>(out.data_ptr()), x.size(0), x.size(1), float(eps));
  return out;
}

// -> (x + delta, rms_norm(x + delta)): a layer's residual add and the norm after it, one call.
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm_bf16(torch::Tensor x, torch::Tensor delta,
                                                           torch::Tensor weight, double eps) {
  check_norm_args(x, weight, "add_rms_norm_bf16");
  TORCH_CHECK(delta.sizes() == x.sizes() && delta.is_contiguous() &&
              delta.scalar_type() == at::kBFloat16 && delta.device().is_cpu(),
              "add_rms_norm_bf16: delta shaped as x, contiguous bf16 on the CPU");
  auto sum = torch::empty_like(x);
  auto out = torch::empty_like(x);
  rms_norm_rows(bf16_data(x), bf16_data(delta), bf16_data(weight),
                reinterpret_cast<uint16_t*>(sum.data_ptr()),
                reinterpret_cast<uint16_t*>(out.data_ptr()), x.size(0), x.size(1), float(eps));
  return {sum, out};
}

// key/value [T, Hkv, D] (rows may be strided views, each row's Hkv * D values contiguous) ->
// the caches [num_blocks, block_size, Hkv, D] at flat row slots[t]; slot -1 (padding) is skipped.
void store_kv(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache,
              torch::Tensor value_cache, torch::Tensor slots) {
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key_cache.dim() == 4 &&
              key_cache.sizes() == value_cache.sizes() && key_cache.is_contiguous() &&
              value_cache.is_contiguous() && key.size(1) == key_cache.size(2) &&
              key.size(2) == key_cache.size(3),
              "store_kv: key/value [T, Hkv, D], caches [num_blocks, block_size, Hkv, D] dense");
  const int64_t T = key.size(0), row = key.size(1) * key.size(2);
  TORCH_CHECK(key.stride(2) == 1 && key.stride(1) == key.size(2) && value.stride(2) == 1 &&
              value.stride(1) == value.size(2), "store_kv: each token's Hkv * D values contiguous");
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() &&
              value.scalar_type() == key_cache.scalar_type() &&
              value_cache.scalar_type() == key_cache.scalar_type() && key.device().is_cpu() &&
              key_cache.device().is_cpu(), "store_kv: CPU tensors of the cache's dtype");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == T && slots.is_contiguous() &&
              slots.scalar_type() == at::kLong, "store_kv: slots [T] int64");
  const int64_t capacity = key_cache.size(0) * key_cache.size(1);
  const int64_t bytes = row * key.element_size();
  const int64_t* s = slots.data_ptr<int64_t>();
  const char* k = static_cast<const char*>(key.data_ptr());
  const char* v = static_cast<const char*>(value.data_ptr());
  char* kc = static_cast<char*>(key_cache.data_ptr());
  char* vc = static_cast<char*>(value_cache.data_ptr());
  const int64_t ks = key.stride(0) * key.element_size();
  const int64_t vs = value.stride(0) * value.element_size();
  for (int64_t t = 0; t < T; ++t) {
    if (s[t] < 0) continue;
    TORCH_CHECK(s[t] < capacity, "store_kv: slot ", s[t], " outside the cache's ", capacity);
    std::memcpy(kc + s[t] * bytes, k + t * ks, bytes);
    std::memcpy(vc + s[t] * bytes, v + t * vs, bytes);
  }
}

torch::Tensor rotary_bf16(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0 &&
              x.scalar_type() == at::kBFloat16 && x.device().is_cpu(),
              "rotary_bf16: x [T, N, D] bf16 on the CPU, its last dim contiguous, D even");
  const int64_t T = x.size(0), N = x.size(1), D = x.size(2), half = D / 2;
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 3 && cos.size(0) == T &&
              cos.size(2) == half && cos.stride(2) == 1 && sin.stride(2) == 1 &&
              cos.stride(0) == sin.stride(0) && cos.scalar_type() == at::kBFloat16 &&
              sin.scalar_type() == at::kBFloat16,
              "rotary_bf16: cos and sin [T, 1, D/2] bf16, alike");
  auto out = torch::empty({T, N, D}, x.options());
  const uint16_t* xs = bf16_data(x);
  const uint16_t* cs = bf16_data(cos);
  const uint16_t* ss = bf16_data(sin);
  uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t st = x.stride(0), sn = x.stride(1), sc = cos.stride(0);
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t n = 0; n < N; ++n) {
        const uint16_t* in = xs + t * st + n * sn;
        uint16_t* dst = o + (t * N + n) * D;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = bf16_to_float(in[i]), x2 = bf16_to_float(in[half + i]);
          const float c = bf16_to_float(cs[t * sc + i]), s = bf16_to_float(ss[t * sc + i]);
          dst[i] = float_to_bf16(bf16_to_float(mul(x1, c)) - bf16_to_float(mul(x2, s)));
          dst[half + i] = float_to_bf16(bf16_to_float(mul(x2, c)) + bf16_to_float(mul(x1, s)));
        }
      }
  });
  return out;
}
