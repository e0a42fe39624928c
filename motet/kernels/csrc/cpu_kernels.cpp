// CPU kernels for the step's hot paths, beside their torch references (kernels/*.py define the meaning).
//
// Plain C ABI (loaded with ctypes by kernels/cpu_native.py, compiled on first use with -march=native), no
// torch headers: a few seconds to build. OpenMP resolves to the libgomp torch has already loaded, so these
// kernels share torch's thread pool instead of oversubscribing the cores.
//
// dtype codes: 0 = float32, 1 = bfloat16 (stored as uint16, converted exactly to fp32 on load; results
// rounded to nearest even, as torch does); weights may also be 2 = int8, 3 = int4 (qgemm.h). Every
// accumulation is in fp32.

#include "attention.h"
#include "gemm.h"
#include "qgemm.h"
#include "sgmv.h"

namespace motet {

// ---------------------------------------------------------------------------------------------------------
// The decoder stack of a Llama-family model over a flattened batch and the paged KV cache, in one call:
// per layer RMSNorm -> qkv (+bias, + LoRA) -> rotary -> KV write -> paged attention -> o (+ LoRA) into the
// residual -> RMSNorm -> gate/up (+ LoRA) -> SiLU * up -> down (+ LoRA) into the residual; then the final
// norm. Activations stay fp32 (weights and cache may be bf16); the meaning is engine/model.py's.

// A linear layer's packed weight and its format: the model's dtype (float GEMM) or a quantized one (qgemm.h).
struct Linear {
    const void* w;
    int32_t code;  // WeightCode
};

// y (=, or +=) x @ W^T (+ bias): the product in the weight's own format. TW: the model's float dtype (norms,
// biases, unquantized weights).
template <typename TW>
void linear(const Linear& L, const float* x, int64_t ldx, int M, int K, int N, const TW* bias, float* y,
            int64_t ldy, bool accumulate) {
    const auto* q = static_cast<const uint8_t*>(L.w);
    if (L.code == kWeightInt8) qgemm<kWeightInt8>(x, ldx, M, K, q, N, bias, y, ldy, accumulate);
    else if (L.code == kWeightInt4) qgemm<kWeightInt4>(x, ldx, M, K, q, N, bias, y, ldy, accumulate);
    else gemm(x, ldx, M, K, static_cast<const TW*>(L.w), N, bias, y, ldy, accumulate);
}

struct Layer {
    const void* input_norm;  // [hidden], weight dtype
    const void* post_norm;
    Linear qkv;  // packed [q + 2 kv, hidden]
    const void* qkv_bias;  // [q + 2 kv] or null
    Linear o;  // packed [hidden, q]
    Linear gate_up;  // packed [2 inter, hidden]
    Linear down;  // packed [hidden, inter]
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
        linear(L.qkv, h.data(), hid, T, hid, qkv_n, static_cast<const TW*>(L.qkv_bias), qkv.data(), qkv_n, false);
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
        linear(L.o, attn.data(), q_size, T, q_size, hid, static_cast<const TW*>(nullptr), x, hid, true);
        clock.mark(kPhaseLinear);
        if (lm) {
            lora_add<TW>(s, lm[3], attn.data(), q_size, q_size, x, hid, hid);
            clock.mark(kPhaseLora);
        }
        rms_norm(x, T, hid, static_cast<const TW*>(L.post_norm), m.eps, h.data());
        clock.mark(kPhaseOther);
        linear(L.gate_up, h.data(), hid, T, hid, 2 * I, static_cast<const TW*>(nullptr), gu.data(), 2 * I, false);
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
        linear(L.down, act.data(), I, T, I, hid, static_cast<const TW*>(nullptr), x, hid, true);
        clock.mark(kPhaseLinear);
        if (lm) {
            lora_add<TW>(s, lm[6], act.data(), I, I, x, hid, hid);
            clock.mark(kPhaseLora);
        }
    }
    rms_norm(x, T, hid, static_cast<const TW*>(m.final_norm), m.eps, x);  // in place: row by row
    clock.mark(kPhaseOther);
}

}  // namespace motet

using namespace motet;

extern "C" {

int motet_abi_version() { return 4; }

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

// dtype_w: a WeightCode; the bias is in the weight's dtype, fp32 for a quantized weight (K: a multiple of 32).
int motet_gemm(int dtype_w, const float* x, int64_t ldx, int M, int K, const void* packed, int N,
               const void* bias, float* y, int64_t ldy, int accumulate) {
    const auto* fbias = static_cast<const float*>(bias);
    const auto* q = static_cast<const uint8_t*>(packed);
    if ((dtype_w == kWeightInt8 || dtype_w == kWeightInt4) && K % QBLOCK != 0) return 1;
    if (dtype_w == kWeightInt8)
        qgemm<kWeightInt8>(x, ldx, M, K, q, N, fbias, y, ldy, accumulate != 0);
    else if (dtype_w == kWeightInt4)
        qgemm<kWeightInt4>(x, ldx, M, K, q, N, fbias, y, ldy, accumulate != 0);
    else if (dtype_w == 0)
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
    // each linear: the model's dtype, or quantized along an input dimension of whole blocks
    const auto ok = [m](const Linear& L, int K) {
        return L.code == m->dtype_w || ((L.code == kWeightInt8 || L.code == kWeightInt4) && K % QBLOCK == 0);
    };
    for (int i = 0; i < m->num_layers; ++i) {
        const Layer& L = m->layers[i];
        if (!ok(L.qkv, m->hidden) || !ok(L.o, m->num_heads * m->head_dim) || !ok(L.gate_up, m->hidden) ||
            !ok(L.down, m->inter))
            return 3;
    }
    if (m->dtype_w == 0 && m->dtype_cache == 0) forward<float, float>(*m, *s, x);
    else if (m->dtype_w == 1 && m->dtype_cache == 1) forward<uint16_t, uint16_t>(*m, *s, x);
    else if (m->dtype_w == 0 && m->dtype_cache == 1) forward<float, uint16_t>(*m, *s, x);
    else if (m->dtype_w == 1 && m->dtype_cache == 0) forward<uint16_t, float>(*m, *s, x);
    else return 2;
    return 0;
}

}  // extern "C"
