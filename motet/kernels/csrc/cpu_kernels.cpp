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
#include "moe.h"
#include "qgemm.h"
#include "sgmv.h"

namespace motet {

// ---------------------------------------------------------------------------------------------------------
// The decoder stack of a Llama-family model over a flattened batch and the paged KV cache, in one call: each
// layer is an attention op, then its MLP op, the dense one or the sparse mixture of experts (the layer's
// descriptor says which); then the final norm. Each op normalizes the residual stream, computes its output
// and adds it to the stream at one point (add_residual). Activations stay fp32 (weights and cache may be
// bf16); the meaning is engine/model.py's. A new kind of layer is a new op and a new MlpKind (or a field of
// an op's weights), not a new forward.

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

struct AttentionWeights {
    const void* norm;  // the input RMSNorm [hidden], weight dtype
    Linear qkv;  // packed [q + 2 kv, hidden]
    const void* qkv_bias;  // [q + 2 kv] or null
    Linear o;  // packed [hidden, q]
    const void* q_norm;  // [head_dim]: each head's q and k RMS-normalized before the rotary (Qwen3), or null
    const void* k_norm;
    void* k_cache;  // [blocks, block_size, kv_heads, head_dim], cache dtype
    void* v_cache;
};

// A SwiGLU MLP: a dense layer's, or a sparse layer's shared expert.
struct MlpWeights {
    Linear gate_up;  // packed [2 inter, hidden]: gate rows, then up rows
    Linear down;  // packed [hidden, inter]
    int32_t inter;  // 0: none (a sparse layer without a shared expert)
};

// A sparse layer's mixture of experts (Mixtral, Qwen2-MoE): experts in the model's dtype.
struct MoeWeights {
    Linear router;  // packed [num_experts, hidden]
    const void* experts_gate_up;  // num_experts packed [2 inter, hidden], one after another
    const void* experts_down;  // num_experts packed [hidden, inter]
    int32_t num_experts, top_k, inter, renormalize;  // renormalize: the top-k weights sum to 1
    MlpWeights shared;  // the shared expert (Qwen2-MoE), inter 0 where none
    Linear shared_gate;  // packed [1, hidden]: the shared expert's scale is sigmoid(x . shared_gate)
};

enum MlpKind { kMlpDense = 0, kMlpSparse = 1 };

struct Layer {
    AttentionWeights attn;
    const void* post_norm;  // the MLP's input RMSNorm [hidden]
    int32_t mlp_kind;  // MlpKind: which of the two below this layer has
    MlpWeights mlp;
    MoeWeights moe;
};

// Sums a buffer over the tensor-parallel ranks, in place (the caller's collective: torch.distributed).
typedef void (*AllReduce)(float* data, int64_t n);

struct Model {
    int dtype_w, dtype_cache;
    int hidden, num_heads, num_kv_heads, head_dim, num_layers, block_size;  // heads: this rank's
    float eps, scale;
    const float* cos;  // [positions, head_dim / 2]
    const float* sin;
    const void* final_norm;  // [hidden]
    const Layer* layers;
    AllReduce all_reduce;  // null on one rank; else each op's output is this rank's partial sum
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
    const LoraPool* lora;  // the adapters' pool the segments' slots index (sgmv.h), or null
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

// Scratch buffers of one forward, grown on first use and reused by every layer.
struct Scratch {
    std::vector<float> h, qkv, attn, out, gu, act, logits, rows, rows_out, gate;
    std::vector<int32_t> experts, offsets, row_of, token_of;
    std::vector<float> weights;
    std::vector<std::pair<float, int64_t>> queue;

