// Shared pieces of the CPU kernels: bf16 <-> fp32, vectorized exp, eight dot products at once.
#pragma once

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

namespace motet {

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

// A tile's row count as a template argument: calls f(std::integral_constant<int, R>{}) with R = rows for rows in
// 2 .. Max, R = 1 otherwise (every microkernel's dispatch from the rows it is handed).
template <int Max, typename F>
inline void with_rows(int rows, F&& f) {
    if constexpr (Max <= 1) {
        f(std::integral_constant<int, 1>{});
    } else if (rows == Max) {
        f(std::integral_constant<int, Max>{});
    } else {
        with_rows<Max - 1>(rows, static_cast<F&&>(f));
    }
}

// A position's slot in the paged KV cache: its block through the sequence's block table, then its place there.
inline int64_t cache_slot(const int32_t* table, int BS, int64_t pos) {
    return static_cast<int64_t>(table[pos / BS]) * BS + pos % BS;
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

// out[i] = gelu_tanh(g[i]) * u[i] (Gemma's GeGLU; torch's gelu with approximate="tanh").
inline void gelu_tanh_mul(const float* g, const float* u, float* out, int n) {
    const float c = 0.7978845608028654f;  // sqrt(2 / pi)
    for (int i = 0; i < n; ++i) {
        const float x = g[i];
        out[i] = 0.5f * x * (1.0f + std::tanh(c * (x + 0.044715f * x * x * x))) * u[i];
    }
}

// out[i] = gelu(g[i]) * u[i], GELU by the error function (torch's gelu, transformers' "gelu").
inline void gelu_mul(const float* g, const float* u, float* out, int n) {
    const float r = 0.7071067811865476f;  // 1 / sqrt(2)
    for (int i = 0; i < n; ++i) out[i] = 0.5f * g[i] * (1.0f + std::erf(g[i] * r)) * u[i];
}

// out[i] = relu(g[i]) * u[i], or relu(g[i])^2 * u[i] where `squared` (transformers' "relu2").
inline void relu_mul(const float* g, const float* u, float* out, int n, bool squared) {
    for (int i = 0; i < n; ++i) {
        const float r = g[i] > 0.0f ? g[i] : 0.0f;
        out[i] = (squared ? r * r : r) * u[i];
    }
}

inline float sigmoid(float x) {
    const float e = std::exp(-std::fabs(x));
    return x >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
}

// out[i] = (up + 1) * gate * sigmoid(alpha * gate), gate clamped to <= limit and up to [-limit, limit] (GPT-OSS's
// experts: engine/worker/model.py's clamped_swiglu).
inline void swiglu_limit_mul(const float* g, const float* u, float* out, int n, float alpha, float limit) {
    for (int i = 0; i < n; ++i) {
        const float gate = std::fmin(g[i], limit), up = std::fmax(std::fmin(u[i], limit), -limit);
        out[i] = (up + 1.0f) * (gate * sigmoid(gate * alpha));
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

}  // namespace motet
