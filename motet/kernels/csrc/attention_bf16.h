// Paged attention over a bf16 KV cache through AVX512_BF16 dot products (built in the avx512bf16 tier only).
#pragma once

#include <algorithm>

#include "attention.h"
#include "gemm_bf16.h"

#ifdef MOTET_BF16_DOT

namespace motet {

// ---------------------------------------------------------------------------------------------------------
// attention.h's meaning (causal, GQA, window, softcap, sinks), tiled as flash attention is: a work item is one
// sequence's kv head and a block of its query tokens, whose rows (each token's G query heads, at most 16 rows)
// go over the context in tiles of 16 keys together, so each key and value is read once per block instead of once
// per token and head. Both products are `vdpbf16ps`: the scores from q (times the scale) rounded to bf16 against
// the keys as the cache holds them, the output from the probabilities rounded to bf16 against the values; sums,
// the online softmax and the output stay fp32 (what a bf16 flash attention computes).
//
// Scores: lanes are the tile's 16 keys; a key row's (d, d + 1) pairs are 32-bit words, so the tile is transposed
// once (16 keys x D/2 words -> D/2 vectors of 16 keys) and each row's q pair is broadcast against them. Output:
// lanes are 16 of the D values; two keys' rows of values are interleaved by pair (gemm_bf16.h's panel_pair) and
// each row's pair of probabilities is broadcast against them.

constexpr int kKeyTile = 16;
constexpr int kMaxRows = 16;  // rows of a work item: its tokens x G

// The 16 x 16 32-bit words of v transposed in place (v[i] lane j -> v[j] lane i).
inline void transpose16(__m512i v[16]) {
    __m512i t[16];
#pragma GCC unroll 8
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
    }
#pragma GCC unroll 4
    for (int i = 0; i < 16; i += 4) {
        v[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        v[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        v[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        v[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    // v[4q + s] holds rows 4q..4q+3's word s (and s + 4, 8, 12 per 128-bit lane group); gather the lane groups
#pragma GCC unroll 4
    for (int s = 0; s < 4; ++s) {
        const __m512i a = v[s], b = v[4 + s], c = v[8 + s], d = v[12 + s];
        const __m512i ab_lo = _mm512_shuffle_i32x4(a, b, 0x44), ab_hi = _mm512_shuffle_i32x4(a, b, 0xEE);
        const __m512i cd_lo = _mm512_shuffle_i32x4(c, d, 0x44), cd_hi = _mm512_shuffle_i32x4(c, d, 0xEE);
        t[s] = _mm512_shuffle_i32x4(ab_lo, cd_lo, 0x88);
        t[4 + s] = _mm512_shuffle_i32x4(ab_lo, cd_lo, 0xDD);
        t[8 + s] = _mm512_shuffle_i32x4(ab_hi, cd_hi, 0x88);
        t[12 + s] = _mm512_shuffle_i32x4(ab_hi, cd_hi, 0xDD);
    }
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) v[i] = t[i];
}

inline __m512 exp16_nonpos(__m512 x) {
    const __m256 lo = exp8_nonpos(_mm512_castps512_ps256(x));
    const __m256 hi = exp8_nonpos(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
}

// One work item: rows [R] = tokens t0 .. t0 + QB - 1 of sequence b, x G heads of kv head h.
inline void attention_block(const float* q, int64_t q_st, int64_t q_sh, const uint16_t* kc, const uint16_t* vc,
                            const int32_t* table, int64_t seq_len, int64_t q_len, int64_t i0, int QB, float* out,
                            int64_t out_st, int h, int G, int D, int64_t kv_row, int BS, float scale, int window,
                            float softcap, const float* sinks) {
    const int R = QB * G, D2 = D / 2;
    alignas(64) uint16_t qb[kMaxRows][kMaxHeadDim];
    alignas(64) float o[kMaxRows][kMaxHeadDim];
    alignas(64) uint16_t pb[kMaxRows][kKeyTile];
    float m[kMaxRows], l[kMaxRows];
    int64_t n_keys[kMaxRows], first[kMaxRows];
    for (int r = 0; r < R; ++r) {
        const int i = r / G, g = r % G;
        const float* qp = q + (i0 + i) * q_st + static_cast<int64_t>(h * G + g) * q_sh;
        for (int d = 0; d < D; ++d) qb[r][d] = f32_to_bf16(qp[d] * scale);
        for (int d = 0; d < D; ++d) o[r][d] = 0.0f;
        m[r] = sinks ? sinks[h * G + g] : -1e30f;  // a sink: one more logit in the denominator, weight 1
        l[r] = sinks ? 1.0f : 0.0f;
        n_keys[r] = seq_len - q_len + (i0 + i) + 1;  // causal: keys 0 .. position
        first[r] = window > 0 && n_keys[r] > window ? n_keys[r] - window : 0;  // and none before the window
    }
    // tiles at multiples of 16 keys whatever the block's first row: a row's sums are the same in any block (its
    // masked keys add exact zeros), so a token's output does not depend on how its prompt was chunked
    const int64_t start = first[0] / kKeyTile * kKeyTile, end = n_keys[R - 1];
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i pair_idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,  //
                                              23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int64_t j0 = start; j0 < end; j0 += kKeyTile) {
        const int n = static_cast<int>(end - j0 < kKeyTile ? end - j0 : kKeyTile);
        const uint16_t* kp[kKeyTile];
        const uint16_t* vp[kKeyTile];
        kv_rows(kc, vc, table, BS, kv_row, h, D, j0, n, kp, vp);
        // scores [R][16 keys]
        __m512 s[kMaxRows];
        for (int r = 0; r < R; ++r) s[r] = _mm512_setzero_ps();
        for (int w0 = 0; w0 < D2; w0 += 16) {  // 16 of each key's D/2 words at a time, transposed
            __m512i kt[16];
            for (int j = 0; j < 16; ++j)
                kt[j] = j < n ? _mm512_loadu_si512(kp[j] + 2 * w0) : _mm512_setzero_si512();
            transpose16(kt);  // kt[w]: the 16 keys' word w0 + w
            for (int r = 0; r < R; ++r) {
                const uint16_t* qr = qb[r] + 2 * w0;
                __m512 acc = s[r];
#pragma GCC unroll 16
                for (int w = 0; w < 16; ++w) {
                    int32_t pair;
                    std::memcpy(&pair, qr + 2 * w, 4);
                    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(pair), (__m512bh)kt[w]);
                }
                s[r] = acc;
            }
        }
        // online softmax per row over its keys in the tile (the others masked to probability 0)
        const __m512i pos = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(j0)), lane);
        for (int r = 0; r < R; ++r) {
            const __mmask16 valid =
                _mm512_cmplt_epi32_mask(pos, _mm512_set1_epi32(static_cast<int>(n_keys[r]))) &
                _mm512_cmpge_epi32_mask(pos, _mm512_set1_epi32(static_cast<int>(first[r])));
            __m512 sr = s[r];
            if (softcap > 0.0f) {
                alignas(64) float tmp[16];
                _mm512_store_ps(tmp, sr);
                for (int j = 0; j < 16; ++j) tmp[j] = softcap * std::tanh(tmp[j] / softcap);
                sr = _mm512_load_ps(tmp);
            }
            const float mx = std::max(m[r], _mm512_mask_reduce_max_ps(valid, sr));
            const float correction = exp_nonpos(m[r] - mx);
            const __m512 p = _mm512_maskz_mov_ps(valid, exp16_nonpos(_mm512_sub_ps(sr, _mm512_set1_ps(mx))));
            l[r] = l[r] * correction + _mm512_reduce_add_ps(p);
            m[r] = mx;
            _mm256_store_si256(reinterpret_cast<__m256i*>(pb[r]), (__m256i)_mm512_cvtneps_pbh(p));
            if (correction != 1.0f) {
                const __m512 c = _mm512_set1_ps(correction);
                for (int d = 0; d < D; d += 16) _mm512_store_ps(o[r] + d, _mm512_mul_ps(_mm512_load_ps(o[r] + d), c));
            }
        }
        // o[r] += p[r] . values, 16 of D at a time, the tile's keys by pairs
        for (int d0 = 0; d0 < D; d0 += 16) {
            __m512i vpair[kKeyTile / 2];
            for (int jp = 0; jp < kKeyTile / 2; ++jp) {
                const int j = 2 * jp;
                const __m256i lo = j < n ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vp[j] + d0))
                                         : _mm256_setzero_si256();
                const __m256i hi = j + 1 < n ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vp[j + 1] + d0))
                                             : _mm256_setzero_si256();
                vpair[jp] = _mm512_permutexvar_epi16(pair_idx, _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
            }
            for (int r = 0; r < R; ++r) {
                __m512 acc = _mm512_load_ps(o[r] + d0);
#pragma GCC unroll 8
                for (int jp = 0; jp < kKeyTile / 2; ++jp) {
                    int32_t pair;
                    std::memcpy(&pair, pb[r] + 2 * jp, 4);
                    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(pair), (__m512bh)vpair[jp]);
                }
                _mm512_store_ps(o[r] + d0, acc);
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        const int i = r / G, g = r % G;
        float* op = out + (i0 + i) * out_st + static_cast<int64_t>(h * G + g) * D;
        const float inv = 1.0f / l[r];
        for (int d = 0; d < D; ++d) op[d] = o[r][d] * inv;
    }
}

