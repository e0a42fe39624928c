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

// Rows [n0, n1) of the weight W [N, K] that `packed` holds (gemm's panels; n0 a multiple of NR), as a dense
// fp32 [n1 - n0, K] in `out` (bf16 converted exactly): the operand of the input's gradient, g @ W, made a few
// rows at a time from the panels the forward reads (a training job's frozen base: motet/training/shared_base.py).
// Each 8 k x 16 columns block of a panel is transposed in registers.
#ifdef __AVX2__
inline void transpose8(__m256 r[8]) {
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 s0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
    const __m256 s1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
    const __m256 s2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
    const __m256 s3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
    const __m256 s4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0));
    const __m256 s5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
    const __m256 s6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0));
    const __m256 s7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
    r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
    r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
    r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
    r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
    r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
    r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
    r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
    r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}
#endif

template <typename TW>
void unpack_rows(const TW* packed, int K, int n0, int n1, float* out) {
    const int p0 = n0 / NR, p1 = (n1 + NR - 1) / NR;
#pragma omp parallel for schedule(static) if (p1 - p0 > 1)
    for (int p = p0; p < p1; ++p) {
        const TW* w = packed + static_cast<int64_t>(p) * K * NR;
        const int rows = n1 - p * NR < NR ? n1 - p * NR : NR;
        float* o = out + static_cast<int64_t>(p * NR - n0) * K;
        int k = 0;
#ifdef __AVX2__
        if (rows == NR)
            for (; k + 8 <= K; k += 8) {
                __m256 lo[8], hi[8];
                for (int i = 0; i < 8; ++i) load16(w + static_cast<int64_t>(k + i) * NR, lo[i], hi[i]);
                transpose8(lo);
                transpose8(hi);
                for (int j = 0; j < 8; ++j) {
                    _mm256_storeu_ps(o + static_cast<int64_t>(j) * K + k, lo[j]);
                    _mm256_storeu_ps(o + static_cast<int64_t>(j + 8) * K + k, hi[j]);
                }
            }
#endif
        for (; k < K; ++k)
            for (int j = 0; j < rows; ++j) o[static_cast<int64_t>(j) * K + k] = load(w + static_cast<int64_t>(k) * NR, j);
    }
}

}  // namespace motet
