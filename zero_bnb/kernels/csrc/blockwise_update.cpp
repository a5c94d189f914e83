// Fused CPU blockwise 8-bit optimizer update: the arithmetic of bitsandbytes' CUDA kernels
// kOptimizerStatic8bit2StateBlockwise / kOptimizerStatic8bit1StateBlockwise and quantize_2D
// (csrc/kernels.cu), as specified in zero_bnb/kernels/reference.py, bit for bit.
//
// One unit of work is one 256-element block: its moments are dequantized, updated, their new absmax
// taken and requantized in a few KiB of stack (L1), so nothing proportional to the partition is
// allocated. Blocks are independent, so threads take contiguous ranges of blocks (OpenMP, static
// schedule) and the result does not depend on the thread count. Build with -ffp-contract=off: every
// product and sum is rounded on its own, as in the reference.
//
// Quantization. quantize_2D's 7-step binary search makes the code a non-decreasing step function of
// x (ties at a midpoint go to the even code, the search's pivot). So the code of x is found exactly
// from a 65 536-entry table indexed by the top 16 bits of x's order-preserving integer key: each
// entry holds the code at the bucket's start and the last key of the bucket that still maps to it
// (found by bisection with the binary search itself when the table is built). Buckets holding more
// than one step, infinities or NaN are flagged, and their elements take the binary search. Unlike
// bitsandbytes' CPU lookup table (which returns the bucket's code for every x in it), the result is the
// binary search's, always.
#include <cfloat>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

