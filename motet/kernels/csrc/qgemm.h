// The GEMM on block-quantized weights (motet/kernels/quant.py's int8 and int4 formats), unpacked in registers.
#pragma once

#include "gemm.h"

namespace motet {

// ---------------------------------------------------------------------------------------------------------
// y [M, N] (=, or +=) x [M, K] @ W^T (+ bias), x and y fp32, W quantized in blocks of 32 along K.
//
// W is packed (cpu_native.pack_quantized) into the same panels of 16 output columns as the float GEMM, each
// panel a run of records, one per block of 32 k: the 16 columns' fp16 scales, (int4) their 16 fp16 mins,
// then the values k-major: int8: 32 x 16 bytes; int4: 32 x 8 bytes, byte j holding column j (low nibble)
// and column j + 8 (high nibble). A panel streams as one contiguous run, 544 (int8) or 320 (int4) bytes per
// block against 2048 for bf16.
//
// Up to kQRows rows (decode) the microkernel unpacks each k's 16 values into two fp32 registers (convert,
// times the scale, plus the min) and adds them times each row's x; more rows dequantize each panel once
// into an fp32 copy in L1/L2 and run the float microkernel over it. Accumulation is fp32 throughout.

enum WeightCode { kWeightF32 = 0, kWeightBF16 = 1, kWeightInt8 = 2, kWeightInt4 = 3 };

constexpr int QBLOCK = 32;
constexpr int kQRows = 4;  // rows up to which the values are unpacked per row tile rather than per panel

template <int FMT>
struct QFormat;
template <>
struct QFormat<kWeightInt8> {
    static constexpr int kHeader = NR * 2;  // fp16 scales
    static constexpr int kRecord = kHeader + QBLOCK * NR;
};
template <>
struct QFormat<kWeightInt4> {
    static constexpr int kHeader = NR * 2 * 2;  // fp16 scales, fp16 mins
    static constexpr int kRecord = kHeader + QBLOCK * NR / 2;
};

// IEEE half -> float, exactly (normals, subnormals, infinities, NaN).
inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    if (exp == 0x1fu) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        u = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
        u = sign;
    } else {  // subnormal: normalize
        exp = 113;
        while ((man & 0x400u) == 0) {
            man <<= 1;
            --exp;
        }
        u = sign | (exp << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// The 16 fp32 values of row kk (0..31) of a block record, portable.
template <int FMT>
inline void unpack16(const uint8_t* rec, int kk, float* out) {
    const uint16_t* hdr = reinterpret_cast<const uint16_t*>(rec);
    const uint8_t* q = rec + QFormat<FMT>::kHeader;
    for (int j = 0; j < NR; ++j) {
        float v;
        if constexpr (FMT == kWeightInt8) {
            v = static_cast<float>(static_cast<int8_t>(q[kk * NR + j])) * f16_to_f32(hdr[j]);
        } else {
            const uint8_t b = q[kk * (NR / 2) + (j % (NR / 2))];
            const int nib = j < NR / 2 ? (b & 0xF) : (b >> 4);
            v = static_cast<float>(nib) * f16_to_f32(hdr[j]) + f16_to_f32(hdr[NR + j]);
        }
        out[j] = v;
    }
}

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define MOTET_QGEMM_SIMD 1

struct QBlockRegs {  // one block's 16 scales (and mins) as fp32
    __m256 s0, s1, m0, m1;
};

template <int FMT>
inline QBlockRegs qblock_regs(const uint8_t* rec) {
    QBlockRegs r;
    r.s0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec)));
    r.s1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 16)));
    if constexpr (FMT == kWeightInt4) {
        r.m0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 32)));
        r.m1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 48)));
    } else {
        r.m0 = r.m1 = _mm256_setzero_ps();
    }
    return r;
}

// Row kk of a block's 16 values, dequantized into two registers (columns 0-7, 8-15).
template <int FMT>
inline void qload16(const uint8_t* q, int kk, const QBlockRegs& b, __m256& w0, __m256& w1) {
    if constexpr (FMT == kWeightInt8) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + kk * NR));
        w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), b.s0);
        w1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))), b.s1);
    } else {
        const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + kk * (NR / 2)));
        const __m128i mask = _mm_set1_epi8(0x0F);
        const __m128i lo = _mm_and_si128(v, mask);
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
        w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), b.s0, b.m0);
        w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), b.s1, b.m1);
    }
}

// A panel [K / 32 records] dequantized into the float GEMM's panel layout [K][16] fp32.
template <int FMT>
inline void dequant_panel(const uint8_t* panel, int K, float* out) {
    for (int b = 0; b < K / QBLOCK; ++b) {
        const uint8_t* rec = panel + static_cast<int64_t>(b) * QFormat<FMT>::kRecord;
        const QBlockRegs regs = qblock_regs<FMT>(rec);
        const uint8_t* q = rec + QFormat<FMT>::kHeader;
        float* o = out + static_cast<int64_t>(b) * QBLOCK * NR;
        for (int kk = 0; kk < QBLOCK; ++kk) {
            __m256 w0, w1;
            qload16<FMT>(q, kk, regs, w0, w1);
            _mm256_storeu_ps(o + kk * NR, w0);
            _mm256_storeu_ps(o + kk * NR + 8, w1);
        }
    }
}

