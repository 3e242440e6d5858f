// Batch-invariant paged attention for AVX2 CPUs, reading keys and values straight from the KV pages. On CPUs
// with AVX-512 the two inner tiles (scores, weighted values) run 16 lanes at a time (attention_tiles.h) with
// the same operations in the same order per lane: the same bits on either path.
//
// Why: the deterministic mode needs a query's output to be bit-identical however its step was batched
// and chunked. Matrix-multiply attention reduces over a padded, masked key range whose width (and so the
// grouping of the sums) depends on the step. Here every (query row, head) walks exactly the keys it may
// see, in position order, with an online softmax: the same operations in the same order wherever the
// query sits in a step, so the result depends only on the query and the keys' values. The query heads
// sharing a KV head walk the keys together (each key and value is read once for all of them), each with
// its own softmax state. Reading pages in place also spares decode the copy that gathering them takes.
// Consecutive rows of one sequence (a verification step, a prefill chunk) walk the pages together, up to
// kRowBlock at a time: each page is taken in by every row of the block while it is in cache, so the
// sequence's keys cross memory once per block, not once per row. Each row keeps its own state and makes
// the same operations it would make alone.
//
// Parallel over keys too: a query's keys are cut at multiples of kChunkTokens positions; each chunk's
// partial softmax (max, sum, weighted values) is computed on its own and the chunks are merged in
// position order. Chunks are set by absolute positions, never by the step, so the arithmetic stays the
// same for a query wherever it is computed. A step with few blocks (decode of one sequence, a verification
// step) then uses every thread (one task per chunk, merged afterwards); a step with many blocks gives each
// thread whole blocks and merges the chunks as it goes, with the same operations.
//
// Layout: q [N, H, D] float32; k_pages / v_pages [P, page_size, kv_heads, D] float32 or float16 views of one
// layer's slot (any page stride, contiguous inside a page); block_table [B, W] page ids each sequence reads, in
// position order, with first_pos [B, W] the position of each page's first slot (padding: a huge value);
// row_seq [N] / row_pos [N] each query row's sequence and position. window > 0 limits a query at p to
// keys in (p - window, p].
//
// Coded pages (paged_attention_coded): the KV pool stores pages in its codec's at-rest format, so attention
// reads the codes in place rather than decoding whole pages first. When a row block takes in a page, the
// page's K and V rows of the task's KV head (the slots some row of the block sees) are dequantised once
// into per-thread float32 buffers, then every row of the block reads them with the float32 path's own
// arithmetic. Dequantising rounds exactly as torch's codes.float() * scales.float() (+ zeros.float(),
// a separate add), so the result is bit-identical to paged_attention on the dequantised pages. K and V
// each have their own format, told by the codes' dtype, with scales float16 [P, page_size, kv_heads, G]
// (channel c in group c / (D / G), D / G a multiple of 8):
//   int8 codes [P, page_size, kv_heads, D]: value = code * scale; zeros empty.
//   uint8 codes [P, page_size, kv_heads, D / 2], two 4-bit codes a byte, channel 2i in byte i's low
//   nibble, 2i + 1 in its high nibble; zeros float16 like the scales: value = code * scale + zero.
// Each tensor is a view of one byte pool: any page stride (its own), contiguous inside a page.
// float16 is read with F16C, present on every AVX2 CPU these kernels are built for (-mf16c).
//
// Float16 pages (raw, no codec) are read where they lie like float32 ones, each 8 values widened to float32
// as they are loaded. Widening is exact, so the result is bit-identical to paged_attention on float32 pages
// holding the same values, and batch-invariant the same way. Why: decode attention streams every visible
// key and value once a step, so half the bytes is most of half the time (bench/README.md, agents).
//
// Merging calls (paged_attention_merge, paged_attention_coded_merge) return no output: they continue a
// caller's online-softmax state (acc [N, H, D] the weighted values, top [N, H] the running max, total [N, H]
// the running sum; start from 0, -inf, 0), merging this call's keys into it, and the caller divides acc by
// total after the last call. Why: a `restore` sequence's keys lie partly in the pool and partly in a tier
// (kiln/models/streamed_attention.py); each part is attended where it lies, by the same arithmetic, and no
// part is copied or gathered. A row need not see any key of a merging call's pages (its state is then left
// as it was), so the check that a row's own position is covered applies to the plain calls only.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "attention_tiles.h"
#include "checks.h"
#include "isa.h"
#include "kernels.h"
#include "page_format.h"
#include "pool.h"
#include "vec_math.h"
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr int64_t kMaxGroup = 16;  // query heads per KV head handled in one pass over the keys
using kiln::attention::kMaxPage;
constexpr int64_t kChunkTokens = kiln::page_format::kChunkTokens;  // a query's keys are split at multiples of this position
constexpr int64_t kRowBlock = 16;  // consecutive query rows of a sequence that read each page together

// 8 keys' or values' channels as float32: float32 pages as they are, float16 ones widened (exactly).
[[gnu::always_inline]] inline __m256 load8(const float* at) { return _mm256_loadu_ps(at); }
[[gnu::always_inline]] inline __m256 load8(const at::Half* at) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
}

