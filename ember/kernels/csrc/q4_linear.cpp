// Int4 linear layers for CPU (ember/kernels/cpu_q4.py), batch-invariant by construction.
//
// W holds the GGUF's Q4_1 blocks as stored: per group of 32 inputs, w = d * q + m (4-bit codes q,
// float16 d and m), never re-rounded. As llama.cpp does for Q4_1 x Q8_1, each row's x is quantized
// per group to int8 (dx = max|x| / 127, xq = round(x * 127 / max|x|)), so the group's dot product is
// an exact integer sum, isum = sum q * xq (VNNI dpbusd: 64 multiply-adds per instruction), and
//   acc = fma(m, dx * sum xq, fma(d * dx, isum, acc))   over groups in order, y = bf16(acc).
// Every output is one fixed sequence of operations over its own row only: the same bits in a step
// of one row or 2,048; integer sums are exact in any order, so AVX-512 VNNI, AVX2 and scalar builds
// agree too (fma rounds once everywhere).
//
// Layouts: x [rows, K] bf16; outputs in quads of 64 (four panels of 16); codes [N / 64][K / 8][4][16]
// dwords, dword j of panel i for inputs 8t .. 8t + 7 holds byte b = q(8t + b, 16i + j) | q(8t + 4 + b,
// 16i + j) << 4; dm [N / 64][K / 32][2][64] float16 (d of the quad's outputs, then m); y [rows, N] bf16.
#include <immintrin.h>

#include <vector>

#include "common.h"
#include "thread_pool.h"

static inline v16 fmadd(v16 a, v16 b, v16 c) {  // a * b + c, rounded once
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

static inline v16 bcast(float f) {
#if defined(__AVX512F__)
    return (v16)_mm512_set1_ps(f);
#else
    v16 v;
    for (int i = 0; i < LANES; ++i) v[i] = f;
    return v;
#endif
}

// acc + per lane the dot product of four unsigned bytes of a with four signed bytes of b (exact)
static inline i16v dot4(i16v acc, i16v a, const int8_t* bytes) {
    int32_t b;
    std::memcpy(&b, bytes, 4);
#if defined(__AVX512VNNI__)
    return (i16v)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)a, _mm512_set1_epi32(b));
#else
    for (int byte = 0; byte < 4; ++byte) acc += ((a >> (8 * byte)) & 0xff) * (int32_t)(int8_t)(b >> (8 * byte));
    return acc;
#endif
}

static inline float half_to_f32(uint16_t h) {  // exact
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t u;
    if (exp == 0x1fu) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp) {
        u = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (!man) {
        u = sign;
    } else {  // subnormal: normalise
        uint32_t m = man, e = 113;
        while (!(m & 0x400u)) m <<= 1, --e;
        u = sign | (e << 23) | ((m & 0x3ffu) << 13);
    }
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

static inline v16 load_half16(const uint16_t* p) {
#if defined(__AVX512F__)
    return (v16)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
#elif defined(__F16C__)
    union { v16 v; __m256 h[2]; } r;
    r.h[0] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
    r.h[1] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 8)));
    return r.v;
#else
    v16 r;
    for (int i = 0; i < LANES; ++i) r[i] = half_to_f32(p[i]);
    return r;
#endif
}

static const int QUAD = 64;            // outputs per quad (four panels of sixteen)
static const int64_t TILE_ROWS = 8;    // rows sharing each code load
static const int64_t BLOCK_ROWS = 64;  // rows quantized at a time (their x stays in cache)

// A block of rows, quantized: xq [rows, K] int8, per group dx [rows, G] and dx * sum xq [rows, G]
struct QuantRows {
    const int8_t* xq;
    const float* dx;
    const float* xsum;
    int64_t K, groups;
};

