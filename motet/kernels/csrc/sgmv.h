// SGMV over the adapters' pool: each token adds its own LoRA adapter's delta (kernels/sgmv.py's meaning and
// layout, motet/lora/pool.py's packing).
#pragma once

#include <algorithm>

#include "common.h"
#include "gemm_bf16.h"

namespace motet {

// q/k/v, o, gate/up, down, then a latent attention's q_a, q_b, kv_a, kv_b (motet/lora/pool.py's DECODER_GROUPS)
constexpr int kLoraGroups = 8;
enum LoraIndex { kLoraQKV = 0, kLoraO, kLoraGateUp, kLoraDown };

// The pool: weights in one buffer of the model's dtype; descriptors [slots, desc_ld] int64: the adapter's rank,
// then per group (element offset of layer 0's piece or -1, layer stride, mask of the group's modules it
// targets). A piece: the targeted modules' A stacked [k r, a_ld] (row i r + j: the i-th targeted module's rank
// j), then each targeted module's BT = (B scale)^T [r, bt_ld[m]].
struct LoraPool {
    const void* data;
    const int64_t* desc;
    int64_t desc_ld;
    int32_t a_ld[kLoraGroups];
    int32_t bt_ld[kLoraGroups][3];
};

// y[t, its columns of module m] += BT_m^T h_m for `rows` BT rows of `n` values: eight columns at a time, each
// loaded once and updated by every rank (h: the module's r values of the shrink).
template <typename TW>
inline void expand_row(const float* h, const TW* bt, int64_t ld, int r, int n, float* y) {
    int o = 0;
#ifdef __AVX2__
    for (; o + 8 <= n; o += 8) {
        __m256 acc = _mm256_loadu_ps(y + o);
        for (int j = 0; j < r; ++j) acc = _mm256_fmadd_ps(_mm256_set1_ps(h[j]), load8(bt + j * ld + o), acc);
        _mm256_storeu_ps(y + o, acc);
    }
#endif
    for (; o < n; ++o) {
        float acc = y[o];
        for (int j = 0; j < r; ++j) acc += h[j] * load(bt + j * ld, o);
        y[o] = acc;
    }
}

// One module group of one layer: n modules read x [T, n_in] and write adjacent columns of y, sizes[m] each.
// For each token whose segment has an adapter targeting the group: h = A x (one pass over the targeted
// modules' rows), then each targeted module's columns += BT_m^T h_m. Tokens are split over the threads in
// contiguous runs (a segment's tokens share their adapter's piece, which stays in cache); small steps run on
// the calling thread: a parallel region costs more than they do.
#ifdef MOTET_BF16_DOT
template <typename TW>
void sgmv_pool_dot(const float* x, int64_t ldx, float* y, int64_t ldy, const LoraPool& P, int g, int layer,
                   const int32_t* seg_starts, const int32_t* seg_slots, int num_segs, int n_in, const int* sizes,
                   int n);
#endif

template <typename TW>
void sgmv_pool(const float* x, int64_t ldx, float* y, int64_t ldy, const LoraPool& P, int g, int layer,
               const int32_t* seg_starts, const int32_t* seg_slots, int num_segs, int n_in, const int* sizes,
               int n) {
#ifdef MOTET_BF16_DOT
    if constexpr (std::is_same_v<TW, uint16_t>)
        return sgmv_pool_dot<TW>(x, ldx, y, ldy, P, g, layer, seg_starts, seg_slots, num_segs, n_in, sizes, n);
#endif
    const TW* W = static_cast<const TW*>(P.data);
    const int64_t T = seg_starts[num_segs];
    const int full = (1 << n) - 1;
    int64_t work = 0;
    int width = 0;  // the widest shrink: k r
    for (int i = 0; i < num_segs; ++i) {
        if (seg_slots[i] < 0) continue;
        const int64_t* row = P.desc + static_cast<int64_t>(seg_slots[i]) * P.desc_ld;
        if (row[1 + 3 * g] < 0) continue;
        const int kr = __builtin_popcount(static_cast<int>(row[3 + 3 * g]) & full) * static_cast<int>(row[0]);
        width = std::max(width, kr);
        work += (seg_starts[i + 1] - seg_starts[i]) * kr * (n_in + 64);
    }
    if (work == 0) return;
    int col[3] = {0, 0, 0};
    for (int m = 1; m < n; ++m) col[m] = col[m - 1] + sizes[m - 1];
    std::vector<float> hbuf(static_cast<size_t>(T) * width);
#pragma omp parallel for schedule(static) if (work >= (1 << 17))
    for (int64_t t = 0; t < T; ++t) {
        const int i = static_cast<int>(std::upper_bound(seg_starts, seg_starts + num_segs + 1, t) - seg_starts) - 1;
        if (seg_slots[i] < 0) continue;
        const int64_t* row = P.desc + static_cast<int64_t>(seg_slots[i]) * P.desc_ld;
        const int64_t offset = row[1 + 3 * g];
        if (offset < 0) continue;
        const int r = static_cast<int>(row[0]), mask = static_cast<int>(row[3 + 3 * g]) & full;
        const int k = __builtin_popcount(mask);
        const TW* piece = W + offset + layer * row[2 + 3 * g];
        float* h = hbuf.data() + t * width;
        dots(x + t * ldx, piece, P.a_ld[g], k * r, n_in, h);
        const TW* bt = piece + static_cast<int64_t>(k) * r * P.a_ld[g];
        for (int m = 0, pos = 0; m < n; ++m) {
            if (!(mask >> m & 1)) continue;
            expand_row(h + pos * r, bt, P.bt_ld[g][m], r, sizes[m], y + t * ldy + col[m]);
            bt += static_cast<int64_t>(r) * P.bt_ld[g][m];
            ++pos;
        }
    }
}

#ifdef MOTET_BF16_DOT
// ---------------------------------------------------------------------------------------------------------
// The avx512bf16 tier's SGMV over a bf16 pool, with `vdpbf16ps` as the base GEMM's (gemm_bf16.h): x and the
// shrink's h are rounded to bf16 (nearest even), every product is exact in fp32 and the sums are fp32: fp32
// arithmetic on x and h rounded to bf16, what a bf16 LoRA in torch computes (it rounds h too). Per segment (one
// adapter's tokens: the scheduler orders a batch by adapter) a tile of tokens at once, so each adapter piece is
// read once per tile instead of once per token. The shrink runs first, for every row; the expand is the base
// GEMM's epilogue (`LoraExpand`): each panel's rows get their delta while the product's tile is still in cache,
// so the output is not streamed through memory a second time.

constexpr int kShrinkRows = 8, kShrinkCols = 2;  // a shrink tile: 8 tokens x 2 rows of A (16 sums)

// h[r][j] (bf16) = xb row r . A row j for R tokens and J rows of A, over n_in: 32 k per `vdpbf16ps`, both
// operands contiguous, their tails masked.
template <int R, int J>
inline void shrink_tile(const uint16_t* xb, int64_t ldb, const uint16_t* A, int64_t lda, int n_in, uint16_t* h,
                        int64_t ldh) {
    __m512 acc[R][J];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
        for (int j = 0; j < J; ++j) acc[r][j] = _mm512_setzero_ps();
    for (int k = 0; k < n_in; k += 32) {
        const int left = n_in - k;
        const __mmask32 mask = left >= 32 ? 0xFFFFFFFFu : (1u << left) - 1;
        __m512i a[J];
#pragma GCC unroll 2
        for (int j = 0; j < J; ++j) a[j] = _mm512_maskz_loadu_epi16(mask, A + j * lda + k);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            const __m512i v = _mm512_maskz_loadu_epi16(mask, xb + r * ldb + k);
#pragma GCC unroll 2
            for (int j = 0; j < J; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)v, (__m512bh)a[j]);
        }
    }
    // The R J sums: each accumulator's 16 lanes added, all at once (a transposing tree of four levels, where
    // one reduction each would cost 4x the work), then rounded to bf16 together.
    __m512 v[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) v[i] = i < R * J ? acc[i / J][i % J] : _mm512_setzero_ps();
    const auto fold = [](__m512 a, __m512 b, __m512i lo, __m512i hi) __attribute__((always_inline)) {
        return _mm512_add_ps(_mm512_permutex2var_ps(a, lo, b), _mm512_permutex2var_ps(a, hi, b));
    };
    // level w (8, 4, 2, 1): a's and b's runs of 2w lanes each halved, a's half-run sums before b's; so lane i
    // ends with accumulator i's total
    const __m512i lo8 = _mm512_set_epi32(23, 22, 21, 20, 19, 18, 17, 16, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i hi8 = _mm512_set_epi32(31, 30, 29, 28, 27, 26, 25, 24, 15, 14, 13, 12, 11, 10, 9, 8);
    const __m512i lo4 = _mm512_set_epi32(27, 26, 25, 24, 11, 10, 9, 8, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512i hi4 = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 23, 22, 21, 20, 7, 6, 5, 4);
    const __m512i lo2 = _mm512_set_epi32(29, 28, 13, 12, 25, 24, 9, 8, 21, 20, 5, 4, 17, 16, 1, 0);
    const __m512i hi2 = _mm512_set_epi32(31, 30, 15, 14, 27, 26, 11, 10, 23, 22, 7, 6, 19, 18, 3, 2);
    const __m512i lo1 = _mm512_set_epi32(30, 14, 28, 12, 26, 10, 24, 8, 22, 6, 20, 4, 18, 2, 16, 0);
    const __m512i hi1 = _mm512_set_epi32(31, 15, 29, 13, 27, 11, 25, 9, 23, 7, 21, 5, 19, 3, 17, 1);
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) v[i] = fold(v[i], v[i + 8], lo8, hi8);
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) v[i] = fold(v[i], v[i + 4], lo4, hi4);
#pragma GCC unroll 2
    for (int i = 0; i < 2; ++i) v[i] = fold(v[i], v[i + 2], lo2, hi2);
    v[0] = fold(v[0], v[1], lo1, hi1);
    alignas(64) uint16_t sums[16];
    _mm256_store_si256(reinterpret_cast<__m256i*>(sums), (__m256i)_mm512_cvtneps_pbh(v[0]));
