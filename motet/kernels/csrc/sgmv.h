// SGMV: each token adds its own LoRA adapter's delta (kernels/sgmv.py's meaning and layout).
#pragma once

#include "common.h"

namespace motet {

// ---------------------------------------------------------------------------------------------------------
// SGMV over a module group: n modules (q/k/v, gate/up, or one alone) read x and write adjacent columns of y,
// sizes[m] each. For each segment i with slot s = seg_slots[i] (-1: rows untouched), each module m whose bit
// is set in `active`: y[rows, m's columns] += (x @ A_m[s]^T) @ B_m[s]^T * scales[m * s_m + s].
// A [S, >= n r, n_in] rank-major (row j n + m: module m's rank j; row stride a_sr), B [S, sum sizes, >= r]
// (row stride b_so); only the first r ranks of each module are read.

// Segment-major: a segment's tokens share their adapter, so each block of A or B rows is read once per
// segment and reused from L1 for its tokens. One shrink for the whole group (its n r rows), then each active
// module's expand. Small products run on the calling thread: a parallel region costs more than they do.
template <typename TX, typename TW>
void sgmv(const TX* x, int64_t x_st, TX* y, int64_t y_st, const TW* A, int64_t a_ss, int64_t a_sr,
          const TW* B, int64_t b_ss, int64_t b_so, const float* scales, int64_t s_m, const int32_t* seg_starts,
          const int32_t* seg_slots, int num_segs, int n_in, const int* sizes, int n, int active, int r) {
    const int64_t T = seg_starts[num_segs];
    int64_t adapted = 0;
    for (int i = 0; i < num_segs; ++i)
        if (seg_slots[i] >= 0) adapted += seg_starts[i + 1] - seg_starts[i];
    if (adapted == 0 || r == 0 || active == 0) return;
    // the expand's work: (module, first column of y, columns) per chunk of up to 64 of an active module's outputs
    constexpr int kChunk = 64;
    struct Chunk {
        int m, o0, n;
    };
    std::vector<Chunk> chunks;
    int n_out = 0;
    for (int m = 0; m < n; ++m) {
        if (active >> m & 1)
            for (int o = 0; o < sizes[m]; o += kChunk)
                chunks.push_back({m, n_out + o, sizes[m] - o < kChunk ? sizes[m] - o : kChunk});
        n_out += sizes[m];
    }
    const int rows = n * r;
    const bool parallel = adapted * rows * (n_in > n_out ? n_in : n_out) >= (1 << 17);
    std::vector<float> h(static_cast<size_t>(T) * rows);  // per token, module-major: h[t][m][j]
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
    // shrink: h[t] = A_slot x[t] over the group's rows; one item per (segment, block of 8 rows)
    const int rblocks = (rows + 7) / 8;
#pragma omp parallel for schedule(static) if (parallel)
    for (int item = 0; item < num_segs * rblocks; ++item) {
        const int i = item / rblocks, k0 = (item % rblocks) * 8;
        const int32_t slot = seg_slots[i];
        if (slot < 0) continue;
        const int cnt = rows - k0 < 8 ? rows - k0 : 8;
        for (int32_t t = seg_starts[i]; t < seg_starts[i + 1]; ++t) {
            alignas(32) float d[8];
            dots(xs + t * xs_st, A + slot * a_ss + k0 * a_sr, a_sr, cnt, n_in, d);
            float* ht = h.data() + static_cast<int64_t>(t) * rows;
            for (int q = 0; q < cnt; ++q) ht[(k0 + q) % n * r + (k0 + q) / n] = d[q];
        }
    }
    // expand: y[t, o] += scale_m * B_slot[o] . h[t][m]; one item per (segment, chunk)
    const int num_chunks = static_cast<int>(chunks.size());
#pragma omp parallel for schedule(static) if (parallel)
    for (int item = 0; item < num_segs * num_chunks; ++item) {
        const int i = item / num_chunks;
        const Chunk ch = chunks[item % num_chunks];
        const int32_t slot = seg_slots[i];
        if (slot < 0) continue;
        const float sc = scales[ch.m * s_m + slot];
        for (int32_t t = seg_starts[i]; t < seg_starts[i + 1]; ++t) {
            alignas(32) float d[kChunk];
            dots(h.data() + static_cast<int64_t>(t) * rows + ch.m * r, B + slot * b_ss + ch.o0 * b_so, b_so, ch.n,
                 r, d);
            TX* yr = y + t * y_st + ch.o0;
            for (int o = 0; o < ch.n; ++o) store(yr, o, load(yr, o) + d[o] * sc);
        }
    }
}

}  // namespace motet
