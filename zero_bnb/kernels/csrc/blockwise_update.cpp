// Fused CPU blockwise 8-bit optimizer update: the arithmetic of bitsandbytes' CUDA kernels
// kOptimizerStatic8bit2StateBlockwise / kOptimizerStatic8bit1StateBlockwise and quantize_2D
// (csrc/kernels.cu), as specified in zero_bnb/kernels/reference.py, bit for bit.
//
// One unit of work is one 256-element block: its moments are dequantized, updated, their new absmax
// taken and requantized in a few KiB of stack (L1), so nothing proportional to the partition is
// allocated. Whole blocks are read and written in place; only a partition's last, partial block is
// copied into a padded buffer. Blocks are independent, so threads take contiguous ranges of blocks
// (OpenMP, static schedule) and the result does not depend on the thread count. Build with
// -ffp-contract=off: every product and sum is rounded on its own, as in the reference.
//
// Quantization. quantize_2D's 7-step binary search makes the code a non-decreasing step function of
// x (ties at a midpoint go to the even code, the search's pivot). So the code of x is found exactly
// from a table indexed by x's sign and the top 16 bits of its magnitude (exponent and 7 mantissa bits):
// each entry holds the code (sign fix applied) at the bucket's first value, the code after the bucket's
// one step and the last low 16 bits that keep the first code (found by bisection with the binary search
// itself when the table is built). Exponents below the map's smallest step share one row, so for
// bitsandbytes' dynamic maps the table has 2 x 4096 entries of which about 6 000 (24 KiB) are touched,
// against 65 536 (256 KiB, beyond L1) for the whole float range. NaN, Inf, magnitudes >= 2 (x is at
// most 1 otherwise) and buckets holding more than one step (none in bitsandbytes' maps) take the binary
// search. Unlike bitsandbytes' CPU lookup table (which returns the bucket's code for every x in it), the
// result is the binary search's, always.
//
// Measured on AMD Zen 4: a 16-lane gather costs about a division; dequantization avoids it (byte-plane
// permutes), so the two quantizer gathers and divisions by absmax (exact; a reciprocal plus an exactness
// check was slower) and the update's division and square root bound the kernel.
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
constexpr uint32_t kTop = 0x3fffu;  // top 16 bits of the magnitude of 1.99..., the last bucket kept

enum Family { ADAM = 0, ADEMAMIX = 1, MOMENTUM = 2, LION = 3, RMSPROP = 4, ADAGRAD = 5 };

struct Scalars {
    float beta1, beta2, beta3, alpha, eps, lr, weight_decay;
    float one_minus_beta1, one_minus_beta2, one_minus_beta3;
    float correction1, correction2, step_size, eps_hat, decay;
    int32_t step;
    int32_t skip_zeros;
};

inline uint32_t bits_of(float x) { uint32_t u; std::memcpy(&u, &x, sizeof u); return u; }

inline float float_of(uint32_t u) { float x; std::memcpy(&x, &u, sizeof x); return x; }

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

// The state-1 sign fix (kernels.cu 1120): a code whose map value's sign differs from the moment's
// moves one step towards it (unsigned char arithmetic). A NaN counts as positive (the GPU's canonical NaN).
template <bool SIGNED>
inline uint8_t fixed(const float* code, int c, float moment) {
    const bool negative = std::signbit(moment) && !std::isnan(moment);
    if (SIGNED && std::signbit(code[c]) != negative) c += moment > 0.0f ? 1 : -1;
    return static_cast<uint8_t>(c);
}

// The code a moment gets, x being it divided by its block's absmax (same sign): the reference, scalar.
template <bool SIGNED>
inline uint8_t code_of(const float* code, float x, float moment) {
    return fixed<SIGNED>(code, binary_search<SIGNED>(code, x), moment);
}

// Table entry: bits 0-7 the code of the bucket's first value, 8-15 the code after its step, 16-31 the
// last low 16 bits keeping the first code (0xffff: no step). A step with equal codes marks a bucket
// that holds more than one step: its elements take the binary search.
inline uint32_t entry_of(uint32_t first, uint32_t next, uint32_t keep) { return first | (next << 8) | (keep << 16); }
constexpr uint32_t kMany = 0u;  // entry_of(0, 0, 0)