// score[j][i] = (query head j . key i) * scale for G query heads at once: each key is loaded once for all
// of them, and the 2 G accumulators (even and odd 8-lane blocks) keep the multiply-adds overlapping. The
// values' cache lines are prefetched meanwhile; they are read next. So are the next page's keys and values
// of the same slots (next_k, next_v; null: none), into L2, a few lines a key: pages lie anywhere in the pool,
// so the hardware prefetcher starts over at each one, and a page asked for all at once would crowd out
// the loads of this one. Both tiles are forced inline: with two callers (float32 and coded pages) GCC left
// them out of line, and the float32 path ran slower.
template <int G, class T>
[[gnu::always_inline]] inline void tile_scores(const float* query, const T* k, const T* v, const T* next_k, const T* next_v,
                                               const int64_t* offsets, int64_t count, int64_t D, float scale,
                                               float (*score)[kMaxPage]) {
  for (int64_t i = 0; i < count; ++i) {
    const T* key = k + offsets[i];
    __m256 even[G], odd[G];
    for (int j = 0; j < G; ++j) even[j] = odd[j] = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 16 <= D; d += 16) {
      _mm_prefetch(reinterpret_cast<const char*>(v + offsets[i] + d), _MM_HINT_T0);
      if (next_k) {
        _mm_prefetch(reinterpret_cast<const char*>(next_k + offsets[i] + d), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(next_v + offsets[i] + d), _MM_HINT_T1);
      }
      const __m256 k0 = load8(key + d), k1 = load8(key + d + 8);
      for (int j = 0; j < G; ++j) {
        even[j] = _mm256_fmadd_ps(_mm256_loadu_ps(query + j * D + d), k0, even[j]);
        odd[j] = _mm256_fmadd_ps(_mm256_loadu_ps(query + j * D + d + 8), k1, odd[j]);
      }
    }
    if (d < D) {
      const __m256 k0 = load8(key + d);
      for (int j = 0; j < G; ++j) even[j] = _mm256_fmadd_ps(_mm256_loadu_ps(query + j * D + d), k0, even[j]);
    }
    for (int j = 0; j < G; ++j) score[j][i] = kiln::horizontal_sum(_mm256_add_ps(even[j], odd[j])) * scale;
  }
}

// out_j = out_j * rescale_j + sum_i weight[j][i] * value_i for G query heads, one 8-lane block of the head
// dimension at a time held in registers (even and odd keys in separate accumulators, added at the end).
template <int G, class T>
[[gnu::always_inline]] inline void tile_values(float* out, const T* v, const int64_t* offsets, int64_t count, int64_t D,
                                               const float* rescale, const float (*weight)[kMaxPage]) {
  for (int64_t d = 0; d < D; d += 8) {
    __m256 even[G], odd[G];
    for (int j = 0; j < G; ++j) {
      even[j] = _mm256_mul_ps(_mm256_set1_ps(rescale[j]), _mm256_loadu_ps(out + j * D + d));
      odd[j] = _mm256_setzero_ps();
    }
    int64_t i = 0;
    for (; i + 2 <= count; i += 2) {
      const __m256 first = load8(v + offsets[i] + d), second = load8(v + offsets[i + 1] + d);
      for (int j = 0; j < G; ++j) {
        even[j] = _mm256_fmadd_ps(_mm256_set1_ps(weight[j][i]), first, even[j]);
        odd[j] = _mm256_fmadd_ps(_mm256_set1_ps(weight[j][i + 1]), second, odd[j]);
      }
    }
    if (i < count) {
      const __m256 last = load8(v + offsets[i] + d);
      for (int j = 0; j < G; ++j) even[j] = _mm256_fmadd_ps(_mm256_set1_ps(weight[j][i]), last, even[j]);
    }
    for (int j = 0; j < G; ++j) _mm256_storeu_ps(out + j * D + d, _mm256_add_ps(even[j], odd[j]));
  }
}

// A block's (consecutive query rows of one sequence) keys of one KV head in [w_begin, w_end) of the
// sequence's block table, all in one chunk: the union of the rows' own ranges there.
struct Task {
  int64_t block, kvh, w_begin, w_end;
};

// Online softmax state of a KV head's query heads: running max and sum, and the weighted values.
struct Partial {
  float max[kMaxGroup], total[kMaxGroup];
  float* acc;  // [group, D]
};

// A merging call's state (null pointers: a plain call, which writes its output instead).
struct State {
  float *acc, *top, *total;
};

// One (page, KV head)'s keys and values, float32 or float16: slot s's at k + s * stride and v + s * stride;
// next_k, next_v the next page's (the same stride) while it is read, to prefetch.
template <class T>
struct PageRows {
  const T *k, *v;
  int64_t stride;
  const T *next_k = nullptr, *next_v = nullptr;
};

// Raw pages (float32 or float16) are read where they lie: no copy, no scratch.
template <class T>
struct RawPages {
  using Value = T;
  const T *k, *v;
  int64_t page_stride, kv_heads, D;

