// Decode attention on the CPU that reads each sequence's keys and values where they lie
// in the paged cache (inference/attention.py builds this file on first use and calls it
// for every call in which each sequence has one query). Loading it also registers the
// CPU kernel of the decode graph's op nanorl::paged_decode_cpp (paged_decode, below).
//
// The pure-torch path gathers a sequence's blocks into one contiguous copy, then runs
// SDPA over it: at decode sizes (one query, a few hundred keys, heads of 32-128 dims)
// both are dominated by per-call and per-head overhead, and the copy doubles the bytes
// moved. Here one loop per sequence does the three steps of attention, each over
// plain arrays the compiler vectorises:
//   1. scores[h][t] = q[h] . k[t][h / group] * scale     for t < len (= position + 1)
//   2. softmax over t, per query head (max first, as SDPA does)
//   3. out[h] = sum_t p[h][t] * v[t][h / group]
// Token t of a sequence lives in slot t % block_size of block table[t / block_size].
// Compiled with -ffast-math (attention.py's build flags) so that expf and the sums
// vectorise: the result differs from SDPA's by rounding only (about 1e-6; the tests bound
// it). The flag also lets the compiler assume every value is finite, as a model's keys
// and values are (where one is not, SDPA's output is not either). It is not passed to
// the linker, which would turn on flush-to-zero for the whole process.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

// Calls visit(t, slot) for the tokens t < len of a sequence, slot pointing at token t's
// vectors in pool, walking the table block by block: token first + i lives in slot i of
// block table[first / block_size], so no token pays a division
template <typename Visit>
static inline void for_each_slot(const float* pool, const int64_t* table, int64_t len,
                                 int64_t block_size, int64_t token_stride, Visit visit) {
  for (int64_t first = 0; first < len; first += block_size) {
    const float* slot = pool + table[first / block_size] * block_size * token_stride;
    const int64_t n = std::min(block_size, len - first);
    for (int64_t i = 0; i < n; ++i, slot += token_stride) visit(first + i, slot);
  }
}

// FIXED_D > 0: the head size known at compile time, so the loops over d unroll and
// vectorise; 0: any head size, read from dim. FIXED_H, FIXED_KV > 0: the head counts
// known too (a small model's: see attend_all), so step 3 sums its outputs in a local array
// the compiler can keep in vector registers for the whole walk over the values (where the
// CPU has enough of them); 0: read from heads_ and kv_heads_, the outputs summed in place in
// out. Each pass reads a slot's vectors for every head at once.
template <int FIXED_D, int FIXED_H, int FIXED_KV>
static void attend_one(const float* __restrict__ q, const float* __restrict__ k_pool,
                       const float* __restrict__ v_pool, const int64_t* table, int64_t len,
                       int64_t block_size, int64_t kv_heads_, int64_t heads_, int64_t dim,
                       float scale, float* __restrict__ out, float* __restrict__ scores) {
  const int64_t D = FIXED_D > 0 ? FIXED_D : dim;
  const int64_t heads = FIXED_H > 0 ? FIXED_H : heads_;
  const int64_t kv_heads = FIXED_KV > 0 ? FIXED_KV : kv_heads_;
  const int64_t group = heads / kv_heads;
  const int64_t token_stride = kv_heads * D;   // a slot holds every kv head's vector
  // 1. scores
  for_each_slot(k_pool, table, len, block_size, token_stride, [&](int64_t t, const float* k) {
    for (int64_t kv = 0; kv < kv_heads; ++kv)
      for (int64_t h = kv * group; h < (kv + 1) * group; ++h) {
        const float* qh = q + h * D;
        const float* kh = k + kv * D;
        float s = 0.f;
        for (int64_t d = 0; d < D; ++d) s += qh[d] * kh[d];
        scores[h * len + t] = s * scale;
      }
  });
  // 2. softmax, each query head's row
  for (int64_t h = 0; h < heads; ++h) {
    float* p = scores + h * len;
    float m = p[0];
    for (int64_t t = 1; t < len; ++t) m = std::max(m, p[t]);
    float sum = 0.f;
    for (int64_t t = 0; t < len; ++t) {
      p[t] = expf(p[t] - m);
      sum += p[t];
    }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < len; ++t) p[t] *= inv;
  }
  // 3. the weighted sum of values
  constexpr bool in_registers = FIXED_D > 0 && FIXED_H > 0;
  float local[in_registers ? FIXED_H * FIXED_D : 1];
  float* acc = in_registers ? local : out;
  std::fill(acc, acc + heads * D, 0.f);
  for_each_slot(v_pool, table, len, block_size, token_stride, [&](int64_t t, const float* v) {
    for (int64_t kv = 0; kv < kv_heads; ++kv)
      for (int64_t h = kv * group; h < (kv + 1) * group; ++h) {
        const float p = scores[h * len + t];
        const float* vh = v + kv * D;
        float* o = acc + h * D;
        for (int64_t d = 0; d < D; ++d) o[d] += p * vh[d];
      }
  });
  if (in_registers) std::copy_n(acc, heads * D, out);
}

