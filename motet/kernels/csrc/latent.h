// DeepSeek's multi-head latent attention over the paged latent cache (engine/worker/latent_attention.py defines it),
// every row in the absorbed form: kv_b_proj's key half folded into each head's query, every head attending over the
// cached rows themselves (one shared key [c_kv | k_pe] and value c_kv a position), the value half applied after.
#pragma once

#include <algorithm>

#include "common.h"
#include "sgmv.h"

namespace motet {

constexpr int kMaxLatentRope = 256;  // the rotated key's width at most (DeepSeek's: 64)

// A head's rotated slice (`rope` values) in place, with the angles of its position (cs, sn: rope / 2 each). DeepSeek's
// neighbouring pairs (`interleaved`) are first laid out as halves (evens, then odds), as the eager layer lays them
// out: q's and k's rotated parts permuted alike (their products unchanged), the cache holding the permuted key.
inline void rotate_latent(float* x, int rope, bool interleaved, const float* cs, const float* sn) {
    const int half = rope / 2;
    if (interleaved) {
        float tmp[kMaxLatentRope];
        for (int i = 0; i < half; ++i) {
            tmp[i] = x[2 * i];
            tmp[half + i] = x[2 * i + 1];
        }
        std::memcpy(x, tmp, sizeof(float) * rope);
    }
#pragma omp simd
    for (int i = 0; i < half; ++i) {
        const float a = x[i], b = x[i + half];
        x[i] = a * cs[i] - b * sn[i];
        x[i + half] = b * cs[i] + a * sn[i];
    }
}

// Each row's H heads attend causally over its sequence's cached latent rows: queries q [T, H, rank + rope] (q_nope
// W_UK, then the rotated q_pe), keys the rows [c_kv | k_pe], values their c_kv, out [T, H, rank]. Work items: (row,
// run of heads), as many as keep the threads busy; each converts a tile of key rows to fp32 once for its heads, with
// an online softmax over the tiles (attention.h's).
template <typename TC>
void latent_paged_attention(const float* q, const TC* cache, const int32_t* tables, int64_t table_stride,
                            const int32_t* qsl, const int32_t* seq_lens, int num_seqs, int T, int H, int rank,
                            int rope, int BS, float scale, float* out) {
    const int Dk = rank + rope;
    std::fill(out + static_cast<int64_t>(qsl[num_seqs]) * H * rank, out + static_cast<int64_t>(T) * H * rank, 0.0f);
    T = qsl[num_seqs];  // (rows past the sequences' attend to nothing: zeros)
    std::vector<int32_t> seq_of(static_cast<size_t>(T));
    for (int b = 0; b < num_seqs; ++b)
        for (int32_t t = qsl[b]; t < qsl[b + 1]; ++t) seq_of[t] = b;
    const int threads = omp_get_max_threads();
    const int runs = std::max(1, std::min(H, (threads + T - 1) / std::max(T, 1)));
    const int G = (H + runs - 1) / runs;  // heads an item
    const int per_row = (H + G - 1) / G;
    const int64_t items = static_cast<int64_t>(T) * per_row;
#pragma omp parallel if (items > 1)
    {
        std::vector<float> qv(static_cast<size_t>(G) * Dk), acc(static_cast<size_t>(G) * rank);
        std::vector<float> kt(static_cast<size_t>(kTile) * Dk), s(static_cast<size_t>(G) * kTile), m(G), l(G);
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; ++item) {
            const int t = static_cast<int>(item / per_row);
            const int h0 = static_cast<int>(item % per_row) * G, g_n = std::min(G, H - h0);
            const int b = seq_of[t];
            const int64_t n_keys = seq_lens[b] - (qsl[b + 1] - qsl[b]) + (t - qsl[b]) + 1;  // causal
            const int32_t* table = tables + b * table_stride;
            for (int g = 0; g < g_n; ++g) {
                const float* qp = q + (static_cast<int64_t>(t) * H + h0 + g) * Dk;
                for (int d = 0; d < Dk; ++d) qv[g * Dk + d] = qp[d] * scale;
                std::fill(acc.begin() + g * rank, acc.begin() + (g + 1) * rank, 0.0f);
                m[g] = -1e30f;
                l[g] = 0.0f;
            }
            for (int64_t j0 = 0; j0 < n_keys; j0 += kTile) {
                const int n = static_cast<int>(std::min<int64_t>(kTile, n_keys - j0));
                for (int j = 0; j < n; ++j) {
                    to_f32(cache + cache_slot(table, BS, j0 + j) * Dk, kt.data() + static_cast<int64_t>(j) * Dk, Dk);
                }
                for (int g = 0; g < g_n; ++g) {
                    float* sg = s.data() + g * kTile;
                    dots(qv.data() + g * Dk, kt.data(), Dk, n, Dk, sg);
                    float mx = m[g];
                    for (int j = 0; j < n; ++j) mx = sg[j] > mx ? sg[j] : mx;
                    const float correction = exp_nonpos(m[g] - mx);
                    exp_shifted(sg, n, mx);
                    float sum = 0.0f;
                    for (int j = 0; j < n; ++j) sum += sg[j];
                    l[g] = l[g] * correction + sum;
                    m[g] = mx;
                    float* a = acc.data() + g * rank;
#pragma omp simd
                    for (int d = 0; d < rank; ++d) a[d] *= correction;
                    for (int j = 0; j < n; ++j) {
                        const float p = sg[j];
                        const float* vr = kt.data() + static_cast<int64_t>(j) * Dk;
#pragma omp simd
                        for (int d = 0; d < rank; ++d) a[d] += p * vr[d];
                    }
                }
            }
            for (int g = 0; g < g_n; ++g) {
                float* o = out + (static_cast<int64_t>(t) * H + h0 + g) * rank;
                const float inv = 1.0f / l[g];
                for (int d = 0; d < rank; ++d) o[d] = acc[g * rank + d] * inv;
            }
        }
    }
}