// R rows times panels first .. first + P - 1 of one quad; 2 * R * P integer chains in flight
template <int R, int P>
static inline void tile(const QuantRows& x, const uint8_t* codes, const uint16_t* dm, int first, uint16_t* y,
                        int64_t N) {
    v16 acc[R][P];
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < P; ++j) acc[r][j] = bcast(0.0f);
    const i16v nibble = {0x0f0f0f0f, 0x0f0f0f0f, 0x0f0f0f0f, 0x0f0f0f0f, 0x0f0f0f0f, 0x0f0f0f0f, 0x0f0f0f0f, 0x0f0f0f0f,
                         0x0f0f0f0f, 0x0f0f0f0f, 0x0f0f0f0f, 0x0f0f0f0f, 0x0f0f0f0f, 0x0f0f0f0f, 0x0f0f0f0f, 0x0f0f0f0f};
    for (int64_t g = 0; g < x.groups; ++g) {
        i16v lo_sum[R][P], hi_sum[R][P];
        for (int r = 0; r < R; ++r)
            for (int j = 0; j < P; ++j) lo_sum[r][j] = hi_sum[r][j] = i16v{};
        for (int t = 0; t < 4; ++t) {  // inputs 32g + 8t .. + 7
            const uint8_t* c = codes + ((g * 4 + t) * 4 + first) * 64;
            for (int j = 0; j < P; ++j) {
                i16v v;
                std::memcpy(&v, c + j * 64, sizeof(v));
                const i16v lo = v & nibble, hi = (v >> 4) & nibble;
                for (int r = 0; r < R; ++r) {
                    const int8_t* x8 = x.xq + r * x.K + g * 32 + t * 8;
                    lo_sum[r][j] = dot4(lo_sum[r][j], lo, x8);
                    hi_sum[r][j] = dot4(hi_sum[r][j], hi, x8 + 4);
                }
            }
        }
        const uint16_t* dmg = dm + g * 2 * QUAD + first * LANES;
        for (int j = 0; j < P; ++j) {
            const v16 d = load_half16(dmg + j * LANES), m = load_half16(dmg + QUAD + j * LANES);
            for (int r = 0; r < R; ++r) {
                const v16 isum = __builtin_convertvector(lo_sum[r][j] + hi_sum[r][j], v16);  // |isum| < 2^24: exact
                const v16 scale = d * bcast(x.dx[r * x.groups + g]);
                acc[r][j] = fmadd(m, bcast(x.xsum[r * x.groups + g]), fmadd(scale, isum, acc[r][j]));
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < P; ++j) {
            float a[LANES];
            std::memcpy(a, &acc[r][j], sizeof(a));
            for (int l = 0; l < LANES; ++l) y[r * N + (first + j) * LANES + l] = f32_to_bf16(a[l]);
        }
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
#define Q4_AVX2 1
// R rows times one quad on AVX2 (where tile()'s sixteen-lane integer vectors go through the stack and
// its dot4 is four shifts, masks and 32-bit multiplies a byte). Eight outputs at a time: vpmaddubsw
// multiplies code bytes by the row's int8 inputs and adds pairs (|pair| <= 2 * 15 * 127, a low and
// a high pair <= 7,620: exact in int16), vpmaddwd adds those to int32, so isum is tile()'s lo + hi
// sum exactly; then per lane the same float steps in the same order: the same bits.
template <int R>
static inline void quad_avx2(const QuantRows& x, const uint8_t* codes, const uint16_t* dm, uint16_t* y,
                             int64_t N) {
    alignas(32) float acc[R][QUAD];
    for (int r = 0; r < R; ++r)
        for (int o = 0; o < QUAD; ++o) acc[r][o] = 0.0f;
    const __m256i nibble = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    for (int64_t g = 0; g < x.groups; ++g) {
        const uint16_t* dmg = dm + g * 2 * QUAD;
        for (int h = 0; h < QUAD / 8; ++h) {  // outputs 8h .. 8h + 7: panel h / 2, dwords 8 (h % 2) ..
            __m256i isum[R];
            for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
            for (int t = 0; t < 4; ++t) {  // inputs 32g + 8t .. + 7
                const __m256i v = _mm256_loadu_si256(
                    (const __m256i*)(codes + ((g * 4 + t) * 4 + h / 2) * 64 + (h % 2) * 32));
                const __m256i lo = _mm256_and_si256(v, nibble);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
                for (int r = 0; r < R; ++r) {
                    const int8_t* x8 = x.xq + r * x.K + g * 32 + t * 8;
                    int32_t a, b;
                    std::memcpy(&a, x8, 4);
                    std::memcpy(&b, x8 + 4, 4);
                    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(a)),
                                                           _mm256_maddubs_epi16(hi, _mm256_set1_epi32(b)));
                    isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(pairs, ones));
                }
            }
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(dmg + h * 8)));
            const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(dmg + QUAD + h * 8)));
            for (int r = 0; r < R; ++r) {
                const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(x.dx[r * x.groups + g]));
                float* a = acc[r] + h * 8;
                const __m256 inner = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(isum[r]), _mm256_load_ps(a));
                _mm256_store_ps(a, _mm256_fmadd_ps(m, _mm256_set1_ps(x.xsum[r * x.groups + g]), inner));
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int o = 0; o < QUAD; ++o) y[r * N + o] = f32_to_bf16(acc[r][o]);
}
#endif

