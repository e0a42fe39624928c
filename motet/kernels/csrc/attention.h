// Paged attention (kernels/paged_attention.py's layout and meaning).
#pragma once

#include "common.h"

namespace motet {

// ---------------------------------------------------------------------------------------------------------
// Paged attention: each sequence's new tokens attend causally to its paged context (GQA), one work item per
// (sequence, query token, kv head), online softmax over key tiles, K/V read in the cache's dtype. Options (the
// torch reference's, motet/kernels/paged_attention_cpu.py): `window` > 0, a query at position p sees keys
// p - window + 1 .. p only (no block before them is read: a window pool's ring may hold newer positions there);
// `softcap` > 0, the scaled scores squashed to softcap * tanh(s / softcap); `sinks` (fp32 [H], or null), each
// head's logit that joins its softmax's denominator and attends to nothing.

// Head h's key and value rows (kp, vp) of the n positions from j0 (rows of kv_row values, heads of D).
template <typename TC>
inline void kv_rows(const TC* kc, const TC* vc, const int32_t* table, int BS, int64_t kv_row, int h, int D, int64_t j0,
                    int n, const TC** kp, const TC** vp) {
    for (int j = 0; j < n; ++j) {
        const int64_t at = cache_slot(table, BS, j0 + j) * kv_row + static_cast<int64_t>(h) * D;
        kp[j] = kc + at;
        vp[j] = vc + at;
    }
}

constexpr int kTile = 32;
constexpr int kMaxGroup = 16;
constexpr int kMaxHeadDim = 256;

// (attention_bf16.h's `attention` runs this, or the bf16 dot-product kernel where the tier and shapes allow)
template <typename TQ, typename TC>
void attention_fma(const TQ* q, int64_t q_st, int64_t q_sh, const TC* kc, const TC* vc, const int32_t* tables,
               int64_t table_stride, const int32_t* qsl, const int32_t* seq_lens, int num_seqs, TQ* out,
               int64_t out_st, int H, int KVH, int D, int BS, float scale, int window = 0, float softcap = 0.0f,
               const float* sinks = nullptr) {
    const int G = H / KVH;
    const int64_t T = qsl[num_seqs];
    const int64_t items = T * KVH;
    // token -> its sequence (a binary search per item would do too; this is T ints)
    std::vector<int32_t> seq_of(static_cast<size_t>(T));
    for (int b = 0; b < num_seqs; ++b)
        for (int32_t t = qsl[b]; t < qsl[b + 1]; ++t) seq_of[t] = b;
    const int64_t kv_row = static_cast<int64_t>(KVH) * D;  // elements per cache position

#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
        const int64_t t = item / KVH;
        const int h = static_cast<int>(item % KVH);
        const int b = seq_of[t];
        const int64_t q_len = qsl[b + 1] - qsl[b];
        const int64_t n_keys = seq_lens[b] - q_len + (t - qsl[b]) + 1;  // causal: keys 0..position
        const int64_t first = window > 0 && n_keys > window ? n_keys - window : 0;  // and none before the window
        const int32_t* table = tables + b * table_stride;

        alignas(32) float qv[kMaxGroup][kMaxHeadDim];
        alignas(32) float acc[kMaxGroup][kMaxHeadDim];
        alignas(32) float s[kMaxGroup][kTile];
        float m[kMaxGroup], l[kMaxGroup];
        for (int g = 0; g < G; ++g) {
            const TQ* qp = q + t * q_st + static_cast<int64_t>(h * G + g) * q_sh;
#pragma omp simd
            for (int d = 0; d < D; ++d) qv[g][d] = load(qp, d) * scale;
#pragma omp simd
            for (int d = 0; d < D; ++d) acc[g][d] = 0.0f;
            // a sink is one more logit in the denominator: the running max starts there, with weight 1
            m[g] = sinks ? sinks[h * G + g] : -1e30f;
            l[g] = sinks ? 1.0f : 0.0f;
        }
        for (int64_t j0 = first; j0 < n_keys; j0 += kTile) {
            const int n = static_cast<int>(n_keys - j0 < kTile ? n_keys - j0 : kTile);
            const TC* kp[kTile];
            const TC* vp[kTile];
            kv_rows(kc, vc, table, BS, kv_row, h, D, j0, n, kp, vp);
            int j = 0;
#ifdef __AVX2__
            // eight keys at a time where they sit in consecutive rows of the cache: the first and the last 7 rows
            // apart says so where they span at most two blocks (BS >= 8); smaller blocks are checked row by row
            const auto rows8 = [&](int j) {
                if (kp[j + 7] - kp[j] != 7 * kv_row) return false;
                for (int r = 1; BS < 8 && r < 7; ++r)
                    if (kp[j + r] - kp[j] != r * kv_row) return false;
                return true;
            };
            for (; j + 8 <= n && rows8(j); j += 8)
                for (int g = 0; g < G; ++g) _mm256_storeu_ps(&s[g][j], dots8(qv[g], kp[j], kv_row, D));
#endif
            for (; j < n; ++j) {
                alignas(32) float kf[kMaxHeadDim];
                to_f32(kp[j], kf, D);
                for (int g = 0; g < G; ++g) {
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (int d = 0; d < D; ++d) dot += qv[g][d] * kf[d];
                    s[g][j] = dot;
                }
            }
            if (softcap > 0.0f)
                for (int g = 0; g < G; ++g)
                    for (int jj = 0; jj < n; ++jj) s[g][jj] = softcap * std::tanh(s[g][jj] / softcap);
            for (int g = 0; g < G; ++g) {
                float mx = m[g];
                for (int jj = 0; jj < n; ++jj) mx = s[g][jj] > mx ? s[g][jj] : mx;
                const float correction = exp_nonpos(m[g] - mx);
                exp_shifted(s[g], n, mx);
                float sum = 0.0f;
                for (int jj = 0; jj < n; ++jj) sum += s[g][jj];
                l[g] = l[g] * correction + sum;
                m[g] = mx;
#pragma omp simd
                for (int d = 0; d < D; ++d) acc[g][d] *= correction;
            }
            for (j = 0; j < n; ++j) {
                alignas(32) float vf[kMaxHeadDim];
                to_f32(vp[j], vf, D);
                for (int g = 0; g < G; ++g) {
                    const float p = s[g][j];
#pragma omp simd
                    for (int d = 0; d < D; ++d) acc[g][d] += p * vf[d];
                }
            }
        }
        for (int g = 0; g < G; ++g) {
            TQ* op = out + t * out_st + static_cast<int64_t>(h * G + g) * D;
            const float inv = 1.0f / l[g];
            for (int d = 0; d < D; ++d) store(op, d, acc[g][d] * inv);
        }
    }
}

}  // namespace motet