struct Map {
    float code[256];
    alignas(64) uint8_t planes[4][256];  // byte k of each code's float bits: the map in 16 registers
    bool is_signed;
    uint32_t base;     // top 16 bits (of the magnitude) of row 0: every smaller exponent shares it
    uint32_t half;     // entries per sign: a power of two above kTop - base + 1 (the last: magnitudes >= 2)
    uint32_t sign_shift;  // 31 - log2(half): u >> sign_shift & half is the sign's offset
    std::vector<uint32_t> table;
};

template <bool SIGNED>
uint32_t bucket_entry(const float* code, uint32_t sign, uint32_t top) {
    const auto value = [&](uint32_t low) { return float_of(sign | (top << 16) | low); };
    const int lo = binary_search<SIGNED>(code, value(0)), hi = binary_search<SIGNED>(code, value(0xffff));
    const uint8_t first = fixed<SIGNED>(code, lo, value(0));
    if (lo == hi) return entry_of(first, first, 0xffff);
    if (hi - lo != 1 && lo - hi != 1) return kMany;
    uint32_t keep = 0, change = 0xffff;  // raw code(keep) == lo, raw code(change) == hi
    while (change - keep > 1) {
        const uint32_t mid = keep + (change - keep) / 2;
        (binary_search<SIGNED>(code, value(mid)) == lo ? keep : change) = mid;
    }
    const uint8_t next = fixed<SIGNED>(code, hi, value(0xffff));
    return next == first ? entry_of(first, first, 0xffff) : entry_of(first, next, keep);
}

template <bool SIGNED>
void build_table(Map& map) {
    const float* code = map.code;
    // Row 0 holds every exponent below the first one whose magnitudes do not all get the code of 0.
    const auto constant_below = [&](uint32_t exponent) {
        const float edge = std::nextafter(float_of(exponent << 23), 0.0f);
        return code_of<SIGNED>(code, 0.0f, 0.0f) == code_of<SIGNED>(code, FLT_TRUE_MIN, FLT_TRUE_MIN) &&
               code_of<SIGNED>(code, FLT_TRUE_MIN, FLT_TRUE_MIN) == code_of<SIGNED>(code, edge, edge) &&
               code_of<SIGNED>(code, -0.0f, -0.0f) == code_of<SIGNED>(code, -edge, -edge);
    };
    uint32_t exponent = 127;
    while (exponent > 1 && !constant_below(exponent)) --exponent;
    const bool row0_constant = constant_below(exponent);
    map.base = (exponent - 1) << 7;
    map.half = 1;
    while (map.half < kTop - map.base + 2) map.half *= 2;
    map.sign_shift = 31 - __builtin_ctz(map.half);
    map.table.assign(2 * map.half, kMany);
    for (uint32_t negative = 0; negative < 2; ++negative) {
        const uint32_t sign = negative << 31;
        const float zero = negative ? -0.0f : 0.0f;
        const uint8_t small = code_of<SIGNED>(code, zero, zero);
        for (uint32_t pos = 0; pos <= kTop - map.base; ++pos) {
            map.table[negative * map.half + pos] = pos < 128 ? (row0_constant ? entry_of(small, small, 0xffff) : kMany)
                                                             : bucket_entry<SIGNED>(code, sign, map.base + pos);
        }
    }
}

// Tables for the maps seen so far (bitsandbytes uses two), built once per process.
const Map& map_for(const float* code, bool is_signed) {
    static std::mutex lock;
    static std::vector<std::unique_ptr<Map>> maps;
    std::lock_guard<std::mutex> guard(lock);
    for (const auto& map : maps)
        if (map->is_signed == is_signed && std::memcmp(map->code, code, sizeof map->code) == 0) return *map;
    auto map = std::make_unique<Map>();
    std::memcpy(map->code, code, sizeof map->code);
    for (int c = 0; c < 256; ++c)
        for (int k = 0; k < 4; ++k) map->planes[k][c] = static_cast<uint8_t>(bits_of(code[c]) >> (8 * k));
    map->is_signed = is_signed;
    if (is_signed)
        build_table<true>(*map);
    else
        build_table<false>(*map);
    maps.push_back(std::move(map));
    return *maps.back();
}