  int64_t scratch_floats() const { return 0; }
  PageRows<T> rows(int64_t page, int64_t kvh, int64_t, int64_t, float*) const {
    const int64_t at = page * page_stride + kvh * D;
    return {k + at, v + at, kv_heads * D};
  }
  // Reading `rows`, the tiles prefetch page `next`'s (bench/README.md § Design figures: out of cache, a
  // decode step's attention over 13,000 keys took 1.07-1.42 ms instead of 1.61-1.77).
  void ahead(PageRows<T>& rows, int64_t next, int64_t kvh) const {
    const int64_t at = next * page_stride + kvh * D;
    rows.next_k = k + at, rows.next_v = v + at;
  }
};

// K or V of coded pages: codes (8 or 4 bits), float16 scales per group of channels (and zeros for 4 bits),
// each with its own page stride.
struct CodedSide {
  const uint8_t* codes;
  const at::Half *scales, *zeros;
  int64_t code_stride, scale_stride, zero_stride, bits, groups;
};

inline float half_to_float(at::Half h) { return _cvtsh_ss(h.x); }

// value = code * scale per group of `group` channels (a multiple of 8).
inline void dequantise_int8(const uint8_t* codes, const at::Half* scales, int64_t D, int64_t group, float* out) {
  for (int64_t begin = 0; begin < D; begin += group) {
    const __m256 s = _mm256_set1_ps(half_to_float(scales[begin / group]));
    for (int64_t d = begin; d < begin + group; d += 8) {
      const __m256i wide = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + d)));
      _mm256_storeu_ps(out + d, _mm256_mul_ps(_mm256_cvtepi32_ps(wide), s));
    }
  }
}

// value = code * scale + zero per group of `group` channels (a multiple of 8). The product is exact in float32
// (4 + 11 significant bits), so only the add rounds, as in torch's codes.float() * scales + zeros.
inline void dequantise_int4(const uint8_t* codes, const at::Half* scales, const at::Half* zeros, int64_t D, int64_t group,
                            float* out) {
  const __m128i nibble = _mm_set1_epi8(0x0f);
  for (int64_t begin = 0; begin < D; begin += group) {
    const __m256 s = _mm256_set1_ps(half_to_float(scales[begin / group])), z = _mm256_set1_ps(half_to_float(zeros[begin / group]));
    for (int64_t d = begin; d < begin + group; d += 8) {
      int32_t packed;  // channels d .. d + 7
      std::memcpy(&packed, codes + d / 2, sizeof packed);
      const __m128i bytes = _mm_cvtsi32_si128(packed);
      const __m128i low = _mm_and_si128(bytes, nibble), high = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
      const __m256 code = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpacklo_epi8(low, high)));
      _mm256_storeu_ps(out + d, _mm256_add_ps(_mm256_mul_ps(code, s), z));
    }
  }
}

// Coded pages, dequantised a (page, KV head) at a time into the caller's scratch, [page_size, D] for K then V.
struct CodedPages {
  using Value = float;
  CodedSide k, v;
  int64_t page_size, kv_heads, D;

  int64_t scratch_floats() const { return 2 * page_size * D; }
  PageRows<float> rows(int64_t page, int64_t kvh, int64_t slot_begin, int64_t slot_end, float* scratch) const {
    dequantise(k, page, kvh, slot_begin, slot_end, scratch);
    dequantise(v, page, kvh, slot_begin, slot_end, scratch + page_size * D);
    return {scratch, scratch + page_size * D, D};
  }
  // Coded pages are dequantised a page at a time into the scratch the tiles read; what their reads would
  // gain from prefetching the next page's codes was not measured, so nothing is asked for.
  void ahead(PageRows<float>&, int64_t, int64_t) const {}

  void dequantise(const CodedSide& side, int64_t page, int64_t kvh, int64_t slot_begin, int64_t slot_end, float* out) const {
    const int64_t code_bytes = side.bits == 8 ? D : D / 2, group = D / side.groups;
    for (int64_t slot = slot_begin; slot < slot_end; ++slot) {
      const int64_t row = slot * kv_heads + kvh;
      const uint8_t* codes = side.codes + page * side.code_stride + row * code_bytes;
      const at::Half* scales = side.scales + page * side.scale_stride + row * side.groups;
      if (side.bits == 8) dequantise_int8(codes, scales, D, group, out + slot * D);
      else dequantise_int4(codes, scales, side.zeros + page * side.zero_stride + row * side.groups, D, group, out + slot * D);
    }
  }
};

template <class Pages>
struct Problem {
  Pages pages;
  const float* q;
  const int64_t *table, *first, *seq_of, *pos_of;
  int64_t H, D, group, kv_heads, page_size, width, window;
  float scale;
  bool wide;  // the AVX-512 tiles (attention_tiles.h): the same bits, fewer instructions

