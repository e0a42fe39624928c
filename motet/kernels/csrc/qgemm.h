// The GEMM on block-quantized weights (motet/kernels/quant.py's int8 and int4 formats), in 8-bit integers.
#pragma once

#include "gemm.h"

namespace motet {

// ---------------------------------------------------------------------------------------------------------
// y [M, N] (=, or +=) x [M, K] @ W^T (+ bias), x and y fp32, W quantized in blocks of 32 along K.
//
// As llama.cpp's CPU kernels do, each row of x is first quantized in blocks of 32 too (as Q8_0 blocks:
// d = max|x| / 127, q = round-to-even(x / d), d kept in fp16, and s = d * sum(q)): a block of the product is
// then an integer dot product, exact in int32, times the two scales (plus, for int4, the weight block's min
// times s). One AVX2
// `maddubs` multiplies 32 byte pairs where the fp32 path needs four FMAs and the conversions of 32 values.
// quant.py's `QuantizedWeight.linear` is the same product in torch. Since the integer sums are exact and every
// row adds its blocks in the same order whatever the rows beside it, a row's result does not depend on the
// batch it runs in.
//
// W is packed (cpu_native.pack_quantized) into panels of 16 output columns, each a run of records, one per
// block of 32 k: the 16 columns' fp16 scales, (int4) their 16 fp16 mins, then the values in groups of 4 k
// ("quads"), each column's 4 values adjacent (byte 4c + i: column c, k 4g + i): int8: per quad, columns 0-7
// then 8-15, 32 bytes each (544 bytes a record); int4: per quad 32 bytes, the low nibbles columns 0-7, the
// high ones columns 8-15 (320 bytes a record, against 2048 for bf16). `maddubs` of a quad's 32 bytes with a
// row's 4 x values (broadcast) and `madd` with ones leave column c's 4-term sum in int32 lane c.

enum WeightCode { kWeightF32 = 0, kWeightBF16 = 1, kWeightInt8 = 2, kWeightInt4 = 3, kWeightMxfp4 = 4 };

constexpr int QBLOCK = 32;
constexpr int kQRows = 4;  // rows per tile: each block's values are unpacked once per tile

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
// MXFP4 (OCP microscaling: FP4 E2M1 codes, a block's E8M0 exponent): packed like int4, each code standing for
// twice its FP4 value, an integer (kMxfp4Values), and the columns' scales 2^(e - 128) as fp32 (exact for every
// exponent byte): the codes' products with the int8 activations are exact integer sums, as int8's are.
template <>
struct QFormat<kWeightMxfp4> {
    static constexpr int kHeader = NR * 4;  // fp32 scales
    static constexpr int kRecord = kHeader + QBLOCK * NR / 2;
};
constexpr int8_t kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// Whether a weight code is a quantized one.
inline bool quantized_code(int code) { return code == kWeightInt8 || code == kWeightInt4 || code == kWeightMxfp4; }

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

// float -> the nearest half (ties to even, subnormals included) -> float: an activation block's scale is
// kept as Q8_0 keeps it.
inline float round_to_f16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    const uint32_t sign = (u >> 16) & 0x8000u, mag = u & 0x7fffffffu;
    uint32_t h;
    if (mag > 0x7f800000u) {
        h = 0x7e00u;  // NaN
    } else if (mag >= 0x477ff000u) {
        h = 0x7c00u;  // rounds past 65504: infinity
    } else if (mag < 0x38800000u) {  // a subnormal half: its mantissa is |f| * 2^24, rounded to even
        h = static_cast<uint32_t>(std::nearbyint(std::fabs(f) * 16777216.0f));
    } else {
        h = (mag - 0x38000000u + 0xfffu + ((mag >> 13) & 1u)) >> 13;
    }
    return f16_to_f32(static_cast<uint16_t>(sign | h));
}

