// A mixture-of-experts step's routed experts in one call (ember/kernels/cpu_moe.py).
//
// The caller groups the step's (token, slot) rows by expert (rows [offsets[e], offsets[e + 1]) go to
// local expert e) and this runs every active expert's SwiGLU MLP over its rows: gate and up, then
// silu(gate) * up, then down, each expert's weights streamed once a call (for up to BLOCK rows an expert,
// a decode step's; a prefill's blocks of rows re-read a part's weights from cache). Two phases over the shared
// pool: every active expert's gate/up outputs (split in chunks of intermediate outputs, silu * up applied
// by the part that computed them), then every active expert's down outputs (chunks of hidden outputs).
// Parts are claimed by whichever thread is free, and every output is one fixed sequence of operations
// over its own row, so neither the split nor the other rows of the step change a bit (batch-invariant).
//
// Dense experts (fp32 or bf16 weights, gate_up [E, 2I, H] with gate rows then up rows, down [E, H, I],
// as ember.model.moe.MoE stacks them): per output a sixteen-lane fused multiply-add over the inputs in
// order, then common.h's fixed lane tree. The bf16 path rounds as the per-expert torch loop does (gate
// and up to bf16, silu(gate) to bf16, the product to bf16, the output to bf16); fp32 rounds nowhere.
//
// Int4 experts: each linear in csrc/q4_linear.cpp's layout and arithmetic (Q4_1 codes with float16
// scale and low, int8 activations per 32 inputs), computed by its own row kernel, so an expert's outputs
// have exactly the bits of ember_q4_linear on that expert; gate_up's outputs are interleaved by 32 (a
// quad of 64 holds gates j .. j + 31 and the ups of the same j) so the part that computed a quad applies
// silu * up (decoder_step.cpp's, the same bits) without waiting for another part.
#include <vector>

#include "common.h"
#include "thread_pool.h"

#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif

// csrc/q4_linear.cpp: rows of x times the quads [quad_begin, quad_end) of one int4 weight, on this thread
void q4_rows_quads(const uint16_t* x, int64_t rows, int64_t K, const uint8_t* codes, const uint16_t* dm, int64_t N,
                   int64_t quad_begin, int64_t quad_end, uint16_t* y);

