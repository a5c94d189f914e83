// Quantize and dequantize one 256-element block through a map's tables (included by blockwise_update.cpp).
#pragma once

#include "quantize_tables.h"

namespace {

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

// The binary search for every element of each group of `width` whose bit is set in `groups` (lanes the table
// left to it): a group at a time, since such lanes are rare (with bitsandbytes' maps: NaN, Inf, |x| >= 2).
template <bool SIGNED>
void search_groups(const Map& map, const float* s, float absmax, uint8_t* out, uint32_t groups, int width) {
    for (; groups; groups &= groups - 1)
        for (int j = width * __builtin_ctz(groups), end = j + width; j < end; ++j)
            quantize_slow<SIGNED>(map, s, absmax, out, j);
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

#if defined(__AVX2__) && !defined(__AVX512F__)
// lookup16 on 8 lanes (AVX2 gathers): the codes as dwords; *slow gets all ones in the lanes that need the binary
// search (or'ed in). The 16-bit quantities fit int32, so the signed compare is the unsigned one.
inline __m256i lookup8(const Map& map, __m256 x, __m256i* slow) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i top = _mm256_srli_epi32(_mm256_slli_epi32(u, 1), 17);  // magnitude >> 16
    __m256i row = _mm256_min_epu32(_mm256_subs_epu16(top, _mm256_set1_epi32(static_cast<int>(map.base))),
                                   _mm256_set1_epi32(static_cast<int>(kTop + 1 - map.base)));
    const __m128i sign_shift = _mm_cvtsi32_si128(static_cast<int>(map.sign_shift));
    row = _mm256_or_si256(row, _mm256_and_si256(_mm256_srl_epi32(u, sign_shift),
                                                _mm256_set1_epi32(static_cast<int>(map.half))));  // row | (u' & half)
    const __m256i entry = _mm256_i32gather_epi32(reinterpret_cast<const int*>(map.table.data()), row, 4);
    const __m256i stepped = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0xffff)),
                                               _mm256_srli_epi32(entry, 16));
    *slow = _mm256_or_si256(*slow, _mm256_cmpeq_epi32(entry, _mm256_setzero_si256()));
    const __m256i c = _mm256_srlv_epi32(entry, _mm256_and_si256(stepped, _mm256_set1_epi32(8)));  // next: byte 1
    return _mm256_and_si256(c, _mm256_set1_epi32(0xff));
}

// The map's values of 8 codes times scale (a block's absmax).
inline __m256 dequantize8(const Map& map, const uint8_t* c, __m256 scale) {
    const __m256i index = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c)));
    return _mm256_mul_ps(_mm256_i32gather_ps(map.code, index, 4), scale);
}

