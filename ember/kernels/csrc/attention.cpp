// Paged attention for CPU, batch-invariant by construction (ember/kernels/cpu_attention.py).
//
// Every query row is computed by the same arithmetic whatever else shares its call: its
// scores are a fixed-order dot product (lanes are keys, the sum over dims runs d = 0..D-1),
// its softmax max is exact, its exponentials come from one polynomial, its sum over keys
// is 16 lanes (key j in lane j % 16) reduced by a fixed tree, and its weighted sum of
// values runs over keys in order. So a token's output is the same bits alone or batched,
// in a whole prompt, a chunk, behind a cached prefix, a decode step or a speculative verify
// step. Built with -ffp-contract=off and no fast-math: every lane is plain IEEE mul/add, so
// an AVX-512 and an AVX2 build give the same bits too.
//
// Layouts: q, out [N, H, D]; caches [num_blocks, block_size, Hkv, D]; a tile is up to
// TILE_ROWS consecutive rows of one sequence at consecutive positions; row i of a tile
// sees keys 0 .. first_pos + i.
#include <vector>

#include "common.h"
#include "thread_pool.h"

typedef float v16u __attribute__((vector_size(64), aligned(4)));  // sixteen floats at any float address

// By vector width. AVX-512: sixteen-float vectors (v16) in 32 registers. AVX2 has 16 registers of
// eight floats, and GCC lowers a v16 there through the stack (a scalar broadcast became sixteen
// stores and a reload): the inner loops below use eight-float halves (v8) and smaller blocks that
// fit the registers, and keys are transposed eight by eight (transpose8). Each lane still runs the same sequence
// of IEEE operations (lanes never mix in these loops), so the bits are the same on either build.
#if defined(__AVX512F__)
static const int QK_HEADS = 8;   // query heads scored per pass over a transposed key block
static const int PV_HEADS = 3;   // query heads sharing each value row read
static const int PV_CHUNKS = 4;  // sixteen-dim chunks of values per pass (4: 64 dims)
#else
static const int QK_HEADS = 4;   // 8 accumulators + 2 key halves + 1 broadcast: 11 of 16 registers
static const int PV_HEADS = 2;   // 2 heads x 2 chunks x 2 halves + 4 value halves + 1: 13
static const int PV_CHUNKS = 2;
typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));
#include <immintrin.h>

template <bool BF16>
static inline __m256 load8(const void* base, int64_t offset) {  // 8 elements from base + offset, as fp32
    if (BF16) {
        const __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)base + offset));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float*)base + offset);
}

static inline void transpose8(__m256* r) {  // r[8] rows -> columns (exact moves)
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int i = 0; i < 4; ++i) {
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}
#endif

template <bool BF16>
static inline void load_row(const void* base, int64_t index, int64_t d, float* dst) {
#if !defined(__AVX512F__)
    for (int64_t i = 0; i < d; i += 8) _mm256_storeu_ps(dst + i, load8<BF16>(base, index * d + i));
#else
    if (BF16) {
        const uint16_t* src = (const uint16_t*)base + index * d;
        for (int64_t i = 0; i < d; i += LANES) {  // d % 16 == 0 (checked by the callers)
            const v16 v = load16<true>(src, i);
            std::memcpy(dst + i, &v, sizeof(v));
        }
    } else {
        std::memcpy(dst, (const float*)base + index * d, d * sizeof(float));
    }
#endif
}

// exp(x) for x <= 0 (softmax arguments)
static inline v16 vexp(v16 x) {
    const v16 lo = splat(-87.0f), zero = splat(0.0f);
    x = x < lo ? lo : x;
    x = x > zero ? zero : x;  // only keys past a row's position (weights set to 0 after) are > 0
    return exp_clamped(x);
}

// max of sc[0 .. n-1], n >= 1: sixteen lanes, then the lanes (max is exact in any order)
static inline float row_max(const float* sc, int64_t n) {
    float m = sc[0];
    int64_t j = 0;
    if (n >= LANES) {
        v16 mv = *(const v16u*)sc;
        for (j = LANES; j + LANES <= n; j += LANES) {
            const v16 x = *(const v16u*)(sc + j);
            mv = x > mv ? x : mv;
        }
        for (int l = 0; l < LANES; ++l) m = mv[l] > m ? mv[l] : m;
    }
    for (; j < n; ++j) m = sc[j] > m ? sc[j] : m;
    return m;
}

struct Shape {
    int64_t heads, kv_heads, head_dim, block_size, table_width;
    float scale;
};

