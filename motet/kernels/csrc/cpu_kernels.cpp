// CPU kernels for the step's hot paths, beside their torch references (kernels/*.py define the meaning).
//
// Plain C ABI (loaded with ctypes by kernels/cpu_native.py, compiled on first use with the flags of the CPU's
// instruction-set tier, kernels/cpu_isa.py: the headers pick their kernels by the compiler's feature macros), no
// torch headers: a few seconds to build. OpenMP resolves to the libgomp torch has already loaded, so these
// kernels share torch's thread pool instead of oversubscribing the cores.
//
// dtype codes: 0 = float32, 1 = bfloat16 (stored as uint16, converted exactly to fp32 on load; results
// rounded to nearest even, as torch does); weights may also be 2 = int8, 3 = int4 (qgemm.h). Every
// accumulation is in fp32 (in the avx512bf16 tier, a bf16 weight's product rounds its fp32 input to bf16 first:
// gemm_bf16.h).

#include "attention.h"
#include "attention_bf16.h"
#include "gemm.h"
#include "gemm_bf16.h"
#include "latent.h"
#include "moe.h"
#include "qgemm.h"
#include "routing.h"
#include "sgmv.h"

namespace motet {

// ---------------------------------------------------------------------------------------------------------
// The decoder stack as a program: a flat list of op records that Python writes once by walking the model's
// layers (engine/worker/cpu_forward.py), run by `forward` in one call a step, llama.cpp's way: a loop over the ops and a
// switch on each op's kind. No op knows an architecture; a family's layer is the ops its declaration implies.
//
// Each op reads rows of one fp32 buffer and writes rows of another: buffer 0 is the residual stream (the
// caller's x [T, hidden]), the others are scratch named by the program (Python's names: the normed input, qkv,
// the attention's output, a block's output, gate/up, ...), each [T, width] with the program's width as its row
// stride, kept between steps. An op's fields are generic (a few ints, pointers and floats) and each kind reads
// them as below; a new kind of layer is a new op kind, not a new struct.
//
//   kind          i[]                                            p[]                              f[]
//   RMS_NORM      in_col, out_col, n, groups, whole              w [n]                            eps
//                 (each of `groups` runs of n columns normed with w: one run spans all heads, or a run per head;
//                 whole > 0: one run that is this rank's part of a row `whole` wide, its sum of squares
//                 all-reduced over the ranks first: a norm across heads split by tensor parallelism)
//   LINEAR        K, N, code, accumulate, lora group, lora       w (packed, in `code`), bias [N]
//                 modules, their sizes (3)
//   ROTARY_KV     H, KVH, D, rotary dims, pool                   cos, sin [P, dims / 2], k/v cache
//                 (q and k heads of `in` rotated in place over their first `dims` values, k and v written to the
//                 caches at the pool's slots; in: q heads, then k heads, then v heads)
//   ATTENTION     H, KVH, D, pool, window                        k/v cache, sinks (fp32 [H])      scale, softcap
//   ACTIVATION    n, activation                                                                   alpha, limit
//                 (in: gate columns then up columns)
//   GATED_ADD     n, gate buffer                                 (out += sigmoid(gate's column 0) * in, per row)
//   ADD_RESIDUAL  n                                              post-norm w [n] (or null)        eps
//                 (in all-reduced over the ranks in place, normed where the layer says, added to out)
//   MOE           router logits buffer, E, top_k, I,             experts' gate_up, down (packed,   alpha, limit,
//                 renormalize, activation, hidden, code,         one after another, in `code`),   scale
//                 routing (0 softmax top-k, 1 routing.h's),      their biases, the correction
//                 sigmoid, groups, kept groups                   bias (fp32 [E], or null)
//   LATENT_ATTN   H, nope, rope, rank, v, kv buffer,              cos, sin [P, rope / 2], cache,    scale
//                 interleaved, kv_b's lora group (-1: none)      W_UK^T, W_UV (packed per head)
//                 (in: q [T, H (nope + rope)]; the kv buffer: [c_kv normed | k_pe] a row; out [T, H v]: latent.h,
//                 the cache's rows [c_kv | rotated k_pe] written at the step's slots)
//
// The pool: 0 = the global layers' KV (the step's slots and tables), 1 = the sliding-window layers' pool (the
// step's window slots and tables, where it has them; else the global ones: a context within the window).

enum OpKind {
    kRmsNorm = 0, kLinear, kRotaryKv, kAttention, kActivation, kAddResidual, kMoe, kGatedAdd, kLatentAttention,
    kNumOpKinds
};
// act(gate) * up by the config's names (cpu_native.ACTIVATIONS, in this order)
enum Activation { kActSilu = 0, kActGeluTanh, kActSwigluLimit, kActGelu, kActRelu, kActRelu2, kNumActivations };
enum KvPool { kPoolGlobal = 0, kPoolWindow = 1 };

struct Op {
    int32_t kind;  // OpKind
    int32_t layer;  // the decoder layer whose LoRA pieces a LINEAR (or LATENT_ATTN) reads
    int32_t in, out;  // buffers
    int32_t i[12];
    const void* p[5];
    float f[3];
};

// Sums a buffer over the tensor-parallel ranks, in place (the caller's collective: torch.distributed).
typedef void (*AllReduce)(float* data, int64_t n);

struct Program {
    int32_t dtype_w, dtype_cache, block_size, num_ops, num_buffers;
    const Op* ops;
    const int32_t* widths;  // [num_buffers]: each buffer's fp32 columns (buffer 0: the caller's x, hidden)
    AllReduce all_reduce;  // null on one rank; else each block's output is this rank's partial sum
    void* scratch;  // the forward's buffers: made by the first call, kept for the next (motet_release frees them)
};

struct Step {
    int num_tokens, num_seqs;
    const int64_t* positions;  // [T]
    const int64_t* slots;  // [T], -1: no KV write
    const int32_t* tables;  // [num_seqs, table_stride]
    int64_t table_stride;
    const int32_t* qsl;  // [num_seqs + 1]
    const int32_t* seq_lens;  // [num_seqs]
    const int64_t* window_slots;  // the window pool's (kv_window.py), or null: the global ones serve
    const int32_t* window_tables;
    int64_t window_table_stride;
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

// The program's buffers and the MoE op's own scratch, grown on first use and kept from step to step.
struct Scratch {
    std::vector<std::vector<float>> buffers;
    std::vector<float*> ptrs;
    std::vector<float> rows, rows_out, gu, act, weights, sums, scores, latent_q, latent_o;
    std::vector<int32_t> experts, offsets, row_of, token_of, cursor;
    std::vector<std::pair<float, int64_t>> queue;