namespace {

constexpr int kBlock = 256;
constexpr int kBuckets = 1 << 16;

enum Family { ADAM = 0, ADEMAMIX = 1, MOMENTUM = 2, LION = 3, RMSPROP = 4, ADAGRAD = 5 };

struct Scalars {
    float beta1, beta2, beta3, alpha, eps, lr, weight_decay;
    float one_minus_beta1, one_minus_beta2, one_minus_beta3;
    float correction1, correction2, step_size, eps_hat, decay;
    int32_t step;
    int32_t skip_zeros;
};

inline uint32_t bits_of(float x) {
    uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    return u;
}

inline float float_of(uint32_t u) {
    float x;
    std::memcpy(&x, &u, sizeof x);
    return x;
}

// Integer key with the order of the floats (-0 just below +0): negatives flipped, positives offset.
inline uint32_t key_of(float x) {
    const uint32_t u = bits_of(x);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

inline float float_of_key(uint32_t key) { return float_of((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key); }

// quantize_2D (kernels.cu 221-266), scalar.
template <bool SIGNED>
int binary_search(const float* code, float x) {
    int pivot = 127, lower_pivot = 0, upper_pivot = 255;
    float lower = SIGNED ? -1.0f : 0.0f, upper = 1.0f;
    float val = code[127];
    for (int i = 64; i > 0; i >>= 1) {
        if (x > val) {
            lower_pivot = pivot;
            lower = val;
            pivot += i;
        } else {
            upper_pivot = pivot;
            upper = val;
            pivot -= i;
        }
        val = code[pivot];
    }
    if (x > val) return x > (upper + val) * 0.5f ? upper_pivot : pivot;
    return x < (lower + val) * 0.5f ? lower_pivot : pivot;
}

// Table entry: bits 0-7 the code at the bucket's first key, bit 8 "one step inside", bit 9 "use the
// search", bits 10 and 11 the sign bits of the map values of the first code and the next, bits 16-31
// the low 16 bits of the last key that keeps the first code.
constexpr uint32_t kStep = 1u << 8, kSlow = 1u << 9, kSign = 1u << 10, kNextSign = 1u << 11;

inline uint32_t sign_bits(const float* code, int c) {
    return (std::signbit(code[c]) ? kSign : 0u) | (c < 255 && std::signbit(code[c + 1]) ? kNextSign : 0u);
}

template <bool SIGNED>
std::vector<uint32_t> build_table(const float* code) {
    std::vector<uint32_t> table(kBuckets);
    for (uint32_t bucket = 0; bucket < kBuckets; ++bucket) {
        const uint32_t first = bucket << 16, last = first | 0xffffu;
        const float lo = float_of_key(first), hi = float_of_key(last);
        if (!std::isfinite(lo) || !std::isfinite(hi)) {
            table[bucket] = kSlow;
            continue;
        }
        const int c_lo = binary_search<SIGNED>(code, lo), c_hi = binary_search<SIGNED>(code, hi);
        if (c_hi == c_lo) {
            table[bucket] = static_cast<uint32_t>(c_lo) | sign_bits(code, c_lo);
        } else if (c_hi == c_lo + 1) {
            uint32_t keep = first, change = last;  // code(keep) == c_lo, code(change) == c_hi
            while (change - keep > 1) {
                const uint32_t mid = keep + (change - keep) / 2;
                (binary_search<SIGNED>(code, float_of_key(mid)) == c_lo ? keep : change) = mid;
            }
            table[bucket] = static_cast<uint32_t>(c_lo) | kStep | sign_bits(code, c_lo) | ((keep & 0xffffu) << 16);
        } else {
            table[bucket] = kSlow;
        }
    }
    return table;
}

struct Map {
    float code[256];
    bool is_signed;
    std::vector<uint32_t> table;
};

// Tables for the maps seen so far (bitsandbytes uses two), built once per process.
const Map& map_for(const float* code, bool is_signed) {
    static std::mutex lock;
    static std::vector<std::unique_ptr<Map>> maps;
    std::lock_guard<std::mutex> guard(lock);
    for (const auto& map : maps)
        if (map->is_signed == is_signed && std::memcmp(map->code, code, sizeof map->code) == 0) return *map;
    auto map = std::make_unique<Map>();
    std::memcpy(map->code, code, sizeof map->code);
    map->is_signed = is_signed;
    map->table = is_signed ? build_table<true>(code) : build_table<false>(code);
    maps.push_back(std::move(map));
    return *maps.back();
}

// quantize_2D of s / absmax for one block, plus (signed maps) the state-1 sign fix (kernels.cu 1120).
template <bool SIGNED>
inline void quantize(const Map& map, const float* __restrict__ s, float absmax, uint8_t* __restrict__ out) {
    const uint32_t* __restrict__ table = map.table.data();
    const float* __restrict__ code = map.code;
    int slow = 0;
#if defined(__AVX512F__)
    const __m512 scale = _mm512_set1_ps(absmax);
    const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u)), low = _mm512_set1_epi32(0xffff);
    const __m512i one = _mm512_set1_epi32(1), byte = _mm512_set1_epi32(0xff);
    __mmask16 any_slow = 0;
    for (int j = 0; j < kBlock; j += 16) {
        const __m512 moment = _mm512_loadu_ps(s + j);
        const __m512i u = _mm512_castps_si512(_mm512_div_ps(moment, scale));
        const __mmask16 negative = _mm512_test_epi32_mask(u, sign);
        const __m512i key = _mm512_mask_blend_epi32(negative, _mm512_or_si512(u, sign),
                                                    _mm512_xor_si512(u, _mm512_set1_epi32(-1)));
        const __m512i entry = _mm512_i32gather_epi32(_mm512_srli_epi32(key, 16), table, 4);
        const __mmask16 stepped = _mm512_test_epi32_mask(entry, _mm512_set1_epi32(kStep)) &
                                  _mm512_cmpgt_epu32_mask(_mm512_and_si512(key, low), _mm512_srli_epi32(entry, 16));
        __m512i c = _mm512_mask_add_epi32(_mm512_and_si512(entry, byte), stepped, _mm512_and_si512(entry, byte), one);
        if (SIGNED) {  // the sign bit of code[c], from the entry
            const __mmask16 code_negative =
                (stepped & _mm512_test_epi32_mask(entry, _mm512_set1_epi32(kNextSign))) |
                (static_cast<__mmask16>(~stepped) & _mm512_test_epi32_mask(entry, _mm512_set1_epi32(kSign)));
            const __mmask16 flipped = code_negative ^ _mm512_test_epi32_mask(_mm512_castps_si512(moment), sign);
            const __mmask16 positive = _mm512_cmp_ps_mask(moment, _mm512_setzero_ps(), _CMP_GT_OQ);
            c = _mm512_mask_add_epi32(c, flipped & positive, c, one);
            c = _mm512_mask_sub_epi32(c, flipped & static_cast<__mmask16>(~positive), c, one);
        }
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j), _mm512_cvtepi32_epi8(c));
        any_slow |= _mm512_test_epi32_mask(entry, _mm512_set1_epi32(kSlow));
    }
    slow = any_slow != 0;
