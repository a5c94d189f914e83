// The quantizer's tables, built once per map from quantize_2D itself (included by blockwise_update.cpp).
//
// quantize_2D's 7-step binary search makes the code a non-decreasing step function of x (ties at a
// midpoint go to the even code, the search's pivot). So the code of x is found exactly from a table
// indexed by x's sign and the top 16 bits of its magnitude (exponent and 7 mantissa bits): each entry
// holds the code (sign fix applied) at the bucket's first value, the code after the bucket's one step and
// the last low 16 bits that keep the first code (found by bisection with the binary search itself when the
// table is built). Exponents below the map's smallest step share one row, so for bitsandbytes' dynamic
// maps the table has 2 x 4096 entries of which about 6 000 (24 KiB) are touched, against 65 536 (256 KiB,
// beyond L1) for the whole float range. NaN, Inf, magnitudes >= 2 (x is at most 1 otherwise) and buckets
// holding more than one step (none in bitsandbytes' maps) take the binary search. Unlike bitsandbytes' CPU
// lookup table (which returns the bucket's code for every x in it), the result is the binary search's,
// always. From that table come the smaller ones of the permute quantizer (Steps), which fit in registers.
#pragma once

#include <algorithm>
#include <cfloat>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__aarch64__) && defined(__ARM_NEON) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#include <arm_neon.h>
#define ZERO_BNB_NEON 1  // AArch64's Advanced SIMD (every aarch64 CPU has it): the NEON paths of codec.h
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

// The permute quantizer's tables (see quantize_permuted in codec.h). A magnitude's exponent e picks a row: row 0 for
// every e below emin (all such magnitudes share one code), e - emin + 1 up to e = 127. The row keeps the top
// 7 - shift[row] mantissa bits, as few as leave at most one step of the code in each bucket, and numbers
// its buckets from base[row] (a signed map's negative half adds 256). first[] holds the code at each
// bucket's smallest magnitude, and exit[][c] the magnitude bits where code c is left for the next one
// (+1 for positive x, -1 for negative x; 0xffffffff: never), as four byte planes.
struct Steps {
    bool usable = false;
    uint16_t emin = 0;
    int split = 256;  // codes below it belong to negative x
    alignas(64) uint16_t base[32] = {}, shift[32] = {};
    // The same numbers from the top 16 bits of x itself: key_base[row] + (top >> key_shift[row]) (mod 2^16), the
    // row's exponent folded into key_base (row 0 shifts everything out; a sign bit only adds multiples of 256).
    alignas(64) uint16_t key_base[32] = {}, key_shift[32] = {};
    alignas(64) uint8_t first[512] = {};
    alignas(64) uint8_t exit[4][256] = {};
};

