// The GEMM on packed bf16 weights through AVX512_BF16 dot products (built in the avx512bf16 tier only).
#pragma once

#include "gemm.h"

#ifdef MOTET_BF16_DOT

namespace motet {

// ---------------------------------------------------------------------------------------------------------
// y [M, N] (=, or +=) x [M, K] @ W^T (+ bias), W bf16 in gemm.h's panels (16 columns, k-major), x and y fp32.
//
// `vdpbf16ps` multiplies 16 pairs of bf16 and adds both products to 16 fp32 sums: per instruction two k of a
// panel's 16 columns, four times the work of an AVX2 FMA on widened weights (gemm.h), and no widening. So x
// is rounded to bf16 once per call (round to nearest even, as torch's .bfloat16()), every product of two bf16
// is exact in fp32 and the sums stay fp32: the result is that of fp32 arithmetic on x rounded to bf16 (the
// precision torch's own bf16 linear gives, which rounds x too).
//
// The instruction wants each 32-bit lane to hold one column's two k: a panel's rows k and k + 1 (32
// contiguous bf16) are interleaved by one `vpermw`. A panel read by one row tile (decode) is interleaved as it
// streams; one read by several is interleaved once into a per-thread copy (K * 16 bf16, kept in L1/L2). So the
// packing is the same in every tier. Odd K: the last pair's second k is a zero (x's padding is zero too).

constexpr int MR_DOT = 12;  // rows per tile: 12 independent sums hide the dot product's latency
constexpr int MR_WIDE = 6;  // rows per two-panel tile (x two panels x kSplitK: 24 sums)
constexpr int kSplitK = 2;  // partial sums per output, in every kernel here: one order of additions for all tiles

// Rows of x rounded to bf16, each ld (>= K, even) wide, zero past K.
inline void round_rows_bf16(const float* x, int64_t ldx, int m_begin, int m_end, int K, uint16_t* xb, int64_t ld) {
    for (int m = m_begin; m < m_end; ++m) {
        const float* xr = x + static_cast<int64_t>(m) * ldx;
        uint16_t* br = xb + static_cast<int64_t>(m) * ld;
        for (int k = 0; k < ld; k += 32) {
            const int left = K - k;
            const __mmask16 lo = left >= 16 ? 0xFFFF : left > 0 ? (1u << left) - 1 : 0;
            const __mmask16 hi = left >= 32 ? 0xFFFF : left > 16 ? (1u << (left - 16)) - 1 : 0;
            const __m512bh v =
                _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, xr + k + 16), _mm512_maskz_loadu_ps(lo, xr + k));
            const __mmask32 keep = ld - k >= 32 ? 0xFFFFFFFFu : (1u << (ld - k)) - 1;
            _mm512_mask_storeu_epi16(br + k, keep, (__m512i)v);  // (C casts between vector types: GCC and clang)
        }
    }
}

// A panel's k pair `kp` (rows 2kp and 2kp + 1, the second zero past K) as 16 lanes of (k, k + 1).
inline __m512i panel_pair(const uint16_t* w, int kp, int K) {
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,  //
                                         23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const uint16_t* p = w + static_cast<int64_t>(kp) * 2 * NR;
    const __m512i v = 2 * kp + 1 < K ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16(0xFFFFu, p);
    return _mm512_permutexvar_epi16(idx, v);
}

// c [R][16] = R rows of bf16 x (ldb apart) . the panel's 16 columns over K2 pairs of k; the panel raw
// (gemm.h's layout, interleaved here) or `PAIRED` (already interleaved: K2 vectors).
template <int R, bool PAIRED>
inline void dot_micro(const uint16_t* xb, int64_t ldb, const uint16_t* w, int K, float* c) {
    // k split over two partial sums (even and odd pairs, added at the end) for every R, so that few rows have
    // enough independent sums and a row's result is the same whatever tile it falls in: a step's output for a
    // request does not depend on what else the batch holds (or on how its prompt was chunked).
    constexpr int U = kSplitK;
    const int K2 = (K + 1) / 2;
    __m512 acc[U][R];
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u)
#pragma GCC unroll 12
        for (int r = 0; r < R; ++r) acc[u][r] = _mm512_setzero_ps();
    const auto step = [&](int u, int kp) __attribute__((always_inline)) {
        const __m512i b = PAIRED ? _mm512_loadu_si512(w + static_cast<int64_t>(kp) * 2 * NR) : panel_pair(w, kp, K);
#pragma GCC unroll 12
        for (int r = 0; r < R; ++r) {
            int32_t pair;
            std::memcpy(&pair, xb + r * ldb + 2 * kp, 4);
            acc[u][r] = _mm512_dpbf16_ps(acc[u][r], (__m512bh)_mm512_set1_epi32(pair), (__m512bh)b);
        }
    };
    int kp = 0;
    for (; kp + U <= K2; kp += U)
#pragma GCC unroll 4
        for (int u = 0; u < U; ++u) step(u, kp + u);
    for (; kp < K2; ++kp) step(0, kp);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
        __m512 s = acc[0][r];
