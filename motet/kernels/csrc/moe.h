// Mixture-of-experts pieces (engine/worker/model.py's SparseMoE and Experts define the meaning): the router's top-k
// choice per token and the grouped expert GEMM.
#pragma once

#include <algorithm>
#include <utility>

#include "gemm_bf16.h"

namespace motet {

// ---------------------------------------------------------------------------------------------------------
// Routing: softmax over a token's E router logits (fp32), its top-k experts, their probabilities as weights
// (renormalized to sum to 1 where `renormalize`). The choice and its order are torch.topk's on the CPU: the
// same (value, index) pairs through the same standard-library selection (nth_element then a sort of the
// first k - 1, or partial_sort where k * 64 <= E), so even exactly tied probabilities pick the experts torch
// picks (which is not always the lowest index).
inline void route(const float* logits, int E, int k, bool renormalize, int32_t* experts, float* weights,
                  std::vector<std::pair<float, int64_t>>& queue) {
    float mx = logits[0];
    for (int e = 1; e < E; ++e) mx = logits[e] > mx ? logits[e] : mx;
    queue.resize(E);
    float sum = 0.0f;
    for (int e = 0; e < E; ++e) {
        queue[e] = {std::exp(logits[e] - mx), e};
        sum += queue[e].first;
    }
    for (auto& q : queue) q.first /= sum;
    const auto larger = [](const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) {
        return (std::isnan(a.first) && !std::isnan(b.first)) || a.first > b.first;  // NaN first, as torch
    };
    if (static_cast<int64_t>(k) * 64 <= E) {
        std::partial_sort(queue.begin(), queue.begin() + k, queue.end(), larger);
    } else {
        std::nth_element(queue.begin(), queue.begin() + k - 1, queue.end(), larger);
        std::sort(queue.begin(), queue.begin() + k - 1, larger);
    }
    float total = 0.0f;
    for (int j = 0; j < k; ++j) total += queue[j].first;
    for (int j = 0; j < k; ++j) {
        experts[j] = static_cast<int32_t>(queue[j].second);
        weights[j] = renormalize ? queue[j].first / total : queue[j].first;
    }
}

// ---------------------------------------------------------------------------------------------------------
// Grouped GEMM: rows sorted by expert, expert e's rows [offsets[e], offsets[e + 1]) of y (=) those rows of x @
// W_e^T (+ bias_e), W_e packed like gemm's weights (panels of NR columns), the experts' packed weights one after
// another, their biases (or null) [E, N].
//
// One parallel region for all experts: the work items are (expert, chunk of up to kMChunk rows, panel),
// ordered so, and each thread takes one contiguous run of them holding an equal share of the estimated cost
// (a panel's rows plus kPanelCost for streaming the panel): at decode a thread streams whole experts' panels
// in order, at prefill the rows' arithmetic is split evenly however unequal the experts' segments are.
constexpr int kPanelCost = 8;  // streaming one panel from memory, in rows of arithmetic (roughly)

template <typename TW>
void grouped_gemm(const float* x, int64_t ldx, const int32_t* offsets, int E, int K, const TW* packed, int N,
                  const TW* bias, float* y, int64_t ldy) {
    const int panels = (N + NR - 1) / NR;
    const int64_t expert_stride = static_cast<int64_t>(panels) * K * NR;
    struct Chunk {
        int expert, m_start, m_end;
    };
    std::vector<Chunk> chunks;
    for (int e = 0; e < E; ++e)
        for (int m = offsets[e]; m < offsets[e + 1]; m += kMChunk)
            chunks.push_back({e, m, std::min(m + kMChunk, static_cast<int>(offsets[e + 1]))});
    if (chunks.empty()) return;
    const int64_t items = static_cast<int64_t>(chunks.size()) * panels;
    // cost before each chunk's first item
    std::vector<int64_t> before(chunks.size() + 1, 0);
    for (size_t c = 0; c < chunks.size(); ++c)
        before[c + 1] = before[c] + static_cast<int64_t>(chunks[c].m_end - chunks[c].m_start + kPanelCost) * panels;
    const int64_t total = before.back();
    // the first item whose cost starts at or past `target`
    const auto first_item = [&](int64_t target) -> int64_t {
        if (target >= total) return items;
        const size_t c = std::upper_bound(before.begin(), before.end(), target) - before.begin() - 1;
        const int64_t per = chunks[c].m_end - chunks[c].m_start + kPanelCost;
        return static_cast<int64_t>(c) * panels + (target - before[c] + per - 1) / per;
    };
#ifdef MOTET_BF16_DOT
    // bf16 weights (the avx512bf16 tier): all rows rounded to bf16 once, for every expert's panels
    constexpr bool dot = std::is_same_v<TW, uint16_t>;
    int64_t ldb = 0;
    uint16_t* xb = dot ? bf16_rows_buffer(offsets[E], K, &ldb) : nullptr;
    if (dot) round_rows_bf16(x, ldx, 0, offsets[E], K, xb, ldb);
#else
    constexpr bool dot = false;
#endif
#pragma omp parallel if (total > 64 * kPanelCost)
    {
        const int nt = omp_get_num_threads(), tid = omp_get_thread_num();
        const int64_t lo = first_item(total * tid / nt), hi = first_item(total * (tid + 1) / nt);
        std::vector<float> convert(sizeof(TW) == 2 && !dot ? static_cast<size_t>(K) * NR : 0);
        std::vector<uint16_t> paired(dot ? static_cast<size_t>(K + 1) * NR : 0);
        for (int64_t item = lo; item < hi; ++item) {
            const Chunk& c = chunks[item / panels];
            const int p = static_cast<int>(item % panels);
            const int n0 = p * NR, nv = N - n0 < NR ? N - n0 : NR;
            const TW* w = packed + c.expert * expert_stride + static_cast<int64_t>(p) * K * NR;
            const TW* b = bias ? bias + static_cast<int64_t>(c.expert) * N : nullptr;
#ifdef MOTET_BF16_DOT
            if constexpr (dot) {
                dot_panel_product(xb, ldb, c.m_start, c.m_end, K, w, n0, nv, b, y, ldy, false, paired.data());
                continue;
            }
#endif
            panel_product(x, ldx, c.m_start, c.m_end, K, w, n0, nv, b, y, ldy, false, convert.data());
        }
    }
}

}  // namespace motet