struct Map {
    float code[256];
    alignas(64) uint8_t planes[4][256];  // byte k of each code's float bits: the map in 16 registers
    bool is_signed;
    uint32_t base;     // top 16 bits (of the magnitude) of row 0: every smaller exponent shares it
    uint32_t half;     // entries per sign: a power of two above kTop - base + 1 (the last: magnitudes >= 2)
    uint32_t sign_shift;  // 31 - log2(half): u >> sign_shift & half is the sign's offset
    bool row0_constant;
    std::vector<uint32_t> table;
    Steps steps;
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
    map.row0_constant = row0_constant;
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

// The code the permute quantizer's tables give the magnitude bits a (sign: negative) of a finite x with
// |x| < 2: the scalar twin of quantize_permuted, used to check the tables when they are built.
inline int permuted_code(const Steps& t, bool is_signed, uint32_t a, bool negative) {
    const uint32_t e = a >> 23, top = a >> 16;
    const uint32_t row = std::min<uint32_t>(e < t.emin ? 0 : e - t.emin + 1, 31);
    const uint32_t number = (t.key_base[row] + ((top | (negative ? 0x8000u : 0u)) >> t.key_shift[row])) & 0xffffu;
    const uint32_t key = is_signed ? (number & 0xffu) + (negative ? 256 : 0) : number;
    const int c = t.first[key];
    uint32_t leave = 0;
    for (int k = 0; k < 4; ++k) leave |= static_cast<uint32_t>(t.exit[k][c]) << (8 * k);
    return (a | (negative ? 0x80000000u : 0u)) >= leave ? c + (c < t.split ? -1 : 1) : c;
}

// Derives the permute quantizer's tables from the 16-bit table; leaves them unusable for maps they cannot
// hold (a step of more than one code, codes shared by both signs, more than 256 buckets per sign, or
// 512 for an unsigned map, whose negative x take the binary search).
template <bool SIGNED>
void build_steps(Map& map) {
    Steps& t = map.steps;
    const uint32_t emin = (map.base >> 7) + 1;
    if (!map.row0_constant || emin < 98) return;
    t.emin = static_cast<uint16_t>(emin);
    uint32_t leave[256];
    int owner[256];
    std::fill(leave, leave + 256, 0xffffffffu);
    std::fill(owner, owner + 256, -1);
    std::vector<uint32_t> inside[2][128];  // mantissas of the steps, per sign and exponent
    constexpr int signs = SIGNED ? 2 : 1;
    for (int negative = 0; negative < signs; ++negative) {
        const float zero = negative ? -0.0f : 0.0f;
        int code = code_of<SIGNED>(map.code, zero, zero);
        const int d = negative ? -1 : 1;
        const auto own = [&](int c) { return (owner[c] == -1 || owner[c] == negative) && (owner[c] = negative, true); };
        const auto step = [&](uint32_t a, int to) {
            if (to != code + d || !own(to)) return false;
            leave[code] = a;
            inside[negative][a >> 23].push_back(a & 0x7fffffu);
            code = to;
            return true;
        };
        if (!own(code)) return;
        for (uint32_t top = emin << 7; top <= kTop; ++top) {
            const uint32_t entry = map.table[negative * map.half + top - map.base];
            const int first = entry & 0xff, next = (entry >> 8) & 0xff, keep = static_cast<int>(entry >> 16);
            if (entry == kMany || (first != code && !step(top << 16, first))) return;
            if (keep != 0xffff && !step((top << 16) | (keep + 1), next)) return;
        }
    }
    uint32_t count = 1;  // row 0
    t.shift[0] = 7;
    for (uint32_t e = emin; e < 128; ++e) {
        uint32_t bits = 0;
        for (; bits <= 7; ++bits) {
            bool alone = true;
            const uint32_t low = (1u << (23 - bits)) - 1;
            for (int negative = 0; negative < signs; ++negative)
                for (size_t i = 0; i < inside[negative][e].size(); ++i)
                    for (size_t k = 0; k < i; ++k) {
                        const uint32_t m = inside[negative][e][i], n = inside[negative][e][k];
                        alone &= (m & low) == 0 || (n & low) == 0 || (m >> (23 - bits)) != (n >> (23 - bits));
                    }
            if (alone) break;
        }
        if (bits > 7) return;
        t.base[e - emin + 1] = static_cast<uint16_t>(count);
        t.shift[e - emin + 1] = static_cast<uint16_t>(7 - bits);
        count += 1u << bits;
    }
    for (uint32_t row = 129 - emin; row < 32; ++row) t.shift[row] = 7;
    t.key_shift[0] = 16;
    for (uint32_t row = 1; row < 32; ++row) {  // (e << 7 | m) >> shift == (e << (7 - shift)) + (m >> shift)
        t.key_shift[row] = t.shift[row];
        t.key_base[row] = static_cast<uint16_t>(t.base[row] - ((row + emin - 1) << (7 - t.shift[row])));
    }
    if (count > (SIGNED ? 256u : 512u)) return;
    for (int negative = 0; negative < signs; ++negative) {
        const uint32_t sign = static_cast<uint32_t>(negative) << 31, offset = negative ? 256 : 0;
        const float zero = negative ? -0.0f : 0.0f;
        t.first[offset] = code_of<SIGNED>(map.code, zero, zero);
        for (uint32_t e = emin; e < 128; ++e) {
            const uint32_t row = e - emin + 1, bits = 7 - t.shift[row];
            for (uint32_t k = 0; k < (1u << bits); ++k) {
                const float x = float_of(sign | (e << 23) | (k << (23 - bits)));
                t.first[offset + t.base[row] + k] = code_of<SIGNED>(map.code, x, x);
            }
        }
    }
    t.split = 256;
    for (int c = 0; c < 256; ++c) {
        if (owner[c] == 0) t.split = std::min(t.split, c);
        if (owner[c] == 1 && leave[c] != 0xffffffffu) leave[c] |= 0x80000000u;  // compared with x's own bits
    }
    for (int c = 0; c < 256; ++c) {
        if (owner[c] == 1 && c >= t.split) return;  // the step's direction is told by the code: below split, down
        for (int k = 0; k < 4; ++k) t.exit[k][c] = static_cast<uint8_t>(leave[c] >> (8 * k));
    }
    // Check every step, from both sides, and the smallest and largest magnitude of every row.
    for (int negative = 0; negative < signs; ++negative) {
        const uint32_t sign = static_cast<uint32_t>(negative) << 31;
        std::vector<uint32_t> probes = {0u, 1u, (emin << 23) - 1, 0x3fffffffu};
        for (int c = 0; c < 256; ++c)
            if (leave[c] != 0xffffffffu && owner[c] == negative) {
                const uint32_t a = leave[c] & 0x7fffffffu;
                probes.insert(probes.end(), {a - 1, a});
            }
        for (const uint32_t a : probes) {
            const float x = float_of(sign | a);
            if (permuted_code(t, SIGNED, a, negative) != code_of<SIGNED>(map.code, x, x)) return;
        }
    }
    t.usable = true;
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
    if (is_signed) {
        build_table<true>(*map);
        build_steps<true>(*map);
    } else {
        build_table<false>(*map);
        build_steps<false>(*map);
    }
    maps.push_back(std::move(map));
    return *maps.back();
}

}  // namespace