#pragma GCC unroll 16
    for (int i = 0; i < R * J; ++i) h[i / J * ldh + i % J] = sums[i];
}

template <int R>
inline void shrink_rows(int cols, const uint16_t* xb, int64_t ldb, const uint16_t* A, int64_t lda, int n_in,
                        uint16_t* h, int64_t ldh) {
    if (cols == 2) shrink_tile<R, 2>(xb, ldb, A, lda, n_in, h, ldh);
    else shrink_tile<R, 1>(xb, ldb, A, lda, n_in, h, ldh);
}

inline void shrink(int rows, int cols, const uint16_t* xb, int64_t ldb, const uint16_t* A, int64_t lda, int n_in,
                   uint16_t* h, int64_t ldh) {
    with_rows<8>(rows, [&](auto r) { shrink_rows<decltype(r)::value>(cols, xb, ldb, A, lda, n_in, h, ldh); });
}

// y[r][0..nv) += h row r (bf16, r_lora values) . BT's nv (<= 16) columns, for R tokens: BT's rows j and j + 1
// (ld apart) interleaved into one pair vector as gemm_bf16.h's panel_pair does; the second row is zero past
// r_lora (so h's value past the module's own, another module's, multiplies zeros).
template <int R>
inline void expand_tile(const uint16_t* h, int64_t ldh, const uint16_t* bt, int64_t ld, int r_lora, int nv,
                        float* y, int64_t ldy) {
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,  //
                                         23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __mmask16 cols = nv >= 16 ? 0xFFFF : (1u << nv) - 1;
    __m512 acc[R];
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int j = 0; j < r_lora; j += 2) {
        const __m256i lo = _mm256_maskz_loadu_epi16(cols, bt + j * ld);
        const __m256i hi = j + 1 < r_lora ? _mm256_maskz_loadu_epi16(cols, bt + (j + 1) * ld) : _mm256_setzero_si256();
        const __m512i b = _mm512_permutexvar_epi16(idx, _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
#pragma GCC unroll 12
        for (int r = 0; r < R; ++r) {
            int32_t pair;
            std::memcpy(&pair, h + r * ldh + j, 4);
            acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(pair), (__m512bh)b);
        }
    }
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
        float* yr = y + r * ldy;
        _mm512_mask_storeu_ps(yr, cols, _mm512_add_ps(_mm512_maskz_loadu_ps(cols, yr), acc[r]));
    }
}