namespace {

const int64_t CHUNK = 64;      // dense: outputs a part computes (a multiple of 16)
const int64_t BLOCK = 32;      // dense: rows kept in cache while a part runs over its outputs
const int64_t QUADS = 2;       // int4: quads (of 64 outputs) a part computes
const int64_t MAX_PARTS = 60000;  // the pool's limit is 0xffff parts a call
#if defined(__AVX512F__)
const int TILE = 4;  // rows sharing each weight load: 2 * TILE sixteen-lane accumulators fit the registers
#else
const int TILE = 2;
#endif

inline v16 fma16(v16 a, v16 b, v16 c) {  // a * b + c, rounded once
#if defined(__AVX512F__)
    return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
    union { v16 v; __m256 h[2]; } x{a}, y{b}, z{c}, r;
    r.h[0] = _mm256_fmadd_ps(x.h[0], y.h[0], z.h[0]);
    r.h[1] = _mm256_fmadd_ps(x.h[1], y.h[1], z.h[1]);
    return r.v;
#else
    v16 r;
    for (int i = 0; i < LANES; ++i) r[i] = std::fma(a[i], b[i], c[i]);
    return r;
#endif
}

// decoder_step.cpp's SiLU pieces, the same operations (so the int4 path's silu * up has its bits)
inline v16 exp_poly(v16 x) {
    const v16 lo = splat(-87.0f), hi = splat(87.0f);
    x = x < lo ? lo : x;
    x = x > hi ? hi : x;
    return exp_clamped(x);
}

inline u16v bf16_bits(v16 f) {
    u16v u;
    std::memcpy(&u, &f, sizeof(u));
    const u16v rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const u16v nan = (u >> 16) | 0x40u;
    return (u & 0x7fffffffu) > 0x7f800000u ? nan : rounded;
}

inline v16 bf16_round(v16 f) {
    const u16v bits = bf16_bits(f) << 16;
    v16 out;
    std::memcpy(&out, &bits, sizeof(out));
    return out;
}

inline v16 silu(v16 g) { return g / (1.0f + exp_poly(-g)); }

// row offsets [experts + 1] of the local experts first .. first + experts - 1 in rows grouped by expert
std::vector<int64_t> offsets_of(const int64_t* counts, int64_t first, int64_t experts) {
    std::vector<int64_t> offsets(experts + 1, 0);
    for (int64_t e = 0; e < first; ++e) offsets[0] += counts[e];
    for (int64_t e = 0; e < experts; ++e) offsets[e + 1] = offsets[e] + counts[first + e];
    return offsets;
}

struct Part {
    int64_t expert, begin, end;  // outputs [begin, end) (dense) or quads (int4) of one active expert
};

// (expert, output range) parts over the active experts, `step` outputs each (more when there would be too many)
std::vector<Part> parts_of(const int64_t* offsets, int64_t experts, int64_t outputs, int64_t step) {
    int64_t active = 0;
    for (int64_t e = 0; e < experts; ++e) active += offsets[e + 1] > offsets[e];
    while (active * ((outputs + step - 1) / step) > MAX_PARTS) step *= 2;
    std::vector<Part> parts;
    for (int64_t e = 0; e < experts; ++e)
        if (offsets[e + 1] > offsets[e])
            for (int64_t b = 0; b < outputs; b += step) parts.push_back({e, b, b + step < outputs ? b + step : outputs});
    return parts;
}

// dot[r][p] = the dot product of row r of x (fp32, stride K) with weight row rows[p] (stride K), for R
// rows and P weight rows sharing every load; each (r, p) is its own accumulator: the same bits for any R, P
template <int R, int P, bool BF16>
inline void dots(const float* x, int64_t K, const void* w, const int64_t* rows, float dot[][P]) {
    v16 acc[R][P];
    for (int r = 0; r < R; ++r)
        for (int p = 0; p < P; ++p) acc[r][p] = splat(0.0f);
    for (int64_t k = 0; k < K; k += LANES) {
        v16 wv[P];
        for (int p = 0; p < P; ++p) wv[p] = load16<BF16>(w, rows[p] * K + k);
        for (int r = 0; r < R; ++r) {
            const v16 xv = load16<false>(x, r * K + k);
            for (int p = 0; p < P; ++p) acc[r][p] = fma16(wv[p], xv, acc[r][p]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int p = 0; p < P; ++p) dot[r][p] = lane_sum(acc[r][p]);
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// The same on AVX2 registers: each sixteen-lane accumulator as two halves, the same fused multiply-adds
// element for element, then the same fixed lane tree: the same bits. (The generic vectors above go
// through the stack on AVX2.) fp32: the halves are elements 0-7 and 8-15 of each sixteen. bf16: the
// even elements and the odd ones (a shift and a mask widen sixteen bf16 weights, where unpacking them in
// order costs twice the instructions and bound the kernel), so x comes permuted alike (even_odd) and
// the lanes are put back in order before the tree.
template <bool BF16>
inline void load_w(const void* w, int64_t at, __m256& lo, __m256& hi) {
    if (BF16) {
        const __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)w + at));
        lo = _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));                             // elements 0, 2, .. 14
        hi = _mm256_castsi256_ps(_mm256_and_si256(h, _mm256_set1_epi32((int)0xffff0000u)));  // 1, 3, .. 15
    } else {
        lo = _mm256_loadu_ps((const float*)w + at);
        hi = _mm256_loadu_ps((const float*)w + at + 8);
    }
}