// Whether attention_dot serves these shapes: D a multiple of 32 (whole 16-word rows of a key), G <= 16.
inline bool attention_dot_fits(int H, int KVH, int D) {
    return D % 32 == 0 && D <= kMaxHeadDim && H % KVH == 0 && H / KVH <= kMaxRows;
}

inline void attention_dot(const float* q, int64_t q_st, int64_t q_sh, const uint16_t* kc, const uint16_t* vc,
                          const int32_t* tables, int64_t table_stride, const int32_t* qsl, const int32_t* seq_lens,
                          int num_seqs, float* out, int64_t out_st, int H, int KVH, int D, int BS, float scale,
                          int window, float softcap, const float* sinks) {
    const int G = H / KVH, QB = kMaxRows / G;
    // the items: each sequence's query blocks x kv heads (first item of each sequence: a prefix sum)
    std::vector<int64_t> first_item(static_cast<size_t>(num_seqs) + 1, 0);
    for (int b = 0; b < num_seqs; ++b) {
        const int64_t blocks = (qsl[b + 1] - qsl[b] + QB - 1) / QB;
        first_item[b + 1] = first_item[b] + blocks * KVH;
    }
    const int64_t kv_row = static_cast<int64_t>(KVH) * D;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t item = 0; item < first_item[num_seqs]; ++item) {
        const int b = static_cast<int>(std::upper_bound(first_item.begin(), first_item.end(), item) -
                                       first_item.begin()) - 1;
        const int64_t local = item - first_item[b], blk = local / KVH;
        const int h = static_cast<int>(local % KVH);
        const int64_t q_len = qsl[b + 1] - qsl[b], i0 = blk * QB;
        const int qb = static_cast<int>(std::min<int64_t>(QB, q_len - i0));
        attention_block(q + qsl[b] * q_st, q_st, q_sh, kc, vc, tables + b * table_stride, seq_lens[b], q_len, i0, qb,
                        out + qsl[b] * out_st, out_st, h, G, D, kv_row, BS, scale, window, softcap, sinks);
    }
}

}  // namespace motet
#endif