// One row's K values as int8 blocks: q [K], d and s [K / 32] (quant.py's `quantize_activations`).
inline void quantize_row(const float* x, int K, int8_t* q, float* d, float* s) {
    for (int b = 0; b < K / QBLOCK; ++b) {
        const float* xb = x + b * QBLOCK;
        int8_t* qb = q + b * QBLOCK;
        float amax = 0.0f;
        for (int i = 0; i < QBLOCK; ++i) amax = std::fmax(amax, std::fabs(xb[i]));
        const float dq = amax / 127.0f, id = dq > 0.0f ? 1.0f / dq : 0.0f;
        int sum = 0;
        for (int i = 0; i < QBLOCK; ++i) {
            const int v = static_cast<int>(std::nearbyint(xb[i] * id));  // the default mode: to nearest even
            qb[i] = static_cast<int8_t>(v);
            sum += v;
        }
        d[b] = round_to_f16(dq);  // stored in fp16 as Q8_0 stores it (q was rounded with the fp32 scale)
        s[b] = d[b] * static_cast<float>(sum);
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define MOTET_QGEMM_SIMD 1
#define MOTET_QGEMM_VNNI 1

// The VNNI tiers (avx512vnni, avx512bf16): `vpdpbusd` multiplies 64 unsigned by signed byte pairs and adds each
// lane's 4 products to its int32 sum: one instruction where AVX2 needs maddubs, madd and an add, and no int16
// intermediate. A quad's 16 columns fill one 512-bit vector (lane c: column c's 4 values). int4 values are
// unsigned already; int8 ones are made so as AVX2's `maddubs` path does: |w| times x with w's sign.
template <int R, int FMT>
inline void qdot(const int8_t* xq, int64_t ldq, const float* xd, const float* xs, int64_t lds,
                 const uint8_t* panel, int nb, float* c) {
    __m512 acc[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < nb; ++b) {
        const uint8_t* rec = panel + static_cast<int64_t>(b) * QFormat<FMT>::kRecord;
        const uint8_t* q = rec + QFormat<FMT>::kHeader;
        __m512i isum[R];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int g = 0; g < QBLOCK / 4; ++g) {
            __m512i w;  // unsigned bytes
            __mmask64 neg = 0;  // int8, MXFP4: the bytes whose weight is negative
            if constexpr (FMT == kWeightInt4 || FMT == kWeightMxfp4) {
                const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * g));
                const __m256i mask = _mm256_set1_epi8(0x0F);
                w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, mask)),
                                       _mm256_and_si256(_mm256_srli_epi16(v, 4), mask), 1);
                if constexpr (FMT == kWeightMxfp4) {  // codes -> their signed values (a table per 128-bit lane)
                    const __m512i values = _mm512_broadcast_i32x4(
                        _mm_loadu_si128(reinterpret_cast<const __m128i*>(kMxfp4Values)));
                    const __m512i sv = _mm512_shuffle_epi8(values, w);
                    neg = _mm512_movepi8_mask(sv);
                    w = _mm512_abs_epi8(sv);
                }
            } else {
                const __m512i v = _mm512_loadu_si512(q + 64 * g);
                neg = _mm512_movepi8_mask(v);
                w = _mm512_abs_epi8(v);
            }
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
                int32_t quad;
                std::memcpy(&quad, xq + r * ldq + b * QBLOCK + 4 * g, 4);
                __m512i a = _mm512_set1_epi32(quad);
                if constexpr (FMT != kWeightInt4) a = _mm512_mask_sub_epi8(a, neg, _mm512_setzero_si512(), a);
                isum[r] = _mm512_dpbusd_epi32(isum[r], w, a);
            }
        }
        const __m512 s = FMT == kWeightMxfp4
                             ? _mm512_loadu_ps(reinterpret_cast<const float*>(rec))
                             : _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec)));
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(s, _mm512_set1_ps(xd[r * lds + b])),
                                     acc[r]);
        if constexpr (FMT == kWeightInt4) {
            const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32)));
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[r * lds + b]), acc[r]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(c + r * NR, acc[r]);
}
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define MOTET_QGEMM_SIMD 1

// c [R][16] = the R rows' quantized x (q: ldq apart; d, s: lds apart) @ the panel's 16 columns, R <= kQRows.
template <int R, int FMT>
inline void qdot(const int8_t* xq, int64_t ldq, const float* xd, const float* xs, int64_t lds,
                 const uint8_t* panel, int nb, float* c) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[R][2];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int b = 0; b < nb; ++b) {
        const uint8_t* rec = panel + static_cast<int64_t>(b) * QFormat<FMT>::kRecord;
        const uint8_t* q = rec + QFormat<FMT>::kHeader;
        __m256i isum[R][2];
        if constexpr (FMT == kWeightInt4) {
            // |sum| of 8 quads of 2 int16 products: 8 * 2 * 15 * 127 = 30480 fits int16
            const __m256i mask = _mm256_set1_epi8(0x0F);
            __m256i s16[R][2];
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r) s16[r][0] = s16[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int g = 0; g < QBLOCK / 4; ++g) {
                const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * g));
                const __m256i w0 = _mm256_and_si256(v, mask);
                const __m256i w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
