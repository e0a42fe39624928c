// SGMV: each token adds its own LoRA adapter's delta (kernels/sgmv.py's meaning).
#pragma once

#include "common.h"

namespace motet {

// ---------------------------------------------------------------------------------------------------------
// SGMV: y[rows of segment i] += (x @ A[slot_i]^T) @ B[slot_i]^T * scale[slot_i]; slot -1 rows untouched.
// A [S, >=r, in] (row stride a_sr), B [S, out, >=r] (row stride b_so); only the first r ranks are read.

// Segment-major: a segment's tokens share their adapter, so each block of A or B rows is read once per
// segment and reused from L1 for its tokens. Small products run on the calling thread: a parallel region
// costs more than they do.
template <typename TX, typename TW>
void sgmv(const TX* x, int64_t x_st, TX* y, int64_t y_st, const TW* A, int64_t a_ss, int64_t a_sr,
          const TW* B, int64_t b_ss, int64_t b_so, const float* scales, const int32_t* seg_starts,
          const int32_t* seg_slots, int num_segs, int n_in, int n_out, int r) {
    const int64_t T = seg_starts[num_segs];
    int64_t adapted = 0;
    for (int i = 0; i < num_segs; ++i)
        if (seg_slots[i] >= 0) adapted += seg_starts[i + 1] - seg_starts[i];
    if (adapted == 0 || r == 0) return;
    const bool parallel = adapted * r * (n_in > n_out ? n_in : n_out) >= (1 << 17);
    std::vector<float> h(static_cast<size_t>(T) * r);
    // x in fp32: itself, or a converted copy
    std::vector<float> xf;
    const float* xs = reinterpret_cast<const float*>(x);
    int64_t xs_st = x_st;
    if constexpr (!std::is_same_v<TX, float>) {
        xf.resize(static_cast<size_t>(T) * n_in);
        for (int64_t t = 0; t < T; ++t) to_f32(x + t * x_st, xf.data() + t * n_in, n_in);
        xs = xf.data();
        xs_st = n_in;
    }
    // shrink: h[t] = A_slot x[t]; one item per (segment, block of 8 rank rows)
    const int rblocks = (r + 7) / 8;
#pragma omp parallel for schedule(static) if (parallel)
    for (int item = 0; item < num_segs * rblocks; ++item) {
        const int i = item / rblocks, k0 = (item % rblocks) * 8;
        const int32_t slot = seg_slots[i];
        if (slot < 0) continue;
        const int rows = r - k0 < 8 ? r - k0 : 8;
        for (int32_t t = seg_starts[i]; t < seg_starts[i + 1]; ++t)
            dots(xs + t * xs_st, A + slot * a_ss + k0 * a_sr, a_sr, rows, n_in, h.data() + static_cast<int64_t>(t) * r + k0);
    }
    // expand: y[t, o] += scale * B_slot[o] . h[t]; one item per (segment, chunk of 64 outputs)
    constexpr int kChunk = 64;
    const int chunks = (n_out + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) if (parallel)
    for (int item = 0; item < num_segs * chunks; ++item) {
        const int i = item / chunks, o0 = (item % chunks) * kChunk;
        const int32_t slot = seg_slots[i];
        if (slot < 0) continue;
        const int n = n_out - o0 < kChunk ? n_out - o0 : kChunk;
        const float sc = scales[slot];
        for (int32_t t = seg_starts[i]; t < seg_starts[i + 1]; ++t) {
            alignas(32) float d[kChunk];
            dots(h.data() + static_cast<int64_t>(t) * r, B + slot * b_ss + o0 * b_so, b_so, n, r, d);
            TX* yr = y + t * y_st + o0;
            for (int o = 0; o < n; ++o) store(yr, o, load(yr, o) + d[o] * sc);
        }
    }
}

}  // namespace motet
