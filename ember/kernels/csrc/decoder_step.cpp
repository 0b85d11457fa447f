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

extern "C" {
int ember_q4_linear(const uint16_t* x, int64_t rows, int64_t K, const uint8_t* codes, const uint16_t* dm,
                    int64_t N, uint16_t* y, int threads);
int ember_paged_attention(const void* q, int q_bf16, const void* k_cache, const void* v_cache, int kv_bf16,
                          const int64_t* tiles, int64_t num_tiles, const int64_t* tables, int64_t table_width,
                          void* out, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                          float scale, int64_t scratch_floats, int threads);
int ember_rms_norm(const uint16_t* x, const uint16_t* weight, uint16_t* out, int64_t rows, int64_t dim, float eps);
}

// exp(x) for any float x (|x| clamped to 87: SiLU's arguments), one polynomial (Cephes expf's) for every lane
static inline float exp_poly(float x) {
    x = x < -87.0f ? -87.0f : x > 87.0f ? 87.0f : x;
    const float fx = x * 1.44269504088896341f;
    const int n = (int)(fx + (fx < 0 ? -0.5f : 0.5f));  // round half away from zero
    const float nf = (float)n;
    float r = x - nf * 0.693359375f;
    r = r - nf * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const uint32_t bits = (uint32_t)(n + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, 4);
    return p * scale;
}

static inline float bf16r(float f) { return bf16_to_f32(f32_to_bf16(f)); }

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

// out [rows, I] = bf16(bf16(silu(gate)) * up) with gate, up the halves of gu [rows, 2I]
static void silu_mul(const uint16_t* gu, int64_t rows, int64_t I, uint16_t* out) {
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t i = 0; i < I; ++i) {
            const float g = bf16_to_f32(gu[r * 2 * I + i]), u = bf16_to_f32(gu[r * 2 * I + I + i]);
            const float silu = bf16r(g / (1.0f + exp_poly(-g)));
            out[r * I + i] = f32_to_bf16(silu * u);
        }
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

int ember_silu_mul(const uint16_t* gu, int64_t rows, int64_t intermediate, uint16_t* out) {
    silu_mul(gu, rows, intermediate, out);
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
        silu_mul(gu, rows, I, act);
        if (ember_q4_linear(act, rows, I, (const uint8_t*)p[DOWN_CODES], (const uint16_t*)p[DOWN_DM], hidden, h, threads))
            return -1;
        add_into(x, h, rows * hidden);
    }
    return 0;
}

}  // extern "C"