  // The chunk's softmax states of the block's rows, from scratch: pages one at a time, and each page for
  // every row while it is in cache, one rescale per page and row. A row's operations are those it would
  // make alone: a page it does not see (later than it, or before its window) has no visible key.
  // `scratch`: pages.scratch_floats() floats of the calling thread's.
  void attend_chunk(const Task& task, int64_t row_begin, int64_t row_end, Partial* parts, float* scratch) const {
    const int64_t b = seq_of[row_begin];
    const int64_t tile = group % 4 == 0 ? 4 : group % 3 == 0 ? 3 : group % 2 == 0 ? 2 : 1;
    int64_t offsets[kMaxPage];
    int64_t lowest = pos_of[row_begin], highest = lowest;  // the block's positions: which slots any row sees
    for (int64_t r = row_begin; r < row_end; ++r) {
      start(parts[r - row_begin]);
      lowest = std::min(lowest, pos_of[r]), highest = std::max(highest, pos_of[r]);
    }
    for (int64_t w = task.w_begin; w < task.w_end; ++w) {
      const int64_t start = first[b * width + w], page = table[b * width + w];
      const int64_t seen_begin = window > 0 ? std::clamp(lowest - window + 1 - start, int64_t{0}, page_size) : 0;
      PageRows<typename Pages::Value> rows = pages.rows(page, task.kvh, seen_begin, std::clamp(highest + 1 - start, int64_t{0}, page_size), scratch);
      if (w + 1 < task.w_end) pages.ahead(rows, table[b * width + w + 1], task.kvh);
      for (int64_t r = row_begin; r < row_end; ++r) {
        const int64_t qpos = pos_of[r];
        int64_t count = 0;  // the page's keys this query sees, in position order
        for (int64_t slot = 0; slot < page_size && start + slot <= qpos; ++slot)
          if (window <= 0 || start + slot > qpos - window) offsets[count++] = slot * rows.stride;
        if (!count) continue;
        const float* query = q + (r * H + task.kvh * group) * D;  // the group's heads are consecutive
        Partial& part = parts[r - row_begin];
        for (int64_t g = 0; g < group; g += tile) {
          if (tile == 4) attend_page<4>(query + g * D, part, g, rows, offsets, count);
          else if (tile == 3) attend_page<3>(query + g * D, part, g, rows, offsets, count);
          else if (tile == 2) attend_page<2>(query + g * D, part, g, rows, offsets, count);
          else attend_page<1>(query + g * D, part, g, rows, offsets, count);
        }
      }
    }
  }

  // Query heads g .. g + G - 1 of `part` take in one page's keys: scores, one rescale, weighted values.
  template <int G>
  void attend_page(const float* query, Partial& part, int64_t g, const PageRows<typename Pages::Value>& rows, const int64_t* offsets,
                   int64_t count) const {
    float weight[G][kMaxPage], rescale[G];
    if (wide) kiln::attention::scores_avx512<G>(query, rows.k, rows.v, rows.next_k, rows.next_v, offsets, count, D, scale, weight);
    else tile_scores<G>(query, rows.k, rows.v, rows.next_k, rows.next_v, offsets, count, D, scale, weight);
    for (int j = 0; j < G; ++j) {
      float page_max = -INFINITY;
      for (int64_t i = 0; i < count; ++i) page_max = weight[j][i] > page_max ? weight[j][i] : page_max;
      const float running = part.max[g + j], new_max = page_max > running ? page_max : running;
      rescale[j] = std::exp(running - new_max);  // exp(-inf) = 0 on the first page
      kiln::exp_shifted(weight[j], count, new_max);  // vectorised: std::exp per key was a tenth of decode attention
      float sum = 0.0f;
      for (int64_t i = 0; i < count; ++i) sum += weight[j][i];
      part.total[g + j] = part.total[g + j] * rescale[j] + sum;
      part.max[g + j] = new_max;
    }
    if (wide) kiln::attention::values_avx512<G>(part.acc + g * D, rows.v, offsets, count, D, rescale, weight);
    else tile_values<G>(part.acc + g * D, rows.v, offsets, count, D, rescale, weight);
  }

  // into <- into merged with the next chunk (starting from max -inf, sum 0, acc 0 gives the chunk itself).
  // A chunk the row saw no key of (its block's, not its own) is no chunk of the row's: skipped.
  void merge(Partial& into, const Partial& chunk) const {
    for (int64_t g = 0; g < group; ++g) {
      if (chunk.max[g] == -INFINITY) continue;
      const float new_max = chunk.max[g] > into.max[g] ? chunk.max[g] : into.max[g];
      const float mine = std::exp(into.max[g] - new_max), theirs = std::exp(chunk.max[g] - new_max);
      into.total[g] = into.total[g] * mine + chunk.total[g] * theirs;
      into.max[g] = new_max;
      const __m256 a = _mm256_set1_ps(mine), c = _mm256_set1_ps(theirs);
      float* out = into.acc + g * D;
      const float* in = chunk.acc + g * D;
      for (int64_t d = 0; d < D; d += 8)
        _mm256_storeu_ps(out + d, _mm256_fmadd_ps(c, _mm256_loadu_ps(in + d), _mm256_mul_ps(a, _mm256_loadu_ps(out + d))));
    }
  }

  void start(Partial& part) const {
    for (int64_t g = 0; g < group; ++g) part.max[g] = -INFINITY, part.total[g] = 0.0f;
    std::fill(part.acc, part.acc + group * D, 0.0f);
  }