#pragma GCC unroll 4
                for (int r = 0; r < R; ++r) {
                    int32_t quad;
                    std::memcpy(&quad, xq + r * ldq + b * QBLOCK + 4 * g, 4);
                    const __m256i a = _mm256_set1_epi32(quad);
                    s16[r][0] = _mm256_add_epi16(s16[r][0], _mm256_maddubs_epi16(w0, a));
                    s16[r][1] = _mm256_add_epi16(s16[r][1], _mm256_maddubs_epi16(w1, a));
                }
            }
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r) {
                isum[r][0] = _mm256_madd_epi16(s16[r][0], ones);
                isum[r][1] = _mm256_madd_epi16(s16[r][1], ones);
            }
        } else {
            // products up to 2 * 127 * 128 per int16: widened to int32 after each quad
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r) isum[r][0] = isum[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int g = 0; g < QBLOCK / 4; ++g) {
                __m256i w0, w1;  // signed bytes
                if constexpr (FMT == kWeightMxfp4) {  // codes -> their signed values (a table per 128-bit lane)
                    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * g));
                    const __m256i mask = _mm256_set1_epi8(0x0F);
                    const __m256i values =
                        _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kMxfp4Values)));
                    w0 = _mm256_shuffle_epi8(values, _mm256_and_si256(v, mask));
                    w1 = _mm256_shuffle_epi8(values, _mm256_and_si256(_mm256_srli_epi16(v, 4), mask));
                } else {
                    w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64 * g));
                    w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64 * g + 32));
                }
                const __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);
#pragma GCC unroll 4
                for (int r = 0; r < R; ++r) {
                    int32_t quad;
                    std::memcpy(&quad, xq + r * ldq + b * QBLOCK + 4 * g, 4);
                    const __m256i a = _mm256_set1_epi32(quad);
                    const __m256i p0 = _mm256_maddubs_epi16(a0, _mm256_sign_epi8(a, w0));
                    const __m256i p1 = _mm256_maddubs_epi16(a1, _mm256_sign_epi8(a, w1));
                    isum[r][0] = _mm256_add_epi32(isum[r][0], _mm256_madd_epi16(p0, ones));
                    isum[r][1] = _mm256_add_epi32(isum[r][1], _mm256_madd_epi16(p1, ones));
                }
            }
        }
        __m256 s0, s1;
        if constexpr (FMT == kWeightMxfp4) {
            s0 = _mm256_loadu_ps(reinterpret_cast<const float*>(rec));
            s1 = _mm256_loadu_ps(reinterpret_cast<const float*>(rec) + 8);
        } else {
            s0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec)));
            s1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 16)));
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
            const __m256 dx = _mm256_set1_ps(xd[r * lds + b]);
            acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][0]), _mm256_mul_ps(s0, dx), acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][1]), _mm256_mul_ps(s1, dx), acc[r][1]);
        }
        if constexpr (FMT == kWeightInt4) {
            const __m256 m0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 32)));
            const __m256 m1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 48)));
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r) {
                const __m256 sx = _mm256_set1_ps(xs[r * lds + b]);
                acc[r][0] = _mm256_fmadd_ps(m0, sx, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(m1, sx, acc[r][1]);
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
        _mm256_storeu_ps(c + r * NR, acc[r][0]);
        _mm256_storeu_ps(c + r * NR + 8, acc[r][1]);
    }
}
#else
// The same arithmetic, portable: per column and block an exact integer sum, then the same fp32 steps.
template <int R, int FMT>
inline void qdot(const int8_t* xq, int64_t ldq, const float* xd, const float* xs, int64_t lds,
                 const uint8_t* panel, int nb, float* c) {
    for (int i = 0; i < R * NR; ++i) c[i] = 0.0f;
    for (int b = 0; b < nb; ++b) {
        const uint8_t* rec = panel + static_cast<int64_t>(b) * QFormat<FMT>::kRecord;
        const uint16_t* hdr = reinterpret_cast<const uint16_t*>(rec);
        const uint8_t* q = rec + QFormat<FMT>::kHeader;
        for (int j = 0; j < NR; ++j) {
            const int half = j / 8, col = j % 8;
            for (int r = 0; r < R; ++r) {
                const int8_t* xr = xq + r * ldq + b * QBLOCK;
                int32_t sum = 0;
                for (int g = 0; g < QBLOCK / 4; ++g)
                    for (int i = 0; i < 4; ++i) {
                        int w;
                        if constexpr (FMT == kWeightInt8) {
                            w = static_cast<int8_t>(q[64 * g + 32 * half + 4 * col + i]);
                        } else {
                            const uint8_t byte = q[32 * g + 4 * col + i];
                            w = half == 0 ? (byte & 0xF) : (byte >> 4);
                            if constexpr (FMT == kWeightMxfp4) w = kMxfp4Values[w];
                        }
                        sum += w * xr[4 * g + i];
                    }
                float& out = c[r * NR + j];
                const float scale = FMT == kWeightMxfp4 ? reinterpret_cast<const float*>(rec)[j] : f16_to_f32(hdr[j]);
                out = std::fma(static_cast<float>(sum), scale * xd[r * lds + b], out);
                if constexpr (FMT == kWeightInt4) out = std::fma(f16_to_f32(hdr[NR + j]), xs[r * lds + b], out);
            }
        }
    }
}
#endif