    template <typename V>
    static typename V::value_type* get(V& v, int64_t n) {
        if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
        return v.data();
    }
};

// What every op of a step reads: the program, the step, its buffers, scratch, the clock.
struct Ctx {
    const Program& prog;
    const Step& s;
    Scratch& scratch;
    PhaseClock& clock;
    int T;
    float* buf(int id) const { return scratch.ptrs[id]; }
    int64_t ld(int id) const { return prog.widths[id]; }
};

// The linear layer's product in the weight's own format: the model's dtype (float GEMM) or a quantized one
// (qgemm.h). TW: the model's float dtype (biases, unquantized weights).
template <typename TW>
void linear(const void* w, int code, const float* x, int64_t ldx, int M, int K, int N, const TW* bias, float* y,
            int64_t ldy, bool accumulate) {
    const auto* q = static_cast<const uint8_t*>(w);
    if (code == kWeightInt8) qgemm<kWeightInt8>(x, ldx, M, K, q, N, bias, y, ldy, accumulate);
    else if (code == kWeightInt4) qgemm<kWeightInt4>(x, ldx, M, K, q, N, bias, y, ldy, accumulate);
    else if (code == kWeightMxfp4) qgemm<kWeightMxfp4>(x, ldx, M, K, q, N, bias, y, ldy, accumulate);
    else gemm(x, ldx, M, K, static_cast<const TW*>(w), N, bias, y, ldy, accumulate);
}

template <typename TW>
void rms_norm(const float* x, int64_t ldx, int M, int n, const TW* w, float eps, float* out, int64_t ldo) {
    for (int m = 0; m < M; ++m) {
        const float* xr = x + m * ldx;
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int i = 0; i < n; ++i) ss += xr[i] * xr[i];
        const float inv = 1.0f / std::sqrt(ss / n + eps);
        float* o = out + m * ldo;
#pragma omp simd
        for (int i = 0; i < n; ++i) o[i] = xr[i] * inv * load(w, i);
    }
}

template <typename TW>
void rms_norm_op(Ctx& c, const Op& op) {
    const int in_col = op.i[0], out_col = op.i[1], n = op.i[2], groups = op.i[3];
    const float* x = c.buf(op.in) + in_col;
    float* out = c.buf(op.out) + out_col;
    const int64_t ldx = c.ld(op.in), ldo = c.ld(op.out);
    const auto* w = static_cast<const TW*>(op.p[0]);
    if (op.i[4] > 0 && c.prog.all_reduce != nullptr) {  // the row spans the ranks: its sum of squares too
        float* ss = Scratch::get(c.scratch.sums, c.T);
        for (int t = 0; t < c.T; ++t) {
            const float* xr = x + t * ldx;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int i = 0; i < n; ++i) acc += xr[i] * xr[i];
            ss[t] = acc;
        }
        c.prog.all_reduce(ss, c.T);
        const float whole = static_cast<float>(op.i[4]);
        for (int t = 0; t < c.T; ++t) {
            const float inv = 1.0f / std::sqrt(ss[t] / whole + op.f[0]);
            const float* xr = x + t * ldx;
            float* o = out + t * ldo;
#pragma omp simd
            for (int i = 0; i < n; ++i) o[i] = xr[i] * inv * load(w, i);
        }
    } else if (groups == 1) {
        rms_norm(x, ldx, c.T, n, w, op.f[0], out, ldo);
    } else {  // each row's runs: rows of n values, `groups` to a row
        for (int t = 0; t < c.T; ++t) rms_norm(x + t * ldx, n, groups, n, w, op.f[0], out + t * ldo, n);
    }
    c.clock.mark(kPhaseOther);
}