// The table's code for x (bits u); false where x is NaN, Inf, >= 2 in magnitude or in a bucket of many steps.
inline bool lookup(const Map& map, uint32_t u, uint8_t* code) {
    const uint32_t top = (u & 0x7fffffffu) >> 16;
    const uint32_t row = top < map.base ? 0 : (top > kTop ? kTop + 1 : top) - map.base;
    const uint32_t entry = map.table[row + ((u >> 31) ? map.half : 0)];
    *code = static_cast<uint8_t>((u & 0xffffu) > (entry >> 16) ? entry >> 8 : entry);
    return entry != kMany;
}

template <bool SIGNED>
void quantize_slow(const Map& map, const float* s, float absmax, uint8_t* out, int j) {
    const float x = s[j] / absmax;
    if (!lookup(map, bits_of(x), out + j)) out[j] = code_of<SIGNED>(map.code, x, s[j]);
}

#if defined(__AVX512F__)
// The table's codes for 16 values of x (stored to out); the mask of those that need the binary search.
inline __mmask16 lookup16(const Map& map, __m512 x, uint8_t* out) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i top = _mm512_srli_epi32(_mm512_slli_epi32(u, 1), 17);  // magnitude >> 16
    __m512i row = _mm512_min_epu32(_mm512_subs_epu16(top, _mm512_set1_epi32(static_cast<int>(map.base))),
                                   _mm512_set1_epi32(static_cast<int>(kTop + 1 - map.base)));
    row = _mm512_ternarylogic_epi32(row, _mm512_srl_epi32(u, _mm_cvtsi32_si128(static_cast<int>(map.sign_shift))),
                                    _mm512_set1_epi32(static_cast<int>(map.half)), 0xF8);  // row | (u' & half)
    const __m512i entry = _mm512_i32gather_epi32(row, map.table.data(), 4);
    const __mmask16 stepped = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0xffff)),
                                                      _mm512_srli_epi32(entry, 16));
    const __m512i c = _mm512_mask_blend_epi32(stepped, entry, _mm512_srli_epi32(entry, 8));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(c));  // the low bytes
    return _mm512_cmpeq_epi32_mask(entry, _mm512_setzero_si512());
}
#endif

// quantize_2D of s / absmax for one block, plus (signed maps) the state-1 sign fix (kernels.cu 1120).
template <bool SIGNED>
void quantize(const Map& map, const float* __restrict__ s, float absmax, uint8_t* __restrict__ out) {
#if defined(__AVX512F__)
    const __m512 scale = _mm512_set1_ps(absmax);
    uint32_t slow = 0;
    for (int j = 0; j < kBlock; j += 16) {
        const __mmask16 lanes = lookup16(map, _mm512_div_ps(_mm512_loadu_ps(s + j), scale), out + j);
        slow |= static_cast<uint32_t>(lanes != 0) << (j / 16);
    }
    for (; slow; slow &= slow - 1)
        for (int j = 16 * __builtin_ctz(slow), end = j + 16; j < end; ++j)
            quantize_slow<SIGNED>(map, s, absmax, out, j);
#else
    for (int j = 0; j < kBlock; ++j) quantize_slow<SIGNED>(map, s, absmax, out, j);
#endif
}

#if defined(__AVX512VBMI__)
// Where 64 looked-up floats land after the byte interleave of dequantize (within 128-bit lanes): the codes
// are permuted by it first, so the floats come out in order.
alignas(64) constexpr uint8_t kInterleave[64] = {
    0, 1, 2, 3, 16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51, 4, 5, 6, 7, 20, 21, 22, 23, 36, 37, 38, 39, 52, 53,
    54, 55, 8, 9, 10, 11, 24, 25, 26, 27, 40, 41, 42, 43, 56, 57, 58, 59, 12, 13, 14, 15, 28, 29, 30, 31, 44, 45,
    46, 47, 60, 61, 62, 63};
#endif