  void finish(const Partial& part, float* out) const {
    for (int64_t g = 0; g < group; ++g) {
      const float inverse = 1.0f / part.total[g];
      for (int64_t d = 0; d < D; ++d) out[g * D + d] = part.acc[g * D + d] * inverse;
    }
  }

  // Row `row`'s state of KV head `kvh`: a merging call's (copied in), else a fresh one.
  void begin(Partial& part, const State& state, int64_t row, int64_t kvh) const {
    if (!state.acc) return start(part);
    const int64_t at = row * H + kvh * group;
    std::copy(state.top + at, state.top + at + group, part.max);
    std::copy(state.total + at, state.total + at + group, part.total);
    std::copy(state.acc + at * D, state.acc + (at + group) * D, part.acc);
  }

  // The row's merged state back to a merging call's state, else its output to `out` ([N, H, D]).
  void end(const Partial& part, const State& state, float* out, int64_t row, int64_t kvh) const {
    const int64_t at = row * H + kvh * group;
    if (!state.acc) return finish(part, out + at * D);
    std::copy(part.max, part.max + group, state.top + at);
    std::copy(part.total, part.total + group, state.total + at);
    std::copy(part.acc, part.acc + group * D, state.acc + at * D);
  }

  // Blocks of consecutive rows of one sequence, at most kRowBlock each: [block_rows[i], block_rows[i + 1]).
  std::vector<int64_t> blocks(int64_t N) const {
    std::vector<int64_t> out{0};
    for (int64_t n = 1; n < N; ++n)
      if (seq_of[n] != seq_of[n - 1] || n - out.back() == kRowBlock) out.push_back(n);
    out.push_back(N);
    return out;
  }

  // Every (block, KV head)'s chunks, in block, head, position order. A block reads the pages any of its
  // rows sees, cut where a chunk ends.
  std::vector<Task> tasks(const std::vector<int64_t>& block_rows) const {
    std::vector<Task> out;
    for (int64_t i = 0; i + 1 < static_cast<int64_t>(block_rows.size()); ++i) {
      const int64_t* starts = first + seq_of[block_rows[i]] * width;  // in position order, padding last (huge)
      int64_t lo = width, hi = 0;
      for (int64_t n = block_rows[i]; n < block_rows[i + 1]; ++n) {
        int64_t w = 0;
        while (w < width && window > 0 && starts[w] + page_size <= pos_of[n] - window + 1) ++w;  // before the window
        lo = std::min(lo, w);
        while (w < width && starts[w] <= pos_of[n]) ++w;
        hi = std::max(hi, w);
      }
      std::vector<Task> chunks;
      for (int64_t w = lo; w < hi; ++w) {
        if (chunks.empty() || starts[chunks.back().w_begin] / kChunkTokens != starts[w] / kChunkTokens) chunks.push_back({i, 0, w, w});
        chunks.back().w_end = w + 1;
      }
      for (int64_t kvh = 0; kvh < kv_heads; ++kvh)
        for (Task task : chunks) task.kvh = kvh, out.push_back(task);
    }
    return out;
  }
};

// What both entry points check of q and the pages' shape; returns head_dim.
int64_t check_query(const torch::Tensor& q, int64_t page_size, int64_t kv_heads) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 3 && q.is_contiguous() && q.scalar_type() == torch::kFloat32,
              "q: contiguous float32 CPU tensor [N, H, D]");
  const int64_t H = q.size(1), D = q.size(2);
  TORCH_CHECK(D % 8 == 0, "head_dim must be a multiple of 8");
  TORCH_CHECK(kv_heads > 0 && H % kv_heads == 0 && H / kv_heads <= kMaxGroup,
              "heads must be a multiple of kv_heads, at most 16 per KV head");
  TORCH_CHECK(page_size > 0 && page_size <= kMaxPage && kChunkTokens % page_size == 0, "page_size must divide ", kChunkTokens);
  return D;
}

// [P, page_size, kv_heads, last] laid out contiguously inside a page (any page stride).
void check_page_view(const torch::Tensor& t, const char* name, torch::ScalarType dtype, int64_t pages, int64_t page_size,
                     int64_t kv_heads, int64_t last) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype, name, ": expected a CPU tensor of ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 4 && t.size(0) == pages && t.size(1) == page_size && t.size(2) == kv_heads && t.size(3) == last,
              name, ": expected [", pages, ", ", page_size, ", ", kv_heads, ", ", last, "], got ", t.sizes());
  TORCH_CHECK(t.stride(3) == 1 && t.stride(2) == last && t.stride(1) == kv_heads * last, name, ": must be contiguous inside a page");
}

// The query rows' index tensors as contiguous int64, checked against each other and the pool.
struct Indices {
  torch::Tensor table, first, seq_of, pos_of;
};

