// The GEMM on packed weight panels and its microkernel.
#pragma once

#include "common.h"

namespace motet {

// ---------------------------------------------------------------------------------------------------------
// GEMM on packed weights: y [M, N] (=, or +=) x [M, K] @ W^T (+ bias), x and y fp32, W fp32 or bf16.
//
// W [N, K] is packed once into panels of 16 output columns, k-major: P[p][k][0..16) = W[16p + j][k]
// (zero rows past N), so a panel streams from memory as one contiguous run, for one row as for many. The
// microkernel keeps a 6 x 16 tile of y in 12 AVX2 registers and adds, for each k, one broadcast x value
// times the panel's 16 weights (bf16 converted exactly on load). At one row this is a GEMV bound by the
// weight bytes; at many rows each panel is reused from L1/L2 for every 6-row tile.

constexpr int NR = 16;
constexpr int MR = 6;
constexpr int kMChunk = 96;  // rows per pass over the panels (x tile stays in L2)

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// The avx512bf16 tier: bf16 weights go through gemm_bf16.h's dot products instead.
#define MOTET_BF16_DOT 1
inline void gemm_dot(const float* x, int64_t ldx, int M, int K, const uint16_t* packed, int N, const uint16_t* bias,
                     float* y, int64_t ldy, bool accumulate);
#endif

#ifdef __AVX2__
inline void load16(const float* p, __m256& lo, __m256& hi) {
    lo = _mm256_loadu_ps(p);
    hi = _mm256_loadu_ps(p + 8);
}
inline void load16(const uint16_t* p, __m256& lo, __m256& hi) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(v)), 16));
    hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(v, 1)), 16));
}

template <int R, typename TW>
inline void micro(const float* x, int64_t ldx, const TW* w, int K, float* c) {
    // Few rows leave too few independent FMA chains to hide the FMA latency: split k over U partial sums.
    // No software prefetch: the panel is one contiguous stream, which the hardware prefetchers follow
    // faster alone (measured: 30 GB/s without, 25-27 with prefetches 1-16 KiB ahead).
    constexpr int U = R == 1 ? 4 : R == 2 ? 2 : 1;
    __m256 acc[U][R][2];
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u)
#pragma GCC unroll 6
        for (int r = 0; r < R; ++r) acc[u][r][0] = acc[u][r][1] = _mm256_setzero_ps();
    int k = 0;
    for (; k + U <= K; k += U) {
#pragma GCC unroll 4
        for (int u = 0; u < U; ++u) {
            const int kk = k + u;
            __m256 b0, b1;
            load16(w + static_cast<int64_t>(kk) * NR, b0, b1);
#pragma GCC unroll 6
            for (int r = 0; r < R; ++r) {
                const __m256 a = _mm256_broadcast_ss(x + r * ldx + kk);
                acc[u][r][0] = _mm256_fmadd_ps(a, b0, acc[u][r][0]);
                acc[u][r][1] = _mm256_fmadd_ps(a, b1, acc[u][r][1]);
            }
        }
    }
    for (; k < K; ++k) {
        __m256 b0, b1;
        load16(w + static_cast<int64_t>(k) * NR, b0, b1);
#pragma GCC unroll 6
        for (int r = 0; r < R; ++r) {
            const __m256 a = _mm256_broadcast_ss(x + r * ldx + k);
            acc[0][r][0] = _mm256_fmadd_ps(a, b0, acc[0][r][0]);
            acc[0][r][1] = _mm256_fmadd_ps(a, b1, acc[0][r][1]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
        __m256 lo = acc[0][r][0], hi = acc[0][r][1];
#pragma GCC unroll 8
        for (int u = 1; u < U; ++u) {
            lo = _mm256_add_ps(lo, acc[u][r][0]);
            hi = _mm256_add_ps(hi, acc[u][r][1]);
        }
        _mm256_storeu_ps(c + r * NR, lo);
        _mm256_storeu_ps(c + r * NR + 8, hi);
    }
}
#else
template <int R, typename TW>
inline void micro(const float* x, int64_t ldx, const TW* w, int K, float* c) {
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < NR; ++j) c[r * NR + j] = 0.0f;
    for (int k = 0; k < K; ++k)
        for (int r = 0; r < R; ++r) {
            const float a = x[r * ldx + k];
            for (int j = 0; j < NR; ++j) c[r * NR + j] += a * load(w + static_cast<int64_t>(k) * NR, j);
        }
}
#endif