// out (=, or +=) in @ W^T (+ bias), then the layer's LoRA deltas of its module group (each token its adapter's;
// the modules' outputs: adjacent columns of out), nothing without adapters in the step.
template <typename TW>
void linear_op(Ctx& c, const Op& op) {
    const int K = op.i[0], N = op.i[1], code = op.i[2], group = op.i[4], modules = op.i[5];
    const float* x = c.buf(op.in);
    float* y = c.buf(op.out);
    const Step& s = c.s;
    const bool lora = group >= 0 && s.lora != nullptr && s.num_segs > 0;
#ifdef MOTET_BF16_DOT
    if constexpr (std::is_same_v<TW, uint16_t>) {
        if (lora && code == kWeightBF16) {  // the shrink, then the product with the expand as its epilogue
            int64_t ldb;
            const uint16_t* xb = rounded_rows(x, c.ld(op.in), c.T, K, &ldb);
            thread_local LoraExpand expand;
            const bool any = lora_shrink(xb, ldb, y, c.ld(op.out), *s.lora, group, op.layer, s.seg_starts, s.seg_slots,
                                         s.num_segs, K, &op.i[6], modules, expand);
            if (any) c.clock.mark(kPhaseLora);  // (the expand is counted with the product it runs inside)
            const auto* w = static_cast<const uint16_t*>(op.p[0]);
            const auto* bias = static_cast<const uint16_t*>(op.p[1]);
            if (any) gemm_dot_rounded(xb, ldb, c.T, K, w, N, bias, y, c.ld(op.out), op.i[3] != 0, expand);
            else gemm_dot_rounded(xb, ldb, c.T, K, w, N, bias, y, c.ld(op.out), op.i[3] != 0, NoEpilogue{});
            c.clock.mark(kPhaseLinear);
            return;
        }
    }
#endif
    linear(op.p[0], code, x, c.ld(op.in), c.T, K, N, static_cast<const TW*>(op.p[1]), y, c.ld(op.out), op.i[3] != 0);
    c.clock.mark(kPhaseLinear);
    if (lora) {
        sgmv_pool<TW>(x, c.ld(op.in), y, c.ld(op.out), *s.lora, group, op.layer, s.seg_starts, s.seg_slots,
                      s.num_segs, K, &op.i[6], modules);
        c.clock.mark(kPhaseLora);
    }
}

// Rotary on each q and k head's first `dims` values (their two halves, Hugging Face layout; the rest passes),
// then k and v written to the pool's cache at each token's slot.
template <typename TC>
void rotary_kv_op(Ctx& c, const Op& op) {
    const Step& s = c.s;
    const int H = op.i[0], KVH = op.i[1], D = op.i[2], half = op.i[3] / 2;
    const bool window = op.i[4] == kPoolWindow && s.window_slots != nullptr;
    const int64_t* slots = window ? s.window_slots : s.slots;
    const auto* cos = static_cast<const float*>(op.p[0]);
    const auto* sin = static_cast<const float*>(op.p[1]);
    TC* kc = static_cast<TC*>(const_cast<void*>(op.p[2]));
    TC* vc = static_cast<TC*>(const_cast<void*>(op.p[3]));
    float* qkv = c.buf(op.in);
    const int64_t ld = c.ld(op.in), kv_size = static_cast<int64_t>(KVH) * D, q_size = static_cast<int64_t>(H) * D;
    for (int t = 0; t < c.T; ++t) {
        float* row = qkv + t * ld;
        const float* cs = cos + s.positions[t] * half;
        const float* sn = sin + s.positions[t] * half;
        for (int hd = 0; hd < H + KVH; ++hd) {
            float* v = row + static_cast<int64_t>(hd) * D;
#pragma omp simd
            for (int i = 0; i < half; ++i) {
                const float a = v[i], b = v[i + half];
                v[i] = a * cs[i] - b * sn[i];
                v[i + half] = b * cs[i] + a * sn[i];
            }
        }
        const int64_t slot = slots[t];
        if (slot >= 0) {
            for (int64_t i = 0; i < kv_size; ++i) {
                store(kc + slot * kv_size, i, row[q_size + i]);
                store(vc + slot * kv_size, i, row[q_size + kv_size + i]);
            }
        }
    }
    c.clock.mark(kPhaseOther);
}