#pragma GCC unroll 4
        for (int u = 1; u < U; ++u) s = _mm512_add_ps(s, acc[u][r]);
        _mm512_storeu_ps(c + r * NR, s);
    }
}

template <bool PAIRED>
inline void dot_rows(int rows, const uint16_t* xb, int64_t ldb, const uint16_t* w, int K, float* c) {
    with_rows<12>(rows, [&](auto r) { dot_micro<decltype(r)::value, PAIRED>(xb, ldb, w, K, c); });
}

// Rows [m_start, m_end) of y over one raw panel `w` (columns n0 .. n0 + nv) from x already rounded (xb, ldb
// apart); `paired`: this thread's copy for an interleaved panel (K rounded up to even, times 16 bf16).
template <typename TB>
inline void dot_panel_product(const uint16_t* xb, int64_t ldb, int m_start, int m_end, int K, const uint16_t* w,
                              int n0, int nv, const TB* bias, float* y, int64_t ldy, bool accumulate,
                              uint16_t* paired) {
    alignas(64) float c[MR_DOT * NR];
    const bool pre = m_end - m_start > MR_DOT;
    if (pre)
        for (int kp = 0; kp < (K + 1) / 2; ++kp)
            _mm512_storeu_si512(paired + static_cast<int64_t>(kp) * 2 * NR, panel_pair(w, kp, K));
    for (int m0 = m_start; m0 < m_end; m0 += MR_DOT) {
        const int rows = m_end - m0 < MR_DOT ? m_end - m0 : MR_DOT;
        const uint16_t* xr = xb + static_cast<int64_t>(m0) * ldb;
        if (pre) dot_rows<true>(rows, xr, ldb, paired, K, c);
        else dot_rows<false>(rows, xr, ldb, w, K, c);
        store_tile(c, rows, nv, bias, n0, y + static_cast<int64_t>(m0) * ldy, ldy, accumulate);
    }
}

// Two panels at once where rows are many: c0, c1 [R][16] = R rows of bf16 x . two interleaved panels (`w2`: per k
// pair, the first panel's 32 bf16 then the second's). Each broadcast x pair feeds two products, so a tile of 6
// rows x 32 columns loads 8 values per 12 products, where one panel's tile of 12 rows loads 13 per 12: the loads,
// not the products, bound a one-panel tile on a core that issues two products a cycle.
template <int R>
inline void dot_micro_wide(const uint16_t* xb, int64_t ldb, const uint16_t* w2, int K, float* c0, float* c1) {
    constexpr int U = kSplitK;  // as dot_micro's: the same additions, so a row's result is the same in either
    const int K2 = (K + 1) / 2;
    __m512 acc[U][R][2];
#pragma GCC unroll 2
    for (int u = 0; u < U; ++u)
#pragma GCC unroll 6
        for (int r = 0; r < R; ++r) acc[u][r][0] = acc[u][r][1] = _mm512_setzero_ps();
    const auto step = [&](int u, int kp) __attribute__((always_inline)) {
        const __m512i b0 = _mm512_loadu_si512(w2 + static_cast<int64_t>(kp) * 4 * NR);
        const __m512i b1 = _mm512_loadu_si512(w2 + static_cast<int64_t>(kp) * 4 * NR + 2 * NR);
#pragma GCC unroll 12
        for (int r = 0; r < R; ++r) {
            int32_t pair;
            std::memcpy(&pair, xb + r * ldb + 2 * kp, 4);
            const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
            acc[u][r][0] = _mm512_dpbf16_ps(acc[u][r][0], a, (__m512bh)b0);
            acc[u][r][1] = _mm512_dpbf16_ps(acc[u][r][1], a, (__m512bh)b1);
        }
    };
    int kp = 0;
    for (; kp + U <= K2; kp += U)
#pragma GCC unroll 2
        for (int u = 0; u < U; ++u) step(u, kp + u);
    for (; kp < K2; ++kp) step(0, kp);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
        __m512 s0 = acc[0][r][0], s1 = acc[0][r][1];
        if constexpr (U == 2) {
            s0 = _mm512_add_ps(s0, acc[1][r][0]);
            s1 = _mm512_add_ps(s1, acc[1][r][1]);
        }
        _mm512_storeu_ps(c0 + r * NR, s0);
        _mm512_storeu_ps(c1 + r * NR, s1);
    }
}

inline void dot_rows_wide(int rows, const uint16_t* xb, int64_t ldb, const uint16_t* w2, int K, float* c0, float* c1) {
    with_rows<6>(rows, [&](auto r) { dot_micro_wide<decltype(r)::value>(xb, ldb, w2, K, c0, c1); });
}