    template <typename V>
    static typename V::value_type* get(V& v, int64_t n) {
        if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
        return v.data();
    }
};

// What every op of a step reads: the model, the step, scratch, the clock.
struct Ctx {
    const Model& m;
    const Step& s;
    Scratch& scratch;
    PhaseClock& clock;
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

// y += layer `layer`'s LoRA deltas of x for group g (its n modules' outputs: adjacent columns of y, sizes[m]
// each); nothing without adapters in the step.
template <typename TW>
void lora_add(const Step& s, int g, int layer, const float* x, int64_t ldx, int n_in, float* y, int64_t ldy,
              const int* sizes, int n) {
    if (s.lora == nullptr || s.num_segs == 0) return;
    sgmv_pool<TW>(x, ldx, y, ldy, *s.lora, g, layer, s.seg_starts, s.seg_slots, s.num_segs, n_in, sizes, n);
}

// The residual stream x [T, hidden] takes an op's output: the one point where each op's result joins the
// stream. Under tensor parallelism the output is this rank's partial sum (its heads, its columns): the
// ranks' parts are all-reduced first.
inline void add_residual(const Model& m, float* x, float* out, int64_t n) {
    if (m.all_reduce != nullptr) m.all_reduce(out, n);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) x[i] += out[i];
}

// The attention op: RMSNorm -> qkv (+ bias, + LoRA) -> (Qwen3: per-head q/k RMSNorm) -> rotary -> KV write ->
// paged attention -> o (+ LoRA), added to the residual stream.
template <typename TW, typename TC>
void attention_op(Ctx& c, const AttentionWeights& W, int layer, float* x) {
    const Model& m = c.m;
    const Step& s = c.s;
    const int T = s.num_tokens, hid = m.hidden, D = m.head_dim, H = m.num_heads, KVH = m.num_kv_heads;
    const int q_size = H * D, kv_size = KVH * D, qkv_n = q_size + 2 * kv_size, half = D / 2;
    float* h = Scratch::get(c.scratch.h, static_cast<int64_t>(T) * hid);
    float* qkv = Scratch::get(c.scratch.qkv, static_cast<int64_t>(T) * qkv_n);
    float* attn = Scratch::get(c.scratch.attn, static_cast<int64_t>(T) * q_size);
    float* out = Scratch::get(c.scratch.out, static_cast<int64_t>(T) * hid);
    rms_norm(x, T, hid, static_cast<const TW*>(W.norm), m.eps, h);
    c.clock.mark(kPhaseOther);
    linear(W.qkv, h, hid, T, hid, qkv_n, static_cast<const TW*>(W.qkv_bias), qkv, qkv_n, false);
    c.clock.mark(kPhaseLinear);
    if (s.lora) {
        const int sizes[3] = {q_size, kv_size, kv_size};
        lora_add<TW>(s, kLoraQKV, layer, h, hid, hid, qkv, qkv_n, sizes, 3);
        c.clock.mark(kPhaseLora);
    }
    // (Qwen3: each q and k head RMS-normalized,) rotary on q and k (the two halves of head_dim, Hugging Face
    // layout), then the KV write
    TC* kc = static_cast<TC*>(W.k_cache);
    TC* vc = static_cast<TC*>(W.v_cache);
    const int64_t kv_row = kv_size;
    for (int t = 0; t < T; ++t) {
        float* row = qkv + static_cast<int64_t>(t) * qkv_n;
        const float* cs = m.cos + s.positions[t] * half;
        const float* sn = m.sin + s.positions[t] * half;
        for (int hd = 0; hd < H + KVH; ++hd) {
            float* v = row + hd * D;
            if (W.q_norm) rms_norm(v, 1, D, static_cast<const TW*>(hd < H ? W.q_norm : W.k_norm), m.eps, v);
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
    c.clock.mark(kPhaseOther);
    attention(qkv, static_cast<int64_t>(qkv_n), static_cast<int64_t>(D), static_cast<const TC*>(kc),
              static_cast<const TC*>(vc), s.tables, s.table_stride, s.qsl, s.seq_lens, s.num_seqs, attn, H, KVH,
              D, m.block_size, m.scale);
    c.clock.mark(kPhaseAttention);
    linear(W.o, attn, q_size, T, q_size, hid, static_cast<const TW*>(nullptr), out, hid, false);
    c.clock.mark(kPhaseLinear);
    if (s.lora) {
        lora_add<TW>(s, kLoraO, layer, attn, q_size, q_size, out, hid, &hid, 1);
        c.clock.mark(kPhaseLora);
    }
    add_residual(m, x, out, static_cast<int64_t>(T) * hid);
    c.clock.mark(kPhaseOther);
}

// out (=, or +=) down(silu(gate) * up) of h [T, hidden] through a SwiGLU MLP (+ layer `layer`'s LoRA; -1:
// none), each row of the activation scaled by row_scale[t] first where given (a shared expert's gate: the
// product is linear).
template <typename TW>
void swiglu(Ctx& c, const MlpWeights& W, const float* h, int T, int layer, const float* row_scale, float* out,
            bool accumulate) {
    const Step& s = c.s;
    const int hid = c.m.hidden, I = W.inter;
    float* gu = Scratch::get(c.scratch.gu, static_cast<int64_t>(T) * 2 * I);
    float* act = Scratch::get(c.scratch.act, static_cast<int64_t>(T) * I);
    linear(W.gate_up, h, hid, T, hid, 2 * I, static_cast<const TW*>(nullptr), gu, 2 * I, false);
    c.clock.mark(kPhaseLinear);
    const bool lora = s.lora && layer >= 0;
    if (lora) {
        const int sizes[2] = {I, I};
        lora_add<TW>(s, kLoraGateUp, layer, h, hid, hid, gu, 2 * I, sizes, 2);
        c.clock.mark(kPhaseLora);
    }
#pragma omp parallel for schedule(static) if (T > 8)
    for (int t = 0; t < T; ++t) {
        const float* g = gu + static_cast<int64_t>(t) * 2 * I;
        float* a = act + static_cast<int64_t>(t) * I;
        silu_mul(g, g + I, a, I);
        if (row_scale) {
            const float sc = row_scale[t];
#pragma omp simd
            for (int i = 0; i < I; ++i) a[i] *= sc;
        }
    }
    c.clock.mark(kPhaseOther);
    linear(W.down, act, I, T, I, hid, static_cast<const TW*>(nullptr), out, hid, accumulate);
    c.clock.mark(kPhaseLinear);
    if (lora) {
        lora_add<TW>(s, kLoraDown, layer, act, I, I, out, hid, &hid, 1);
        c.clock.mark(kPhaseLora);
    }
}

// The dense MLP op: RMSNorm -> gate/up (+ LoRA) -> SiLU * up -> down (+ LoRA), added to the residual stream.
template <typename TW>
void mlp_op(Ctx& c, const void* norm, const MlpWeights& W, int layer, float* x) {
    const int T = c.s.num_tokens, hid = c.m.hidden;
    float* h = Scratch::get(c.scratch.h, static_cast<int64_t>(T) * hid);
    float* out = Scratch::get(c.scratch.out, static_cast<int64_t>(T) * hid);
    rms_norm(x, T, hid, static_cast<const TW*>(norm), c.m.eps, h);
    c.clock.mark(kPhaseOther);
    swiglu<TW>(c, W, h, T, layer, nullptr, out, false);
    add_residual(c.m, x, out, static_cast<int64_t>(T) * hid);
    c.clock.mark(kPhaseOther);
}

// The sparse MoE op: RMSNorm -> router -> softmax, top-k -> the (token, choice) rows sorted by expert ->
// each expert's gate/up, SiLU * up, down over its segment (grouped GEMMs) -> the rows' weighted sum per token
// (+ the shared expert, scaled by its sigmoid gate), added to the residual stream. No LoRA: adapters target
// the attention of an MoE model only (motet/lora/adapter.py refuses the others).
template <typename TW>
void moe_op(Ctx& c, const void* norm, const MoeWeights& W, float* x) {
    Scratch& sc = c.scratch;
    const int T = c.s.num_tokens, hid = c.m.hidden, E = W.num_experts, k = W.top_k, I = W.inter;
    const int R = T * k;  // (token, choice) rows
    float* h = Scratch::get(sc.h, static_cast<int64_t>(T) * hid);
    float* out = Scratch::get(sc.out, static_cast<int64_t>(T) * hid);
    float* logits = Scratch::get(sc.logits, static_cast<int64_t>(T) * E);
    int32_t* experts = Scratch::get(sc.experts, R);
    float* weights = Scratch::get(sc.weights, R);
    rms_norm(x, T, hid, static_cast<const TW*>(norm), c.m.eps, h);
    c.clock.mark(kPhaseOther);
    linear(W.router, h, hid, T, hid, E, static_cast<const TW*>(nullptr), logits, E, false);
    c.clock.mark(kPhaseLinear);
    for (int t = 0; t < T; ++t)
        route(logits + static_cast<int64_t>(t) * E, E, k, W.renormalize != 0, experts + t * k, weights + t * k,
              sc.queue);
    // rows sorted by expert, stably (a token's choices in token order within an expert's segment)
    int32_t* offsets = Scratch::get(sc.offsets, E + 1);
    int32_t* row_of = Scratch::get(sc.row_of, R);  // (token, choice) -> its sorted row
    int32_t* token_of = Scratch::get(sc.token_of, R);  // sorted row -> its token
    std::fill(offsets, offsets + E + 1, 0);
    for (int i = 0; i < R; ++i) ++offsets[experts[i] + 1];
    for (int e = 0; e < E; ++e) offsets[e + 1] += offsets[e];
    std::vector<int32_t> cursor(offsets, offsets + E);
    for (int i = 0; i < R; ++i) {
        const int32_t r = cursor[experts[i]]++;
        row_of[i] = r;
        token_of[r] = i / k;
    }
    // the small element-wise passes below run on the calling thread unless large (a parallel region costs
    // more than a few hundred KiB of copying)
    constexpr int64_t kParallelElems = 1 << 18;
    float* rows = Scratch::get(sc.rows, static_cast<int64_t>(R) * hid);
#pragma omp parallel for schedule(static) if (static_cast<int64_t>(R) * hid > kParallelElems)
    for (int r = 0; r < R; ++r)
        std::memcpy(rows + static_cast<int64_t>(r) * hid, h + static_cast<int64_t>(token_of[r]) * hid,
                    sizeof(float) * hid);
    c.clock.mark(kPhaseOther);
    float* gu = Scratch::get(sc.gu, static_cast<int64_t>(R) * 2 * I);
    float* act = Scratch::get(sc.act, static_cast<int64_t>(R) * I);
    float* rows_out = Scratch::get(sc.rows_out, static_cast<int64_t>(R) * hid);
    grouped_gemm(rows, hid, offsets, E, hid, static_cast<const TW*>(W.experts_gate_up), 2 * I, gu, 2 * I);
    c.clock.mark(kPhaseLinear);
#pragma omp parallel for schedule(static) if (static_cast<int64_t>(R) * I > kParallelElems / 4)
    for (int r = 0; r < R; ++r) {
        const float* g = gu + static_cast<int64_t>(r) * 2 * I;
        silu_mul(g, g + I, act + static_cast<int64_t>(r) * I, I);
    }
    c.clock.mark(kPhaseOther);
    grouped_gemm(act, I, offsets, E, I, static_cast<const TW*>(W.experts_down), hid, rows_out, hid);
    c.clock.mark(kPhaseLinear);
    // each token's rows, weighted, in the order of its choices (a token's sum does not depend on the batch)
#pragma omp parallel for schedule(static) if (static_cast<int64_t>(R) * hid > kParallelElems)
    for (int t = 0; t < T; ++t) {
        float* o = out + static_cast<int64_t>(t) * hid;
        for (int j = 0; j < k; ++j) {
            const float w = weights[t * k + j];
            const float* y = rows_out + static_cast<int64_t>(row_of[t * k + j]) * hid;
            if (j == 0) {
#pragma omp simd
                for (int i = 0; i < hid; ++i) o[i] = w * y[i];
            } else {
#pragma omp simd
                for (int i = 0; i < hid; ++i) o[i] += w * y[i];
            }
        }
    }
    c.clock.mark(kPhaseOther);
    if (W.shared.inter > 0) {
        float* gate = Scratch::get(sc.gate, T);
        linear(W.shared_gate, h, hid, T, hid, 1, static_cast<const TW*>(nullptr), gate, 1, false);
        for (int t = 0; t < T; ++t) gate[t] = 1.0f / (1.0f + std::exp(-gate[t]));
        swiglu<TW>(c, W.shared, h, T, -1, gate, out, true);
    }
    add_residual(c.m, x, out, static_cast<int64_t>(T) * hid);
    c.clock.mark(kPhaseOther);
}

template <typename TW, typename TC>
void forward(const Model& m, const Step& s, float* x) {
    Scratch scratch;
    PhaseClock clock(s.timings);
    Ctx c{m, s, scratch, clock};
    for (int li = 0; li < m.num_layers; ++li) {
        const Layer& L = m.layers[li];
        attention_op<TW, TC>(c, L.attn, li, x);
        switch (L.mlp_kind) {
            case kMlpSparse: moe_op<TW>(c, L.post_norm, L.moe, x); break;
            default: mlp_op<TW>(c, L.post_norm, L.mlp, li, x); break;
        }
    }
    rms_norm(x, s.num_tokens, m.hidden, static_cast<const TW*>(m.final_norm), m.eps, x);  // in place: row by row
    clock.mark(kPhaseOther);
}

}  // namespace motet

using namespace motet;

extern "C" {

#ifndef MOTET_ABI_VERSION
#error "MOTET_ABI_VERSION is given by kernels/cpu_native.py's FLAGS"
#endif
int motet_abi_version() { return MOTET_ABI_VERSION; }

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

// One module group's LoRA deltas at one layer (sgmv.h): x and y fp32, the pool in dtype_w (0 fp32, 1 bf16).
int motet_sgmv(int dtype_w, const float* x, int64_t x_st, float* y, int64_t y_st, const LoraPool* pool, int group,
               int layer, const int32_t* seg_starts, const int32_t* seg_slots, int num_segs, int n_in,
               const int* sizes, int n) {
    if (group < 0 || group >= kLoraGroups || n < 1 || n > 3) return 1;
    if (dtype_w == 0)
        sgmv_pool<float>(x, x_st, y, y_st, *pool, group, layer, seg_starts, seg_slots, num_segs, n_in, sizes, n);
    else if (dtype_w == 1)
        sgmv_pool<uint16_t>(x, x_st, y, y_st, *pool, group, layer, seg_starts, seg_slots, num_segs, n_in, sizes, n);
    else
        return 2;
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
    // each linear: the model's dtype, or quantized along an input dimension of whole blocks; experts, their
    // router and gate: the model's dtype
    const auto ok = [m](const Linear& L, int K) {
        return L.code == m->dtype_w || ((L.code == kWeightInt8 || L.code == kWeightInt4) && K % QBLOCK == 0);
    };
    const auto mlp_ok = [&](const MlpWeights& W) {
        return W.inter > 0 && ok(W.gate_up, m->hidden) && ok(W.down, W.inter);
    };
    for (int i = 0; i < m->num_layers; ++i) {
        const Layer& L = m->layers[i];
        if (!ok(L.attn.qkv, m->hidden) || !ok(L.attn.o, m->num_heads * m->head_dim)) return 3;
        if (L.mlp_kind == kMlpDense && !mlp_ok(L.mlp)) return 3;
        if (L.mlp_kind == kMlpSparse) {
            const MoeWeights& W = L.moe;
            if (W.num_experts < 1 || W.top_k < 1 || W.top_k > W.num_experts || W.inter < 1 ||
                W.router.code != m->dtype_w || (W.shared.inter > 0 && (!mlp_ok(W.shared) ||
                W.shared_gate.code != m->dtype_w)))
                return 3;
        }
        if (L.mlp_kind != kMlpDense && L.mlp_kind != kMlpSparse) return 3;
    }
    if (m->dtype_w == 0 && m->dtype_cache == 0) forward<float, float>(*m, *s, x);
    else if (m->dtype_w == 1 && m->dtype_cache == 1) forward<uint16_t, uint16_t>(*m, *s, x);
    else if (m->dtype_w == 0 && m->dtype_cache == 1) forward<float, uint16_t>(*m, *s, x);
    else if (m->dtype_w == 1 && m->dtype_cache == 0) forward<uint16_t, float>(*m, *s, x);
    else return 2;
    return 0;
}

}  // extern "C"