// Dequantize 256 codes through a 256-entry map and scale by absmax. With AVX512-VBMI the map sits in 16
// registers as four 256-byte planes (byte k of every value's bits): 64 codes look up each plane with two
// 128-byte permutes and a blend, and the bytes are interleaved back into floats, about three times
// faster than a 16-lane gather per 16 codes. Else an explicit gather where AVX-512 exists (compilers
// tuned for AMD Zen emulate gathers with scalar loads), else scalar.
inline void dequantize(const Map& map, const uint8_t* __restrict__ c, float absmax, float* __restrict__ out) {
#if defined(__AVX512VBMI__)
    __m512i t[4][4];
    for (int k = 0; k < 4; ++k)
        for (int q = 0; q < 4; ++q) t[k][q] = _mm512_load_si512(map.planes[k] + 64 * q);
    const __m512i order = _mm512_load_si512(kInterleave);
    const __m512 scale = _mm512_set1_ps(absmax);
    for (int j = 0; j < kBlock; j += 64) {
        const __m512i index = _mm512_permutexvar_epi8(order, _mm512_loadu_si512(c + j));
        const __mmask64 high = _mm512_movepi8_mask(index);
        __m512i b[4];
        for (int k = 0; k < 4; ++k)
            b[k] = _mm512_mask_blend_epi8(high, _mm512_permutex2var_epi8(t[k][0], index, t[k][1]),
                                          _mm512_permutex2var_epi8(t[k][2], index, t[k][3]));
        const __m512i low01 = _mm512_unpacklo_epi8(b[0], b[1]), high01 = _mm512_unpackhi_epi8(b[0], b[1]);
        const __m512i low23 = _mm512_unpacklo_epi8(b[2], b[3]), high23 = _mm512_unpackhi_epi8(b[2], b[3]);
        const __m512i values[4] = {_mm512_unpacklo_epi16(low01, low23), _mm512_unpackhi_epi16(low01, low23),
                                   _mm512_unpacklo_epi16(high01, high23), _mm512_unpackhi_epi16(high01, high23)};
        for (int r = 0; r < 4; ++r)
            _mm512_storeu_ps(out + j + 16 * r, _mm512_mul_ps(_mm512_castsi512_ps(values[r]), scale));
    }
#elif defined(__AVX512F__)
    const __m512 scale = _mm512_set1_ps(absmax);
    for (int j = 0; j < kBlock; j += 16) {
        const __m512i index = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + j)));
        _mm512_storeu_ps(out + j, _mm512_mul_ps(_mm512_i32gather_ps(index, map.code, 4), scale));
    }
#else
    const float* __restrict__ code = map.code;
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

// One block's data: in place for a whole block, a padded copy for the last partial one.
struct View {
    const float* g;
    float* p;
    uint8_t *c1, *c2, *c3;
};