// The low bytes of 4 x 8 dwords (each < 256), in order: the packs work within 128-bit lanes, the permute undoes that.
inline void store_bytes(const __m256i c[4], uint8_t* out) {
    const __m256i packed = _mm256_packus_epi16(_mm256_packus_epi32(c[0], c[1]), _mm256_packus_epi32(c[2], c[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                        _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}
#endif

#if defined(__AVX512VBMI__)
// Where 64 looked-up floats land after the byte interleave of dequantize (within 128-bit lanes): the codes
// are permuted by it first, so the floats come out in order. packus_epi32 then packus_epi16 of four
// vectors of 16 lanes puts their lanes in this order too. It is its own inverse (a 4 x 4 transpose).
alignas(64) constexpr uint8_t kInterleave[64] = {
    0, 1, 2, 3, 16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51, 4, 5, 6, 7, 20, 21, 22, 23, 36, 37, 38, 39, 52, 53,
    54, 55, 8, 9, 10, 11, 24, 25, 26, 27, 40, 41, 42, 43, 56, 57, 58, 59, 12, 13, 14, 15, 28, 29, 30, 31, 44, 45,
    46, 47, 60, 61, 62, 63};
// table[index] for 64 byte indices into a 256-byte table (high: the indices' top bits).
inline __m512i lookup256(const uint8_t* table, __m512i index, __mmask64 high) {
    return _mm512_mask_blend_epi8(
        high, _mm512_permutex2var_epi8(_mm512_load_si512(table), index, _mm512_load_si512(table + 64)),
        _mm512_permutex2var_epi8(_mm512_load_si512(table + 128), index, _mm512_load_si512(table + 192)));
}

// Four byte planes (64 lanes in kInterleave order) into 4 x 16 dwords in lane order.
inline void interleave_planes(const __m512i b[4], __m512i values[4]) {
    const __m512i low01 = _mm512_unpacklo_epi8(b[0], b[1]), high01 = _mm512_unpackhi_epi8(b[0], b[1]);
    const __m512i low23 = _mm512_unpacklo_epi8(b[2], b[3]), high23 = _mm512_unpackhi_epi8(b[2], b[3]);
    values[0] = _mm512_unpacklo_epi16(low01, low23);
    values[1] = _mm512_unpackhi_epi16(low01, low23);
    values[2] = _mm512_unpacklo_epi16(high01, high23);
    values[3] = _mm512_unpackhi_epi16(high01, high23);
}

// Word and byte selections that leave 64 lanes in kInterleave order, as packus_epi32 and packus_epi16 would, in
// one permute each: the high words of 2 x 16 dwords (high16), the low (low8) or high (high8) bytes of 2 x 32 words.
struct Selections {
    alignas(64) uint16_t high16[32];
    alignas(64) uint8_t low8[64], high8[64];
    constexpr Selections() : high16(), low8(), high8() {
        for (int w = 0; w < 32; ++w) {
            const int lane = w / 8, j = w % 8;
            high16[w] = static_cast<uint16_t>(2 * (4 * lane + j % 4) + 1 + (j < 4 ? 0 : 32));
        }
        for (int w = 0; w < 64; ++w) {
            const int lane = w / 16, j = w % 16;
            low8[w] = static_cast<uint8_t>(2 * (8 * lane + j % 8) + (j < 8 ? 0 : 64));
            high8[w] = static_cast<uint8_t>(low8[w] + 1);
        }
    }
};
alignas(64) constexpr Selections kSelect{};

// quantize_2D of s / absmax plus the sign fix for one block, without a gather (the tables of Steps): the
// top 16 bits of each x give its row and bucket (16-bit lanes: a row lookup and a variable shift), the bucket
// its first code (a 512-byte table, 4 permutes per 64 values), that code the magnitude where it is left (4
// byte planes), and one comparison moves the code one step. x is exact (a division, as in the reference).
// NaN, Inf, |x| >= 2 and an unsigned map's negative x take the binary search. The block's four groups of 64
// go through each stage together: one group alone is a chain of dependent shuffles that leaves the shuffle
// ports idle (Zen 4, signed map, per value: 0.36 ns a group at a time; 0.28 ns with the groups together, the
// one-permute selections and the folded key_base, benchmarks/results/cpu_kernel_stages.md).
template <bool SIGNED>
void quantize_permuted(const Map& map, const float* __restrict__ s, float absmax, uint8_t* __restrict__ out) {
    constexpr int kGroups = kBlock / 64;
    const Steps& t = map.steps;
    const __m512 scale = _mm512_set1_ps(absmax);
    const __m512i base = _mm512_load_si512(t.key_base), shift = _mm512_load_si512(t.key_shift);
    const __m512i bias = _mm512_set1_epi16(static_cast<int16_t>(t.emin - 1)), byte = _mm512_set1_epi16(0xff);
    const __m512i high16 = _mm512_load_si512(kSelect.high16), low8 = _mm512_load_si512(kSelect.low8);
    const __m512i high8 = _mm512_load_si512(kSelect.high8), order = _mm512_load_si512(kInterleave);
    const __m512i one = _mm512_set1_epi8(1), split = _mm512_set1_epi8(static_cast<char>(std::min(t.split, 255)));
    __m512i u[kGroups][4];
    for (int q = 0; q < kGroups; ++q)
        for (int r = 0; r < 4; ++r)
            u[q][r] = _mm512_castps_si512(_mm512_div_ps(_mm512_loadu_ps(s + 64 * q + 16 * r), scale));
    __m512i top[kGroups][2], key[kGroups][2], largest = _mm512_setzero_si512();
    for (int q = 0; q < kGroups; ++q)
        for (int h = 0; h < 2; ++h) {
            top[q][h] = _mm512_permutex2var_epi16(u[q][2 * h], high16, u[q][2 * h + 1]);
            const __m512i signed_exponent = _mm512_srli_epi16(top[q][h], 7);
            const __m512i e = SIGNED ? _mm512_and_si512(signed_exponent, byte) : signed_exponent;
            largest = _mm512_max_epu16(largest, e);  // >= 128: NaN, Inf, |x| >= 2 (or an unsigned map's x < 0)
            // Elsewhere e - emin + 1 < 32 (emin >= 98): vpermw reads 5 index bits
            const __m512i row = _mm512_subs_epu16(e, bias);
            key[q][h] = _mm512_add_epi16(_mm512_permutexvar_epi16(row, base),
                                         _mm512_srlv_epi16(top[q][h], _mm512_permutexvar_epi16(row, shift)));
        }
    __m512i first[kGroups];
    __mmask64 f7[kGroups];
    for (int q = 0; q < kGroups; ++q) {
        const __m512i low = _mm512_permutex2var_epi8(key[q][0], low8, key[q][1]);
        const __mmask64 b7 = _mm512_movepi8_mask(low);
        // bit 8 of the bucket number: a signed map's is x's sign (it numbers each sign's buckets below 256)
        const __mmask64 b8 = SIGNED ? _mm512_movepi8_mask(_mm512_permutex2var_epi8(top[q][0], high8, top[q][1]))
                                    : _mm512_test_epi8_mask(_mm512_permutex2var_epi8(key[q][0], high8, key[q][1]), one);
        first[q] = _mm512_mask_blend_epi8(b8, lookup256(t.first, low, b7), lookup256(t.first + 256, low, b7));
        f7[q] = _mm512_movepi8_mask(first[q]);
    }
    for (int q = 0; q < kGroups; ++q) {
        __m512i planes[4], leave[4];
        for (int k = 0; k < 4; ++k) planes[k] = lookup256(t.exit[k], first[q], f7[q]);
        interleave_planes(planes, leave);
        __mmask16 moved[4];
        for (int r = 0; r < 4; ++r) moved[r] = _mm512_cmpge_epu32_mask(u[q][r], leave[r]);
        __mmask64 step = _mm512_kunpackd(_mm512_kunpackw(moved[3], moved[2]), _mm512_kunpackw(moved[1], moved[0]));
        __m512i codes = _mm512_permutexvar_epi8(order, first[q]);
        if (SIGNED) {
            const __mmask64 down = _mm512_cmplt_epu8_mask(codes, split);
            codes = _mm512_mask_sub_epi8(codes, step & down, codes, one);
            step &= ~down;
        }
        codes = _mm512_mask_add_epi8(codes, step, codes, one);
        _mm512_storeu_si512(out + 64 * q, codes);
    }
    if (_mm512_cmpge_epu16_mask(largest, _mm512_set1_epi16(128))) {
        for (int i = 0; i < kBlock; ++i) {
            const float x = s[i] / absmax;
            const uint32_t e = bits_of(x) >> 23;
            if ((SIGNED ? e & 0xff : e) >= 128) out[i] = code_of<SIGNED>(map.code, x, s[i]);
        }
    }
}

#endif

#if defined(ZERO_BNB_NEON)
// table[index] for 16 byte indices into a 256-byte table: four 64-byte TBL lookups (an index outside a lookup's
// 64 bytes leaves its lane as the previous one set it).
inline uint8x16_t table256(const uint8_t* table, uint8x16_t index) {
    uint8x16_t r = vqtbl4q_u8(vld1q_u8_x4(table), index);
    r = vqtbx4q_u8(r, vld1q_u8_x4(table + 64), vsubq_u8(index, vdupq_n_u8(64)));
    r = vqtbx4q_u8(r, vld1q_u8_x4(table + 128), vsubq_u8(index, vdupq_n_u8(128)));
    return vqtbx4q_u8(r, vld1q_u8_x4(table + 192), vsubq_u8(index, vdupq_n_u8(192)));
}

// table[row] of a 32-entry 16-bit table (held as 64 bytes) for 8 rows (< 32): one TBL over bytes 2 row, 2 row + 1.
inline uint16x8_t table32x16(const uint8x16x4_t& table, uint16x8_t row) {
    const uint16x8_t index = vmlaq_n_u16(vdupq_n_u16(0x0100), row, 0x0202);  // low byte 2 row, high byte 2 row + 1
    return vreinterpretq_u16_u8(vqtbl4q_u8(table, vreinterpretq_u8_u16(index)));
}

// quantize_permuted (and permuted_code, its scalar twin) with NEON, 16 values at a time: the same tables (Steps),
// looked up with TBL instead of AVX512-VBMI's byte permutes. The top 16 bits of x give its row (exponent) and
// bucket (the row's mantissa bits), the bucket its first code, that code the magnitude where it is left, and one
// comparison moves the code one step. NaN, Inf, |x| >= 2 and an unsigned map's negative x take the binary search.
template <bool SIGNED>
void quantize_neon(const Map& map, const float* __restrict__ s, float absmax, uint8_t* __restrict__ out) {
    const Steps& t = map.steps;
    const float32x4_t scale = vdupq_n_f32(absmax);
    const uint8x16x4_t key_base = vld1q_u8_x4(reinterpret_cast<const uint8_t*>(t.key_base));
    const uint8x16x4_t key_shift = vld1q_u8_x4(reinterpret_cast<const uint8_t*>(t.key_shift));
    const uint16x8_t bias = vdupq_n_u16(static_cast<uint16_t>(t.emin - 1)), last_row = vdupq_n_u16(31);
    const uint8x16_t split = vdupq_n_u8(static_cast<uint8_t>(std::min(t.split, 255)));
    uint16x8_t largest = vdupq_n_u16(0);
    for (int j = 0; j < kBlock; j += 16) {
        uint32x4_t u[4];
        for (int r = 0; r < 4; ++r) u[r] = vreinterpretq_u32_f32(vdivq_f32(vld1q_f32(s + j + 4 * r), scale));
        const uint16x8_t top[2] = {vcombine_u16(vshrn_n_u32(u[0], 16), vshrn_n_u32(u[1], 16)),
                                   vcombine_u16(vshrn_n_u32(u[2], 16), vshrn_n_u32(u[3], 16))};
        uint16x8_t number[2];
        for (int h = 0; h < 2; ++h) {
            const uint16x8_t signed_exponent = vshrq_n_u16(top[h], 7);
            const uint16x8_t e = SIGNED ? vandq_u16(signed_exponent, vdupq_n_u16(0xff)) : signed_exponent;
            largest = vmaxq_u16(largest, e);  // >= 128: NaN, Inf, |x| >= 2 (or an unsigned map's x < 0)
            const uint16x8_t row = vminq_u16(vqsubq_u16(e, bias), last_row);
            const int16x8_t right = vnegq_s16(vreinterpretq_s16_u16(table32x16(key_shift, row)));
            number[h] = vaddq_u16(table32x16(key_base, row), vshlq_u16(top[h], right));  // (mod 2^16)
        }
        const uint8x16_t low = vcombine_u8(vmovn_u16(number[0]), vmovn_u16(number[1]));
        // bit 8 of the bucket number: a signed map's is x's sign (it numbers each sign's buckets below 256)
        const uint8x16_t b8 =
            SIGNED ? vtstq_u8(vcombine_u8(vshrn_n_u16(top[0], 8), vshrn_n_u16(top[1], 8)), vdupq_n_u8(0x80))
                   : vtstq_u8(vcombine_u8(vshrn_n_u16(number[0], 8), vshrn_n_u16(number[1], 8)), vdupq_n_u8(1));
        const uint8x16_t first = vbslq_u8(b8, table256(t.first + 256, low), table256(t.first, low));
        uint8x16_t b[4];
        for (int k = 0; k < 4; ++k) b[k] = table256(t.exit[k], first);
        const uint16x8_t low01 = vreinterpretq_u16_u8(vzip1q_u8(b[0], b[1]));
        const uint16x8_t high01 = vreinterpretq_u16_u8(vzip2q_u8(b[0], b[1]));
        const uint16x8_t low23 = vreinterpretq_u16_u8(vzip1q_u8(b[2], b[3]));
        const uint16x8_t high23 = vreinterpretq_u16_u8(vzip2q_u8(b[2], b[3]));
        const uint32x4_t leave[4] = {vreinterpretq_u32_u16(vzip1q_u16(low01, low23)),
                                     vreinterpretq_u32_u16(vzip2q_u16(low01, low23)),
                                     vreinterpretq_u32_u16(vzip1q_u16(high01, high23)),
                                     vreinterpretq_u32_u16(vzip2q_u16(high01, high23))};
        uint32x4_t moved[4];
        for (int r = 0; r < 4; ++r) moved[r] = vcgeq_u32(u[r], leave[r]);
        uint8x16_t step = vcombine_u8(vmovn_u16(vcombine_u16(vmovn_u32(moved[0]), vmovn_u32(moved[1]))),
                                      vmovn_u16(vcombine_u16(vmovn_u32(moved[2]), vmovn_u32(moved[3]))));
        uint8x16_t codes = first;
        if (SIGNED) {
            const uint8x16_t down = vcltq_u8(codes, split);
            codes = vaddq_u8(codes, vandq_u8(step, down));  // all ones: - 1
            step = vbicq_u8(step, down);
        }
        vst1q_u8(out + j, vsubq_u8(codes, step));  // all ones: + 1
    }
    if (vmaxvq_u16(largest) >= 128) {
        for (int i = 0; i < kBlock; ++i) {
            const float x = s[i] / absmax;
            const uint32_t e = bits_of(x) >> 23;
            if ((SIGNED ? e & 0xff : e) >= 128) out[i] = code_of<SIGNED>(map.code, x, s[i]);
        }
    }
}
#endif

// Dequantize 256 codes through a 256-entry map and scale by absmax. With AVX512-VBMI the map sits in 16
// registers as four 256-byte planes (byte k of every value's bits): 64 codes look up each plane with two
// 128-byte permutes and a blend, and the bytes are interleaved back into floats, about three times
// faster than a 16-lane gather per 16 codes. Else an explicit gather where AVX-512 or AVX2 exists (compilers
// tuned for AMD Zen emulate gathers with scalar loads), else scalar.
inline void dequantize(const Map& map, const uint8_t* __restrict__ c, float absmax, float* __restrict__ out) {
#if defined(__AVX512VBMI__)
    const __m512i order = _mm512_load_si512(kInterleave);
    const __m512 scale = _mm512_set1_ps(absmax);
    for (int j = 0; j < kBlock; j += 64) {
        const __m512i index = _mm512_permutexvar_epi8(order, _mm512_loadu_si512(c + j));
        const __mmask64 high = _mm512_movepi8_mask(index);
        __m512i b[4], values[4];
        for (int k = 0; k < 4; ++k) b[k] = lookup256(map.planes[k], index, high);
        interleave_planes(b, values);
        for (int r = 0; r < 4; ++r)
            _mm512_storeu_ps(out + j + 16 * r, _mm512_mul_ps(_mm512_castsi512_ps(values[r]), scale));
    }
#elif defined(__AVX512F__)
    const __m512 scale = _mm512_set1_ps(absmax);
    for (int j = 0; j < kBlock; j += 16) {
        const __m512i index = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + j)));
        _mm512_storeu_ps(out + j, _mm512_mul_ps(_mm512_i32gather_ps(index, map.code, 4), scale));
    }
#elif defined(__AVX2__)
    const __m256 scale = _mm256_set1_ps(absmax);
    for (int j = 0; j < kBlock; j += 8) _mm256_storeu_ps(out + j, dequantize8(map, c + j, scale));
#else
    const float* __restrict__ code = map.code;
#pragma omp simd
    for (int j = 0; j < kBlock; ++j) out[j] = code[c[j]] * absmax;
#endif
}