// M rows of x quantized (quantize_row): q [M, K], d and s [M, K / 32], in buffers kept per calling thread (the
// step's thread) across calls.
struct QuantizedRows {
    int M, K, nb;
    int8_t* q;
    float *d, *s;
    QuantizedRows(int m, int k) : M(m), K(k), nb(k / QBLOCK) {
        thread_local std::vector<int8_t> q_buf;
        thread_local std::vector<float> d_buf, s_buf;
        q_buf.resize(static_cast<size_t>(M) * K);
        d_buf.resize(static_cast<size_t>(M) * nb);
        s_buf.resize(static_cast<size_t>(M) * nb);
        q = q_buf.data();
        d = d_buf.data();
        s = s_buf.data();
    }
    // a few rows are quantized by the calling thread: splitting them would cost a barrier more than the work
    bool serial() const { return M <= 2 * kQRows; }
    void quantize(const float* x, int64_t ldx, int m_begin, int m_end) {
        for (int m = m_begin; m < m_end; ++m)
            quantize_row(x + static_cast<int64_t>(m) * ldx, K, q + static_cast<int64_t>(m) * K,
                         d + static_cast<int64_t>(m) * nb, s + static_cast<int64_t>(m) * nb);
    }
    // inside a parallel region: the rows split over the team (a barrier after)
    void quantize_shared(const float* x, int64_t ldx) {
#pragma omp for schedule(static)
        for (int m = 0; m < M; ++m) quantize(x, ldx, m, m + 1);
    }
};

template <int FMT>
inline void qdot_rows(int rows, const int8_t* xq, int64_t ldq, const float* xd, const float* xs, int64_t lds,
                      const uint8_t* panel, int nb, float* c) {
    with_rows<4>(rows, [&](auto r) { qdot<decltype(r)::value, FMT>(xq, ldq, xd, xs, lds, panel, nb, c); });
}

// K must be a multiple of QBLOCK; bias (TB: fp32 or bf16) may be null.
template <int FMT, typename TB>
void qgemm(const float* x, int64_t ldx, int M, int K, const uint8_t* packed, int N, const TB* bias, float* y,
           int64_t ldy, bool accumulate) {
    const int panels = (N + NR - 1) / NR;
    const int nb = K / QBLOCK;
    const int64_t panel_bytes = static_cast<int64_t>(nb) * QFormat<FMT>::kRecord;
    QuantizedRows rows_q(M, K);
    int8_t* xq = rows_q.q;
    float* xd = rows_q.d;
    float* xs = rows_q.s;
    if (rows_q.serial()) rows_q.quantize(x, ldx, 0, M);
#pragma omp parallel
    {
        if (!rows_q.serial()) rows_q.quantize_shared(x, ldx);
        alignas(32) float c[kQRows * NR];
        // rows in chunks whose quantized x stays in L2, each chunk's panels split evenly over the threads
        for (int m_start = 0; m_start < M; m_start += kMChunk) {
            const int m_end = m_start + kMChunk < M ? m_start + kMChunk : M;
#pragma omp for schedule(static)
            for (int p = 0; p < panels; ++p) {
                const int n0 = p * NR;
                const int nv = N - n0 < NR ? N - n0 : NR;
                const uint8_t* w = packed + p * panel_bytes;
                for (int m0 = m_start; m0 < m_end; m0 += kQRows) {
                    const int rows = m_end - m0 < kQRows ? m_end - m0 : kQRows;
                    qdot_rows<FMT>(rows, xq + static_cast<int64_t>(m0) * K, K, xd + static_cast<int64_t>(m0) * nb,
                                   xs + static_cast<int64_t>(m0) * nb, nb, w, nb, c);
                    store_tile(c, rows, nv, bias, n0, y + static_cast<int64_t>(m0) * ldy, ldy, accumulate);
                }
            }
        }
    }
}

}  // namespace motet