namespace motet {

// Paged attention (attention.h's meaning): the bf16 dot-product kernel for fp32 queries over a bf16 cache where
// the tier has it and the shapes fit, else attention.h's.
template <typename TQ, typename TC>
void attention(const TQ* q, int64_t q_st, int64_t q_sh, const TC* kc, const TC* vc, const int32_t* tables,
               int64_t table_stride, const int32_t* qsl, const int32_t* seq_lens, int num_seqs, TQ* out,
               int64_t out_st, int H, int KVH, int D, int BS, float scale, int window = 0, float softcap = 0.0f,
               const float* sinks = nullptr) {
#ifdef MOTET_BF16_DOT
    if constexpr (std::is_same_v<TQ, float> && std::is_same_v<TC, uint16_t>) {
        if (attention_dot_fits(H, KVH, D))
            return attention_dot(q, q_st, q_sh, kc, vc, tables, table_stride, qsl, seq_lens, num_seqs, out, out_st, H,
                                 KVH, D, BS, scale, window, softcap, sinks);
    }
#endif
    attention_fma(q, q_st, q_sh, kc, vc, tables, table_stride, qsl, seq_lens, num_seqs, out, out_st, H, KVH, D, BS,
                  scale, window, softcap, sinks);
}

}  // namespace motet