// rows r and r + S of a 16 x 16 block swap their off-diagonal S-wide halves (one transpose stage).
// GCC's __builtin_shuffle exists since GCC 4.7 (__builtin_shufflevector only since 12); clang has the latter.
#if defined(__clang__)
#define SHUFFLE(A, B, S, I) __builtin_shufflevector(A, B, I(S, 0), I(S, 1), I(S, 2), I(S, 3), I(S, 4), I(S, 5), \
    I(S, 6), I(S, 7), I(S, 8), I(S, 9), I(S, 10), I(S, 11), I(S, 12), I(S, 13), I(S, 14), I(S, 15))
#else
#define SHUFFLE(A, B, S, I) __builtin_shuffle(A, B, (i16v){I(S, 0), I(S, 1), I(S, 2), I(S, 3), I(S, 4), I(S, 5), \
    I(S, 6), I(S, 7), I(S, 8), I(S, 9), I(S, 10), I(S, 11), I(S, 12), I(S, 13), I(S, 14), I(S, 15)})
#endif
#define STAGE(S, A, B)                 \
    {                                  \
        v16 lo = SHUFFLE(A, B, S, I0); \
        v16 hi = SHUFFLE(A, B, S, I1); \
        A = lo;                        \
        B = hi;                        \
    }
#define I0(S, C) (((C) & (S)) ? 16 + (C) - (S) : (C))
#define I1(S, C) (((C) & (S)) ? 16 + (C) : (C) + (S))

static inline void transpose16(v16* m) {  // m[16] rows -> columns, in registers (exact moves)
    for (int r = 0; r < 16; ++r)
        if (!(r & 8)) STAGE(8, m[r], m[r + 8]);
    for (int r = 0; r < 16; ++r)
        if (!(r & 4)) STAGE(4, m[r], m[r + 4]);
    for (int r = 0; r < 16; ++r)
        if (!(r & 2)) STAGE(2, m[r], m[r + 2]);
    for (int r = 0; r < 16; ++r)
        if (!(r & 1)) STAGE(1, m[r], m[r + 1]);
}

// kt[d * 16 + l] = dim d of key j0 + l in fp32 (0 past the last key): one block of keys, transposed
template <bool BF16>
static inline void key_block(const void* k_cache, const int64_t* table, int64_t j0, int64_t num_keys, int64_t h,
                             const Shape& s, float* kt) {
    const int64_t D = s.head_dim, BS = s.block_size;
#if defined(__AVX512F__)
    for (int64_t d0 = 0; d0 < D; d0 += LANES) {  // sixteen keys x sixteen dims at a time, in registers
        v16 m[LANES];
        for (int64_t l = 0; l < LANES; ++l) {
            const int64_t j = j0 + l;
            if (j < num_keys) {
                const int64_t slot = table[j / BS] * BS + j % BS;
                m[l] = load16<BF16>(k_cache, (slot * s.kv_heads + h) * D + d0);
            } else {
                m[l] = splat(0.0f);
            }
        }
        transpose16(m);
        std::memcpy(kt + d0 * LANES, m, sizeof(m));
    }
#else  // eight keys x eight dims at a time (transpose16's sixteen-float shuffles go through the stack on AVX2)
    for (int64_t l0 = 0; l0 < LANES; l0 += 8) {
        int64_t at[8];  // each key's first element, or -1 past the last key
        for (int64_t l = 0; l < 8; ++l) {
            const int64_t j = j0 + l0 + l;
            at[l] = j < num_keys ? ((table[j / BS] * BS + j % BS) * s.kv_heads + h) * D : -1;
        }
        for (int64_t d0 = 0; d0 < D; d0 += 8) {
            __m256 r[8];
            for (int64_t l = 0; l < 8; ++l) r[l] = at[l] < 0 ? _mm256_setzero_ps() : load8<BF16>(k_cache, at[l] + d0);
            transpose8(r);
            for (int64_t i = 0; i < 8; ++i) _mm256_storeu_ps(kt + (d0 + i) * LANES + l0, r[i]);
        }
    }
#endif
}

