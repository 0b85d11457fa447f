// Helpers shared by the C++ kernels: sixteen-lane float vectors (GCC/clang vector extensions), exact
// bf16 conversions, a fixed-tree lane sum.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16v __attribute__((vector_size(64)));
typedef uint32_t u16v __attribute__((vector_size(64)));

static const int LANES = 16;

static inline v16 splat(float f) {
    v16 v = {};
    return v + f;
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as torch's .to(bfloat16)
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

// exp(x) for x already clamped to [-87, 87]: Cephes expf's minimax polynomial on [-ln2/2, ln2/2]
// after a range reduction, for every lane; lane-wise IEEE operations only, so a lane's result does
// not depend on its neighbours. SiLU (decoder_step.cpp) and softmax (attention.cpp) share it.
static inline v16 exp_clamped(v16 x) {
    const v16 fx = x * 1.44269504088896341f;  // x / ln 2
    const v16 half = fx < 0 ? splat(-0.5f) : splat(0.5f);
    const i16v n = __builtin_convertvector(fx + half, i16v);  // round half away from zero
    const v16 nf = __builtin_convertvector(n, v16);
    v16 r = x - nf * 0.693359375f;  // ln 2 split in two: the first part is exact times n
    r = r - nf * -2.12194440e-4f;
    v16 p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const u16v bits = (u16v)((n + 127) << 23);  // 2^n
    v16 scale;
    std::memcpy(&scale, &bits, sizeof(scale));
    return p * scale;
}

static inline float lane_sum(v16 v) {  // fixed tree: 16 -> 8 -> 4 -> 2 -> 1
    float a[LANES];
    std::memcpy(a, &v, sizeof(a));
    for (int w = LANES / 2; w >= 1; w /= 2)
        for (int i = 0; i < w; ++i) a[i] = a[i] + a[i + w];
    return a[0];
}

template <bool BF16>
static inline v16 load16(const void* base, int64_t offset) {  // 16 elements from base + offset
    v16 v;
    if (BF16) {
#if defined(__AVX512F__)
        const __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)base + offset));
        const __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
        v = (v16)_mm512_castsi512_ps(u);
#else
        typedef uint16_t h16 __attribute__((vector_size(32)));
        h16 h;
        std::memcpy(&h, (const uint16_t*)base + offset, sizeof(h));
        u16v u = __builtin_convertvector(h, u16v) << 16;
        std::memcpy(&v, &u, sizeof(v));
#endif
    } else {
        std::memcpy(&v, (const float*)base + offset, sizeof(v));
    }
    return v;
}