template <typename TC>
void attention_op(Ctx& c, const Op& op) {
    const Step& s = c.s;
    const int H = op.i[0], KVH = op.i[1], D = op.i[2];
    const bool window = op.i[3] == kPoolWindow && s.window_tables != nullptr;
    attention(static_cast<const float*>(c.buf(op.in)), c.ld(op.in), static_cast<int64_t>(D),
              static_cast<const TC*>(op.p[0]), static_cast<const TC*>(op.p[1]), window ? s.window_tables : s.tables,
              window ? s.window_table_stride : s.table_stride, s.qsl, s.seq_lens, s.num_seqs, c.buf(op.out),
              c.ld(op.out), H, KVH, D, c.prog.block_size, op.f[0], op.i[4], op.f[1],
              static_cast<const float*>(op.p[2]));
    c.clock.mark(kPhaseAttention);
}

inline void activate(int kind, const float* g, const float* u, float* out, int n, float alpha, float limit) {
    switch (kind) {
        case kActGeluTanh: gelu_tanh_mul(g, u, out, n); break;
        case kActSwigluLimit: swiglu_limit_mul(g, u, out, n, alpha, limit); break;
        case kActGelu: gelu_mul(g, u, out, n); break;
        case kActRelu: relu_mul(g, u, out, n, false); break;
        case kActRelu2: relu_mul(g, u, out, n, true); break;
        default: silu_mul(g, u, out, n);
    }
}

// out = act(gate) * up of in's rows (gate columns, then up columns), each row times sigmoid(its gate value) where
// the op names a gate buffer (a shared expert's: the product after it is linear).
inline void activation_op(Ctx& c, const Op& op) {
    const int n = op.i[0], kind = op.i[1], T = c.T;
    const float* in = c.buf(op.in);
    float* out = c.buf(op.out);
    const int64_t ldi = c.ld(op.in), ldo = c.ld(op.out);
#pragma omp parallel for schedule(static) if (T > 8)
    for (int t = 0; t < T; ++t) {
        const float* g = in + t * ldi;
        activate(kind, g, g + n, out + t * ldo, n, op.f[0], op.f[1]);
    }
    c.clock.mark(kPhaseOther);
}

// out[:, :n] += sigmoid(gate[:, 0]) * in[:, :n]: Qwen2-MoE's shared expert scaled by its gate after its down
// projection, as transformers scales it (a quantized down rounds its input in blocks: scaled before, it would
// round differently).
inline void gated_add_op(Ctx& c, const Op& op) {
    const int n = op.i[0], gate_id = op.i[1], T = c.T;
    const float* in = c.buf(op.in);
    const float* gate = c.buf(gate_id);
    float* out = c.buf(op.out);
    const int64_t ldi = c.ld(op.in), ldo = c.ld(op.out), ldg = c.ld(gate_id);
    for (int t = 0; t < T; ++t) {
        const float sc = sigmoid(gate[t * ldg]);
        const float* x = in + t * ldi;
        float* o = out + t * ldo;
#pragma omp simd
        for (int i = 0; i < n; ++i) o[i] += sc * x[i];
    }
    c.clock.mark(kPhaseOther);
}

// A block's output joins the residual stream, the one point where it does: under tensor parallelism it is this
// rank's partial sum (its heads, its columns), so the ranks' parts are all-reduced first; then the layer's norm
// after the block where it has one (OLMo 2's, Gemma's), then the add.
template <typename TW>
void add_residual_op(Ctx& c, const Op& op) {
    const int n = op.i[0], T = c.T;
    float* o = c.buf(op.in);
    float* x = c.buf(op.out);
    const int64_t ldo = c.ld(op.in), ldx = c.ld(op.out);
    if (c.prog.all_reduce != nullptr) c.prog.all_reduce(o, static_cast<int64_t>(T) * ldo);
    if (op.p[0] != nullptr) rms_norm(o, ldo, T, n, static_cast<const TW*>(op.p[0]), op.f[0], o, ldo);
    for (int t = 0; t < T; ++t) {
        float* xr = x + t * ldx;
        const float* orow = o + t * ldo;
#pragma omp simd
        for (int i = 0; i < n; ++i) xr[i] += orow[i];
    }
    c.clock.mark(kPhaseOther);
}

