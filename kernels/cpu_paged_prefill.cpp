// Prefill attention on a CPU with AVX512-BF16: causal attention of one sequence's new tokens
// over its paged KV cache (cached prefix + the chunk itself), read in place, bf16 only.
//
// Why: torch's CPU SDPA (flash kernel) computes in fp32 and spent ~20 ms per layer on a
// 1,024-token prompt of the default model (one thread): 53% of the whole prefill, twice what
// the linears cost. Here both products run on vdpbf16ps (bf16 pairs, fp32 accumulation), as
// the linears do in oneDNN: ~2x faster than SDPA (benchmarks/cpu_prefill_attention.py).
//
// Layout (raypaged/model/kv_cache.py):
//   query        [n, H, D] bf16        positions seq_len-n .. seq_len-1 of the sequence
//   key / value  [num_blocks, bs, Hkv, D] bf16
//   block_table  [>= ceil(seq_len / bs)] int32
// Work item: (query tile of TQ tokens, KV head h): its TQ * G rows (token x query head of h)
// share each chunk of KC keys, packed into the pair layouts vdpbf16ps reads. Every tile reads
// the chunks of its whole prefix, so with more than one tile the chunks are packed once per call
// before the tiles run (packing them per tile was a third of the kernel's time on a 1,024-token
// prompt); a single tile packs each chunk where it reads it, in its own buffer (packing a long
// prefix into memory to read it back once was 1.2x slower for 16 tokens over 16k cached).
// Per row, an online softmax over chunks in fp32 (m, l, acc as in cpu_paged_decode.cpp); the
// probabilities are rounded to bf16 for the P.V product (as GPU flash attention does), the
// output once at the end. Scores are exact products of bf16 inputs summed in fp32.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