#else
#pragma omp simd reduction(| : slow)
    for (int j = 0; j < kBlock; ++j) {
        const float x = s[j] / absmax;
        const uint32_t key = key_of(x);
        const uint32_t entry = table[key >> 16];
        const bool stepped = (entry & kStep) && (key & 0xffffu) > (entry >> 16);
        int c = static_cast<int>((entry & 0xffu) + stepped);
        if (SIGNED) {  // the sign bit of code[c], from the entry
            const bool negative = (entry & (stepped ? kNextSign : kSign)) != 0;
            const bool flipped = negative != std::signbit(s[j]);
            c += flipped ? (s[j] > 0.0f ? 1 : -1) : 0;
        }
        out[j] = static_cast<uint8_t>(c);
        slow |= static_cast<int>(entry & kSlow);
    }
#endif
    if (slow) {  // infinities and NaN (an absmax of 0 or Inf): the binary search itself
        for (int j = 0; j < kBlock; ++j) {
            const float x = s[j] / absmax;
            if (!(table[key_of(x) >> 16] & kSlow)) continue;
            int c = binary_search<SIGNED>(code, x);
            if (SIGNED && std::signbit(code[c]) != std::signbit(s[j])) c += s[j] > 0.0f ? 1 : -1;
            out[j] = static_cast<uint8_t>(c);
        }
    }
}

// Dequantize 256 codes through a 256-entry map and scale by absmax (an explicit gather where AVX-512 exists:
// compilers tuned for AMD Zen emulate gathers with scalar loads).
inline void dequantize(const float* __restrict__ code, const uint8_t* __restrict__ c, float absmax,
                       float* __restrict__ out) {
#if defined(__AVX512F__)
    const __m512 scale = _mm512_set1_ps(absmax);
    for (int j = 0; j < kBlock; j += 16) {
        const __m512i index = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + j)));
        _mm512_storeu_ps(out + j, _mm512_mul_ps(_mm512_i32gather_ps(index, code, 4), scale));
    }
#else
#pragma omp simd
    for (int j = 0; j < kBlock; ++j) out[j] = code[c[j]] * absmax;
#endif
}

// fmaxf over |s| from -FLT_MAX, NaN ignored (kernels.cu 1043): order-free, so a vector max is exact.
inline float absmax_of(const float* __restrict__ s) {
    float m = -FLT_MAX;
#pragma omp simd reduction(max : m)
    for (int j = 0; j < kBlock; ++j) {
        const float a = std::fabs(s[j]);
        m = std::isnan(a) ? m : (a > m ? a : m);
    }
    return m;
}

struct Block {
    alignas(64) float g[kBlock];
    alignas(64) float p[kBlock];
    alignas(64) float s1[kBlock];
    alignas(64) float s2[kBlock];
    alignas(64) float s3[kBlock];
    alignas(64) uint8_t c1[kBlock];
    alignas(64) uint8_t c2[kBlock];
    alignas(64) uint8_t c3[kBlock];
};

// Copies one block in, padding the tail as the CUDA loads do (g = 0, p = 0, codes 128 / 0).
inline void load(Block& b, const float* g, const float* p, const uint8_t* c1, const uint8_t* c2, const uint8_t* c3,
                 int valid) {
    std::memcpy(b.g, g, valid * sizeof(float));
    std::memcpy(b.p, p, valid * sizeof(float));
    std::memcpy(b.c1, c1, valid);
    if (c2) std::memcpy(b.c2, c2, valid);
    if (c3) std::memcpy(b.c3, c3, valid);
    for (int j = valid; j < kBlock; ++j) {
        b.g[j] = 0.0f;
        b.p[j] = 0.0f;
        b.c1[j] = 128;
        b.c2[j] = 0;
        b.c3[j] = 128;
    }
}