// c [R][16] = x [R rows, K] @ the panel's 16 columns, R <= kQRows.
template <int R, int FMT>
inline void qmicro(const float* x, int64_t ldx, const uint8_t* panel, int K, float* c) {
    // One row leaves too few independent FMA chains: split each block's k over two partial sums.
    constexpr int U = R == 1 ? 2 : 1;
    __m256 acc[U][R][2];
#pragma GCC unroll 2
    for (int u = 0; u < U; ++u)
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) acc[u][r][0] = acc[u][r][1] = _mm256_setzero_ps();
    for (int b = 0; b < K / QBLOCK; ++b) {
        const uint8_t* rec = panel + static_cast<int64_t>(b) * QFormat<FMT>::kRecord;
        const QBlockRegs regs = qblock_regs<FMT>(rec);
        const uint8_t* q = rec + QFormat<FMT>::kHeader;
        const float* xb = x + b * QBLOCK;
        for (int kk = 0; kk < QBLOCK; kk += U) {
#pragma GCC unroll 2
            for (int u = 0; u < U; ++u) {
                __m256 w0, w1;
                qload16<FMT>(q, kk + u, regs, w0, w1);
#pragma GCC unroll 4
                for (int r = 0; r < R; ++r) {
                    const __m256 a = _mm256_broadcast_ss(xb + r * ldx + kk + u);
                    acc[u][r][0] = _mm256_fmadd_ps(a, w0, acc[u][r][0]);
                    acc[u][r][1] = _mm256_fmadd_ps(a, w1, acc[u][r][1]);
                }
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
        __m256 lo = acc[0][r][0], hi = acc[0][r][1];
        if constexpr (U == 2) {
            lo = _mm256_add_ps(lo, acc[U - 1][r][0]);
            hi = _mm256_add_ps(hi, acc[U - 1][r][1]);
        }
        _mm256_storeu_ps(c + r * NR, lo);
        _mm256_storeu_ps(c + r * NR + 8, hi);
    }
}
#else
template <int FMT>
inline void dequant_panel(const uint8_t* panel, int K, float* out) {
    for (int b = 0; b < K / QBLOCK; ++b) {
        const uint8_t* rec = panel + static_cast<int64_t>(b) * QFormat<FMT>::kRecord;
        for (int kk = 0; kk < QBLOCK; ++kk) unpack16<FMT>(rec, kk, out + (static_cast<int64_t>(b) * QBLOCK + kk) * NR);
    }
}

template <int R, int FMT>
inline void qmicro(const float* x, int64_t ldx, const uint8_t* panel, int K, float* c) {
    for (int i = 0; i < R * NR; ++i) c[i] = 0.0f;
    float w[NR];
    for (int b = 0; b < K / QBLOCK; ++b) {
        const uint8_t* rec = panel + static_cast<int64_t>(b) * QFormat<FMT>::kRecord;
        for (int kk = 0; kk < QBLOCK; ++kk) {
            unpack16<FMT>(rec, kk, w);
            const int k = b * QBLOCK + kk;
            for (int r = 0; r < R; ++r) {
                const float a = x[r * ldx + k];
                for (int j = 0; j < NR; ++j) c[r * NR + j] += a * w[j];
            }
        }
    }
}
#endif

template <int FMT>
inline void qmicro_rows(int rows, const float* x, int64_t ldx, const uint8_t* panel, int K, float* c) {
    switch (rows) {
        case 4: qmicro<4, FMT>(x, ldx, panel, K, c); break;
        case 3: qmicro<3, FMT>(x, ldx, panel, K, c); break;
        case 2: qmicro<2, FMT>(x, ldx, panel, K, c); break;
        default: qmicro<1, FMT>(x, ldx, panel, K, c); break;
    }
}

// K must be a multiple of QBLOCK; bias (TB: fp32 or bf16) may be null.
template <int FMT, typename TB>
void qgemm(const float* x, int64_t ldx, int M, int K, const uint8_t* packed, int N, const TB* bias, float* y,
           int64_t ldy, bool accumulate) {
    const int panels = (N + NR - 1) / NR;
    const int64_t panel_bytes = static_cast<int64_t>(K / QBLOCK) * QFormat<FMT>::kRecord;
    for (int m_start = 0; m_start < M; m_start += kMChunk) {
        const int m_end = m_start + kMChunk < M ? m_start + kMChunk : M;
        const bool dequant = m_end - m_start > kQRows;
#pragma omp parallel
        {
            std::vector<float> panel(dequant ? static_cast<size_t>(K) * NR : 0);
            alignas(32) float c[MR * NR];
#pragma omp for schedule(static)
            for (int p = 0; p < panels; ++p) {
                const int n0 = p * NR;
                const int nv = N - n0 < NR ? N - n0 : NR;
                const uint8_t* w = packed + p * panel_bytes;
                if (dequant) dequant_panel<FMT>(w, K, panel.data());
                const int tile = dequant ? MR : kQRows;
                for (int m0 = m_start; m0 < m_end; m0 += tile) {
                    const int rows = m_end - m0 < tile ? m_end - m0 : tile;
                    const float* xm = x + static_cast<int64_t>(m0) * ldx;
                    if (dequant)
                        micro_rows(rows, xm, ldx, panel.data(), K, c);
                    else
                        qmicro_rows<FMT>(rows, xm, ldx, w, K, c);
                    store_tile(c, rows, nv, bias, n0, y + static_cast<int64_t>(m0) * ldy, ldy, accumulate);
                }
            }
        }
    }
}

}  // namespace motet