// Each expert's rows through its weight, every expert in one grouped GEMM (moe.h): on float weights, or on
// quantized ones (int8 / int4 / MXFP4 blocks, every expert's packed weight one after another, its bias fp32).
template <typename TW>
void experts_product(int code, const float* x, int64_t ldx, const int32_t* offsets, int E, int K, const void* w,
                     int N, const TW* bias, float* y, int64_t ldy) {
    const auto* q = static_cast<const uint8_t*>(w);
    const auto* fbias = reinterpret_cast<const float*>(bias);
    if (code == kWeightInt8) grouped_qgemm<kWeightInt8>(x, ldx, offsets, E, K, q, N, fbias, y, ldy);
    else if (code == kWeightInt4) grouped_qgemm<kWeightInt4>(x, ldx, offsets, E, K, q, N, fbias, y, ldy);
    else if (code == kWeightMxfp4) grouped_qgemm<kWeightMxfp4>(x, ldx, offsets, E, K, q, N, fbias, y, ldy);
    else grouped_gemm(x, ldx, offsets, E, K, static_cast<const TW*>(w), N, bias, y, ldy);
}

// The sparse layer's experts over the router's logits: softmax, top-k -> the (token, choice) rows sorted by
// expert -> each expert's gate/up (+ bias), activation, down (+ bias) over its segment (grouped GEMMs) -> the rows'
// weighted sum per token into out (=). No LoRA: adapters target the attention of an MoE model only
// (motet/lora/adapter.py refuses the others).
template <typename TW>
void moe_op(Ctx& c, const Op& op) {
    Scratch& sc = c.scratch;
    const int logits_id = op.i[0], E = op.i[1], k = op.i[2], I = op.i[3], kind = op.i[5], hid = op.i[6];
    const bool renormalize = op.i[4] != 0;
    const int T = c.T, R = T * k;  // (token, choice) rows
    const float* h = c.buf(op.in);
    float* out = c.buf(op.out);
    const int64_t ldh = c.ld(op.in), ldo = c.ld(op.out), ldl = c.ld(logits_id);
    const float* logits = c.buf(logits_id);
    int32_t* experts = Scratch::get(sc.experts, R);
    float* weights = Scratch::get(sc.weights, R);
    const RouteOptions options{op.i[9] != 0, op.i[10], op.i[11], static_cast<const float*>(op.p[4]), op.f[2],
                               renormalize};
    for (int t = 0; t < T; ++t) {
        if (op.i[8] == 0) route(logits + t * ldl, E, k, renormalize, experts + t * k, weights + t * k, sc.queue);
        else route_scored(logits + t * ldl, E, k, options, experts + t * k, weights + t * k, sc.queue, sc.scores);
    }
    // rows sorted by expert, stably (a token's choices in token order within an expert's segment)
    int32_t* offsets = Scratch::get(sc.offsets, E + 1);
    int32_t* row_of = Scratch::get(sc.row_of, R);  // (token, choice) -> its sorted row
    int32_t* token_of = Scratch::get(sc.token_of, R);  // sorted row -> its token
    int32_t* cursor = Scratch::get(sc.cursor, E);
    std::fill(offsets, offsets + E + 1, 0);
    for (int i = 0; i < R; ++i) ++offsets[experts[i] + 1];
    for (int e = 0; e < E; ++e) offsets[e + 1] += offsets[e];
    std::copy(offsets, offsets + E, cursor);
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
        std::memcpy(rows + static_cast<int64_t>(r) * hid, h + token_of[r] * ldh, sizeof(float) * hid);
    c.clock.mark(kPhaseOther);
    float* gu = Scratch::get(sc.gu, static_cast<int64_t>(R) * 2 * I);
    float* act = Scratch::get(sc.act, static_cast<int64_t>(R) * I);
    float* rows_out = Scratch::get(sc.rows_out, static_cast<int64_t>(R) * hid);
    const int code = op.i[7];
    experts_product<TW>(code, rows, hid, offsets, E, hid, op.p[0], 2 * I, static_cast<const TW*>(op.p[2]), gu, 2 * I);
    c.clock.mark(kPhaseLinear);
#pragma omp parallel for schedule(static) if (static_cast<int64_t>(R) * I > kParallelElems / 4)
    for (int r = 0; r < R; ++r) {
        const float* g = gu + static_cast<int64_t>(r) * 2 * I;
        activate(kind, g, g + I, act + static_cast<int64_t>(r) * I, I, op.f[0], op.f[1]);
    }
    c.clock.mark(kPhaseOther);
    experts_product<TW>(code, act, I, offsets, E, I, op.p[1], hid, static_cast<const TW*>(op.p[3]), rows_out, hid);
    c.clock.mark(kPhaseLinear);
    // each token's rows, weighted, in the order of its choices (a token's sum does not depend on the batch)
#pragma omp parallel for schedule(static) if (static_cast<int64_t>(R) * hid > kParallelElems)
    for (int t = 0; t < T; ++t) {
        float* o = out + t * ldo;
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
}

// DeepSeek's latent attention (latent.h), its projections the program's linear and norm ops around it: the rotary
// on q's and the kv buffer's rotated parts, the latent rows written to the cache, the latent queries (q_nope W_UK per
// head), the attention over the cached rows, its output through W_UV per head into out; an adapter on kv_b_proj
// folded in on both sides.
template <typename TW, typename TC>
void latent_attention_op(Ctx& c, const Op& op) {
    const Step& s = c.s;
    const int H = op.i[0], nope = op.i[1], rope = op.i[2], rank = op.i[3], V = op.i[4], kv_id = op.i[5];
    const bool interleaved = op.i[6] != 0;
    const int group = op.i[7], T = c.T, qk = nope + rope, Dk = rank + rope;
    const auto* cos = static_cast<const float*>(op.p[0]);
    const auto* sin = static_cast<const float*>(op.p[1]);
    TC* cache = static_cast<TC*>(const_cast<void*>(op.p[2]));
    float* q = c.buf(op.in);
    float* kv = c.buf(kv_id);
    float* out = c.buf(op.out);
    const int64_t ldq = c.ld(op.in), ldk = c.ld(kv_id), ldo = c.ld(op.out);
    for (int t = 0; t < T; ++t) {
        const float* cs = cos + s.positions[t] * (rope / 2);
        const float* sn = sin + s.positions[t] * (rope / 2);
        for (int h = 0; h < H; ++h) rotate_latent(q + t * ldq + h * qk + nope, rope, interleaved, cs, sn);
        float* row = kv + t * ldk;
        rotate_latent(row + rank, rope, interleaved, cs, sn);
        if (s.slots[t] >= 0)
            for (int i = 0; i < Dk; ++i) store(cache + s.slots[t] * Dk, i, row[i]);
    }
    c.clock.mark(kPhaseOther);
    const bool lora = group >= 0 && s.lora != nullptr && s.num_segs > 0;
    float* ql = Scratch::get(c.scratch.latent_q, static_cast<int64_t>(T) * H * Dk);
    const int64_t uk = static_cast<int64_t>((rank + NR - 1) / NR) * NR * nope;  // elements of a head's W_UK^T
    const int64_t uv = static_cast<int64_t>((V + NR - 1) / NR) * NR * rank;  // of a head's W_UV
    const auto* w_uk = static_cast<const TW*>(op.p[3]);
    const auto* w_uv = static_cast<const TW*>(op.p[4]);
    for (int h = 0; h < H; ++h) {
        linear<TW>(w_uk + h * uk, c.prog.dtype_w, q + h * qk, ldq, T, nope, rank, nullptr, ql + h * Dk,
                   static_cast<int64_t>(H) * Dk, false);
        for (int t = 0; t < T; ++t)
            std::memcpy(ql + (static_cast<int64_t>(t) * H + h) * Dk + rank, q + t * ldq + h * qk + nope,
                        sizeof(float) * rope);
    }
    if (lora)
        latent_lora<TW>(false, q, ldq, qk, ql, static_cast<int64_t>(H) * Dk, Dk, T, H, nope, rank, V, *s.lora, group,
                        op.layer, s.seg_starts, s.seg_slots, s.num_segs);
    c.clock.mark(kPhaseLinear);
    float* ol = Scratch::get(c.scratch.latent_o, static_cast<int64_t>(T) * H * rank);
    latent_paged_attention(ql, static_cast<const TC*>(cache), s.tables, s.table_stride, s.qsl, s.seq_lens,
                           s.num_seqs, T, H, rank, rope, c.prog.block_size, op.f[0], ol);
    c.clock.mark(kPhaseAttention);
    for (int h = 0; h < H; ++h)
        linear<TW>(w_uv + h * uv, c.prog.dtype_w, ol + h * rank, static_cast<int64_t>(H) * rank, T, rank, V, nullptr,
                   out + h * V, ldo, false);
    if (lora)
        latent_lora<TW>(true, ol, static_cast<int64_t>(H) * rank, rank, out, ldo, V, T, H, nope, rank, V, *s.lora,
                        group, op.layer, s.seg_starts, s.seg_slots, s.num_segs);
    c.clock.mark(kPhaseLinear);
}

template <typename TW, typename TC>
void forward(const Program& prog, Scratch& scratch, const Step& s, float* x) {
    PhaseClock clock(s.timings);
    const int T = s.num_tokens;
    scratch.buffers.resize(prog.num_buffers);
    scratch.ptrs.resize(prog.num_buffers);
    scratch.ptrs[0] = x;
    for (int b = 1; b < prog.num_buffers; ++b)
        scratch.ptrs[b] = Scratch::get(scratch.buffers[b], static_cast<int64_t>(T) * prog.widths[b]);
    Ctx c{prog, s, scratch, clock, T};
    for (int i = 0; i < prog.num_ops; ++i) {
        const Op& op = prog.ops[i];
        switch (op.kind) {
            case kRmsNorm: rms_norm_op<TW>(c, op); break;
            case kLinear: linear_op<TW>(c, op); break;
            case kRotaryKv: rotary_kv_op<TC>(c, op); break;
            case kAttention: attention_op<TC>(c, op); break;
            case kActivation: activation_op(c, op); break;
            case kAddResidual: add_residual_op<TW>(c, op); break;
            case kMoe: moe_op<TW>(c, op); break;
            case kGatedAdd: gated_add_op(c, op); break;
            case kLatentAttention: latent_attention_op<TW, TC>(c, op); break;
            default: break;  // (refused by check_program)
        }
    }
}

// 0 where every op's buffers, columns and shapes are in range and its kernels take its arguments.
inline int check_program(const Program& m) {
    if (m.num_buffers < 1 || m.block_size < 1) return 3;
    const auto buffer = [&m](int id) { return id >= 0 && id < m.num_buffers; };
    const auto width = [&m](int id) { return m.widths[id]; };
    // a linear's weight: the model's dtype, or quantized along an input dimension of whole blocks
    const auto weight_ok = [&m](int code, int K) {
        return code == m.dtype_w || (quantized_code(code) && K % QBLOCK == 0);
    };
    for (int n = 0; n < m.num_ops; ++n) {
        const Op& op = m.ops[n];
        if (op.kind < 0 || op.kind >= kNumOpKinds || !buffer(op.in) || !buffer(op.out)) return 3;
        const int* i = op.i;
        bool ok = true;
        switch (op.kind) {
            case kRmsNorm:
                ok = i[2] > 0 && i[3] > 0 && i[0] >= 0 && i[1] >= 0 && i[0] + i[2] * i[3] <= width(op.in) &&
                     i[1] + i[2] * i[3] <= width(op.out) && op.p[0] != nullptr && i[4] >= 0 &&
                     (i[4] == 0 || (i[3] == 1 && i[4] >= i[2]));
                break;
            case kLinear:
                ok = i[0] <= width(op.in) && i[1] <= width(op.out) && weight_ok(i[2], i[0]) && op.p[0] != nullptr &&
                     i[4] < kLoraGroups && (i[4] < 0 || (i[5] >= 1 && i[5] <= 3));
                break;
            case kRotaryKv:
                ok = (i[0] + 2 * i[1]) * i[2] <= width(op.in) && i[3] % 2 == 0 && i[3] > 0 && i[3] <= i[2] &&
                     op.p[0] && op.p[1] && op.p[2] && op.p[3];
                break;
            case kAttention:
                ok = i[1] > 0 && i[0] % i[1] == 0 && i[0] / i[1] <= kMaxGroup && i[2] <= kMaxHeadDim &&
                     i[0] * i[2] <= width(op.in) && i[0] * i[2] <= width(op.out) && i[4] >= 0 && op.p[0] && op.p[1];
                break;
            case kActivation:
                ok = 2 * i[0] <= width(op.in) && i[0] <= width(op.out) && i[1] >= 0 && i[1] < kNumActivations;
                break;
            case kAddResidual:
                ok = i[0] <= width(op.in) && i[0] <= width(op.out);
                break;
            case kGatedAdd:
                ok = i[0] <= width(op.in) && i[0] <= width(op.out) && buffer(i[1]);
                break;
            case kMoe:
                ok = buffer(i[0]) && i[1] >= 1 && i[2] >= 1 && i[2] <= i[1] && i[3] >= 1 && i[1] <= width(i[0]) &&
                     i[5] >= 0 && i[5] < kNumActivations && i[6] <= width(op.in) && i[6] <= width(op.out) &&
                     weight_ok(i[7], i[6]) && weight_ok(i[7], i[3]) && op.p[0] && op.p[1] &&
                     (i[8] == 0 || (i[8] == 1 && i[10] >= 1 && i[1] % i[10] == 0 && i[11] >= 1 && i[11] <= i[10]));
                break;
            case kLatentAttention:
                ok = i[0] >= 1 && i[1] >= 1 && i[2] >= 2 && i[2] % 2 == 0 && i[2] <= kMaxLatentRope && i[3] >= 1 &&
                     i[4] >= 1 && buffer(i[5]) && i[0] * (i[1] + i[2]) <= width(op.in) &&
                     i[0] * i[4] <= width(op.out) && i[3] + i[2] <= width(i[5]) && i[7] < kLoraGroups && op.p[0] && op.p[1] && op.p[2] && op.p[3] &&
                     op.p[4];
                break;
        }
        if (!ok) return 3;
    }
    return 0;
}

}  // namespace motet