// Scores of NB query heads against sixteen keys (kt: [D, 16]); every accumulator sums over d in order
template <int NB>
static inline void qk_block(const float* q, const float* kt, int64_t D, float* out, int64_t out_stride) {
#if !defined(__AVX512F__)
    v8 lo[NB], hi[NB];
    for (int b = 0; b < NB; ++b) lo[b] = hi[b] = (v8){};
    for (int64_t d = 0; d < D; ++d) {
        const v8 klo = *(const v8u*)(kt + d * LANES), khi = *(const v8u*)(kt + d * LANES + 8);
        for (int b = 0; b < NB; ++b) {
            const float qd = q[b * D + d];
            lo[b] = lo[b] + qd * klo;
            hi[b] = hi[b] + qd * khi;
        }
    }
    for (int b = 0; b < NB; ++b) {
        *(v8u*)(out + b * out_stride) = lo[b];
        *(v8u*)(out + b * out_stride + 8) = hi[b];
    }
#else
    v16 a[NB];
    for (int b = 0; b < NB; ++b) a[b] = splat(0.0f);
    for (int64_t d = 0; d < D; ++d) {
        v16 kd;
        std::memcpy(&kd, kt + d * LANES, sizeof(kd));
        for (int b = 0; b < NB; ++b) a[b] = a[b] + q[b * D + d] * kd;
    }
    for (int b = 0; b < NB; ++b) std::memcpy(out + b * out_stride, &a[b], sizeof(a[b]));
#endif
}

// Probabilities times values for NB query heads (p: their rows, stride p_stride) over keys 0..seen-1 in
// order, CH chunks of 16 dims from vals (row stride D); res[b * 64 + c * 16 + l]
template <int NB, int CH>
static inline void pv_block(const float* p, int64_t p_stride, int64_t seen, const float* vals, int64_t D,
                            float* res) {
#if !defined(__AVX512F__)
    v8 h[NB][2 * CH];  // sixteen-dim chunk c is halves 2c and 2c + 1
    for (int b = 0; b < NB; ++b)
        for (int c = 0; c < 2 * CH; ++c) h[b][c] = (v8){};
    for (int64_t j = 0; j < seen; ++j) {
        v8 x[2 * CH];
        for (int c = 0; c < 2 * CH; ++c) x[c] = *(const v8u*)(vals + j * D + c * 8);
        for (int b = 0; b < NB; ++b) {
            const float pj = p[b * p_stride + j];
            for (int c = 0; c < 2 * CH; ++c) h[b][c] = h[b][c] + pj * x[c];
        }
    }
    for (int b = 0; b < NB; ++b)
        for (int c = 0; c < 2 * CH; ++c) *(v8u*)(res + b * 64 + c * 8) = h[b][c];
#else
    v16 a[NB][CH];
    for (int b = 0; b < NB; ++b)
        for (int c = 0; c < CH; ++c) a[b][c] = splat(0.0f);
    for (int64_t j = 0; j < seen; ++j) {
        v16 x[CH];  // one unaligned vector load each (a memcpy of the whole array stalled store forwarding)
        for (int c = 0; c < CH; ++c) x[c] = *(const v16u*)(vals + j * D + c * LANES);
        for (int b = 0; b < NB; ++b) {
            const float pj = p[b * p_stride + j];
            for (int c = 0; c < CH; ++c) a[b][c] = a[b][c] + pj * x[c];
        }
    }
    for (int b = 0; b < NB; ++b)
        for (int c = 0; c < CH; ++c) std::memcpy(res + b * 64 + c * LANES, &a[b][c], sizeof(v16));
#endif
}