// kv_b_proj's adapter deltas (delta W = (B scale) A, the pool's piece: A [r, a_ld] then BT [r, bt_ld]) in the
// absorbed form, for each row whose segment's adapter targets kv_b_proj (group `g`), per head h:
// - `values` false, the key half folded into the latent query: q_lat[h] += (q_nope[h] BT_K[h]^T) A, BT_K[h] BT's
//   columns h (nope + v) .. + nope;
// - `values` true, the value half after the attention: out[h] += (o_lat[h] A^T) BT_V[h], BT_V[h] BT's next v columns.
// The same product as the expanded form's c_kv (W + delta W)^T, associated the other way.
template <typename TW>
void latent_lora(bool values, const float* x, int64_t ldx, int64_t x_head, float* y, int64_t ldy, int64_t y_head,
                 int T, int H, int nope, int rank, int V, const LoraPool& P, int g, int layer,
                 const int32_t* seg_starts, const int32_t* seg_slots, int num_segs) {
    const TW* W = static_cast<const TW*>(P.data);
    const int64_t a_ld = P.a_ld[g], bt_ld = P.bt_ld[g][0];
    std::vector<float> u;
    for (int i = 0; i < num_segs; ++i) {
        if (seg_slots[i] < 0) continue;
        const int64_t* row = P.desc + static_cast<int64_t>(seg_slots[i]) * P.desc_ld;
        const int64_t offset = row[1 + 3 * g];
        if (offset < 0 || !(row[3 + 3 * g] & 1)) continue;
        const int r = static_cast<int>(row[0]);
        const TW* a = W + offset + layer * row[2 + 3 * g];
        const TW* bt = a + static_cast<int64_t>(r) * a_ld;
        u.resize(r);
        for (int t = seg_starts[i]; t < seg_starts[i + 1] && t < T; ++t) {
            for (int h = 0; h < H; ++h) {
                const float* xh = x + t * ldx + h * x_head;
                float* yh = y + t * ldy + h * y_head;
                const int64_t col = static_cast<int64_t>(h) * (nope + V);
                if (!values) {  // u = q_nope[h] BT_K[h]^T, then q_lat[h] += u A
                    for (int j = 0; j < r; ++j) {
                        float d = 0.0f;
                        for (int e = 0; e < nope; ++e) d += xh[e] * load(bt + j * bt_ld + col, e);
                        u[j] = d;
                    }
                    for (int j = 0; j < r; ++j)
                        for (int e = 0; e < rank; ++e) yh[e] += u[j] * load(a + j * a_ld, e);
                } else {  // u = A o_lat[h], then out[h] += u BT_V[h]
                    dots(xh, a, a_ld, r, rank, u.data());
                    expand_row(u.data(), bt + col + nope, bt_ld, r, V, yh);
                }
            }
        }
    }
}

}  // namespace motet