// R rows (from row `row` of x) times the quads [begin, end)
template <int R, int P>
static inline void rows_times_quads(const QuantRows& x, int64_t row, const uint8_t* codes, const uint16_t* dm,
                                    uint16_t* y, int64_t N, int64_t begin, int64_t end) {
    const QuantRows rx{x.xq + row * x.K, x.dx + row * x.groups, x.xsum + row * x.groups, x.K, x.groups};
    const int64_t quad_codes = x.K / 2 * QUAD, quad_dm = x.groups * 2 * QUAD;
#if defined(Q4_AVX2)
    if constexpr (R > 4) {  // four rows' integer sums fill AVX2's registers
        rows_times_quads<4, P>(x, row, codes, dm, y, N, begin, end);
        rows_times_quads<R - 4, P>(x, row + 4, codes, dm, y, N, begin, end);
    } else {
        for (int64_t quad = begin; quad < end; ++quad)
            quad_avx2<R>(rx, codes + quad * quad_codes, dm + quad * quad_dm, y + row * N + quad * QUAD, N);
    }
    return;
#endif
    for (int64_t quad = begin; quad < end; ++quad)
        for (int first = 0; first < 4; first += P)
            tile<R, P>(rx, codes + quad * quad_codes, dm + quad * quad_dm, first, y + row * N + quad * QUAD, N);
}

// xq = round(x * 127 / max|x|) per group of 32 (ties to even), dx = max|x| / 127
static void quantize_rows(const uint16_t* x, int64_t rows, int64_t K, int8_t* xq, float* dx, float* xsum) {
    const int64_t groups = K / 32;
    const float magic = 12582912.0f;  // 1.5 * 2^23: (v + magic) - magic rounds |v| < 2^22 to an integer, ties to even
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t g = 0; g < groups; ++g) {
            const uint16_t* src = x + r * K + g * 32;
            float v[32], amax = 0.0f;
            for (int k = 0; k < 32; ++k) v[k] = bf16_to_f32(src[k]);
            for (int k = 0; k < 32; ++k) amax = std::fabs(v[k]) > amax ? std::fabs(v[k]) : amax;
            const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            int32_t q[32], total = 0;
            for (int k = 0; k < 32; ++k) {
                float scaled = (v[k] * inv + magic) - magic;
                scaled = scaled > 127.0f ? 127.0f : scaled < -127.0f ? -127.0f : scaled;
                q[k] = (int32_t)scaled;
            }
            for (int k = 0; k < 32; ++k) {
                xq[r * K + g * 32 + k] = (int8_t)q[k];
                total += q[k];
            }
            dx[r * groups + g] = d;
            xsum[r * groups + g] = d * (float)total;
        }
}