// One tile, one KV head. scratch: scores, scaled queries, a transposed key block, values (cpu_attention.Tiles.plan).
template <bool QBF16, bool KVBF16>
static void tile_head(const void* q, const void* k_cache, const void* v_cache, const int64_t* table,
                      int64_t row0, int64_t rows, int64_t first_pos, int64_t h, const Shape& s,
                      void* out, float* scratch) {
    const int64_t D = s.head_dim, G = s.heads / s.kv_heads, Hkv = s.kv_heads, BS = s.block_size;
    const int64_t num_keys = first_pos + rows;
    const int64_t padded = (num_keys + LANES - 1) / LANES * LANES;
    const int64_t qrows = rows * G;
    float* scores = scratch;                      // [qrows, padded]
    float* qs = scores + qrows * padded;          // [qrows, D] scaled queries
    float* kt = qs + qrows * D;                   // [D, 16] one block of keys, transposed
    float* vals = kt + D * LANES;                 // [num_keys, D] values in fp32
    for (int64_t i = 0; i < rows; ++i)
        for (int64_t g = 0; g < G; ++g) {
            float* dst = qs + (i * G + g) * D;
            load_row<QBF16>(q, (row0 + i) * s.heads + h * G + g, D, dst);
            for (int64_t d = 0; d < D; ++d) dst[d] = dst[d] * s.scale;
        }
    // scores, sixteen keys at a time: kt[d] holds dim d of the sixteen keys
    for (int64_t j0 = 0; j0 < padded; j0 += LANES) {
        key_block<KVBF16>(k_cache, table, j0, num_keys, h, s, kt);
        // the query heads that see some key of the block, NB at a time: kt[d] is loaded once per NB
        int64_t r = (j0 > first_pos ? j0 - first_pos : 0) * G;
        for (; r + QK_HEADS <= qrows; r += QK_HEADS)
            qk_block<QK_HEADS>(qs + r * D, kt, D, scores + r * padded + j0, padded);
        switch (qrows - r) {  // the rest in one block (a decode's three heads: one block of 3)
            case 7: qk_block<7>(qs + r * D, kt, D, scores + r * padded + j0, padded); break;
            case 6: qk_block<6>(qs + r * D, kt, D, scores + r * padded + j0, padded); break;
            case 5: qk_block<5>(qs + r * D, kt, D, scores + r * padded + j0, padded); break;
            case 4: qk_block<4>(qs + r * D, kt, D, scores + r * padded + j0, padded); break;
            case 3: qk_block<3>(qs + r * D, kt, D, scores + r * padded + j0, padded); break;
            case 2: qk_block<2>(qs + r * D, kt, D, scores + r * padded + j0, padded); break;
            case 1: qk_block<1>(qs + r * D, kt, D, scores + r * padded + j0, padded); break;
            default: break;
        }
    }
    // softmax numerators in place, and their sums
    float sums[4096];
    for (int64_t i = 0; i < rows; ++i) {
        const int64_t seen = first_pos + i + 1;
        for (int64_t g = 0; g < G; ++g) {
            float* sc = scores + (i * G + g) * padded;
            float m = row_max(sc, seen);
            v16 total = {};
            for (int64_t j0 = 0; j0 < seen; j0 += LANES) {
                v16 x;
                std::memcpy(&x, sc + j0, sizeof(x));
                v16 e = vexp(x - m);
                if (j0 + LANES > seen) {  // the row's last block: keys past it weigh nothing
                    float tmp[LANES];
                    std::memcpy(tmp, &e, sizeof(tmp));
                    for (int64_t l = seen - j0; l < LANES; ++l) tmp[l] = 0.0f;
                    std::memcpy(&e, tmp, sizeof(e));
                }
                std::memcpy(sc + j0, &e, sizeof(e));
                total = total + e;
            }
            sums[i * G + g] = lane_sum(total);
        }
    }
    // values in fp32, then each query's probabilities times values, keys in order, summed in registers
    for (int64_t j = 0; j < num_keys; ++j) {
        const int64_t slot = table[j / BS] * BS + j % BS;
        load_row<KVBF16>(v_cache, slot * Hkv + h, D, vals + j * D);
    }
    float res[PV_HEADS * 64];
    const int64_t pass = PV_CHUNKS * LANES;  // dims of values one pv_block pass covers
    for (int64_t i = 0; i < rows; ++i) {
        const int64_t seen = first_pos + i + 1;
        for (int64_t g0 = 0; g0 < G; g0 += PV_HEADS) {  // up to PV_HEADS query heads share each value row read
            const int64_t nb = G - g0 < PV_HEADS ? G - g0 : PV_HEADS;
            const float* p = scores + (i * G + g0) * padded;
            for (int64_t d0 = 0; d0 < D; d0 += 64) {
                const int64_t width = D - d0 < 64 ? D - d0 : 64;  // D % 16 == 0
                if (width == 64) {
                    for (int64_t c0 = 0; c0 < 64; c0 += pass) {  // res[b * 64 + c0 + ...]
                        if (nb == 3) pv_block<3, PV_CHUNKS>(p, padded, seen, vals + d0 + c0, D, res + c0);
                        else if (nb == 2) pv_block<2, PV_CHUNKS>(p, padded, seen, vals + d0 + c0, D, res + c0);
                        else pv_block<1, PV_CHUNKS>(p, padded, seen, vals + d0 + c0, D, res + c0);
                    }
                } else {
                    for (int64_t b = 0; b < nb; ++b)
                        for (int64_t c = 0; c < width; c += LANES)
                            pv_block<1, 1>(p + b * padded, padded, seen, vals + d0 + c, D, res + b * 64 + c);
                }
                for (int64_t b = 0; b < nb; ++b) {
                    const float total = sums[i * G + g0 + b];
                    const int64_t index = ((row0 + i) * s.heads + h * G + g0 + b) * D + d0;
                    for (int64_t d = 0; d < width; ++d) {
                        if (QBF16) ((uint16_t*)out)[index + d] = f32_to_bf16(res[b * 64 + d] / total);
                        else ((float*)out)[index + d] = res[b * 64 + d] / total;
                    }
                }
            }
        }
    }
}

