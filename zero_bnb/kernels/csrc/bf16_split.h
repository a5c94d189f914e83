// The bf16 residual split of a checkpoint's fp32 masters (zero_bnb/core/residual.py, split_rounded_bf16), in one
// pass over memory: per element, check that the bf16 module weight is the master rounded to nearest even, keep the
// master's bottom 16 bits, and list the elements that the bf16 weight and those bits do not give back (the ties that
// carried, NaN). The torch version takes several passes and temporaries per chunk (about 6 ns per element on a
// Xeon); this one reads 6 and writes 2 bytes per element once.
//
// Rounding as torch's float -> bfloat16 cast (c10/util/BFloat16.h, the vectorised ATen casts): round to nearest,
// ties to even, on the bits, denormals kept. A NaN master is accepted beside any NaN weight: torch's scalar cast
// makes 0x7FC0, its vectorised casts 0xFFFF and CUDA's 0x7FFF. Like every element, it is listed among the
// exceptions (its fp32 value stored beside the weights) unless the weight and its bottom half give it back.
#pragma once

#include <cstdint>

namespace zero_bnb_split {

// Elements checked before looking for exceptions; a group with none is the common case (about one element in
// 2^17 of trained weights is one).
constexpr int64_t kSpan = 4096;

// The master bits that weight w and bottom half lo give when no tie carried: (w << 16) + lo read as a signed
// 16-bit number, except the tie lo == 0x8000, which stays +0x8000 (core.residual._join_chunk). Wrapping 32-bit
// arithmetic throughout, no narrower types: the loops below vectorise.
inline uint32_t joined(uint32_t w, uint32_t lo) { return (w << 16) + (((lo + 0x7FFFu) & 0xFFFFu) - 0x7FFFu); }

// 1 when w is not m rounded to nearest even (for a NaN m: when w is no NaN), else 0.
inline uint32_t not_rounding(uint32_t m, uint32_t w) {
    const uint32_t nan = (m & 0x7FFFFFFFu) > 0x7F800000u;
    const uint32_t weight_nan = (w & 0x7FFFu) > 0x7F80u;
    const uint32_t rounded = (m + 0x7FFFu + ((m >> 16) & 1u)) >> 16;
    return (nan & (weight_nan ^ 1u)) | ((nan ^ 1u) & static_cast<uint32_t>(rounded != w));
}

}  // namespace zero_bnb_split

extern "C" {

// master: n fp32 masters (their bits); weight: n bf16 module weights (their bits); low: n outputs, each master's
// bottom 16 bits. Writes the increasing indices of the elements that joined(weight, low) does not give back into
// index, at most cap of them. Returns -1 (low then partly written) when some weight is not its master's rounding,
// else the count of those elements (which may exceed cap: call again with room for them). Single-threaded.
int64_t zero_bnb_split_rounded_bf16(const uint32_t* __restrict__ master, const uint16_t* __restrict__ weight,
                                    int64_t n, uint16_t* __restrict__ low, int64_t* __restrict__ index,
                                    int64_t cap) {
    using namespace zero_bnb_split;
    int64_t count = 0;
    for (int64_t start = 0; start < n; start += kSpan) {
        const int64_t end = start + kSpan < n ? start + kSpan : n;
        uint32_t wrong = 0, differ = 0;  // or-reductions: the loop vectorises
        for (int64_t i = start; i < end; ++i) {
            const uint32_t m = master[i], w = weight[i], lo = m & 0xFFFFu;
            low[i] = static_cast<uint16_t>(lo);
            wrong |= not_rounding(m, w);
            differ |= joined(w, lo) ^ m;
        }
        if (wrong) return -1;
        if (differ) {
            for (int64_t i = start; i < end; ++i) {
                if (joined(weight[i], low[i]) != master[i]) {
                    if (count < cap) index[count] = i;
                    ++count;
                }
            }
        }
    }
    return count;
}

}  // extern "C"