#if defined(__AVX512F__)
// Adam: the two dequantizations, one pass per 16 elements (update, parameter, absmax), the two requantizations.
void adam_block(const Scalars& s, const View& b, const Map& map1, const Map& map2, float* a1, float* a2) {
    alignas(64) float s1[kBlock], s2[kBlock];
    dequantize(map1, b.c1, *a1, s1);
    dequantize(map2, b.c2, *a2, s2);
    const __m512 beta1 = _mm512_set1_ps(s.beta1), beta2 = _mm512_set1_ps(s.beta2);
    const __m512 one_minus_beta1 = _mm512_set1_ps(s.one_minus_beta1);
    const __m512 one_minus_beta2 = _mm512_set1_ps(s.one_minus_beta2);
    const __m512 step_size = _mm512_set1_ps(s.step_size), eps_hat = _mm512_set1_ps(s.eps_hat);
    const __m512 decay = _mm512_set1_ps(s.decay);
    const bool decayed = s.weight_decay > 0.0f;
    const __m512 infinity = _mm512_set1_ps(INFINITY);
    __m512 max1 = _mm512_set1_ps(-FLT_MAX), max2 = max1;
    for (int j = 0; j < kBlock; j += 16) {
        const __m512 old1 = _mm512_load_ps(s1 + j), old2 = _mm512_load_ps(s2 + j);
        const __m512 g = _mm512_loadu_ps(b.g + j), p = _mm512_loadu_ps(b.p + j);
        const __mmask16 finite = _mm512_cmp_ps_mask(_mm512_abs_ps(g), infinity, _CMP_LT_OQ);
        const __m512 v = _mm512_maskz_add_ps(finite, _mm512_mul_ps(old2, beta2),
                                             _mm512_mul_ps(_mm512_mul_ps(one_minus_beta2, g), g));
        const __m512 m = _mm512_maskz_add_ps(finite, _mm512_mul_ps(old1, beta1), _mm512_mul_ps(one_minus_beta1, g));
        const __m512 direction = _mm512_div_ps(m, _mm512_add_ps(_mm512_sqrt_ps(v), eps_hat));
        __m512 moved = _mm512_add_ps(p, _mm512_mul_ps(step_size, direction));
        if (decayed) moved = _mm512_mul_ps(moved, decay);
        _mm512_storeu_ps(b.p + j, _mm512_mask_blend_ps(finite, p, moved));
        _mm512_store_ps(s1 + j, m);
        _mm512_store_ps(s2 + j, v);
        max1 = _mm512_max_ps(_mm512_abs_ps(m), max1);  // the second operand when the first is NaN
        max2 = _mm512_max_ps(_mm512_abs_ps(v), max2);
    }
    const float n1 = _mm512_reduce_max_ps(max1), n2 = _mm512_reduce_max_ps(max2);
    *a1 = n1;
    *a2 = n2;
    quantize<true>(map1, s1, n1, b.c1);
    quantize<false>(map2, s2, n2, b.c2);
}
#endif

template <int FAMILY>
void two_state(const Scalars& s, const View& b, const Map& map1, const Map& map2, float* a1, float* a2, float* a3) {
    alignas(64) float s1[kBlock], s2[kBlock], s3[kBlock];
    dequantize(map1, b.c1, *a1, s1);
    dequantize(map2, b.c2, *a2, s2);
    if (FAMILY == ADEMAMIX) dequantize(map1, b.c3, *a3, s3);
    const float* __restrict__ gs = b.g;
    float* __restrict__ ps = b.p;
    const bool decay = s.weight_decay > 0.0f;
#pragma omp simd
    for (int j = 0; j < kBlock; ++j) {
        const float g = gs[j], p = ps[j];
        const bool finite = std::isfinite(g);
        const float v = finite ? s2[j] * s.beta2 + (s.one_minus_beta2 * g) * g : 0.0f;
        const float m = finite ? s1[j] * s.beta1 + s.one_minus_beta1 * g : 0.0f;
        s1[j] = m;
        s2[j] = v;
        float moved;
        if (FAMILY == ADEMAMIX) {
            const float slow = finite ? s3[j] * s.beta3 + s.one_minus_beta3 * g : 0.0f;
            s3[j] = slow;
            moved = p - s.lr * ((m / s.correction1 + s.alpha * slow) / (std::sqrt(v) / s.correction2 + s.eps));
        } else {
            moved = p + s.step_size * (m / (std::sqrt(v) + s.eps_hat));
        }
        moved = decay ? moved * s.decay : moved;
        ps[j] = finite ? moved : p;
    }
    const float n1 = absmax_of(s1), n2 = absmax_of(s2);
    *a1 = n1;
    *a2 = n2;
    quantize<true>(map1, s1, n1, b.c1);
    quantize<false>(map2, s2, n2, b.c2);
    if (FAMILY == ADEMAMIX) {
        const float n3 = absmax_of(s3);
        *a3 = n3;
        quantize<true>(map1, s3, n3, b.c3);
    }
}