// q [B, heads, D]; k_pool, v_pool [blocks, block_size, kv_heads, D]; tables [B, W] int64;
// positions [B] int64 (each query's position: it sees tokens 0 .. position). Checks that
// every read attend_all will make lies inside the tensors it reads.
static void check_reads(const torch::Tensor& q, const torch::Tensor& k_pool,
                        const torch::Tensor& v_pool, const torch::Tensor& tables,
                        const torch::Tensor& positions) {
  for (const auto& t : {q, k_pool, v_pool, tables, positions})
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "decode_attention: CPU tensors, "
                "contiguous");
  TORCH_CHECK(q.scalar_type() == torch::kFloat && k_pool.scalar_type() == torch::kFloat
              && v_pool.scalar_type() == torch::kFloat, "decode_attention: float32 q and pools");
  TORCH_CHECK(tables.scalar_type() == torch::kLong && positions.scalar_type() == torch::kLong,
              "decode_attention: int64 tables and positions");
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 4 && v_pool.sizes() == k_pool.sizes()
              && k_pool.size(3) == q.size(2) && q.size(1) % k_pool.size(2) == 0,
              "decode_attention: q [B, heads, D] and pools [blocks, block_size, kv_heads, D] "
              "with heads a multiple of kv_heads");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == q.size(0)
              && positions.numel() == q.size(0), "decode_attention: a table and a position "
              "per query");
  const int64_t B = q.size(0), W = tables.size(1), block_size = k_pool.size(1);
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(pos[b] >= 0 && pos[b] < W * block_size, "decode_attention: position ",
                pos[b], " outside a table of ", W, " blocks");
    for (int64_t i = 0; i <= pos[b] / block_size; ++i)
      TORCH_CHECK(tp[b * W + i] >= 0 && tp[b * W + i] < k_pool.size(0),
                  "decode_attention: block ", tp[b * W + i], " outside the pool");
  }
}

// The attention itself, over tensors check_reads has passed. Returns [B, heads, D].
static torch::Tensor attend_all(const torch::Tensor& q, const torch::Tensor& k_pool,
                                const torch::Tensor& v_pool, const torch::Tensor& tables,
                                const torch::Tensor& positions, double scale) {
  const int64_t B = q.size(0), heads = q.size(1), D = q.size(2);
  const int64_t block_size = k_pool.size(1), kv_heads = k_pool.size(2), W = tables.size(1);
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_pool.data_ptr<float>();
  const float* vp = v_pool.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float s = static_cast<float>(scale);
  // a fixed head size lets the compiler unroll and vectorise the loops over d; the
  // embedded default's heads (4 query heads of 32 dims over 2 kv heads) are fixed too, its
  // 4 x 32 outputs summed in registers (docs/speed.md has the gain)
  auto* attend = D == 32 && heads == 4 && kv_heads == 2 ? attend_one<32, 4, 2>
               : D == 32 ? attend_one<32, 0, 0> : D == 64 ? attend_one<64, 0, 0>
               : D == 128 ? attend_one<128, 0, 0> : attend_one<0, 0, 0>;
  at::parallel_for(0, B, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> scores(heads * W * block_size);   // this thread's, reused
    for (int64_t b = lo; b < hi; ++b)
      attend(qp + b * heads * D, kp, vp, tp + b * W, pos[b] + 1, block_size, kv_heads, heads, D,
             s, op + b * heads * D, scores.data());
  });
  return out;
}

