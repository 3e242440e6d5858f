// Batch-invariant paged attention for AVX2 CPUs, reading keys and values straight from the KV pages.
//
// Why: the deterministic mode needs a query's output to be bit-identical however its step was batched
// and chunked. Matrix-multiply attention reduces over a padded, masked key range whose width (and so the
// grouping of the sums) depends on the step. Here every (query row, head) walks exactly the keys it may
// see, in position order, with an online softmax: the same operations in the same order wherever the
// query sits in a step, so the result depends only on the query and the keys' values. The query heads
// sharing a KV head walk the keys together (each key and value is read once for all of them), each with
// its own softmax state. Reading pages in place also spares decode the copy that gathering them takes.
//
// Layout: q [N, H, D] float32; k_pages / v_pages [P, page_size, kv_heads, D] float32 views of one layer's
// slot (any page stride, contiguous inside a page); block_table [B, W] page ids each sequence reads, in
// position order, with first_pos [B, W] the position of each page's first slot (padding: a huge value);
// row_seq [N] / row_pos [N] each query row's sequence and position. window > 0 limits a query at p to
// keys in (p - window, p].
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "pool.h"
#include <cmath>

namespace {

constexpr int64_t kMaxGroup = 16;  // query heads per KV head handled in one pass over the keys
constexpr int64_t kMaxPage = 256;  // tokens per page

// Two accumulators (even and odd 8-lane blocks), so the multiply-adds of one dot product overlap.
inline float dot(const float* a, const float* b, int64_t D) {
  __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    even = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), even);
    odd = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), odd);
  }
  if (d < D) even = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), even);
  const __m256 acc = _mm256_add_ps(even, odd);
  __m128 sum = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
  sum = _mm_add_ss(sum, _mm_shuffle_ps(sum, sum, 1));
  return _mm_cvtss_f32(sum);
}

// out += weight * v
inline void add_scaled(float* out, float weight, const float* v, int64_t D) {
  const __m256 w = _mm256_set1_ps(weight);
  for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(out + d, _mm256_fmadd_ps(w, _mm256_loadu_ps(v + d), _mm256_loadu_ps(out + d)));
}

}  // namespace

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_pages, torch::Tensor v_pages, torch::Tensor block_table,
                              torch::Tensor first_pos, torch::Tensor row_seq, torch::Tensor row_pos, int64_t window,
                              double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == torch::kFloat32, "q: contiguous float32 [N, H, D]");
  TORCH_CHECK(k_pages.dim() == 4 && k_pages.scalar_type() == torch::kFloat32 && v_pages.sizes() == k_pages.sizes() &&
              v_pages.strides() == k_pages.strides(), "k_pages, v_pages: float32 [P, page_size, kv_heads, D], same strides");
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t page_size = k_pages.size(1), kv_heads = k_pages.size(2), page_stride = k_pages.stride(0);
  TORCH_CHECK(k_pages.size(3) == D && D % 8 == 0, "head_dim must match and be a multiple of 8");
  TORCH_CHECK(k_pages.stride(3) == 1 && k_pages.stride(2) == D && k_pages.stride(1) == kv_heads * D, "pages must be contiguous inside");
  TORCH_CHECK(H % kv_heads == 0 && H / kv_heads <= kMaxGroup, "heads must be a multiple of kv_heads, at most 16 per KV head");
  auto table = block_table.to(torch::kLong).contiguous(), first = first_pos.to(torch::kLong).contiguous();
  auto seq_of = row_seq.to(torch::kLong).contiguous(), pos_of = row_pos.to(torch::kLong).contiguous();
  const int64_t width = table.size(1), group = H / kv_heads;
  auto out = torch::zeros_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_pages.data_ptr<float>();
  const float* vp = v_pages.data_ptr<float>();
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t* fp = first.data_ptr<int64_t>();
  const int64_t* sp = seq_of.data_ptr<int64_t>();
  const int64_t* pp = pos_of.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  TORCH_CHECK(page_size <= kMaxPage, "page_size must be at most ", kMaxPage);
  kiln::SpinPool::run(N * kv_heads, 1, [&](int64_t begin, int64_t end) {
    float running_max[kMaxGroup], total[kMaxGroup], score[kMaxGroup][kMaxPage];
    int64_t offsets[kMaxPage];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / kv_heads, kvh = task % kv_heads;
      const int64_t b = sp[n], qpos = pp[n];
      const float* query = qp + (n * H + kvh * group) * D;  // the group's heads are consecutive
      float* acc = op + (n * H + kvh * group) * D;
      for (int64_t g = 0; g < group; ++g) running_max[g] = -INFINITY, total[g] = 0.0f;
      for (int64_t w = 0; w < width; ++w) {
        const int64_t start = fp[b * width + w];
        if (start > qpos) break;  // pages are in position order; the rest are later (or padding)
        const int64_t page = tp[b * width + w];
        int64_t count = 0;  // the page's keys this query sees, in position order
        for (int64_t slot = 0; slot < page_size && start + slot <= qpos; ++slot)
          if (window <= 0 || start + slot > qpos - window) offsets[count++] = page * page_stride + (slot * kv_heads + kvh) * D;
        if (!count) continue;
        // Online softmax one page at a time: one rescale per page, not per key.
        for (int64_t g = 0; g < group; ++g) {
          float page_max = -INFINITY;
          for (int64_t i = 0; i < count; ++i) {
            score[g][i] = dot(query + g * D, kp + offsets[i], D) * fscale;
            page_max = score[g][i] > page_max ? score[g][i] : page_max;
          }
          const float new_max = page_max > running_max[g] ? page_max : running_max[g];
          const float rescale = std::exp(running_max[g] - new_max);  // exp(-inf) = 0 on the first page
          float* out = acc + g * D;
          for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(out + d, _mm256_mul_ps(_mm256_set1_ps(rescale), _mm256_loadu_ps(out + d)));
          float sum = 0.0f;
          for (int64_t i = 0; i < count; ++i) {
            const float weight = std::exp(score[g][i] - new_max);
            sum += weight;
            add_scaled(out, weight, vp + offsets[i], D);
          }
          total[g] = total[g] * rescale + sum;
          running_max[g] = new_max;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        const float inverse = 1.0f / total[g];
        for (int64_t d = 0; d < D; ++d) acc[g * D + d] *= inverse;
      }
    }
  });
  return out;
}