template <int R, int P, bool BF16>
inline void dots_avx2(const float* x, int64_t K, const void* w, const int64_t* rows, float dot[][P]) {
    __m256 lo[R][P], hi[R][P];
    for (int r = 0; r < R; ++r)
        for (int p = 0; p < P; ++p) lo[r][p] = hi[r][p] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += LANES) {
        __m256 wl[P], wh[P];
        for (int p = 0; p < P; ++p) load_w<BF16>(w, rows[p] * K + k, wl[p], wh[p]);
        for (int r = 0; r < R; ++r) {
            const __m256 xl = _mm256_loadu_ps(x + r * K + k), xh = _mm256_loadu_ps(x + r * K + k + 8);
            for (int p = 0; p < P; ++p) {
                lo[r][p] = _mm256_fmadd_ps(wl[p], xl, lo[r][p]);
                hi[r][p] = _mm256_fmadd_ps(wh[p], xh, hi[r][p]);
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int p = 0; p < P; ++p) {
            float a[LANES], l[8], h[8];
            _mm256_storeu_ps(l, lo[r][p]);
            _mm256_storeu_ps(h, hi[r][p]);
            for (int i = 0; i < 8; ++i) {
                if (BF16) a[2 * i] = l[i], a[2 * i + 1] = h[i];
                else a[i] = l[i], a[8 + i] = h[i];
            }
            for (int width = LANES / 2; width >= 1; width /= 2)  // common.h's lane_sum tree
                for (int i = 0; i < width; ++i) a[i] = a[i] + a[i + width];
            dot[r][p] = a[0];
        }
}
#define MOE_AVX2 1
const bool EVEN_ODD = true;  // bf16 rows of x are read permuted (even elements, then odd, per sixteen)
#else
const bool EVEN_ODD = false;
#endif

// rows [n, K] fp32 with each sixteen reordered even elements first (the AVX2 bf16 kernel's lanes)
const float* even_odd(const float* x, int64_t n, int64_t K, std::vector<float>& buf) {
    buf.resize(n * K);
    for (int64_t k = 0; k < n * K; k += LANES)
        for (int i = 0; i < 8; ++i) buf[k + i] = x[k + 2 * i], buf[k + 8 + i] = x[k + 2 * i + 1];
    return buf.data();
}

// dots over n rows, in tiles of TILE rows and the remainder one by one
template <int P, bool BF16>
inline void dots_rows(const float* x, int64_t n, int64_t K, const void* w, const int64_t* rows, float (*dot)[P]) {
    int64_t r = 0;
#if defined(MOE_AVX2)
    for (; r + TILE <= n; r += TILE) dots_avx2<TILE, P, BF16>(x + r * K, K, w, rows, dot + r);
    for (; r < n; ++r) dots_avx2<1, P, BF16>(x + r * K, K, w, rows, dot + r);
    return;
#endif
    for (; r + TILE <= n; r += TILE) dots<TILE, P, BF16>(x + r * K, K, w, rows, dot + r);
    for (; r < n; ++r) dots<1, P, BF16>(x + r * K, K, w, rows, dot + r);
}

// x rows as fp32 (bf16 widened exactly; fp32 pointed at)
template <bool BF16>
const float* widen(const void* x, int64_t n, int64_t K, std::vector<float>& buf) {
    if (!BF16) return (const float*)x;
    buf.resize(n * K);
    for (int64_t i = 0; i < n * K; ++i) buf[i] = bf16_to_f32(((const uint16_t*)x)[i]);
    return buf.data();
}

// phase 1 of a dense part: act[rows, begin .. end) = silu(x gate^T) * (x up^T), rounded as the loop does
template <bool BF16>
void dense_gate_up(const void* x, int64_t n, int64_t H, int64_t I, const void* gate_up, int64_t begin, int64_t end,
                   float* act) {
    thread_local std::vector<float> wide, gu;
    thread_local std::vector<float> permuted;
    const float* xf = widen<BF16>(x, n, H, wide);
    if (BF16 && EVEN_ODD) xf = even_odd(xf, n, H, permuted);
    const int64_t width = end - begin;
    gu.resize(n * width * 2);
    float (*dot)[2] = (float (*)[2])gu.data();
    thread_local std::vector<float> col;
    col.resize(BLOCK * 2);
    for (int64_t first = 0; first < n; first += BLOCK) {  // a block of rows stays in cache over the part's outputs
        const int64_t m = n - first < BLOCK ? n - first : BLOCK;
        for (int64_t j = begin; j < end; ++j) {
            const int64_t rows[2] = {j, I + j};
            dots_rows<2, BF16>(xf + first * H, m, H, gate_up, rows, (float (*)[2])col.data());
            for (int64_t r = 0; r < m; ++r) {
                dot[(first + r) * width + j - begin][0] = col[2 * r];
                dot[(first + r) * width + j - begin][1] = col[2 * r + 1];
            }
        }
    }
    for (int64_t r = 0; r < n; ++r)
        for (int64_t i = 0; i < width; i += LANES) {
            v16 g, u;
            for (int l = 0; l < LANES; ++l) g[l] = dot[r * width + i + l][0], u[l] = dot[r * width + i + l][1];
            v16 h;
            if (BF16) {
                g = bf16_round(g), u = bf16_round(u);
                h = bf16_round(bf16_round(silu(g)) * u);
            } else {
                h = silu(g) * u;
            }
            std::memcpy(act + r * I + begin + i, &h, sizeof(h));
        }
}

// phase 2 of a dense part: out[rows, begin .. end) = act down^T, in the weights' dtype
template <bool BF16>
void dense_down(const float* act, int64_t n, int64_t H, int64_t I, const void* down, int64_t begin, int64_t end,
                void* out) {
    thread_local std::vector<float> col, permuted;
    col.resize(BLOCK);
    const float* x = BF16 && EVEN_ODD ? even_odd(act, n, I, permuted) : act;
    for (int64_t first = 0; first < n; first += BLOCK) {
        const int64_t m = n - first < BLOCK ? n - first : BLOCK;
        for (int64_t o = begin; o < end; ++o) {
            const int64_t rows[1] = {o};
            dots_rows<1, BF16>(x + first * I, m, I, down, rows, (float (*)[1])col.data());
            for (int64_t r = first; r < first + m; ++r) {
                if (BF16) ((uint16_t*)out)[r * H + o] = f32_to_bf16(col[r - first]);
                else ((float*)out)[r * H + o] = col[r - first];
            }
        }
    }
}

template <bool BF16>
void dense(const void* x, int64_t H, int64_t I, const int64_t* offsets, int64_t experts, const void* gate_up,
           const void* down, void* out, int threads) {
    const int64_t bytes = BF16 ? 2 : 4;
    thread_local std::vector<float> scratch;  // (the caller's thread: one call at a time per thread)
    scratch.resize(offsets[experts] * I);
    float* act = scratch.data();
    const std::vector<Part> up = parts_of(offsets, experts, I, CHUNK);
    shared_pool().run((int)up.size(), threads, [&](int i) {
        const Part& p = up[i];
        const int64_t first = offsets[p.expert], n = offsets[p.expert + 1] - first;
        dense_gate_up<BF16>((const char*)x + first * H * bytes, n, H, I,
                            (const char*)gate_up + p.expert * 2 * I * H * bytes, p.begin, p.end, act + first * I);
    });
    const std::vector<Part> dn = parts_of(offsets, experts, H, CHUNK);
    shared_pool().run((int)dn.size(), threads, [&](int i) {
        const Part& p = dn[i];
        const int64_t first = offsets[p.expert], n = offsets[p.expert + 1] - first;
        dense_down<BF16>(act + first * I, n, H, I, (const char*)down + p.expert * H * I * bytes, p.begin, p.end,
                         (char*)out + first * H * bytes);
    });
}

}  // namespace