inline void expand(int rows, const uint16_t* h, int64_t ldh, const uint16_t* bt, int64_t ld, int r_lora, int nv,
                   float* y, int64_t ldy) {
    with_rows<12>(rows, [&](auto r) { expand_tile<decltype(r)::value>(h, ldh, bt, ld, r_lora, nv, y, ldy); });
}

// One segment with an adapter on the group: its rows, its adapter's piece at this layer, where its shrink tiles
// begin in the flattened list the threads share.
struct LoraSegment {
    int64_t t0, rows;
    const uint16_t* piece;
    int r, mask, k;  // rank, targeted modules, their count
    int64_t first_tile;
};

// The step's LoRA for one module group at one layer: its segments, then (once `shrink` ran) every row's h, and
// the expand as an epilogue of the product that writes y (or run alone: `expand_all`).
struct LoraExpand {
    const LoraPool* P;
    int g, n, sizes[3], col[3];
    std::vector<LoraSegment> segs;  // by t0
    uint16_t* h;
    int64_t ldh;
    float* y;
    int64_t ldy;

    // y's rows [m_start, m_end), columns [n0, n0 + nv): each segment's rows there, each of its modules there
    void operator()(int m_start, int m_end, int n0, int nv) const {
        const auto first = std::upper_bound(segs.begin(), segs.end(), m_start,
                                            [](int64_t t, const LoraSegment& s) { return t < s.t0 + s.rows; });
        for (auto s = first; s != segs.end() && s->t0 < m_end; ++s) {
            const int64_t a = std::max<int64_t>(m_start, s->t0), b = std::min<int64_t>(m_end, s->t0 + s->rows);
            const uint16_t* bt = s->piece + static_cast<int64_t>(s->k) * s->r * P->a_ld[g];
            for (int m = 0, pos = 0; m < n; ++m) {
                if (!(s->mask >> m & 1)) continue;
                const int c0 = std::max(n0, col[m]), c1 = std::min(n0 + nv, col[m] + sizes[m]);
                if (c0 < c1)
                    for (int64_t t = a; t < b; t += MR_DOT)
                        expand(static_cast<int>(std::min<int64_t>(MR_DOT, b - t)), h + t * ldh + pos * s->r, ldh,
                               bt + (c0 - col[m]), P->bt_ld[g][m], s->r, c1 - c0, y + t * ldy + c0, ldy);
                bt += static_cast<int64_t>(s->r) * P->bt_ld[g][m];
                ++pos;
            }
        }
    }