template <typename TW>
inline void micro_rows(int rows, const float* x, int64_t ldx, const TW* w, int K, float* c) {
    with_rows<6>(rows, [&](auto r) { micro<decltype(r)::value>(x, ldx, w, K, c); });
}

// A tile c [rows][NR] into y's rows (from y, columns n0 .. n0 + nv), plus the bias; = or +=.
template <typename TB>
inline void store_tile(const float* c, int rows, int nv, const TB* bias, int n0, float* y, int64_t ldy,
                       bool accumulate) {
    for (int r = 0; r < rows; ++r) {
        float* yr = y + static_cast<int64_t>(r) * ldy + n0;
        for (int j = 0; j < nv; ++j) {
            const float v = c[r * NR + j] + (bias ? load(bias, n0 + j) : 0.0f);
            yr[j] = accumulate ? yr[j] + v : v;
        }
    }
}

// Rows [m_start, m_end) of y (=, or +=) x @ W^T over one packed panel `w` (output columns n0 .. n0 + nv),
// plus the bias. A bf16 panel read by several row tiles is converted once, into `convert` (an fp32 copy kept
// in L1/L2: K * NR floats).
template <typename TW, typename TB>
inline void panel_product(const float* x, int64_t ldx, int m_start, int m_end, int K, const TW* w, int n0, int nv,
                          const TB* bias, float* y, int64_t ldy, bool accumulate, float* convert) {
    alignas(32) float c[MR * NR];
    const bool conv = sizeof(TW) == 2 && m_end - m_start > MR;
    if (conv) to_f32(w, convert, static_cast<int64_t>(K) * NR);
    for (int m0 = m_start; m0 < m_end; m0 += MR) {
        const int rows = m_end - m0 < MR ? m_end - m0 : MR;
        if (conv)
            micro_rows(rows, x + static_cast<int64_t>(m0) * ldx, ldx, convert, K, c);
        else
            micro_rows(rows, x + static_cast<int64_t>(m0) * ldx, ldx, w, K, c);
        store_tile(c, rows, nv, bias, n0, y + static_cast<int64_t>(m0) * ldy, ldy, accumulate);
    }
}

template <typename TW>
void gemm(const float* x, int64_t ldx, int M, int K, const TW* packed, int N, const TW* bias, float* y,
          int64_t ldy, bool accumulate) {
#ifdef MOTET_BF16_DOT
    if constexpr (std::is_same_v<TW, uint16_t>) return gemm_dot(x, ldx, M, K, packed, N, bias, y, ldy, accumulate);
#endif
    const int panels = (N + NR - 1) / NR;
    // Rows in chunks (their x tile stays in L2), each chunk's panels split evenly over the threads: each
    // thread streams one contiguous run of panels.
    for (int m_start = 0; m_start < M; m_start += kMChunk) {
        const int m_end = m_start + kMChunk < M ? m_start + kMChunk : M;
#pragma omp parallel if (panels > 1)  // one panel (a router, a gate): no other thread would have work
        {
            std::vector<float> convert(sizeof(TW) == 2 && m_end - m_start > MR ? static_cast<size_t>(K) * NR : 0);
#pragma omp for schedule(static)
            for (int p = 0; p < panels; ++p) {
                const int n0 = p * NR;
                const int nv = N - n0 < NR ? N - n0 : NR;
                panel_product(x, ldx, m_start, m_end, K, packed + static_cast<int64_t>(p) * K * NR, n0, nv, bias,
                              y, ldy, accumulate, convert.data());
            }
        }
    }
}

}  // namespace motet