template <int FAMILY>
void two_state(const Scalars& s, Block& b, const Map& map1, const Map& map2, float* a1, float* a2, float* a3) {
    const float* __restrict__ q1 = map1.code;
    const float* __restrict__ q2 = map2.code;
    dequantize(q1, b.c1, *a1, b.s1);
    dequantize(q2, b.c2, *a2, b.s2);
    if (FAMILY == ADEMAMIX) dequantize(q1, b.c3, *a3, b.s3);
#pragma omp simd
    for (int j = 0; j < kBlock; ++j) {
        const float g = b.g[j];
        const bool finite = std::isfinite(g);
        const float v = b.s2[j] * s.beta2 + (s.one_minus_beta2 * g) * g;
        const float m = b.s1[j] * s.beta1 + s.one_minus_beta1 * g;
        b.s1[j] = finite ? m : 0.0f;
        b.s2[j] = finite ? v : 0.0f;
        if (FAMILY == ADEMAMIX) {
            const float slow = b.s3[j] * s.beta3 + s.one_minus_beta3 * g;
            b.s3[j] = finite ? slow : 0.0f;
        }
    }
    const float n1 = absmax_of(b.s1), n2 = absmax_of(b.s2);
    const float n3 = FAMILY == ADEMAMIX ? absmax_of(b.s3) : 0.0f;
    *a1 = n1;
    *a2 = n2;
    if (FAMILY == ADEMAMIX) *a3 = n3;
    const bool decay = s.weight_decay > 0.0f;
#pragma omp simd
    for (int j = 0; j < kBlock; ++j) {
        const float p = b.p[j];
        float moved;
        if (FAMILY == ADEMAMIX)
            moved = p - s.lr * ((b.s1[j] / s.correction1 + s.alpha * b.s3[j]) /
                                (std::sqrt(b.s2[j]) / s.correction2 + s.eps));
        else
            moved = p + s.step_size * (b.s1[j] / (std::sqrt(b.s2[j]) + s.eps_hat));
        moved = decay ? moved * s.decay : moved;
        b.p[j] = std::isfinite(b.g[j]) ? moved : p;
    }
    quantize<true>(map1, b.s1, n1, b.c1);
    quantize<false>(map2, b.s2, n2, b.c2);
    if (FAMILY == ADEMAMIX) quantize<true>(map1, b.s3, n3, b.c3);
}

template <int FAMILY>
void one_state(const Scalars& s, Block& b, const Map& map1, float* a1) {
    const float* __restrict__ q1 = map1.code;
    const float m1 = *a1;
    const bool decay = s.weight_decay > 0.0f;
    const bool skip_zeros = s.skip_zeros != 0;
    const bool first = s.step == 1;
#pragma omp simd
    for (int j = 0; j < kBlock; ++j) {
        const float raw = b.g[j];
        const bool active = !skip_zeros || raw != 0.0f;
        float param = b.p[j];
        float g = raw;
        if (FAMILY == LION)
            param = (decay && active) ? param * s.decay : param;
        else
            g = decay ? g + param * s.weight_decay : g;
        const float old = q1[b.c1[j]] * m1;
        float m, moved;
        if (FAMILY == MOMENTUM) {
            m = first ? g : old * s.beta1 + g;
            moved = param - s.lr * m;
        } else if (FAMILY == LION) {
            const float direction = old * s.beta1 + s.one_minus_beta1 * g;
            const float sign = static_cast<float>((direction > 0.0f) - (direction < 0.0f));
            m = old * s.beta2 + s.one_minus_beta2 * g;
            moved = param - s.lr * sign;
        } else {
            m = FAMILY == RMSPROP ? old * s.beta1 + s.one_minus_beta1 * (g * g) : old + g * g;
            moved = param - s.lr * (raw / (std::sqrt(m) + s.eps));
        }
        b.s1[j] = active ? m : old;
        b.p[j] = active ? moved : param;
    }
    const float n1 = absmax_of(b.s1);
    *a1 = n1;
    quantize<true>(map1, b.s1, n1, b.c1);
}

