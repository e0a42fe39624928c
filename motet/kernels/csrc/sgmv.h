// SGMV over the adapters' pool: each token adds its own LoRA adapter's delta (kernels/sgmv.py's meaning and
// layout, motet/lora/pool.py's packing).
#pragma once

#include <algorithm>

#include "common.h"

namespace motet {

// q/k/v, o, gate/up, down, then a latent attention's q_a, q_b, kv_a, kv_b (motet/lora/pool.py's DECODER_GROUPS)
constexpr int kLoraGroups = 8;
enum LoraIndex { kLoraQKV = 0, kLoraO, kLoraGateUp, kLoraDown };

// The pool: weights in one buffer of the model's dtype; descriptors [slots, desc_ld] int64: the adapter's rank,
// then per group (element offset of layer 0's piece or -1, layer stride, mask of the group's modules it
// targets). A piece: the targeted modules' A stacked [k r, a_ld] (row i r + j: the i-th targeted module's rank
// j), then each targeted module's BT = (B scale)^T [r, bt_ld[m]].
struct LoraPool {
    const void* data;
    const int64_t* desc;
    int64_t desc_ld;
    int32_t a_ld[kLoraGroups];
    int32_t bt_ld[kLoraGroups][3];
};

// y[t, its columns of module m] += BT_m^T h_m for `rows` BT rows of `n` values: eight columns at a time, each
// loaded once and updated by every rank (h: the module's r values of the shrink).
template <typename TW>
inline void expand_row(const float* h, const TW* bt, int64_t ld, int r, int n, float* y) {
    int o = 0;
#ifdef __AVX2__
    for (; o + 8 <= n; o += 8) {
        __m256 acc = _mm256_loadu_ps(y + o);
        for (int j = 0; j < r; ++j) acc = _mm256_fmadd_ps(_mm256_set1_ps(h[j]), load8(bt + j * ld + o), acc);
        _mm256_storeu_ps(y + o, acc);
    }
#endif
    for (; o < n; ++o) {
        float acc = y[o];
        for (int j = 0; j < r; ++j) acc += h[j] * load(bt + j * ld, o);
        y[o] = acc;
    }
}

// One module group of one layer: n modules read x [T, n_in] and write adjacent columns of y, sizes[m] each.
// For each token whose segment has an adapter targeting the group: h = A x (one pass over the targeted
// modules' rows), then each targeted module's columns += BT_m^T h_m. Tokens are split over the threads in
// contiguous runs (a segment's tokens share their adapter's piece, which stays in cache); small steps run on
// the calling thread: a parallel region costs more than they do.
template <typename TW>
void sgmv_pool(const float* x, int64_t ldx, float* y, int64_t ldy, const LoraPool& P, int g, int layer,
               const int32_t* seg_starts, const int32_t* seg_slots, int num_segs, int n_in, const int* sizes,
               int n) {
    const TW* W = static_cast<const TW*>(P.data);
    const int64_t T = seg_starts[num_segs];
    const int full = (1 << n) - 1;
    int64_t work = 0;
    int width = 0;  // the widest shrink: k r
    for (int i = 0; i < num_segs; ++i) {
        if (seg_slots[i] < 0) continue;
        const int64_t* row = P.desc + static_cast<int64_t>(seg_slots[i]) * P.desc_ld;
        if (row[1 + 3 * g] < 0) continue;
        const int kr = __builtin_popcount(static_cast<int>(row[3 + 3 * g]) & full) * static_cast<int>(row[0]);
        width = std::max(width, kr);
        work += (seg_starts[i + 1] - seg_starts[i]) * kr * (n_in + 64);
    }
    if (work == 0) return;
    int col[3] = {0, 0, 0};
    for (int m = 1; m < n; ++m) col[m] = col[m - 1] + sizes[m - 1];
    std::vector<float> hbuf(static_cast<size_t>(T) * width);
#pragma omp parallel for schedule(static) if (work >= (1 << 17))
    for (int64_t t = 0; t < T; ++t) {
        const int i = static_cast<int>(std::upper_bound(seg_starts, seg_starts + num_segs + 1, t) - seg_starts) - 1;
        if (seg_slots[i] < 0) continue;
        const int64_t* row = P.desc + static_cast<int64_t>(seg_slots[i]) * P.desc_ld;
        const int64_t offset = row[1 + 3 * g];
        if (offset < 0) continue;
        const int r = static_cast<int>(row[0]), mask = static_cast<int>(row[3 + 3 * g]) & full;
        const int k = __builtin_popcount(mask);
        const TW* piece = W + offset + layer * row[2 + 3 * g];
        float* h = hbuf.data() + t * width;
        dots(x + t * ldx, piece, P.a_ld[g], k * r, n_in, h);
        const TW* bt = piece + static_cast<int64_t>(k) * r * P.a_ld[g];
        for (int m = 0, pos = 0; m < n; ++m) {
            if (!(mask >> m & 1)) continue;
            expand_row(h + pos * r, bt, P.bt_ld[g][m], r, sizes[m], y + t * ldy + col[m]);
            bt += static_cast<int64_t>(r) * P.bt_ld[g][m];
            ++pos;
        }
    }
}

}  // namespace motet