extern "C" {

// tiles [T, 4]: (first row, rows, sequence, first position); tables [S, table_width]. Computes every
// (tile, KV head) pair, split over `threads` threads (the caller's among them) in ranges of about
// equal work (rows x keys); each pair is computed alone, so the split changes no bit. scratch_floats:
// the scratch one pair needs (cpu_attention.Tiles.scratch_floats). Returns 0, or -1 on a shape it does not take.
int ember_paged_attention(const void* q, int q_bf16, const void* k_cache, const void* v_cache, int kv_bf16,
                          const int64_t* tiles, int64_t num_tiles, const int64_t* tables, int64_t table_width,
                          void* out, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                          float scale, int64_t scratch_floats, int threads) {
    if (head_dim > 512 || head_dim <= 0 || head_dim % 16 || kv_heads <= 0 || heads % kv_heads) return -1;
    for (int64_t t = 0; t < num_tiles; ++t)
        if (tiles[4 * t + 1] * (heads / kv_heads) > 4096) return -1;
    const Shape s{heads, kv_heads, head_dim, block_size, table_width, scale};
    const int64_t items = num_tiles * kv_heads;
    std::vector<double> done(items + 1, 0.0);  // work before each (tile, head) pair
    for (int64_t i = 0; i < items; ++i) {
        const int64_t* tile = tiles + 4 * (i / kv_heads);
        done[i + 1] = done[i] + (double)tile[1] * (double)(tile[3] + tile[1]);
    }
    // parts of about equal work (rows x keys), more than threads so a free thread can take a slow one's
    const int parts = (int)(threads <= 1 ? 1 : (items < 4 * threads ? items : 4 * threads));
    shared_pool().run(parts, threads, [&](int part) {
        thread_local std::vector<float> scratch;
        if ((int64_t)scratch.size() < scratch_floats) scratch.resize(scratch_floats);
        const double lo = done[items] * part / parts, hi = done[items] * (part + 1) / parts;
        for (int64_t i = 0; i < items; ++i) {
            if (done[i] < lo || done[i] >= hi) continue;  // each pair goes to the part where it starts
            const int64_t* tile = tiles + 4 * (i / kv_heads);
            const int64_t* table = tables + tile[2] * table_width;
            const int64_t h = i % kv_heads;
            float* sc = scratch.data();
            if (q_bf16 && kv_bf16)
                tile_head<true, true>(q, k_cache, v_cache, table, tile[0], tile[1], tile[3], h, s, out, sc);
            else if (q_bf16)
                tile_head<true, false>(q, k_cache, v_cache, table, tile[0], tile[1], tile[3], h, s, out, sc);
            else if (kv_bf16)
                tile_head<false, true>(q, k_cache, v_cache, table, tile[0], tile[1], tile[3], h, s, out, sc);
            else
                tile_head<false, false>(q, k_cache, v_cache, table, tile[0], tile[1], tile[3], h, s, out, sc);
        }
    });
    return 0;
}

// RMSNorm of bf16 rows with a bf16 weight, as the model's bf16 RMSNorm computes it (normalised in fp32,
// rounded to bf16, times the weight, rounded again), each row's sum of squares in 16 lanes reduced by
// the fixed tree: a row's result does not depend on the other rows. dim % 16 == 0; returns -1 otherwise.
int ember_rms_norm(const uint16_t* x, const uint16_t* weight, uint16_t* out, int64_t rows, int64_t dim, float eps) {
    if (dim % LANES || dim <= 0) return -1;
    for (int64_t r = 0; r < rows; ++r) {
        const uint16_t* row = x + r * dim;
        v16 acc = {};
        for (int64_t d = 0; d < dim; d += LANES) {
            v16 v = load16<true>(row, d);
            acc = acc + v * v;
        }
        const float inv = 1.0f / std::sqrt(lane_sum(acc) / (float)dim + eps);
        for (int64_t d = 0; d < dim; ++d) {
            const float h = bf16_to_f32(f32_to_bf16(bf16_to_f32(row[d]) * inv));
            out[r * dim + d] = f32_to_bf16(bf16_to_f32(weight[d]) * h);
        }
    }
    return 0;
}

}  // extern "C"