    // every panel of y's columns, the panels split over the threads (where the product is not ours to extend)
    void expand_all(int64_t T) const {
        const int N = col[n - 1] + sizes[n - 1], panels = (N + NR - 1) / NR;
#pragma omp parallel for schedule(static) if (T * N >= (1 << 14))
        for (int p = 0; p < panels; ++p) (*this)(0, static_cast<int>(T), p * NR, std::min(NR, N - p * NR));
    }
};

// The segments of group g's adapters at `layer`, and every row's h = A x from x rounded to bf16 (xb, ldb);
// false if no segment has an adapter on the group. h lives in the calling thread's buffer until its next call.
inline bool lora_shrink(const uint16_t* xb, int64_t ldb, float* y, int64_t ldy, const LoraPool& P, int g, int layer,
                        const int32_t* seg_starts, const int32_t* seg_slots, int num_segs, int n_in, const int* sizes,
                        int n, LoraExpand& out) {
    const uint16_t* W = static_cast<const uint16_t*>(P.data);
    const int full = (1 << n) - 1;
    out.P = &P;
    out.g = g;
    out.n = n;
    for (int m = 0; m < n; ++m) {
        out.sizes[m] = sizes[m];
        out.col[m] = m > 0 ? out.col[m - 1] + sizes[m - 1] : 0;
    }
    out.segs.clear();
    int64_t tiles = 0, work = 0;
    int width = 0;  // the widest shrink: k r
    for (int i = 0; i < num_segs; ++i) {
        if (seg_slots[i] < 0 || seg_starts[i + 1] <= seg_starts[i]) continue;
        const int64_t* row = P.desc + static_cast<int64_t>(seg_slots[i]) * P.desc_ld;
        const int64_t offset = row[1 + 3 * g];
        const int mask = static_cast<int>(row[3 + 3 * g]) & full;
        if (offset < 0 || mask == 0) continue;
        LoraSegment s{seg_starts[i], seg_starts[i + 1] - seg_starts[i], W + offset + layer * row[2 + 3 * g],
                      static_cast<int>(row[0]), mask, __builtin_popcount(mask), tiles};
        tiles += (s.rows + kShrinkRows - 1) / kShrinkRows * ((s.k * s.r + kShrinkCols - 1) / kShrinkCols);
        width = std::max(width, s.k * s.r);
        work += s.rows * s.k * s.r * n_in;
        out.segs.push_back(s);
    }
    if (out.segs.empty()) return false;
    // a spare value per row: an odd rank's last pair reads one past its module's h (times a zero row of BT)
    thread_local std::vector<uint16_t> hbuf;
    const int64_t T = seg_starts[num_segs];
    out.ldh = width + 2;
    hbuf.assign(static_cast<size_t>(T) * out.ldh, 0);
    out.h = hbuf.data();
    out.y = y;
    out.ldy = ldy;
    const std::vector<LoraSegment>& segs = out.segs;
    uint16_t* h = out.h;
    const int64_t ldh = out.ldh;
#pragma omp parallel for schedule(static) if (work >= (1 << 16))
    for (int64_t tile = 0; tile < tiles; ++tile) {
        const LoraSegment& s = *(std::upper_bound(segs.begin(), segs.end(), tile,
                                                  [](int64_t t, const LoraSegment& x) { return t < x.first_tile; }) -
                                 1);
        const int64_t kr = s.k * s.r, col_tiles = (kr + kShrinkCols - 1) / kShrinkCols;
        const int64_t local = tile - s.first_tile, r0 = local / col_tiles * kShrinkRows;
        const int64_t j0 = local % col_tiles * kShrinkCols;
        const int64_t t = s.t0 + r0;
        shrink(static_cast<int>(std::min<int64_t>(kShrinkRows, s.rows - r0)),
               static_cast<int>(std::min<int64_t>(kShrinkCols, kr - j0)), xb + t * ldb, ldb, s.piece + j0 * P.a_ld[g],
               P.a_ld[g], n_in, h + t * ldh + j0, ldh);
    }
    return true;
}

// The deltas alone, on y that a product already wrote (motet_sgmv, and a quantized or fp32 base weight's).
template <typename TW>
void sgmv_pool_dot(const float* x, int64_t ldx, float* y, int64_t ldy, const LoraPool& P, int g, int layer,
                   const int32_t* seg_starts, const int32_t* seg_slots, int num_segs, int n_in, const int* sizes,
                   int n) {
    const int64_t T = seg_starts[num_segs];
    int64_t ldb;
    const uint16_t* xb = rounded_rows(x, ldx, static_cast<int>(T), n_in, &ldb);
    thread_local LoraExpand lora;
    if (lora_shrink(xb, ldb, y, ldy, P, g, layer, seg_starts, seg_slots, num_segs, n_in, sizes, n, lora))
        lora.expand_all(T);
}
#endif
}  // namespace motet