// Rows [m_start, m_end) of y over two adjacent raw panels (w, and w's next: columns n0 .. n0 + 16 + nv1),
// interleaved together into this thread's `paired` copy (2 x K rounded up to even, times 16 bf16).
template <typename TB>
inline void dot_panels_wide(const uint16_t* xb, int64_t ldb, int m_start, int m_end, int K, const uint16_t* w, int n0,
                            int nv1, const TB* bias, float* y, int64_t ldy, bool accumulate, uint16_t* paired) {
    alignas(64) float c0[MR_WIDE * NR], c1[MR_WIDE * NR];
    const uint16_t* w1 = w + static_cast<int64_t>(K) * NR;
    for (int kp = 0; kp < (K + 1) / 2; ++kp) {
        _mm512_storeu_si512(paired + static_cast<int64_t>(kp) * 4 * NR, panel_pair(w, kp, K));
        _mm512_storeu_si512(paired + static_cast<int64_t>(kp) * 4 * NR + 2 * NR, panel_pair(w1, kp, K));
    }
    for (int m0 = m_start; m0 < m_end; m0 += MR_WIDE) {
        const int rows = m_end - m0 < MR_WIDE ? m_end - m0 : MR_WIDE;
        dot_rows_wide(rows, xb + static_cast<int64_t>(m0) * ldb, ldb, paired, K, c0, c1);
        float* yr = y + static_cast<int64_t>(m0) * ldy;
        store_tile(c0, rows, NR, bias, n0, yr, ldy, accumulate);
        store_tile(c1, rows, nv1, bias, n0 + NR, yr, ldy, accumulate);
    }
}

// Room for M rows of x rounded to bf16 ([M, ld], ld: K rounded up to even), kept by the calling thread.
inline uint16_t* bf16_rows_buffer(int M, int K, int64_t* ld) {
    thread_local std::vector<uint16_t> buf;
    *ld = (K + 1) / 2 * 2;
    buf.resize(static_cast<size_t>(M) * *ld);
    return buf.data();
}

// What runs on a panel's rows [m_start, m_end) of y (columns n0 .. n0 + nv) right after the product wrote them,
// while they are in this thread's cache (the step's LoRA expand, sgmv.h); none by default.
struct NoEpilogue {
    void operator()(int, int, int, int) const {}
};

// y [M, N] (=, or +=) xb @ W^T (+ bias) from x already rounded to bf16 (xb: M rows, ldb apart, K rounded up to
// even and zero there), then the epilogue on each panel's rows.
template <typename Epilogue>
inline void gemm_dot_rounded(const uint16_t* xb, int64_t ldb, int M, int K, const uint16_t* packed, int N,
                             const uint16_t* bias, float* y, int64_t ldy, bool accumulate, const Epilogue& epilogue) {
    const int panels = (N + NR - 1) / NR;
#pragma omp parallel if (panels > 1)
    {
        std::vector<uint16_t> paired(M > MR_DOT ? static_cast<size_t>(ldb) * NR * 2 : 0);
        for (int m_start = 0; m_start < M; m_start += kMChunk) {
            const int m_end = m_start + kMChunk < M ? m_start + kMChunk : M;
            // several row tiles: two panels a task (dot_panels_wide), a last odd one alone
            const bool wide = m_end - m_start > MR_DOT;
            const int tasks = wide ? (panels + 1) / 2 : panels;
            // no barrier between chunks: each chunk writes its own rows
#pragma omp for schedule(static) nowait
            for (int i = 0; i < tasks; ++i) {
                const int p = wide ? 2 * i : i, n0 = p * NR;
                const uint16_t* w = packed + static_cast<int64_t>(p) * K * NR;
                if (wide && p + 1 < panels) {
                    const int nv1 = N - n0 - NR < NR ? N - n0 - NR : NR;
                    dot_panels_wide(xb, ldb, m_start, m_end, K, w, n0, nv1, bias, y, ldy, accumulate, paired.data());
                    epilogue(m_start, m_end, n0, NR);
                    epilogue(m_start, m_end, n0 + NR, nv1);
                } else {
                    const int nv = N - n0 < NR ? N - n0 : NR;
                    dot_panel_product(xb, ldb, m_start, m_end, K, w, n0, nv, bias, y, ldy, accumulate, paired.data());
                    epilogue(m_start, m_end, n0, nv);
                }
            }
        }
    }
}

// x's rows rounded to bf16 into the calling thread's buffer (`bf16_rows_buffer`); returns it. Rounded by the
// calling thread (a small share of a product's time, at any M): splitting them over the team would cost a
// barrier, a whole time slice when another process holds a core.
inline uint16_t* rounded_rows(const float* x, int64_t ldx, int M, int K, int64_t* ldb) {
    uint16_t* xb = bf16_rows_buffer(M, K, ldb);
    round_rows_bf16(x, ldx, 0, M, K, xb, *ldb);
    return xb;
}

inline void gemm_dot(const float* x, int64_t ldx, int M, int K, const uint16_t* packed, int N, const uint16_t* bias,
                     float* y, int64_t ldy, bool accumulate) {
    int64_t ldb;
    const uint16_t* xb = rounded_rows(x, ldx, M, K, &ldb);
    gemm_dot_rounded(xb, ldb, M, K, packed, N, bias, y, ldy, accumulate, NoEpilogue{});
}

}  // namespace motet
#endif