// Everything the kernel indexes memory with is checked: block_table [B, W] page ids within the pool,
// first_pos [B, W] (the same shape) non-negative and ascending along each sequence's row, row_seq / row_pos
// [N] one per query row, each row's sequence within the table and its position covered by one of that
// sequence's pages (the row's own key, stored before attention reads it; `own_key` false: merging calls,
// whose pages may hold none of a row's keys, check only that positions are non-negative).
Indices check_indices(const torch::Tensor& block_table, const torch::Tensor& first_pos, const torch::Tensor& row_seq,
                      const torch::Tensor& row_pos, int64_t N, int64_t pages, int64_t page_size, bool own_key) {
  Indices in{kiln::index_tensor(block_table, "block_table", 2), kiln::index_tensor(first_pos, "first_pos", 2),
             kiln::index_tensor(row_seq, "row_seq", 1), kiln::index_tensor(row_pos, "row_pos", 1)};
  const int64_t B = in.table.size(0), W = in.table.size(1);
  TORCH_CHECK(in.first.sizes() == in.table.sizes(), "first_pos: expected the block table's shape ", in.table.sizes(), ", got ",
              in.first.sizes());
  TORCH_CHECK(in.seq_of.numel() == N && in.pos_of.numel() == N, "row_seq, row_pos: one per query row (", N, "), got ",
              in.seq_of.numel(), " and ", in.pos_of.numel());
  kiln::check_range(in.table.data_ptr<int64_t>(), B * W, 0, pages, "block_table");
  kiln::check_range(in.seq_of.data_ptr<int64_t>(), N, 0, B, "row_seq");
  const int64_t* first = in.first.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * W; ++i)
    TORCH_CHECK(first[i] >= 0 && (i % W == 0 || first[i - 1] <= first[i]), "first_pos[", i / W, ", ", i % W, "] = ", first[i],
                ": positions must be non-negative and ascending along a sequence's pages");
  const int64_t *seq_of = in.seq_of.data_ptr<int64_t>(), *pos_of = in.pos_of.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n) {
    TORCH_CHECK(pos_of[n] >= 0, "row ", n, " at position ", pos_of[n], ": positions must be non-negative");
    if (!own_key) continue;
    const int64_t* starts = first + seq_of[n] * W;
    const int64_t* page = std::upper_bound(starts, starts + W, pos_of[n]);  // just past the page holding the position
    TORCH_CHECK(page != starts && pos_of[n] - page[-1] < page_size, "row ", n, " at position ", pos_of[n],
                " of sequence ", seq_of[n], ": no page of the block table holds that position");
  }
  return in;
}

// Runs the problem over every row of q (the pages' checks done): a plain call returns the output; a merging
// call (state's pointers set, checked by check_state) merges into the state and returns an undefined tensor.
template <class Pages>
torch::Tensor attend(const Pages& pages, const torch::Tensor& q, const torch::Tensor& block_table, const torch::Tensor& first_pos,
                     const torch::Tensor& row_seq, const torch::Tensor& row_pos, int64_t num_pages, int64_t page_size,
                     int64_t kv_heads, int64_t window, double scale, const State& state) {
  const Indices in = check_indices(block_table, first_pos, row_seq, row_pos, q.size(0), num_pages, page_size, !state.acc);
  const torch::Tensor &table = in.table, &first = in.first, &seq_of = in.seq_of, &pos_of = in.pos_of;
  auto out = state.acc ? torch::Tensor() : torch::empty_like(q);
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2), group = H / kv_heads;
  const Problem<Pages> problem{pages, q.data_ptr<float>(), table.data_ptr<int64_t>(), first.data_ptr<int64_t>(),
                               seq_of.data_ptr<int64_t>(), pos_of.data_ptr<int64_t>(), H, D, group, kv_heads, page_size,
                               table.size(1), window, static_cast<float>(scale), kiln::active_isa() == kiln::Isa::kAvx512Vnni};
  const std::vector<int64_t> block_rows = problem.blocks(N);
  const std::vector<Task> tasks = problem.tasks(block_rows);
  const int64_t units = (static_cast<int64_t>(block_rows.size()) - 1) * kv_heads, T = static_cast<int64_t>(tasks.size());
  std::vector<int64_t> first_task(units + 1, T);  // tasks of (block, KV head) u: [first_task[u], first_task[u + 1])
  for (int64_t t = T - 1; t >= 0; --t) first_task[tasks[t].block * kv_heads + tasks[t].kvh] = t;
  for (int64_t u = units - 1; u >= 0; --u) first_task[u] = std::min(first_task[u], first_task[u + 1]);
  const int64_t stride = group * D;  // one row's state (and output) for one KV head
  float* op = state.acc ? nullptr : out.data_ptr<float>();
  if (units >= 2 * at::get_num_threads()) {  // enough blocks for every thread: each takes whole blocks
    kiln::SpinPool::run(units, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> buffers(2 * kRowBlock * stride), scratch(pages.scratch_floats());
      Partial chunk[kRowBlock], merged[kRowBlock];
      for (int64_t r = 0; r < kRowBlock; ++r) chunk[r].acc = &buffers[r * stride], merged[r].acc = &buffers[(kRowBlock + r) * stride];
      for (int64_t u = begin; u < end; ++u) {
        const int64_t row_begin = block_rows[u / kv_heads], rows = block_rows[u / kv_heads + 1] - row_begin, kvh = u % kv_heads;
        for (int64_t r = 0; r < rows; ++r) problem.begin(merged[r], state, row_begin + r, kvh);
        for (int64_t t = first_task[u]; t < first_task[u + 1]; ++t) {
          problem.attend_chunk(tasks[t], row_begin, row_begin + rows, chunk, scratch.data());
          for (int64_t r = 0; r < rows; ++r) problem.merge(merged[r], chunk[r]);
        }
        for (int64_t r = 0; r < rows; ++r) problem.end(merged[r], state, op, row_begin + r, kvh);
      }
    });
    return out;
  }
  // Few blocks (decode, speculative verification): one task per chunk, then the merge.
  std::vector<int64_t> first_part(T + 1, 0);  // task t's rows' states: [first_part[t], first_part[t + 1])
  for (int64_t t = 0; t < T; ++t) first_part[t + 1] = first_part[t] + block_rows[tasks[t].block + 1] - block_rows[tasks[t].block];
  std::vector<float> accs((first_part[T] + 1) * stride);
  std::vector<Partial> parts(first_part[T] + 1);
  for (int64_t i = 0; i <= first_part[T]; ++i) parts[i].acc = &accs[i * stride];
  kiln::SpinPool::run(T, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(pages.scratch_floats());
    for (int64_t t = begin; t < end; ++t)
      problem.attend_chunk(tasks[t], block_rows[tasks[t].block], block_rows[tasks[t].block + 1], &parts[first_part[t]],
                           scratch.data());
  });
  Partial& merged = parts[first_part[T]];
  for (int64_t u = 0; u < units; ++u) {
    const int64_t row_begin = block_rows[u / kv_heads], rows = block_rows[u / kv_heads + 1] - row_begin, kvh = u % kv_heads;
    for (int64_t r = 0; r < rows; ++r) {
      problem.begin(merged, state, row_begin + r, kvh);
      for (int64_t t = first_task[u]; t < first_task[u + 1]; ++t) problem.merge(merged, parts[first_part[t] + r]);
      problem.end(merged, state, op, row_begin + r, kvh);
    }
  }
  return out;
}