template <int FAMILY>
void update(const Scalars& s, int64_t n, float* p, const float* g, uint8_t* state1, uint8_t* state2, float* absmax1,
            float* absmax2, const Map& map1, const Map* map2, int threads) {
    constexpr bool two = FAMILY == ADAM || FAMILY == ADEMAMIX;
    const int64_t blocks = (n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t k = 0; k < blocks; ++k) {
        Block b;
        const int64_t start = k * kBlock;
        const int valid = static_cast<int>(n - start < kBlock ? n - start : kBlock);
        uint8_t* c3 = FAMILY == ADEMAMIX ? state1 + n + start : nullptr;
        load(b, g + start, p + start, state1 + start, two ? state2 + start : nullptr, c3, valid);
        if constexpr (two)
            two_state<FAMILY>(s, b, map1, *map2, absmax1 + k, absmax2 + k,
                              FAMILY == ADEMAMIX ? absmax1 + blocks + k : nullptr);
        else
            one_state<FAMILY>(s, b, map1, absmax1 + k);
        std::memcpy(p + start, b.p, valid * sizeof(float));
        std::memcpy(state1 + start, b.c1, valid);
        if (two) std::memcpy(state2 + start, b.c2, valid);
        if (c3) std::memcpy(c3, b.c3, valid);
    }
}

}  // namespace

extern "C" {

// Updates n elements in place. state1 holds n codes (AdEMAMix: 2n, the slow moment second) and absmax1
// ceil(n / 256) scales (AdEMAMix: twice that, row-major); state2/absmax2/qmap2 are null for 1-state
// families. qmap1 is a signed map, qmap2 an unsigned one, each 256 sorted floats. Returns 0, or -1 for an
// unknown family.
int zero_bnb_blockwise_update(int family, const Scalars* scalars, int64_t n, float* p, const float* g,
                              uint8_t* state1, uint8_t* state2, float* absmax1, float* absmax2, const float* qmap1,
                              const float* qmap2, int threads) {
    const Scalars s = *scalars;
    const Map& map1 = map_for(qmap1, true);
    const Map* map2 = qmap2 ? &map_for(qmap2, false) : nullptr;
    switch (family) {
    case ADAM: update<ADAM>(s, n, p, g, state1, state2, absmax1, absmax2, map1, map2, threads); return 0;
    case ADEMAMIX: update<ADEMAMIX>(s, n, p, g, state1, state2, absmax1, absmax2, map1, map2, threads); return 0;
    case MOMENTUM: update<MOMENTUM>(s, n, p, g, state1, state2, absmax1, absmax2, map1, map2, threads); return 0;
    case LION: update<LION>(s, n, p, g, state1, state2, absmax1, absmax2, map1, map2, threads); return 0;
    case RMSPROP: update<RMSPROP>(s, n, p, g, state1, state2, absmax1, absmax2, map1, map2, threads); return 0;
    case ADAGRAD: update<ADAGRAD>(s, n, p, g, state1, state2, absmax1, absmax2, map1, map2, threads); return 0;
    default: return -1;
    }
}

// The codes quantize_2D (and, for a signed map, the sign fix) gives the n values of x, already divided
// by their absmax: the quantizer alone, for tests and measurements.
void zero_bnb_quantize(const float* qmap, int is_signed, const float* x, int64_t n, uint8_t* out) {
    const Map& map = map_for(qmap, is_signed != 0);
    for (int64_t start = 0; start < n; start += kBlock) {
        alignas(64) float s[kBlock] = {0.0f};
        alignas(64) uint8_t codes[kBlock];
        const int valid = static_cast<int>(n - start < kBlock ? n - start : kBlock);
        std::memcpy(s, x + start, valid * sizeof(float));
        if (is_signed)
            quantize<true>(map, s, 1.0f, codes);
        else
            quantize<false>(map, s, 1.0f, codes);
        std::memcpy(out + start, codes, valid);
    }
}

}  // extern "C"
