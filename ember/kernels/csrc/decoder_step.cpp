// A whole decode step's decoder layers in one call (ember/kernels/cpu_step.py), and the elementwise
// parts of a layer as calls of their own (the op-by-op path, ember.kernels.cpu_int4.decode_layer).
//
// The captured step runs, for every layer, the same kernels in the same order as the op-by-op path:
// RMSNorm, the int4 QKV linear, RoPE with the K/V cache write, paged attention, the int4 output
// projection and the residual add, RMSNorm, the int4 gate/up linear, SiLU(gate) * up, the int4 down
// projection and the residual add. So both give the same bits: capture only removes the ~15 Python and
// torch dispatches a layer costs (about 0.3 ms a layer at batch 1). Every elementwise op below is per
// element, plain IEEE (-ffp-contract=off), the same for any number of rows.
#include "common.h"
#include "thread_pool.h"

extern "C" {
int ember_q4_linear(const uint16_t* x, int64_t rows, int64_t K, const uint8_t* codes, const uint16_t* dm,
                    int64_t N, uint16_t* y, int threads);
int ember_paged_attention(const void* q, int q_bf16, const void* k_cache, const void* v_cache, int kv_bf16,
                          const int64_t* tiles, int64_t num_tiles, const int64_t* tables, int64_t table_width,
                          void* out, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                          float scale, int64_t scratch_floats, int threads);
int ember_rms_norm(const uint16_t* x, const uint16_t* weight, uint16_t* out, int64_t rows, int64_t dim, float eps);
}

// exp(x) for any float x (clamped to +-87: SiLU's arguments)
static inline v16 exp_poly(v16 x) {
    const v16 lo = splat(-87.0f), hi = splat(87.0f);
    x = x < lo ? lo : x;
    x = x > hi ? hi : x;
    return exp_clamped(x);
}

// sixteen floats rounded to bf16 (round to nearest even, NaN stays NaN: f32_to_bf16's rule), as the
// top halves of u32 lanes
static inline u16v bf16_bits(v16 f) {
    u16v u;
    std::memcpy(&u, &f, sizeof(u));
    const u16v rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const u16v nan = (u >> 16) | 0x40u;
    return (u & 0x7fffffffu) > 0x7f800000u ? nan : rounded;
}

static inline v16 bf16_round(v16 f) {  // f rounded to bf16, back as floats
    const u16v bits = bf16_bits(f) << 16;
    v16 out;
    std::memcpy(&out, &bits, sizeof(out));
    return out;
}

// q, k rotated (rotate-half), as the model's apply_rope computes them: x * cos + rotated * sin in fp32,
// rounded to bf16. qkv [rows, heads + 2 kv_heads, D] bf16; cos, sin: tables [positions, D] (positions
// null: row r's at r); q_out [rows, heads, D]; row r's K and V go to k_dst / v_dst at index slots[r]
// ([slots, kv_heads, D]; slots null: index r).
static void rope_store(const uint16_t* qkv, int64_t rows, int64_t heads, int64_t kv_heads, int64_t D,
                       const int64_t* positions, const float* cos, const float* sin, uint16_t* q_out,
                       uint16_t* k_dst, uint16_t* v_dst, const int64_t* slots) {
    const int64_t width = (heads + 2 * kv_heads) * D, half = D / 2;
    for (int64_t r = 0; r < rows; ++r) {
        const uint16_t* src = qkv + r * width;
        const int64_t at = positions ? positions[r] : r;
        const float* c = cos + at * D;
        const float* s = sin + at * D;
        const int64_t slot = slots ? slots[r] : r;
        for (int64_t h = 0; h < heads + kv_heads; ++h) {
            const uint16_t* x = src + h * D;
            uint16_t* dst = h < heads ? q_out + (r * heads + h) * D : k_dst + (slot * kv_heads + h - heads) * D;
            for (int64_t d = 0; d < D; ++d) {
                const float rotated = d < half ? -bf16_to_f32(x[d + half]) : bf16_to_f32(x[d - half]);
                const float a = bf16_to_f32(x[d]) * c[d], b = rotated * s[d];
                dst[d] = f32_to_bf16(a + b);
            }
        }
        std::memcpy(v_dst + slot * kv_heads * D, src + (heads + kv_heads) * D, kv_heads * D * sizeof(uint16_t));
    }
}

// out [rows, I] = bf16(bf16(silu(gate)) * up) with gate, up the halves of gu [rows, 2I]; I % 16 == 0.
// Rows are split over the pool when there are many (prefill); each element is computed alone.
static void silu_mul(const uint16_t* gu, int64_t rows, int64_t I, uint16_t* out, int threads) {
    typedef uint16_t h16 __attribute__((vector_size(32)));
    const int64_t parts = rows * I >= (1 << 16) && threads > 1 ? (rows < 4 * threads ? rows : 4 * threads) : 1;
    shared_pool().run((int)parts, threads, [&](int part) {
        for (int64_t r = rows * part / parts; r < rows * (part + 1) / parts; ++r)
            for (int64_t i = 0; i < I; i += LANES) {
                const v16 g = load16<true>(gu, r * 2 * I + i), u = load16<true>(gu, r * 2 * I + I + i);
                const v16 silu = bf16_round(g / (1.0f + exp_poly(-g)));
                const h16 h = __builtin_convertvector(bf16_bits(silu * u), h16);
                std::memcpy(out + r * I + i, &h, sizeof(h));
            }
    });
}