// A merging call's state, checked against q: acc float32 [N, H, D], top and total float32 [N, H], contiguous.
State check_state(const torch::Tensor& q, torch::Tensor& acc, torch::Tensor& top, torch::Tensor& total) {
  TORCH_CHECK(acc.device().is_cpu() && acc.scalar_type() == torch::kFloat32 && acc.is_contiguous() && acc.sizes() == q.sizes(),
              "acc: a contiguous float32 CPU tensor of q's shape ", q.sizes(), ", got ", acc.sizes());
  for (const torch::Tensor* t : {&top, &total})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == torch::kFloat32 && t->is_contiguous() && t->dim() == 2 &&
                t->size(0) == q.size(0) && t->size(1) == q.size(1),
                "top, total: contiguous float32 CPU tensors [N, H] = [", q.size(0), ", ", q.size(1), "], got ", t->sizes());
  return {acc.data_ptr<float>(), top.data_ptr<float>(), total.data_ptr<float>()};
}

// Raw pages (float32 or float16), checked; a plain call (state's pointers null) or a merging one.
torch::Tensor attend_raw(const torch::Tensor& q, const torch::Tensor& k_pages, const torch::Tensor& v_pages,
                         const torch::Tensor& block_table, const torch::Tensor& first_pos, const torch::Tensor& row_seq,
                         const torch::Tensor& row_pos, int64_t window, double scale, const State& state) {
  const bool half = k_pages.scalar_type() == torch::kHalf;
  TORCH_CHECK(k_pages.device().is_cpu() && v_pages.device().is_cpu() && k_pages.dim() == 4 &&
              (half || k_pages.scalar_type() == torch::kFloat32) && v_pages.scalar_type() == k_pages.scalar_type() &&
              v_pages.sizes() == k_pages.sizes() && v_pages.strides() == k_pages.strides(),
              "k_pages, v_pages: float32 or float16 [P, page_size, kv_heads, D], same dtype and strides");
  const int64_t page_size = k_pages.size(1), kv_heads = k_pages.size(2), D = check_query(q, page_size, kv_heads);
  TORCH_CHECK(k_pages.size(3) == D, "head_dim must match");
  TORCH_CHECK(k_pages.stride(3) == 1 && k_pages.stride(2) == D && k_pages.stride(1) == kv_heads * D, "pages must be contiguous inside");
  if (half) {
    const RawPages<at::Half> pages{k_pages.data_ptr<at::Half>(), v_pages.data_ptr<at::Half>(), k_pages.stride(0), kv_heads, D};
    return attend(pages, q, block_table, first_pos, row_seq, row_pos, k_pages.size(0), page_size, kv_heads, window, scale, state);
  }
  const RawPages<float> pages{k_pages.data_ptr<float>(), v_pages.data_ptr<float>(), k_pages.stride(0), kv_heads, D};
  return attend(pages, q, block_table, first_pos, row_seq, row_pos, k_pages.size(0), page_size, kv_heads, window, scale, state);
}