namespace {

constexpr int64_t TQ = 16;                 // query tokens per work item
constexpr int64_t KC = 32;                 // keys per chunk: two 16-lane score vectors per row
constexpr int64_t R = 4;                   // rows per pass: 8 score / 16 output accumulators
constexpr int64_t MAX_GROUP = 16;          // query heads per KV head (cpu_paged_decode.py)
constexpr int64_t MAX_ROWS = TQ * MAX_GROUP;

// Sizes of one packed chunk (uint32 words): K as [d pair][key] (a dword holds d and d+1 of one
// key), V as [key pair][d] (a dword holds one d of two keys); keys past seq_len are zeros.
template <int64_t D> constexpr int64_t k_chunk_words() { return D / 2 * KC; }
template <int64_t D> constexpr int64_t v_chunk_words() { return KC / 2 * D; }

// The paged cache a call reads: keys and values of KV head h at a position.
struct Cache {
  const uint16_t *k, *v;
  const int32_t* table;
  int64_t seq_len, bs, token_stride, block_stride;
};

// Chunk c0 / KC of KV head h into kp and vp (k_chunk_words / v_chunk_words words).
template <int64_t D>
void pack_chunk(const Cache& c, int64_t h, int64_t c0, uint32_t* kp, uint32_t* vp) {
  for (int64_t t = 0; t < KC; ++t) {
    const uint16_t *kr = nullptr, *vr = nullptr;
    const int64_t pos = c0 + t;
    if (pos < c.seq_len) {
      const int64_t at = int64_t(c.table[pos / c.bs]) * c.block_stride + (pos % c.bs) * c.token_stride + h * D;
      kr = c.k + at;
      vr = c.v + at;
    }
    for (int64_t dp = 0; dp < D / 2; ++dp) kp[dp * KC + t] = kr ? reinterpret_cast<const uint32_t*>(kr)[dp] : 0u;
    uint16_t* vt = reinterpret_cast<uint16_t*>(vp + t / 2 * D) + t % 2;
    for (int64_t d = 0; d < D; ++d) vt[2 * d] = vr ? vr[d] : uint16_t(0);
  }
}

// kpack / vpack: every chunk of every KV head, packed here (item = h * chunks + chunk), or
// nullptr: each tile packs the chunk it reads.
template <int64_t D>
void prefill(const uint16_t* q, const Cache& cache, uint32_t* kpack, uint32_t* vpack,
             uint16_t* out, int64_t n, int64_t H, int64_t Hkv, float scale) {
  constexpr int64_t DP = D / 2, DV = D / 16;
  const int64_t G = H / Hkv, seq_len = cache.seq_len, chunks = (seq_len + KC - 1) / KC;
  const int64_t ctx = seq_len - n, tiles = (n + TQ - 1) / TQ;
  if (kpack)
    at::parallel_for(0, Hkv * chunks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item)
        pack_chunk<D>(cache, item / chunks, item % chunks * KC, kpack + item * k_chunk_words<D>(),
                      vpack + item * v_chunk_words<D>());
    });
  at::parallel_for(0, tiles * Hkv, 1, [&](int64_t begin, int64_t end) {
    alignas(64) uint32_t kown[k_chunk_words<D>()];  // a chunk packed here (no kpack)
    alignas(64) uint32_t vown[v_chunk_words<D>()];
    alignas(64) float acc[MAX_ROWS][D];
    alignas(64) uint16_t pb[R][KC];        // a pass's probabilities in bf16
    float m[MAX_ROWS], l[MAX_ROWS];
    const uint32_t* qrow[MAX_ROWS];        // a row's query as d pairs
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i lane16 = _mm512_add_epi32(lane, _mm512_set1_epi32(16));
    const __m512 masked = _mm512_set1_ps(-1e30f);  // finite: -ffast-math assumes no infinities
    for (int64_t item = begin; item < end; ++item) {
      // Later tiles see more keys: zig-zag the tile order so that each thread's contiguous
      // range of items holds early and late tiles alike.
      const int64_t j = item / Hkv, h = item % Hkv;
      const int64_t tile = j % 2 == 0 ? j / 2 : tiles - 1 - j / 2;
      const int64_t q0 = tile * TQ, q1 = std::min(n, q0 + TQ), rows = (q1 - q0) * G;
      for (int64_t r = 0; r < rows; ++r) {  // row r: token q0 + r / G, query head h * G + r % G
        qrow[r] = reinterpret_cast<const uint32_t*>(q + ((q0 + r / G) * H + h * G + r % G) * D);
        for (int64_t d = 0; d < D; ++d) acc[r][d] = 0.f;
        m[r] = -1e30f;
        l[r] = 0.f;
      }
      const int64_t key_end = ctx + q1;  // the tile's last token sees keys 0 .. key_end - 1
      for (int64_t c0 = 0; c0 < key_end; c0 += KC) {
        // keys past nk (this tile's last visible key) are masked out of the scores below, and
        // their zero weights leave the output as it is
        const int64_t nk = std::min(KC, key_end - c0);
        const uint32_t *kp = kown, *vp = vown;
        if (kpack) {
          kp = kpack + (h * chunks + c0 / KC) * k_chunk_words<D>();
          vp = vpack + (h * chunks + c0 / KC) * v_chunk_words<D>();
        } else {
          pack_chunk<D>(cache, h, c0, kown, vown);
        }
        for (int64_t r0 = 0; r0 < rows; r0 += R) {
          // rows past the tile's end repeat its last row and are never stored
          int64_t visible[R];
          __m512 s0[R], s1[R];
          for (int64_t u = 0; u < R; ++u) {
            const int64_t r = std::min(r0 + u, rows - 1);
            visible[u] = r0 + u < rows ? std::min(nk, ctx + q0 + r / G - c0 + 1) : 0;
            s0[u] = _mm512_setzero_ps();
            s1[u] = _mm512_setzero_ps();
          }
          if (visible[0] <= 0 && visible[R - 1] <= 0) continue;  // rows ascend by position
          for (int64_t dp = 0; dp < DP; ++dp) {  // scores: q . k over d pairs
            const __m512bh k0 = (__m512bh)_mm512_load_si512(kp + dp * KC);
            const __m512bh k1 = (__m512bh)_mm512_load_si512(kp + dp * KC + 16);
            for (int64_t u = 0; u < R; ++u) {
              const __m512bh qd = (__m512bh)_mm512_set1_epi32(int(qrow[std::min(r0 + u, rows - 1)][dp]));
              s0[u] = _mm512_dpbf16_ps(s0[u], qd, k0);
              s1[u] = _mm512_dpbf16_ps(s1[u], qd, k1);
            }
          }
          for (int64_t u = 0; u < R; ++u) {  // online softmax, this chunk
            uint32_t* p = reinterpret_cast<uint32_t*>(pb[u]);
            const int64_t r = r0 + u;
            if (visible[u] <= 0) {  // nothing visible (or no row): weights 0, state unchanged
              _mm512_store_si512(p, _mm512_setzero_si512());
              continue;
            }
            const __m512i vis = _mm512_set1_epi32(int(visible[u]));
            const __m512 sc = _mm512_set1_ps(scale);
            const __m512 a = _mm512_mask_mov_ps(masked, _mm512_cmplt_epi32_mask(lane, vis), _mm512_mul_ps(s0[u], sc));
            const __m512 b = _mm512_mask_mov_ps(masked, _mm512_cmplt_epi32_mask(lane16, vis), _mm512_mul_ps(s1[u], sc));
            const float top = std::max(m[r], _mm512_reduce_max_ps(_mm512_max_ps(a, b)));
            const float rescale = top > m[r] ? std::exp(m[r] - top) : 1.f;  // exp(0): 1 exactly
            alignas(64) float w[KC];
            _mm512_store_ps(w, _mm512_sub_ps(a, _mm512_set1_ps(top)));
            _mm512_store_ps(w + 16, _mm512_sub_ps(b, _mm512_set1_ps(top)));
            for (int64_t t = 0; t < KC; ++t) w[t] = std::exp(w[t]);  // vectorized (-ffast-math)
            const __m512 wa = _mm512_load_ps(w), wb = _mm512_load_ps(w + 16);
            l[r] = l[r] * rescale + _mm512_reduce_add_ps(_mm512_add_ps(wa, wb));
            m[r] = top;
            _mm512_store_si512(p, (__m512i)_mm512_cvtne2ps_pbh(wb, wa));  // keys 0..31 in order
            if (rescale != 1.f)
              for (int64_t d = 0; d < D; d += 16)
                _mm512_store_ps(acc[r] + d, _mm512_mul_ps(_mm512_load_ps(acc[r] + d), _mm512_set1_ps(rescale)));
          }
          __m512 o[R][DV];  // acc += p . v over key pairs
          for (int64_t u = 0; u < R; ++u)
            for (int64_t x = 0; x < DV; ++x) o[u][x] = _mm512_load_ps(acc[std::min(r0 + u, rows - 1)] + 16 * x);
          for (int64_t tp = 0; tp < KC / 2; ++tp) {
            __m512bh vv[DV];
            for (int64_t x = 0; x < DV; ++x) vv[x] = (__m512bh)_mm512_load_si512(vp + tp * D + 16 * x);
            for (int64_t u = 0; u < R; ++u) {
              const __m512bh pw = (__m512bh)_mm512_set1_epi32(int(reinterpret_cast<const uint32_t*>(pb[u])[tp]));
              for (int64_t x = 0; x < DV; ++x) o[u][x] = _mm512_dpbf16_ps(o[u][x], pw, vv[x]);
            }
          }
          for (int64_t u = 0; u < R && r0 + u < rows; ++u)
            for (int64_t x = 0; x < DV; ++x) _mm512_store_ps(acc[r0 + u] + 16 * x, o[u][x]);
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        uint16_t* dst = out + ((q0 + r / G) * H + h * G + r % G) * D;
        const __m512 inv = _mm512_set1_ps(1.f / l[r]);
        for (int64_t d = 0; d < D; d += 16)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d),
                              (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(acc[r] + d), inv)));
      }
    }
  });
}

}  // namespace