static void add_into(uint16_t* x, const uint16_t* y, int64_t n) {  // x = bf16(x + y)
    for (int64_t i = 0; i < n; ++i) x[i] = f32_to_bf16(bf16_to_f32(x[i]) + bf16_to_f32(y[i]));
}

// What each layer's plan row holds (int64 each: pointers and nothing else), in this order
enum LayerPlan {
    NORM1, QKV_CODES, QKV_DM, O_CODES, O_DM, NORM2, GU_CODES, GU_DM, DOWN_CODES, DOWN_DM, K_CACHE, V_CACHE,
    PLAN_WIDTH
};
// The model's shape (plan header, int64 each)
enum ModelPlan { LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, BLOCK_SIZE, COS, SIN, HEADER_WIDTH };

extern "C" {

int ember_rope_store(const uint16_t* qkv, int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim,
                     const int64_t* positions, const float* cos, const float* sin, uint16_t* q_out, uint16_t* k_out,
                     uint16_t* v_out) {
    if (head_dim % 2) return -1;
    rope_store(qkv, rows, heads, kv_heads, head_dim, positions, cos, sin, q_out, k_out, v_out, nullptr);
    return 0;
}

int ember_silu_mul(const uint16_t* gu, int64_t rows, int64_t intermediate, uint16_t* out, int threads) {
    if (intermediate % LANES) return -1;
    silu_mul(gu, rows, intermediate, out, threads);
    return 0;
}

// Every decoder layer of one step. x [rows, hidden] bf16, in place (the embeddings in, the last layer's
// output out); plan: the header (ModelPlan) then a row (LayerPlan) per layer; slots [rows]: each row's
// cache slot; tiles, tables, scale, scratch_floats: as ember_paged_attention takes them; work: bf16
// scratch of rows * (hidden + (heads + 2 kv_heads) * D + 2 * heads * D + 3 * intermediate) elements.
int ember_decoder_step(const int64_t* plan, uint16_t* x, int64_t rows, const int64_t* positions, const int64_t* slots,
                       const int64_t* tiles, int64_t num_tiles, const int64_t* tables, int64_t table_width,
                       float scale, float eps, int64_t scratch_floats, uint16_t* work, int threads,
                       int attention_threads) {
    const int64_t L = plan[LAYERS], hidden = plan[HIDDEN], H = plan[HEADS], Hkv = plan[KV_HEADS], D = plan[HEAD_DIM];
    const int64_t I = plan[INTERMEDIATE], BS = plan[BLOCK_SIZE];
    if (I % LANES) return -1;
    const float* cos = (const float*)plan[COS];
    const float* sin = (const float*)plan[SIN];
    const int64_t qkv_width = (H + 2 * Hkv) * D;
    uint16_t* h = work;                    // [rows, hidden] normed input, then a projection's output
    uint16_t* qkv = h + rows * hidden;     // [rows, qkv_width]
    uint16_t* q = qkv + rows * qkv_width;  // [rows, H * D]
    uint16_t* att = q + rows * H * D;      // [rows, H * D]
    uint16_t* gu = att + rows * H * D;     // [rows, 2 I]
    uint16_t* act = gu + rows * 2 * I;     // [rows, I]
    for (int64_t l = 0; l < L; ++l) {
        const int64_t* p = plan + HEADER_WIDTH + l * PLAN_WIDTH;
        uint16_t* k_cache = (uint16_t*)p[K_CACHE];
        uint16_t* v_cache = (uint16_t*)p[V_CACHE];
        if (ember_rms_norm(x, (const uint16_t*)p[NORM1], h, rows, hidden, eps)) return -1;
        if (ember_q4_linear(h, rows, hidden, (const uint8_t*)p[QKV_CODES], (const uint16_t*)p[QKV_DM], qkv_width, qkv,
                            threads))
            return -1;
        rope_store(qkv, rows, H, Hkv, D, positions, cos, sin, q, k_cache, v_cache, slots);
        if (ember_paged_attention(q, 1, k_cache, v_cache, 1, tiles, num_tiles, tables, table_width, att, H, Hkv, D, BS,
                                  scale, scratch_floats, attention_threads))
            return -1;
        if (ember_q4_linear(att, rows, H * D, (const uint8_t*)p[O_CODES], (const uint16_t*)p[O_DM], hidden, h, threads))
            return -1;
        add_into(x, h, rows * hidden);
        if (ember_rms_norm(x, (const uint16_t*)p[NORM2], h, rows, hidden, eps)) return -1;
        if (ember_q4_linear(h, rows, hidden, (const uint8_t*)p[GU_CODES], (const uint16_t*)p[GU_DM], 2 * I, gu, threads))
            return -1;
        silu_mul(gu, rows, I, act, threads);
        if (ember_q4_linear(act, rows, I, (const uint8_t*)p[DOWN_CODES], (const uint16_t*)p[DOWN_DM], hidden, h, threads))
            return -1;
        add_into(x, h, rows * hidden);
    }
    return 0;
}

}  // extern "C"
