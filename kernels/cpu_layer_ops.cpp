// The bf16 glue of a decoder layer on a CPU, one call each: RMSNorm and the rotary embedding.
//
// At a small batch a decode step is mostly the linear layers' weight reads; around them run
// hundreds of small torch ops per step (one RMSNorm is about eight: cast, pow, mean, add, rsqrt,
// mul, cast, mul), each microseconds of dispatch for a few hundred values. These do the same arithmetic in
// one call, rounding where torch's ops round, and add the squares in the order torch's sum does
// (below), so they give torch's bits; tests/model/test_cpu_layer_ops.py compares them bit for bit.
//   rms_norm: out = bf16(w * bf16(x * 1 / sqrt(sum(x^2) / H + eps)))   (x, the sum: fp32)
//   rotary:   out = [bf16(bf16(x1 c) - bf16(x2 s)), bf16(bf16(x2 c) + bf16(x1 s))]
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
// whose float vectors are 8 wide on x86: the sum has no AVX512 kernel; the test checks): the row as 8-float vectors, those in groups of ILP = 4
// summed lane-wise into 4 accumulators, with chunks of 2^level_power groups carried up LEVELS
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

}  // namespace

torch::Tensor rms_norm_bf16(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.is_contiguous() &&
              x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 &&
              weight.numel() == x.size(1) && x.device().is_cpu(),
              "rms_norm_bf16: x [T, H] and weight [H], contiguous bf16 CPU tensors");
  const int64_t T = x.size(0), H = x.size(1);
  auto out = torch::empty_like(x);
  const uint16_t* xs = bf16_data(x);
  const uint16_t* w = bf16_data(weight);
  uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  // rows in parallel (a prefill's thousands), each row alone (a decode step's few)
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> squares(H);
    for (int64_t t = begin; t < end; ++t) {
      const uint16_t* row = xs + t * H;
      for (int64_t i = 0; i < H; ++i) {
        const float v = bf16_to_float(row[i]);
        squares[i] = v * v;
      }
      const float inv = 1.0f / std::sqrt(torch_row_sum(squares.data(), H) / float(H) + float(eps));
      for (int64_t i = 0; i < H; ++i)
        o[t * H + i] = mul(bf16_to_float(w[i]), bf16_to_float(mul(bf16_to_float(row[i]), inv)));
    }
  });
  return out;
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
