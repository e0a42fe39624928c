// Mixture-of-experts pieces (engine/worker/model.py's SparseMoE and Experts define the meaning): the router's top-k
// choice per token and the grouped expert GEMMs (float and quantized weights).
#pragma once

#include <algorithm>
#include <utility>

#include "gemm_bf16.h"
#include "qgemm.h"

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

// The work items of a grouped product over `panels` panels an expert, and each thread's share of them.
class ExpertWork {
public:
    struct Chunk {
        int expert, m_start, m_end;
    };

    ExpertWork(const int32_t* offsets, int E, int panels) : panels_(panels) {
        for (int e = 0; e < E; ++e)
            for (int m = offsets[e]; m < offsets[e + 1]; m += kMChunk)
                chunks_.push_back({e, m, std::min(m + kMChunk, static_cast<int>(offsets[e + 1]))});
        items_ = static_cast<int64_t>(chunks_.size()) * panels;
        before_.assign(chunks_.size() + 1, 0);  // cost before each chunk's first item
        for (size_t c = 0; c < chunks_.size(); ++c)
            before_[c + 1] = before_[c] + static_cast<int64_t>(rows(c) + kPanelCost) * panels;
    }
    bool empty() const { return chunks_.empty(); }
    int64_t cost() const { return before_.back(); }
    // thread tid of nt's items [*lo, *hi): one contiguous run holding an equal share of the cost
    void share(int tid, int nt, int64_t* lo, int64_t* hi) const {
        *lo = first_item(cost() * tid / nt);
        *hi = first_item(cost() * (tid + 1) / nt);
    }
    const Chunk& chunk(int64_t item) const { return chunks_[item / panels_]; }
    int panel(int64_t item) const { return static_cast<int>(item % panels_); }

private:
    int rows(size_t c) const { return chunks_[c].m_end - chunks_[c].m_start; }
    // the first item whose cost starts at or past `target`
    int64_t first_item(int64_t target) const {
        if (target >= cost()) return items_;
        const size_t c = std::upper_bound(before_.begin(), before_.end(), target) - before_.begin() - 1;
        const int64_t per = rows(c) + kPanelCost;
        return static_cast<int64_t>(c) * panels_ + (target - before_[c] + per - 1) / per;
    }

    int panels_;
    int64_t items_ = 0;
    std::vector<Chunk> chunks_;
    std::vector<int64_t> before_;
};

template <typename TW>
void grouped_gemm(const float* x, int64_t ldx, const int32_t* offsets, int E, int K, const TW* packed, int N,
                  const TW* bias, float* y, int64_t ldy) {
    const int panels = (N + NR - 1) / NR;
    const int64_t expert_stride = static_cast<int64_t>(panels) * K * NR;
    const ExpertWork work(offsets, E, panels);
    if (work.empty()) return;
#ifdef MOTET_BF16_DOT
    // bf16 weights (the avx512bf16 tier): all rows rounded to bf16 once, for every expert's panels
    constexpr bool dot = std::is_same_v<TW, uint16_t>;
    int64_t ldb = 0;
    uint16_t* xb = dot ? bf16_rows_buffer(offsets[E], K, &ldb) : nullptr;
    if (dot) round_rows_bf16(x, ldx, 0, offsets[E], K, xb, ldb);
#else
    constexpr bool dot = false;
#endif
#pragma omp parallel if (work.cost() > 64 * kPanelCost)
    {
        int64_t lo, hi;
        work.share(omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
        std::vector<float> convert(sizeof(TW) == 2 && !dot ? static_cast<size_t>(K) * NR : 0);
        std::vector<uint16_t> paired(dot ? static_cast<size_t>(K + 1) * NR : 0);
        for (int64_t item = lo; item < hi; ++item) {
            const ExpertWork::Chunk& c = work.chunk(item);
            const int p = work.panel(item);
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

// ---------------------------------------------------------------------------------------------------------
// The grouped GEMM on quantized experts (qgemm.h's formats, FMT): the same rows and work items as grouped_gemm,
// W_e packed by pack_quantized (every expert's panels one after another), biases fp32 [E, N] (or null). All rows
// are quantized once (each row as qgemm quantizes it), then one parallel region covers every (expert, chunk,
// panel) item of the experts that have rows, where the per-expert product needs a region (and its barriers)
// per expert. A row's result is qgemm's on its expert's segment bit for bit: each row's integer block sums and
// their fp32 steps do not depend on the rows beside it, and a chunk's rows are tiled as qgemm tiles them.
template <int FMT>
void grouped_qgemm(const float* x, int64_t ldx, const int32_t* offsets, int E, int K, const uint8_t* packed, int N,
                   const float* bias, float* y, int64_t ldy) {
    const int panels = (N + NR - 1) / NR;
    const int nb = K / QBLOCK;
    const int64_t panel_bytes = static_cast<int64_t>(nb) * QFormat<FMT>::kRecord;
    const int64_t expert_stride = static_cast<int64_t>(panels) * panel_bytes;
    const ExpertWork work(offsets, E, panels);
    if (work.empty()) return;
    const int M = offsets[E];
    QuantizedRows rows_q(M, K);
    if (rows_q.serial()) rows_q.quantize(x, ldx, 0, M);
#pragma omp parallel if (work.cost() > 64 * kPanelCost)
    {
        if (!rows_q.serial()) rows_q.quantize_shared(x, ldx);
        int64_t lo, hi;
        work.share(omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
        alignas(64) float c[kQRows * NR];
        for (int64_t item = lo; item < hi; ++item) {
            const ExpertWork::Chunk& ch = work.chunk(item);
            const int p = work.panel(item);
            const int n0 = p * NR, nv = N - n0 < NR ? N - n0 : NR;
            const uint8_t* w = packed + ch.expert * expert_stride + p * panel_bytes;
            const float* b = bias ? bias + static_cast<int64_t>(ch.expert) * N : nullptr;
            for (int m0 = ch.m_start; m0 < ch.m_end; m0 += kQRows) {
                const int rows = ch.m_end - m0 < kQRows ? ch.m_end - m0 : kQRows;
                const int64_t at = static_cast<int64_t>(m0);
                qdot_rows<FMT>(rows, rows_q.q + at * K, K, rows_q.d + at * nb, rows_q.s + at * nb, nb, w, nb, c);
                store_tile(c, rows, nv, b, n0, y + static_cast<int64_t>(m0) * ldy, ldy, false);
            }
        }
    }
}

}  // namespace motet