template <int FAMILY>
void one_state(const Scalars& s, const View& b, const Map& map1, float* a1) {
    alignas(64) float old[kBlock], s1[kBlock];
    dequantize(map1, b.c1, *a1, old);
    const float* __restrict__ gs = b.g;
    float* __restrict__ ps = b.p;
    const bool decay = s.weight_decay > 0.0f;
    const bool skip_zeros = s.skip_zeros != 0;
    const bool first = s.step == 1;
#pragma omp simd
    for (int j = 0; j < kBlock; ++j) {
        const float raw = gs[j];
        const bool active = !skip_zeros || raw != 0.0f;
        float param = ps[j];
        float g = raw;
        if (FAMILY == LION)
            param = (decay && active) ? param * s.decay : param;
        else
            g = decay ? g + param * s.weight_decay : g;
        float m, moved;
        if (FAMILY == MOMENTUM) {
            m = first ? g : old[j] * s.beta1 + g;
            moved = param - s.lr * m;
        } else if (FAMILY == LION) {
            const float direction = old[j] * s.beta1 + s.one_minus_beta1 * g;
            const float sign = static_cast<float>((direction > 0.0f) - (direction < 0.0f));
            m = old[j] * s.beta2 + s.one_minus_beta2 * g;
            moved = param - s.lr * sign;
        } else {
            m = FAMILY == RMSPROP ? old[j] * s.beta1 + s.one_minus_beta1 * (g * g) : old[j] + g * g;
            moved = param - s.lr * (raw / (std::sqrt(m) + s.eps));
        }
        s1[j] = active ? m : old[j];
        ps[j] = active ? moved : param;
    }
    const float n1 = absmax_of(s1);
    *a1 = n1;
    quantize<true>(map1, s1, n1, b.c1);
}

template <int FAMILY>
void step_block(const Scalars& s, const View& b, const Map& map1, const Map* map2, float* a1, float* a2, float* a3) {
#if defined(__AVX512F__)
    if constexpr (FAMILY == ADAM) return adam_block(s, b, map1, *map2, a1, a2);
#endif
    if constexpr (FAMILY == ADAM || FAMILY == ADEMAMIX)
        two_state<FAMILY>(s, b, map1, *map2, a1, a2, a3);
    else
        one_state<FAMILY>(s, b, map1, a1);
}

template <int FAMILY>
void update(const Scalars& s, int64_t n, float* p, const float* g, uint8_t* state1, uint8_t* state2, float* absmax1,
            float* absmax2, const Map& map1, const Map* map2, int threads) {
    constexpr bool two = FAMILY == ADAM || FAMILY == ADEMAMIX;
    const int64_t blocks = (n + kBlock - 1) / kBlock, whole = n / kBlock;
    float* slow_absmax = FAMILY == ADEMAMIX ? absmax1 + blocks : nullptr;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t k = 0; k < whole; ++k) {
        const int64_t start = k * kBlock;
        const View b{g + start, p + start, state1 + start, two ? state2 + start : nullptr,
                     FAMILY == ADEMAMIX ? state1 + n + start : nullptr};
        step_block<FAMILY>(s, b, map1, map2, absmax1 + k, two ? absmax2 + k : nullptr,
                           slow_absmax ? slow_absmax + k : nullptr);
    }
    if (whole == blocks) return;
    // The last, partial block, padded as the CUDA loads do (g = 0, p = 0, codes 128 / 0 / 128).
    const int64_t start = whole * kBlock;
    const int valid = static_cast<int>(n - start);
    alignas(64) float gp[kBlock] = {0.0f}, pp[kBlock] = {0.0f};
    alignas(64) uint8_t c1[kBlock], c2[kBlock], c3[kBlock];
    std::memset(c1, 128, kBlock);
    std::memset(c2, 0, kBlock);
    std::memset(c3, 128, kBlock);
    std::memcpy(gp, g + start, valid * sizeof(float));
    std::memcpy(pp, p + start, valid * sizeof(float));
    std::memcpy(c1, state1 + start, valid);
    if (two) std::memcpy(c2, state2 + start, valid);
    if (FAMILY == ADEMAMIX) std::memcpy(c3, state1 + n + start, valid);
    step_block<FAMILY>(s, View{gp, pp, c1, c2, c3}, map1, map2, absmax1 + whole, two ? absmax2 + whole : nullptr,
                       slow_absmax ? slow_absmax + whole : nullptr);
    std::memcpy(p + start, pp, valid * sizeof(float));
    std::memcpy(state1 + start, c1, valid);
    if (two) std::memcpy(state2 + start, c2, valid);
    if (FAMILY == ADEMAMIX) std::memcpy(state1 + n + start, c3, valid);
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
