// CPU kernels for the step's hot paths, beside their torch references (kernels/*.py define the meaning).
//
// Plain C ABI (loaded with ctypes by kernels/cpu_native.py, compiled on first use with -march=native), no
// torch headers: a few seconds to build. OpenMP resolves to the libgomp torch has already loaded, so these
// kernels share torch's thread pool instead of oversubscribing the cores.
//
// dtype codes: 0 = float32, 1 = bfloat16 (stored as uint16, converted exactly to fp32 on load; results
// rounded to nearest even, as torch does). Every accumulation is in fp32.

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include <omp.h>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

inline float bf16_to_f32(uint16_t v) {
    uint32_t u = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) { return bf16_to_f32(p[i]); }
inline void store(float* p, int64_t i, float v) { p[i] = v; }
inline void store(uint16_t* p, int64_t i, float v) { p[i] = f32_to_bf16(v); }

// Rows of n values of type T into fp32 (a contiguous copy).
template <typename T>
inline void to_f32(const T* src, float* dst, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) dst[i] = load(src, i);
}

// exp for x <= 0 (softmax after subtracting the max): Cephes-style range reduction and a degree-6
// polynomial, ~2 ulp; written so that the compiler vectorizes loops over it (libm's expf is a call).
inline float exp_nonpos(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float log2e = 1.44269504088896341f;
    float n = std::floor(x * log2e + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t e = (static_cast<int32_t>(n) + 127) << 23;
    float scale;
    std::memcpy(&scale, &e, 4);
    return p * scale;
}

#ifdef __AVX2__
// exp_nonpos on eight lanes.
inline __m256 exp8_nonpos(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

// v[i] = exp(v[i] - shift) for v[i] <= shift.
inline void exp_shifted(float* v, int n, float shift) {
    int i = 0;
#ifdef __AVX2__
    const __m256 sh = _mm256_set1_ps(shift);
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(v + i, exp8_nonpos(_mm256_sub_ps(_mm256_loadu_ps(v + i), sh)));
#endif
    for (; i < n; ++i) v[i] = exp_nonpos(v[i] - shift);
}

// out[i] = silu(g[i]) * u[i], without overflow on either side of 0.
inline void silu_mul(const float* g, const float* u, float* out, int n) {
    int i = 0;
#ifdef __AVX2__
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        const __m256 e = exp8_nonpos(_mm256_or_ps(x, sign));  // exp(-|x|)
        const __m256 inv = _mm256_div_ps(one, _mm256_add_ps(one, e));
        const __m256 sig = _mm256_blendv_ps(_mm256_mul_ps(e, inv), inv, _mm256_cmp_ps(x, zero, _CMP_GE_OQ));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(x, sig), _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < n; ++i) {
        const float e = exp_nonpos(-std::fabs(g[i]));
        const float sig = g[i] >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
        out[i] = g[i] * sig * u[i];
    }
}

// Eight dot products at once: v (fp32, n values) with rows w, w + ws, ..., w + 7 ws (fp32 or bf16), as one
// vector [d0..d7]. The rows' partial sums are reduced together (two hadd levels and one lane swap), which
// costs far less than eight horizontal reductions.
#ifdef __AVX2__
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

template <typename TW>
inline __m256 dots8(const float* v, const TW* w, int64_t ws, int n) {
    __m256 a[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(v + i);
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(x, load8(w + j * ws + i), a[j]);
    }
    const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    __m256 out = _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
    if (i < n) {
        alignas(32) float tail[8];
        for (int j = 0; j < 8; ++j) {
            float d = 0.0f;
            for (int k = i; k < n; ++k) d += v[k] * load(w + j * ws, k);
            tail[j] = d;
        }
        out = _mm256_add_ps(out, _mm256_load_ps(tail));
    }
    return out;
}
#endif

template <typename TW>
inline void dots(const float* v, const TW* w, int64_t ws, int rows, int n, float* out) {
    int j = 0;
#ifdef __AVX2__
    for (; j + 8 <= rows; j += 8) _mm256_storeu_ps(out + j, dots8(v, w + j * ws, ws, n));
#endif
    for (; j < rows; ++j) {
        float d = 0.0f;
#pragma omp simd reduction(+ : d)
        for (int k = 0; k < n; ++k) d += v[k] * load(w + j * ws, k);
        out[j] = d;
    }
}

// ---------------------------------------------------------------------------------------------------------
// Paged attention: each sequence's new tokens attend causally to its paged context (GQA), one work item per
// (sequence, query token, kv head), online softmax over key tiles, K/V read in the cache's dtype.

constexpr int kTile = 32;
constexpr int kMaxGroup = 16;
constexpr int kMaxHeadDim = 256;

template <typename TQ, typename TC>
void attention(const TQ* q, int64_t q_st, int64_t q_sh, const TC* kc, const TC* vc, const int32_t* tables,
               int64_t table_stride, const int32_t* qsl, const int32_t* seq_lens, int num_seqs, TQ* out,
               int H, int KVH, int D, int BS, float scale) {
    const int G = H / KVH;
    const int64_t T = qsl[num_seqs];
    const int64_t items = T * KVH;
    // token -> its sequence (a binary search per item would do too; this is T ints)
    std::vector<int32_t> seq_of(static_cast<size_t>(T));
    for (int b = 0; b < num_seqs; ++b)
        for (int32_t t = qsl[b]; t < qsl[b + 1]; ++t) seq_of[t] = b;
    const int64_t kv_row = static_cast<int64_t>(KVH) * D;  // elements per cache position

#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
        const int64_t t = item / KVH;
        const int h = static_cast<int>(item % KVH);
        const int b = seq_of[t];
        const int64_t q_len = qsl[b + 1] - qsl[b];
        const int64_t n_keys = seq_lens[b] - q_len + (t - qsl[b]) + 1;  // causal: keys 0..position
        const int32_t* table = tables + b * table_stride;

        alignas(32) float qv[kMaxGroup][kMaxHeadDim];
        alignas(32) float acc[kMaxGroup][kMaxHeadDim];
        alignas(32) float s[kMaxGroup][kTile];
        float m[kMaxGroup], l[kMaxGroup];
        for (int g = 0; g < G; ++g) {
            const TQ* qp = q + t * q_st + static_cast<int64_t>(h * G + g) * q_sh;
#pragma omp simd
            for (int d = 0; d < D; ++d) qv[g][d] = load(qp, d) * scale;
#pragma omp simd
            for (int d = 0; d < D; ++d) acc[g][d] = 0.0f;
            m[g] = -1e30f;
            l[g] = 0.0f;
        }
        for (int64_t j0 = 0; j0 < n_keys; j0 += kTile) {
            const int n = static_cast<int>(n_keys - j0 < kTile ? n_keys - j0 : kTile);
            const TC* kp[kTile];
            const TC* vp[kTile];
            for (int j = 0; j < n; ++j) {
                const int64_t pos = j0 + j;
                const int64_t slot = static_cast<int64_t>(table[pos / BS]) * BS + pos % BS;
                kp[j] = kc + slot * kv_row + static_cast<int64_t>(h) * D;
                vp[j] = vc + slot * kv_row + static_cast<int64_t>(h) * D;
            }
            int j = 0;
#ifdef __AVX2__
            // eight keys at a time where they sit in one block (consecutive rows of the cache)
            for (; j + 8 <= n && kp[j + 7] - kp[j] == 7 * kv_row; j += 8)
                for (int g = 0; g < G; ++g) _mm256_storeu_ps(&s[g][j], dots8(qv[g], kp[j], kv_row, D));
#endif
            for (; j < n; ++j) {
                alignas(32) float kf[kMaxHeadDim];
                to_f32(kp[j], kf, D);
                for (int g = 0; g < G; ++g) {
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (int d = 0; d < D; ++d) dot += qv[g][d] * kf[d];
                    s[g][j] = dot;
                }
            }
            for (int g = 0; g < G; ++g) {
                float mx = m[g];
                for (int jj = 0; jj < n; ++jj) mx = s[g][jj] > mx ? s[g][jj] : mx;
                const float correction = exp_nonpos(m[g] - mx);
                exp_shifted(s[g], n, mx);
                float sum = 0.0f;
                for (int jj = 0; jj < n; ++jj) sum += s[g][jj];
                l[g] = l[g] * correction + sum;
                m[g] = mx;
#pragma omp simd
                for (int d = 0; d < D; ++d) acc[g][d] *= correction;
            }
            for (j = 0; j < n; ++j) {
                alignas(32) float vf[kMaxHeadDim];
                to_f32(vp[j], vf, D);
                for (int g = 0; g < G; ++g) {
                    const float p = s[g][j];
#pragma omp simd
                    for (int d = 0; d < D; ++d) acc[g][d] += p * vf[d];
                }
            }
        }
        for (int g = 0; g < G; ++g) {
            TQ* op = out + (t * H + h * G + g) * static_cast<int64_t>(D);
            const float inv = 1.0f / l[g];
            for (int d = 0; d < D; ++d) store(op, d, acc[g][d] * inv);
        }
    }
}

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
    switch (rows) {
        case 6: micro<6>(x, ldx, w, K, c); break;
        case 5: micro<5>(x, ldx, w, K, c); break;
        case 4: micro<4>(x, ldx, w, K, c); break;
        case 3: micro<3>(x, ldx, w, K, c); break;
        case 2: micro<2>(x, ldx, w, K, c); break;
        default: micro<1>(x, ldx, w, K, c); break;
    }
}

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