// One side's codes, scales and zeros checked against the format its codes' dtype names.
CodedSide coded_side(const torch::Tensor& codes, const torch::Tensor& scales, const torch::Tensor& zeros, const char* side,
                     int64_t pages, int64_t page_size, int64_t kv_heads, int64_t D) {
  const bool four = codes.scalar_type() == torch::kUInt8;
  TORCH_CHECK(four || codes.scalar_type() == torch::kInt8, side,
              "_codes: int8 (8-bit codes) or uint8 (two 4-bit codes a byte), got ", codes.scalar_type());
  const std::string name(side);
  check_page_view(codes, (name + "_codes").c_str(), codes.scalar_type(), pages, page_size, kv_heads, four ? D / 2 : D);
  const int64_t groups = scales.dim() == 4 ? scales.size(3) : 0;
  TORCH_CHECK(groups > 0 && D % groups == 0 && (D / groups) % 8 == 0, side,
              "_scales: the last dim must be D / group with group a multiple of 8 channels");
  check_page_view(scales, (name + "_scales").c_str(), torch::kHalf, pages, page_size, kv_heads, groups);
  if (!four) {
    TORCH_CHECK(zeros.numel() == 0, side, "_zeros: 8-bit codes are symmetric, zeros must be empty");
    return {static_cast<const uint8_t*>(codes.data_ptr()), scales.data_ptr<at::Half>(), nullptr, codes.stride(0), scales.stride(0),
            0, 8, groups};
  }
  check_page_view(zeros, (name + "_zeros").c_str(), torch::kHalf, pages, page_size, kv_heads, groups);
  return {static_cast<const uint8_t*>(codes.data_ptr()), scales.data_ptr<at::Half>(), zeros.data_ptr<at::Half>(), codes.stride(0),
          scales.stride(0), zeros.stride(0), 4, groups};
}

// Coded pages, checked; a plain call (state's pointers null) or a merging one.
torch::Tensor attend_coded(const torch::Tensor& q, const torch::Tensor& k_codes, const torch::Tensor& k_scales,
                           const torch::Tensor& k_zeros, const torch::Tensor& v_codes, const torch::Tensor& v_scales,
                           const torch::Tensor& v_zeros, const torch::Tensor& block_table, const torch::Tensor& first_pos,
                           const torch::Tensor& row_seq, const torch::Tensor& row_pos, int64_t window, double scale,
                           const State& state) {
  TORCH_CHECK(k_codes.dim() == 4, "k_codes: expected [P, page_size, kv_heads, D or D / 2], got ", k_codes.sizes());
  const int64_t pages = k_codes.size(0), page_size = k_codes.size(1), kv_heads = k_codes.size(2);
  const int64_t D = check_query(q, page_size, kv_heads);
  const CodedPages coded{coded_side(k_codes, k_scales, k_zeros, "k", pages, page_size, kv_heads, D),
                         coded_side(v_codes, v_scales, v_zeros, "v", pages, page_size, kv_heads, D), page_size, kv_heads, D};
  return attend(coded, q, block_table, first_pos, row_seq, row_pos, pages, page_size, kv_heads, window, scale, state);
}

}  // namespace

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_pages, torch::Tensor v_pages, torch::Tensor block_table,
                              torch::Tensor first_pos, torch::Tensor row_seq, torch::Tensor row_pos, int64_t window,
                              double scale) {
  return attend_raw(q, k_pages, v_pages, block_table, first_pos, row_seq, row_pos, window, scale, State{});
}

void paged_attention_merge(torch::Tensor q, torch::Tensor k_pages, torch::Tensor v_pages, torch::Tensor block_table,
                           torch::Tensor first_pos, torch::Tensor row_seq, torch::Tensor row_pos, int64_t window, double scale,
                           torch::Tensor acc, torch::Tensor top, torch::Tensor total) {
  attend_raw(q, k_pages, v_pages, block_table, first_pos, row_seq, row_pos, window, scale, check_state(q, acc, top, total));
}

torch::Tensor paged_attention_coded(torch::Tensor q, torch::Tensor k_codes, torch::Tensor k_scales, torch::Tensor k_zeros,
                                    torch::Tensor v_codes, torch::Tensor v_scales, torch::Tensor v_zeros,
                                    torch::Tensor block_table, torch::Tensor first_pos, torch::Tensor row_seq,
                                    torch::Tensor row_pos, int64_t window, double scale) {
  return attend_coded(q, k_codes, k_scales, k_zeros, v_codes, v_scales, v_zeros, block_table, first_pos, row_seq, row_pos, window,
                      scale, State{});
}

void paged_attention_coded_merge(torch::Tensor q, torch::Tensor k_codes, torch::Tensor k_scales, torch::Tensor k_zeros,
                                 torch::Tensor v_codes, torch::Tensor v_scales, torch::Tensor v_zeros, torch::Tensor block_table,
                                 torch::Tensor first_pos, torch::Tensor row_seq, torch::Tensor row_pos, int64_t window,
                                 double scale, torch::Tensor acc, torch::Tensor top, torch::Tensor total) {
  attend_coded(q, k_codes, k_scales, k_zeros, v_codes, v_scales, v_zeros, block_table, first_pos, row_seq, row_pos, window, scale,
               check_state(q, acc, top, total));
}