// The module's function: check_reads, then attend_all.
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool,
                               torch::Tensor tables, torch::Tensor positions, double scale) {
  check_reads(q, k_pool, v_pool, tables, positions);
  return attend_all(q, k_pool, v_pool, tables, positions, scale);
}

// Checks that write_slots may copy token i's key and value vectors k[i], v[i]
// [kv_heads, D] into slot slots[i] of a layer's pools [blocks, block_size, kv_heads, D]
// (slot = block * block_size + offset): every slot inside the pool.
static void check_slots(const torch::Tensor& pool, const torch::Tensor& k,
                        const torch::Tensor& v, const torch::Tensor& slots) {
  const int64_t row = pool.size(2) * pool.size(3), num_slots = pool.size(0) * pool.size(1);
  for (const auto& t : {k, v})
    TORCH_CHECK(t.scalar_type() == torch::kFloat && t.dim() == 3
                && t.size(1) * t.size(2) == row, "paged_decode: new keys and values "
                "[tokens, kv_heads, D] of float32");
  TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.is_contiguous()
              && slots.numel() == k.size(0) && slots.numel() == v.size(0),
              "paged_decode: an int64 slot per token");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < slots.numel(); ++i)
    TORCH_CHECK(slot[i] >= 0 && slot[i] < num_slots, "paged_decode: slot ", slot[i],
                " outside the pool");
}

// The copies check_slots allowed. new is read in place when each token's vectors are
// contiguous (a view of the layer's qkv is)
static void write_slots(torch::Tensor pool, torch::Tensor new_rows, const torch::Tensor& slots) {
  const int64_t row = pool.size(2) * pool.size(3);
  if (new_rows.stride(2) != 1 || new_rows.stride(1) != new_rows.size(2))
    new_rows = new_rows.contiguous();
  const float* src = new_rows.data_ptr<float>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  float* dst = pool.data_ptr<float>();
  for (int64_t i = 0; i < slots.numel(); ++i)
    std::copy_n(src + i * new_rows.stride(0), row, dst + slot[i] * row);
}

// The decode graph's op nanorl::paged_decode_cpp (inference/attention.py, DecodeAttention):
// one layer of a step in which every sequence decodes. Writes the step's keys and values
// [B, kv_heads, D] (views of the layer's qkv) into their slots of the layer's pools, then
// attends; everything is checked before anything is written. Registered here so that the
// compiled graph calls it without a trip through Python.
static torch::Tensor paged_decode(const torch::Tensor& q, const torch::Tensor& k,
                                  const torch::Tensor& v, torch::Tensor k_cache,
                                  torch::Tensor v_cache, int64_t layer,
                                  const torch::Tensor& slots, const torch::Tensor& tables,
                                  const torch::Tensor& positions) {
  auto k_pool = k_cache.select(0, layer), v_pool = v_cache.select(0, layer);
  const auto query = q.contiguous();
  const auto position = positions.reshape({-1});
  check_reads(query, k_pool, v_pool, tables, position);
  check_slots(k_pool, k, v, slots);
  write_slots(k_pool, k, slots);
  write_slots(v_pool, v, slots);
  return attend_all(query, k_pool, v_pool, tables, position,
                    1.0 / std::sqrt(static_cast<double>(q.size(2))));
}

TORCH_LIBRARY_IMPL(nanorl, CPU, m) {
  m.impl("paged_decode_cpp", &paged_decode);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention,
        "one query per sequence attending over its blocks where they lie in the pool");
}