static void rows_block(const uint16_t* x, int64_t rows, int64_t K, const uint8_t* codes, const uint16_t* dm,
                       int64_t N, int64_t quad_begin, int64_t quad_end, uint16_t* y, std::vector<float>& scratch) {
    const int64_t groups = K / 32;
    scratch.resize(rows * (K / 4 + 2 * groups) + 16);
    int8_t* xq = (int8_t*)scratch.data();
    float* dx = scratch.data() + rows * K / 4;
    float* xsum = dx + rows * groups;
    quantize_rows(x, rows, K, xq, dx, xsum);
    const QuantRows qx{xq, dx, xsum, K, groups};
    int64_t r = 0;
    for (; r + TILE_ROWS <= rows; r += TILE_ROWS)
        rows_times_quads<TILE_ROWS, 1>(qx, r, codes, dm, y, N, quad_begin, quad_end);
    switch (rows - r) {
        case 7: rows_times_quads<7, 1>(qx, r, codes, dm, y, N, quad_begin, quad_end); break;
        case 6: rows_times_quads<6, 1>(qx, r, codes, dm, y, N, quad_begin, quad_end); break;
        case 5: rows_times_quads<5, 1>(qx, r, codes, dm, y, N, quad_begin, quad_end); break;
        case 4: rows_times_quads<4, 2>(qx, r, codes, dm, y, N, quad_begin, quad_end); break;
        case 3: rows_times_quads<3, 2>(qx, r, codes, dm, y, N, quad_begin, quad_end); break;
        case 2: rows_times_quads<2, 4>(qx, r, codes, dm, y, N, quad_begin, quad_end); break;
        case 1: rows_times_quads<1, 4>(qx, r, codes, dm, y, N, quad_begin, quad_end); break;
        default: break;
    }
}


// rows of x times the quads [quad_begin, quad_end) of one weight, on the calling thread: the fused MoE
// kernel's building block (csrc/moe.cpp), the same bits as ember_q4_linear
void q4_rows_quads(const uint16_t* x, int64_t rows, int64_t K, const uint8_t* codes, const uint16_t* dm, int64_t N,
                   int64_t quad_begin, int64_t quad_end, uint16_t* y) {
    thread_local std::vector<float> scratch;
    rows_block(x, rows, K, codes, dm, N, quad_begin, quad_end, y, scratch);
}

extern "C" {

// y [rows, N] = x [rows, K] times the int4 weight, over `threads` threads (the caller's among them):
// up to BLOCK_ROWS rows split by quads, more by blocks of rows; every output is computed alone, so
// the split changes no bit. K % 32 == 0 and N % 64 == 0,
// else returns -1.
int ember_q4_linear(const uint16_t* x, int64_t rows, int64_t K, const uint8_t* codes, const uint16_t* dm,
                    int64_t N, uint16_t* y, int threads) {
    if (K % 32 || N % QUAD || K <= 0 || rows < 0) return -1;
    const int64_t quads = N / QUAD, blocks = (rows + BLOCK_ROWS - 1) / BLOCK_ROWS;
    if (threads < 1) threads = 1;
    if (blocks <= 1) {  // by quads: for a decode's few rows, four parts a thread, claimed by whichever is free
        const int64_t want = rows <= TILE_ROWS ? 4 * threads : threads;  // (each part quantizes the rows again)
        const int64_t parts = threads == 1 ? 1 : (quads < want ? quads : want);
        shared_pool().run((int)parts, threads, [&](int part) {
            thread_local std::vector<float> scratch;
            rows_block(x, rows, K, codes, dm, N, quads * part / parts, quads * (part + 1) / parts, y, scratch);
        });
    } else {  // blocks of BLOCK_ROWS rows
        shared_pool().run((int)blocks, threads, [&](int part) {
            thread_local std::vector<float> scratch;
            const int64_t first = part * BLOCK_ROWS, n = rows - first < BLOCK_ROWS ? rows - first : BLOCK_ROWS;
            rows_block(x + first * K, n, K, codes, dm, N, 0, quads, y + first * N, scratch);
        });
    }
    return 0;
}

}  // extern "C"