extern "C" {

// out[r] = expert(x[r]) for the rows x [rows, H] grouped by expert (counts[e] rows for expert e, all
// experts): the rows of the local experts first .. first + experts - 1 (gate_up [experts, 2I, H], down
// [experts, H, I]); the other rows of out are left as they are. x, out and the weights in one dtype (bf16
// when `bf16`, else fp32). H % 16 == 0 and I % 16 == 0, else returns -1.
int ember_moe_dense(const void* x, int64_t H, int64_t I, const int64_t* counts, int64_t first, int64_t experts,
                    const void* gate_up, const void* down, int bf16, void* out, int threads) {
    if (H % LANES || I % LANES || H <= 0 || I <= 0) return -1;
    if (threads < 1) threads = 1;
    const std::vector<int64_t> offsets = offsets_of(counts, first, experts);
    if (bf16) dense<true>(x, H, I, offsets.data(), experts, gate_up, down, out, threads);
    else dense<false>(x, H, I, offsets.data(), experts, gate_up, down, out, threads);
    return 0;
}

// The same over int4 experts (bf16 x and out): gate_up [E] packs of [2I, H] with outputs interleaved by 32
// (gates j .. j + 31, then their ups), down [E] packs of [H, I], each in q4_linear.cpp's layout, stacked;
// H % 64 == 0 and I % 32 == 0, else -1.
int ember_moe_int4(const uint16_t* x, int64_t H, int64_t I, const int64_t* counts, int64_t first, int64_t experts,
                   const uint8_t* gu_codes, const uint16_t* gu_dm, const uint8_t* down_codes, const uint16_t* down_dm,
                   uint16_t* out, int threads) {
    if (H % 64 || I % 32 || H <= 0 || I <= 0) return -1;
    if (threads < 1) threads = 1;
    const std::vector<int64_t> offset_list = offsets_of(counts, first, experts);
    const int64_t* offsets = offset_list.data();
    thread_local std::vector<uint16_t> scratch;  // gate/up outputs [rows, 2I], then silu * up [rows, I]
    scratch.resize(offsets[experts] * 3 * I);
    uint16_t* gu = scratch.data();
    uint16_t* act = gu + offsets[experts] * 2 * I;
    const int64_t gu_code_bytes = 2 * I * H / 2, gu_dm_halves = 2 * I * (H / 32) * 2;
    const int64_t down_code_bytes = H * I / 2, down_dm_halves = H * (I / 32) * 2;
    const std::vector<Part> up = parts_of(offsets, experts, 2 * I / 64, QUADS);
    shared_pool().run((int)up.size(), threads, [&](int i) {
        const Part& p = up[i];
        const int64_t first = offsets[p.expert], n = offsets[p.expert + 1] - first;
        q4_rows_quads(x + first * H, n, H, gu_codes + p.expert * gu_code_bytes, gu_dm + p.expert * gu_dm_halves,
                      2 * I, p.begin, p.end, gu + first * 2 * I);
        typedef uint16_t h16 __attribute__((vector_size(32)));
        for (int64_t r = first; r < first + n; ++r)
            for (int64_t q = p.begin; q < p.end; ++q)
                for (int64_t l = 0; l < 32; l += LANES) {  // gates at 64q + l, their ups 32 further
                    const v16 g = load16<true>(gu, r * 2 * I + q * 64 + l), u = load16<true>(gu, r * 2 * I + q * 64 + 32 + l);
                    const h16 h = __builtin_convertvector(bf16_bits(bf16_round(silu(g)) * u), h16);
                    std::memcpy(act + r * I + q * 32 + l, &h, sizeof(h));
                }
    });
    const std::vector<Part> dn = parts_of(offsets, experts, H / 64, QUADS);
    shared_pool().run((int)dn.size(), threads, [&](int i) {
        const Part& p = dn[i];
        const int64_t first = offsets[p.expert], n = offsets[p.expert + 1] - first;
        q4_rows_quads(act + first * I, n, I, down_codes + p.expert * down_code_bytes,
                      down_dm + p.expert * down_dm_halves, H, p.begin, p.end, out + first * H);
    });
    return 0;
}

}  // extern "C"