// A block whose absmax is 0 (all moments +-0, e.g. embedding rows no batch has touched yet): every x = s / 0
// is NaN and takes the binary search, 10x the cost of a block. x and so the code depend only on s's bits,
// so each run of equal bits is searched once (the same codes, without 255 of the 256 searches).
template <bool SIGNED>
void quantize_zero_block(const Map& map, const float* __restrict__ s, uint8_t* __restrict__ out) {
    const uint32_t first = bits_of(s[0]);
    uint32_t differ = 0;
#pragma omp simd reduction(| : differ)
    for (int j = 0; j < kBlock; ++j) differ |= bits_of(s[j]) ^ first;
    if (differ == 0) {  // the usual case: one value (+0) in the whole block
        quantize_slow<SIGNED>(map, s, 0.0f, out, 0);
        std::memset(out + 1, out[0], kBlock - 1);
        return;
    }
    uint32_t last = ~first;
    for (int j = 0; j < kBlock; ++j) {
        const uint32_t u = bits_of(s[j]);
        if (u == last) {
            out[j] = out[j - 1];
            continue;
        }
        quantize_slow<SIGNED>(map, s, 0.0f, out, j);
        last = u;
    }
}

// quantize_2D of s / absmax for one block, plus (signed maps) the state-1 sign fix (kernels.cu 1120).
template <bool SIGNED>
void quantize(const Map& map, const float* __restrict__ s, float absmax, uint8_t* __restrict__ out) {
    if (absmax == 0.0f) return quantize_zero_block<SIGNED>(map, s, out);
#if defined(__AVX512VBMI__)
    if (map.steps.usable) {
        return quantize_permuted<SIGNED>(map, s, absmax, out);
    }
#endif
#if defined(__AVX512F__)
    const __m512 scale = _mm512_set1_ps(absmax);
    uint32_t slow = 0;
    for (int j = 0; j < kBlock; j += 16) {
        const __mmask16 lanes = lookup16(map, _mm512_div_ps(_mm512_loadu_ps(s + j), scale), out + j);
        slow |= static_cast<uint32_t>(lanes != 0) << (j / 16);
    }
    search_groups<SIGNED>(map, s, absmax, out, slow, 16);
#elif defined(__AVX2__)
    const __m256 scale = _mm256_set1_ps(absmax);
    uint32_t slow = 0;  // per 32 values: one test of 4 lookups' or'ed masks (a scalar mask per 8 took 4% of a step)
    for (int j = 0; j < kBlock; j += 32) {
        __m256i c[4], lanes = _mm256_setzero_si256();
        for (int r = 0; r < 4; ++r) c[r] = lookup8(map, _mm256_div_ps(_mm256_loadu_ps(s + j + 8 * r), scale), &lanes);
        slow |= static_cast<uint32_t>(!_mm256_testz_si256(lanes, lanes)) << (j / 32);
        store_bytes(c, out + j);
    }
    search_groups<SIGNED>(map, s, absmax, out, slow, 32);
#else
#if defined(ZERO_BNB_NEON)
    if (map.steps.usable) return quantize_neon<SIGNED>(map, s, absmax, out);
#endif
    for (int j = 0; j < kBlock; ++j) quantize_slow<SIGNED>(map, s, absmax, out, j);
#endif
}

}  // namespace