using namespace motet;

extern "C" {

#ifndef MOTET_ABI_VERSION
#error "MOTET_ABI_VERSION is given by kernels/cpu_native.py's FLAGS"
#endif
int motet_abi_version() { return MOTET_ABI_VERSION; }

// The kernels this build holds, by the instruction sets its flags allowed (cpu_native.KERNEL_BITS): 1 the
// AVX2 ones, 2 bf16 dot products (gemm_bf16.h), 4 VNNI integer dot products (qgemm.h).
int motet_kernels() {
    int bits = 0;
#ifdef __AVX2__
    bits |= 1;
#endif
#ifdef MOTET_BF16_DOT
    bits |= 2;
#endif
#ifdef MOTET_QGEMM_VNNI
    bits |= 4;
#endif
    return bits;
}

// window 0: none; softcap 0: none; sinks: fp32 [H] or null.
int motet_attention(int dtype_q, int dtype_cache, const void* q, int64_t q_st, int64_t q_sh, const void* kc,
                    const void* vc, const int32_t* tables, int64_t table_stride, const int32_t* qsl,
                    const int32_t* seq_lens, int num_seqs, void* out, int H, int KVH, int D, int BS,
                    float scale, int window, float softcap, const float* sinks) {
    if (H % KVH != 0 || H / KVH > kMaxGroup || D > kMaxHeadDim || window < 0) return 1;
#define ATTN(TQ, TC)                                                                                         \
    attention(static_cast<const TQ*>(q), q_st, q_sh, static_cast<const TC*>(kc), static_cast<const TC*>(vc), \
              tables, table_stride, qsl, seq_lens, num_seqs, static_cast<TQ*>(out),                         \
              static_cast<int64_t>(H) * D, H, KVH, D, BS, scale, window, softcap, sinks)
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
    if (quantized_code(dtype_w) && K % QBLOCK != 0) return 1;
    if (dtype_w == kWeightInt8)
        qgemm<kWeightInt8>(x, ldx, M, K, q, N, fbias, y, ldy, accumulate != 0);
    else if (dtype_w == kWeightInt4)
        qgemm<kWeightInt4>(x, ldx, M, K, q, N, fbias, y, ldy, accumulate != 0);
    else if (dtype_w == kWeightMxfp4)
        qgemm<kWeightMxfp4>(x, ldx, M, K, q, N, fbias, y, ldy, accumulate != 0);
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

// Rows [n0, n1) of the weight packed as motet_gemm's (dtype_w 0 fp32 or 1 bf16; n0 a multiple of 16) as a dense
// fp32 [n1 - n0, K] in `out`.
int motet_unpack_rows(int dtype_w, const void* packed, int K, int n0, int n1, float* out) {
    if (n0 % NR != 0 || n1 < n0) return 3;
    if (dtype_w == 0)
        unpack_rows(static_cast<const float*>(packed), K, n0, n1, out);
    else if (dtype_w == 1)
        unpack_rows(static_cast<const uint16_t*>(packed), K, n0, n1, out);
    else
        return 2;
    return 0;
}

// Rows sorted by expert through their experts' weights (offsets [E + 1]: each expert's rows), every expert
// packed as motet_gemm's weights one after another (dtype_w: a WeightCode), biases [E, N] in the weight's dtype,
// fp32 for a quantized weight (K: a multiple of 32), or null.
int motet_experts(int dtype_w, const float* x, int64_t ldx, const int32_t* offsets, int E, int K,
                  const void* packed, int N, const void* bias, float* y, int64_t ldy) {
    if (quantized_code(dtype_w) && K % QBLOCK != 0) return 1;
    if (quantized_code(dtype_w) || dtype_w == 0)
        experts_product<float>(dtype_w, x, ldx, offsets, E, K, packed, N, static_cast<const float*>(bias), y, ldy);
    else if (dtype_w == 1)
        experts_product<uint16_t>(1, x, ldx, offsets, E, K, packed, N, static_cast<const uint16_t*>(bias), y, ldy);
    else
        return 2;
    return 0;
}

// 0, or why the program cannot run: 2 its dtypes, 3 an op's arguments.
int motet_check(const Program* m) {
    if (m->dtype_w < 0 || m->dtype_w > 1 || m->dtype_cache < 0 || m->dtype_cache > 1) return 2;
    return check_program(*m);
}

// The program over x [T, widths[0]] (the embeddings in, the program's last op's result out). The program is
// checked once (motet_check) when it is made.
int motet_forward(Program* m, const Step* s, float* x) {
    if (m->scratch == nullptr) m->scratch = new Scratch();
    Scratch& scratch = *static_cast<Scratch*>(m->scratch);
    if (m->dtype_w == 0 && m->dtype_cache == 0) forward<float, float>(*m, scratch, *s, x);
    else if (m->dtype_w == 1 && m->dtype_cache == 1) forward<uint16_t, uint16_t>(*m, scratch, *s, x);
    else if (m->dtype_w == 0 && m->dtype_cache == 1) forward<float, uint16_t>(*m, scratch, *s, x);
    else if (m->dtype_w == 1 && m->dtype_cache == 0) forward<uint16_t, float>(*m, scratch, *s, x);
    else return 2;
    return 0;
}

// Frees the program's scratch (its buffers stay with it between steps).
void motet_release(Program* m) {
    delete static_cast<Scratch*>(m->scratch);
    m->scratch = nullptr;
}

}  // extern "C"