template <typename TW>
void gemm(const float* x, int64_t ldx, int M, int K, const TW* packed, int N, const TW* bias, float* y,
          int64_t ldy, bool accumulate) {
    const int panels = (N + NR - 1) / NR;
    // Rows in chunks (their x tile stays in L2), each chunk's panels split evenly over the threads: each
    // thread streams one contiguous run of panels.
    for (int m_start = 0; m_start < M; m_start += kMChunk) {
        const int m_end = m_start + kMChunk < M ? m_start + kMChunk : M;
        // A bf16 panel read by several row tiles is converted once, into an fp32 copy kept in L1/L2.
        const bool convert = sizeof(TW) == 2 && m_end - m_start > MR;
#pragma omp parallel
        {
            std::vector<float> panel(convert ? static_cast<size_t>(K) * NR : 0);
            alignas(32) float c[MR * NR];
#pragma omp for schedule(static)
            for (int p = 0; p < panels; ++p) {
                const int n0 = p * NR;
                const int nv = N - n0 < NR ? N - n0 : NR;
                const TW* w = packed + static_cast<int64_t>(p) * K * NR;
                if (convert) to_f32(w, panel.data(), static_cast<int64_t>(K) * NR);
                for (int m0 = m_start; m0 < m_end; m0 += MR) {
                    const int rows = m_end - m0 < MR ? m_end - m0 : MR;
                    if (convert)
                        micro_rows(rows, x + static_cast<int64_t>(m0) * ldx, ldx, panel.data(), K, c);
                    else
                        micro_rows(rows, x + static_cast<int64_t>(m0) * ldx, ldx, w, K, c);
                    for (int r = 0; r < rows; ++r) {
                        float* yr = y + static_cast<int64_t>(m0 + r) * ldy + n0;
                        for (int j = 0; j < nv; ++j) {
                            const float v = c[r * NR + j] + (bias ? load(bias, n0 + j) : 0.0f);
                            yr[j] = accumulate ? yr[j] + v : v;
                        }
                    }
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------------
// The decoder stack of a Llama-family model over a flattened batch and the paged KV cache, in one call:
// per layer RMSNorm -> qkv (+bias, + LoRA) -> rotary -> KV write -> paged attention -> o (+ LoRA) into the
// residual -> RMSNorm -> gate/up (+ LoRA) -> SiLU * up -> down (+ LoRA) into the residual; then the final
// norm. Activations stay fp32 (weights and cache may be bf16); the meaning is engine/model.py's.

struct Layer {
    const void* input_norm;  // [hidden], weight dtype
    const void* post_norm;
    const void* qkv;  // packed [q + 2 kv, hidden]
    const void* qkv_bias;  // [q + 2 kv] or null
    const void* o;  // packed [hidden, q]
    const void* gate_up;  // packed [2 inter, hidden]
    const void* down;  // packed [hidden, inter]
    void* k_cache;  // [blocks, block_size, kv_heads, head_dim], cache dtype
    void* v_cache;
};

struct LoraModule {  // one (layer, module) of the step's adapters; A == null: no adapter targets it
    const void* A;  // [S, >= r, n_in]
    const void* B;  // [S, n_out, >= r]
    const float* scales;  // [S]
    int64_t a_ss, a_sr, b_ss, b_so;
    int r;
};

struct Model {
    int dtype_w, dtype_cache;
    int hidden, inter, num_heads, num_kv_heads, head_dim, num_layers, block_size;
    float eps, scale;
    const float* cos;  // [positions, head_dim / 2]
    const float* sin;
    const void* final_norm;  // [hidden]
    const Layer* layers;
};

struct Step {
    int num_tokens, num_seqs;
    const int64_t* positions;  // [T]
    const int64_t* slots;  // [T], -1: no KV write
    const int32_t* tables;  // [num_seqs, table_stride]
    int64_t table_stride;
    const int32_t* qsl;  // [num_seqs + 1]
    const int32_t* seq_lens;  // [num_seqs]
    int num_segs;
    const int32_t* seg_starts;  // LoRA segments, or null
    const int32_t* seg_slots;
    const LoraModule* lora;  // [num_layers * 7] (q, k, v, o, gate, up, down), or null
    double* timings;  // or null: seconds added per phase (kPhaseLinear, ...), for the step profile
};

enum Phase { kPhaseLinear = 0, kPhaseAttention = 1, kPhaseLora = 2, kPhaseOther = 3, kNumPhases = 4 };

// Adds the time since the previous mark to a phase (when the step asked for timings).
struct PhaseClock {
    double* out;
    double last;
    explicit PhaseClock(double* o) : out(o), last(o ? omp_get_wtime() : 0.0) {}
    void mark(Phase p) {
        if (!out) return;
        const double now = omp_get_wtime();
        out[p] += now - last;
        last = now;
    }
};

template <typename TW>
void rms_norm(const float* x, int M, int n, const TW* w, float eps, float* out) {
    for (int m = 0; m < M; ++m) {
        const float* xr = x + static_cast<int64_t>(m) * n;
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int i = 0; i < n; ++i) ss += xr[i] * xr[i];
        const float inv = 1.0f / std::sqrt(ss / n + eps);
        float* o = out + static_cast<int64_t>(m) * n;
#pragma omp simd
        for (int i = 0; i < n; ++i) o[i] = xr[i] * inv * load(w, i);
    }
}

template <typename TW>
void lora_add(const Step& s, const LoraModule& mod, const float* x, int64_t ldx, int n_in, float* y,
              int64_t ldy, int n_out) {
    if (s.lora == nullptr || mod.A == nullptr) return;
    sgmv(x, ldx, y, ldy, static_cast<const TW*>(mod.A), mod.a_ss, mod.a_sr, static_cast<const TW*>(mod.B),
         mod.b_ss, mod.b_so, mod.scales, s.seg_starts, s.seg_slots, s.num_segs, n_in, n_out, mod.r);
}

template <typename TW, typename TC>
void forward(const Model& m, const Step& s, float* x) {
    const int T = s.num_tokens, hid = m.hidden, I = m.inter, D = m.head_dim;
    const int H = m.num_heads, KVH = m.num_kv_heads, q_size = H * D, kv_size = KVH * D;
    const int qkv_n = q_size + 2 * kv_size, half = D / 2;
    std::vector<float> h(static_cast<size_t>(T) * hid), qkv(static_cast<size_t>(T) * qkv_n);
    std::vector<float> attn(static_cast<size_t>(T) * q_size), gu(static_cast<size_t>(T) * 2 * I);
    std::vector<float> act(static_cast<size_t>(T) * I);
    const int64_t kv_row = static_cast<int64_t>(kv_size);
    PhaseClock clock(s.timings);
    for (int li = 0; li < m.num_layers; ++li) {
        const Layer& L = m.layers[li];
        const LoraModule* lm = s.lora ? s.lora + li * 7 : nullptr;
        rms_norm(x, T, hid, static_cast<const TW*>(L.input_norm), m.eps, h.data());
        clock.mark(kPhaseOther);
        gemm(h.data(), hid, T, hid, static_cast<const TW*>(L.qkv), qkv_n, static_cast<const TW*>(L.qkv_bias),
             qkv.data(), qkv_n, false);
        clock.mark(kPhaseLinear);
        if (lm) {
            lora_add<TW>(s, lm[0], h.data(), hid, hid, qkv.data(), qkv_n, q_size);
            lora_add<TW>(s, lm[1], h.data(), hid, hid, qkv.data() + q_size, qkv_n, kv_size);
            lora_add<TW>(s, lm[2], h.data(), hid, hid, qkv.data() + q_size + kv_size, qkv_n, kv_size);
            clock.mark(kPhaseLora);
        }
        // rotary on q and k (the two halves of head_dim, Hugging Face layout), then the KV write
        TC* kc = static_cast<TC*>(L.k_cache);
        TC* vc = static_cast<TC*>(L.v_cache);
        for (int t = 0; t < T; ++t) {
            float* row = qkv.data() + static_cast<int64_t>(t) * qkv_n;
            const float* cs = m.cos + s.positions[t] * half;
            const float* sn = m.sin + s.positions[t] * half;
            for (int hd = 0; hd < H + KVH; ++hd) {
                float* v = row + hd * D;
#pragma omp simd
                for (int i = 0; i < half; ++i) {
                    const float a = v[i], b = v[i + half];
                    v[i] = a * cs[i] - b * sn[i];
                    v[i + half] = b * cs[i] + a * sn[i];
                }
            }
            const int64_t slot = s.slots[t];
            if (slot >= 0) {
                for (int i = 0; i < kv_size; ++i) {
                    store(kc + slot * kv_row, i, row[q_size + i]);
                    store(vc + slot * kv_row, i, row[q_size + kv_size + i]);
                }
            }
        }
        clock.mark(kPhaseOther);
        attention(qkv.data(), static_cast<int64_t>(qkv_n), static_cast<int64_t>(D), static_cast<const TC*>(kc),
                  static_cast<const TC*>(vc), s.tables, s.table_stride, s.qsl, s.seq_lens, s.num_seqs,
                  attn.data(), H, KVH, D, m.block_size, m.scale);
        clock.mark(kPhaseAttention);
        gemm(attn.data(), q_size, T, q_size, static_cast<const TW*>(L.o), hid, static_cast<const TW*>(nullptr),
             x, hid, true);
        clock.mark(kPhaseLinear);
        if (lm) {
            lora_add<TW>(s, lm[3], attn.data(), q_size, q_size, x, hid, hid);
            clock.mark(kPhaseLora);
        }
        rms_norm(x, T, hid, static_cast<const TW*>(L.post_norm), m.eps, h.data());
        clock.mark(kPhaseOther);
        gemm(h.data(), hid, T, hid, static_cast<const TW*>(L.gate_up), 2 * I, static_cast<const TW*>(nullptr),
             gu.data(), 2 * I, false);
        clock.mark(kPhaseLinear);
        if (lm) {
            lora_add<TW>(s, lm[4], h.data(), hid, hid, gu.data(), 2 * I, I);
            lora_add<TW>(s, lm[5], h.data(), hid, hid, gu.data() + I, 2 * I, I);
            clock.mark(kPhaseLora);
        }
#pragma omp parallel for schedule(static) if (T > 8)
        for (int t = 0; t < T; ++t) {
            const float* g = gu.data() + static_cast<int64_t>(t) * 2 * I;
            float* a = act.data() + static_cast<int64_t>(t) * I;
            silu_mul(g, g + I, a, I);
        }
        clock.mark(kPhaseOther);
        gemm(act.data(), I, T, I, static_cast<const TW*>(L.down), hid, static_cast<const TW*>(nullptr), x, hid,
             true);
        clock.mark(kPhaseLinear);
        if (lm) {
            lora_add<TW>(s, lm[6], act.data(), I, I, x, hid, hid);
            clock.mark(kPhaseLora);
        }
    }
    rms_norm(x, T, hid, static_cast<const TW*>(m.final_norm), m.eps, x);  // in place: row by row
    clock.mark(kPhaseOther);
}

}  // namespace

extern "C" {

int motet_abi_version() { return 3; }

int motet_attention(int dtype_q, int dtype_cache, const void* q, int64_t q_st, int64_t q_sh, const void* kc,
                    const void* vc, const int32_t* tables, int64_t table_stride, const int32_t* qsl,
                    const int32_t* seq_lens, int num_seqs, void* out, int H, int KVH, int D, int BS,
                    float scale) {
    if (H % KVH != 0 || H / KVH > kMaxGroup || D > kMaxHeadDim) return 1;
#define ATTN(TQ, TC)                                                                                       \
    attention(static_cast<const TQ*>(q), q_st, q_sh, static_cast<const TC*>(kc), static_cast<const TC*>(vc), \
              tables, table_stride, qsl, seq_lens, num_seqs, static_cast<TQ*>(out), H, KVH, D, BS, scale)
    if (dtype_q == 0 && dtype_cache == 0) ATTN(float, float);
    else if (dtype_q == 0 && dtype_cache == 1) ATTN(float, uint16_t);
    else if (dtype_q == 1 && dtype_cache == 1) ATTN(uint16_t, uint16_t);
    else if (dtype_q == 1 && dtype_cache == 0) ATTN(uint16_t, float);
    else return 2;
#undef ATTN
    return 0;
}

int motet_sgmv(int dtype_x, int dtype_w, const void* x, int64_t x_st, void* y, int64_t y_st, const void* A,
               int64_t a_ss, int64_t a_sr, const void* B, int64_t b_ss, int64_t b_so, const float* scales,
               const int32_t* seg_starts, const int32_t* seg_slots, int num_segs, int n_in, int n_out, int r) {
#define SGMV(TX, TW)                                                                                       \
    sgmv(static_cast<const TX*>(x), x_st, static_cast<TX*>(y), y_st, static_cast<const TW*>(A), a_ss, a_sr, \
         static_cast<const TW*>(B), b_ss, b_so, scales, seg_starts, seg_slots, num_segs, n_in, n_out, r)
    if (dtype_x == 0 && dtype_w == 0) SGMV(float, float);
    else if (dtype_x == 1 && dtype_w == 1) SGMV(uint16_t, uint16_t);
    else if (dtype_x == 0 && dtype_w == 1) SGMV(float, uint16_t);
    else if (dtype_x == 1 && dtype_w == 0) SGMV(uint16_t, float);
    else return 2;
#undef SGMV
    return 0;
}

int motet_gemm(int dtype_w, const float* x, int64_t ldx, int M, int K, const void* packed, int N,
               const void* bias, float* y, int64_t ldy, int accumulate) {
    if (dtype_w == 0)
        gemm(x, ldx, M, K, static_cast<const float*>(packed), N, static_cast<const float*>(bias), y, ldy,
             accumulate != 0);
    else if (dtype_w == 1)
        gemm(x, ldx, M, K, static_cast<const uint16_t*>(packed), N, static_cast<const uint16_t*>(bias), y, ldy,
             accumulate != 0);
    else
        return 2;
    return 0;
}

int motet_forward(const Model* m, const Step* s, float* x) {
    if (m->num_heads % m->num_kv_heads != 0 || m->num_heads / m->num_kv_heads > kMaxGroup ||
        m->head_dim > kMaxHeadDim || m->head_dim % 2 != 0)
        return 1;
    if (m->dtype_w == 0 && m->dtype_cache == 0) forward<float, float>(*m, *s, x);
    else if (m->dtype_w == 1 && m->dtype_cache == 1) forward<uint16_t, uint16_t>(*m, *s, x);
    else if (m->dtype_w == 0 && m->dtype_cache == 1) forward<float, uint16_t>(*m, *s, x);
    else if (m->dtype_w == 1 && m->dtype_cache == 0) forward<uint16_t, float>(*m, *s, x);
    else return 2;
    return 0;
}

}  // extern "C"