bool paged_prefill_built() { return true; }
#else
bool paged_prefill_built() { return false; }  // no AVX512-BF16 on the machine that built it
#endif

// scale: the softmax scale. The caller checks the rest (cpu_paged_decode.py prefill_unsupported).
torch::Tensor paged_prefill(torch::Tensor query, torch::Tensor key, torch::Tensor value,
                            torch::Tensor block_table, int64_t seq_len, double scale) {
  TORCH_CHECK(paged_prefill_built(), "the prefill kernel needs AVX512-BF16, which this build lacks");
  TORCH_CHECK(query.dim() == 3 && key.dim() == 4 && key.sizes() == value.sizes(),
              "query [n, H, D], key and value [num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(query.is_contiguous() && key.is_contiguous() && value.is_contiguous() &&
              block_table.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && key.scalar_type() == at::kBFloat16 &&
              value.scalar_type() == at::kBFloat16, "bf16 query and cache");
  TORCH_CHECK(block_table.scalar_type() == at::kInt, "block_table int32");
  const int64_t n = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t bs = key.size(1), Hkv = key.size(2);
  TORCH_CHECK(key.size(3) == D && H % Hkv == 0 && H / Hkv <= 16 && (D == 64 || D == 128),
              "unsupported head layout");
  TORCH_CHECK(n >= 1 && seq_len >= n && block_table.size(0) * bs >= seq_len,
              "the block table must cover seq_len >= n >= 1 tokens");
  auto out = torch::empty_like(query);
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  auto in = [](const torch::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); };
  auto run = [&](auto dim) {
    constexpr int64_t DIM = decltype(dim)::value;
    const Cache cache{in(key), in(value), block_table.data_ptr<int32_t>(), seq_len, bs, Hkv * DIM,
                      bs * Hkv * DIM};
    // packed once per call for more than one tile (the CPU allocator aligns to 64 bytes, as the
    // vector loads need)
    torch::Tensor kpack, vpack;
    uint32_t *kp = nullptr, *vp = nullptr;
    if (n > TQ) {
      const int64_t chunks = (seq_len + KC - 1) / KC;
      kpack = torch::empty({Hkv * chunks * k_chunk_words<DIM>()}, query.options().dtype(at::kInt));
      vpack = torch::empty({Hkv * chunks * v_chunk_words<DIM>()}, query.options().dtype(at::kInt));
      kp = reinterpret_cast<uint32_t*>(kpack.data_ptr<int32_t>());
      vp = reinterpret_cast<uint32_t*>(vpack.data_ptr<int32_t>());
    }
    prefill<DIM>(in(query), cache, kp, vp, reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()),
                 n, H, Hkv, float(scale));
  };
  if (D == 64) run(std::integral_constant<int64_t, 64>());
  else run(std::integral_constant<int64_t, 128>());
#endif
  return out;
}
