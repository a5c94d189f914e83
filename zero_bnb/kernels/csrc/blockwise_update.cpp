// Fused CPU blockwise 8-bit optimizer update: the arithmetic of bitsandbytes' CUDA kernels
// kOptimizerStatic8bit2StateBlockwise / kOptimizerStatic8bit1StateBlockwise and quantize_2D
// (csrc/kernels.cu), as specified in zero_bnb/kernels/reference.py, bit for bit.
//
// One unit of work is one 256-element block: its moments are dequantized, updated, their new absmax
// taken and requantized in a few KiB of stack (L1), so nothing proportional to the partition is
// allocated. Whole blocks are read and written in place; only a partition's last, partial block is
// copied into a padded buffer. Blocks are independent, so threads take contiguous ranges of blocks
// (OpenMP, static schedule) and the result does not depend on the thread count. Build with
// -ffp-contract=off: every product and sum is rounded on its own, as in the reference (and
// -fno-trapping-math, without which gcc leaves the portable update loops scalar).
//
// Quantization (quantize_tables.h, codec.h): exact, the binary search's code for every float, found
// through tables. Measured on AMD Zen 4 (EPYC, AVX-512 VBMI), one thread, Adam on 512 blocks (L2), CPU
// time per element: 1.55 ns with the 16-bit table's gathers (1.05 ns of it in the two requantizations,
// the gathers about 3/4 of that, the divisions by absmax about 1/20), 1.13 ns with the permute quantizer
// (0.65 ns in the requantizations, 0.19 ns in the two dequantizations, about 0.3 ns in the update), 1.03 ns
// with a block's four groups of 64 quantized stage by stage (0.53 ns in the requantizations). AVX2 builds
// (x86-64-v3) gather from the 16-bit table 8 lanes at a time and run Adam in one 8-lane pass that gathers the
// old moments: 1.24 ns on an Intel Xeon (the scalar path they took before: 10.2 ns), 2026-11-27.
// aarch64 builds quantize through the permute quantizer's tables with NEON's TBL (vqtbl4q_u8, 16 values at a time)
// and take absmax with NEON; dequantization and the update loops are the portable ones, which the compiler
// vectorises. Checked bit for bit under qemu-aarch64 (tests/test_kernels_cross.py); not yet timed on an Arm CPU.
#include "codec.h"
// The checkpoint's bf16 residual split lives in the same library (one build, one cache entry).
#include "bf16_split.h"

namespace {

enum Family { ADAM = 0, ADEMAMIX = 1, MOMENTUM = 2, LION = 3, RMSPROP = 4, ADAGRAD = 5 };

struct Scalars {
    float beta1, beta2, beta3, alpha, eps, lr, weight_decay;
    float one_minus_beta1, one_minus_beta2, one_minus_beta3;
    float correction1, correction2, step_size, eps_hat, decay;
    int32_t step;
    int32_t skip_zeros;
};

#if defined(__AVX2__) && !defined(__AVX512F__)
inline __m256 abs8(__m256 x) { return _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff))); }

// The largest of 8 lanes, none NaN.
inline float reduce_max8(__m256 m) {
    m = _mm256_max_ps(m, _mm256_permute2f128_ps(m, m, 1));
    m = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm256_cvtss_f32(_mm256_max_ps(m, _mm256_shuffle_ps(m, m, _MM_SHUFFLE(2, 3, 0, 1))));
}
#endif

// fmaxf over |s| from -FLT_MAX, NaN ignored (kernels.cu 1043): order-free, so a vector max is exact.
inline float absmax_of(const float* __restrict__ s) {
#if defined(__AVX512F__)
    __m512 m[4];
    for (int r = 0; r < 4; ++r) m[r] = _mm512_set1_ps(-FLT_MAX);
    for (int j = 0; j < kBlock; j += 64)
        for (int r = 0; r < 4; ++r)  // max_ps gives its second operand when the first is NaN
            m[r] = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(s + j + 16 * r)), m[r]);
    return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m[0], m[1]), _mm512_max_ps(m[2], m[3])));
#elif defined(__AVX2__)
    // four independent chains, as above: gcc's vectorization of the loop below (its NaN test) took 12x as long
    __m256 m[4];
    for (int r = 0; r < 4; ++r) m[r] = _mm256_set1_ps(-FLT_MAX);
    for (int j = 0; j < kBlock; j += 32)
        for (int r = 0; r < 4; ++r)  // max_ps gives its second operand when the first is NaN
            m[r] = _mm256_max_ps(abs8(_mm256_loadu_ps(s + j + 8 * r)), m[r]);
    return reduce_max8(_mm256_max_ps(_mm256_max_ps(m[0], m[1]), _mm256_max_ps(m[2], m[3])));
#elif defined(ZERO_BNB_NEON)
    // a > m ? a : m, false for any NaN (FMAX returns a NaN operand, FMAXNM a signalling one)
    float32x4_t m[4];
    for (int r = 0; r < 4; ++r) m[r] = vdupq_n_f32(-FLT_MAX);
    for (int j = 0; j < kBlock; j += 16)
        for (int r = 0; r < 4; ++r) {
            const float32x4_t a = vabsq_f32(vld1q_f32(s + j + 4 * r));
            m[r] = vbslq_f32(vcgtq_f32(a, m[r]), a, m[r]);
        }
    return vmaxvq_f32(vmaxq_f32(vmaxq_f32(m[0], m[1]), vmaxq_f32(m[2], m[3])));  // none NaN
#else
    float m = -FLT_MAX;
#pragma omp simd reduction(max : m)
    for (int j = 0; j < kBlock; ++j) {
        const float a = std::fabs(s[j]);
        m = std::isnan(a) ? m : (a > m ? a : m);
    }
    return m;
#endif
}

// One block's data: in place for a whole block, a padded copy for the last partial one.
struct View {
    const float* g;
    float* p;
    uint8_t *c1, *c2, *c3;
};

// Blocks ahead whose data each block prefetches. A block takes a few hundred ns of arithmetic, and without this a
// partition of 16M or 64M parameters ran 15-40% slower per element than one of 4M (AdamW, 1 thread, CPU time: AVX2
// build 1.91-2.04 -> 1.58-1.60 ns, AVX512-VBMI build 1.60-1.64 -> 1.50-1.53; 4M within noise; a Xeon with AVX-512
// and a 480 MiB L3, 2026-11-27).
constexpr int64_t kAhead = 2;

// Inlined always: otherwise gcc deleted the calls (a function with no side effects to it).
[[gnu::always_inline]] inline void prefetch_block(const View& b) {
    const char *g = reinterpret_cast<const char*>(b.g), *p = reinterpret_cast<const char*>(b.p);
    for (int line = 0; line < kBlock * static_cast<int>(sizeof(float)); line += 64) {
        __builtin_prefetch(g + line);
        __builtin_prefetch(p + line, 1);
    }
    for (const uint8_t* codes : {b.c1, b.c2, b.c3})
        for (int line = 0; codes && line < kBlock; line += 64) __builtin_prefetch(codes + line, 1);
}

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

#if defined(__AVX2__) && !defined(__AVX512F__)
// adam_block on 8 lanes (a masked-off lane is +0, as maskz_add gives), dequantizing in the same pass: the gathers
// go straight into the update (1.42 -> 1.33 ns/param at 4M, 1 thread, against two dequantize passes).
void adam_block(const Scalars& s, const View& b, const Map& map1, const Map& map2, float* a1, float* a2) {
    alignas(32) float s1[kBlock], s2[kBlock];
    const __m256 scale1 = _mm256_set1_ps(*a1), scale2 = _mm256_set1_ps(*a2);
    const __m256 beta1 = _mm256_set1_ps(s.beta1), beta2 = _mm256_set1_ps(s.beta2);
    const __m256 one_minus_beta1 = _mm256_set1_ps(s.one_minus_beta1);
    const __m256 one_minus_beta2 = _mm256_set1_ps(s.one_minus_beta2);
    const __m256 step_size = _mm256_set1_ps(s.step_size), eps_hat = _mm256_set1_ps(s.eps_hat);
    const __m256 decay = _mm256_set1_ps(s.decay);
    const bool decayed = s.weight_decay > 0.0f;
    const __m256 infinity = _mm256_set1_ps(INFINITY);
    __m256 max1 = _mm256_set1_ps(-FLT_MAX), max2 = max1;
    for (int j = 0; j < kBlock; j += 8) {
        const __m256 old1 = dequantize8(map1, b.c1 + j, scale1), old2 = dequantize8(map2, b.c2 + j, scale2);
        const __m256 g = _mm256_loadu_ps(b.g + j), p = _mm256_loadu_ps(b.p + j);
        const __m256 finite = _mm256_cmp_ps(abs8(g), infinity, _CMP_LT_OQ);
        const __m256 v = _mm256_and_ps(finite, _mm256_add_ps(_mm256_mul_ps(old2, beta2),
                                                             _mm256_mul_ps(_mm256_mul_ps(one_minus_beta2, g), g)));
        const __m256 m = _mm256_and_ps(finite, _mm256_add_ps(_mm256_mul_ps(old1, beta1),
                                                             _mm256_mul_ps(one_minus_beta1, g)));
        const __m256 direction = _mm256_div_ps(m, _mm256_add_ps(_mm256_sqrt_ps(v), eps_hat));
        __m256 moved = _mm256_add_ps(p, _mm256_mul_ps(step_size, direction));
        if (decayed) moved = _mm256_mul_ps(moved, decay);
        _mm256_storeu_ps(b.p + j, _mm256_blendv_ps(p, moved, finite));
        _mm256_store_ps(s1 + j, m);
        _mm256_store_ps(s2 + j, v);
        max1 = _mm256_max_ps(abs8(m), max1);  // the second operand when the first is NaN
        max2 = _mm256_max_ps(abs8(v), max2);
    }
    const float n1 = reduce_max8(max1), n2 = reduce_max8(max2);
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
            const float sign = direction > 0.0f ? 1.0f : (direction < 0.0f ? -1.0f : 0.0f);  // 0 for NaN
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
#if defined(__AVX2__)
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
    const auto view = [&](int64_t k) {
        const int64_t start = k * kBlock;
        return View{g + start, p + start, state1 + start, two ? state2 + start : nullptr,
                    FAMILY == ADEMAMIX ? state1 + n + start : nullptr};
    };
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t k = 0; k < whole; ++k) {
        if (k + kAhead < whole) prefetch_block(view(k + kAhead));
        step_block<FAMILY>(s, view(k), map1, map2, absmax1 + k, two ? absmax2 + k : nullptr,
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
    const auto block = [&](const float* s, uint8_t* codes) {
        if (is_signed)
            quantize<true>(map, s, 1.0f, codes);
        else
            quantize<false>(map, s, 1.0f, codes);
    };
    const int64_t whole = n / kBlock * kBlock;
    for (int64_t start = 0; start < whole; start += kBlock) block(x + start, out + start);
    if (whole == n) return;
    alignas(64) float s[kBlock] = {0.0f};  // the last, partial block, padded
    alignas(64) uint8_t codes[kBlock];
    std::memcpy(s, x + whole, (n - whole) * sizeof(float));
    block(s, codes);
    std::memcpy(out + whole, codes, n - whole);
}

// The fastest way this build quantizes: 2 through the permute tables (AVX512-VBMI; maps they cannot hold take
// 1), 1 through the 16-bit table's 16-lane gathers (AVX-512), 3 through its 8-lane gathers (AVX2), 4 through the
// permute tables with NEON's TBL (aarch64; maps they cannot hold take 0), 0 through scalar lookups. The numbering
// is build.py's QUANTIZER_PATHS.
int zero_bnb_widest_path() {
#if defined(__AVX512VBMI__)
    return 2;
#elif defined(__AVX512F__)
    return 1;
#elif defined(__AVX2__)
    return 3;
#elif defined(ZERO_BNB_NEON)
    return 4;
#else
    return 0;
#endif
}

// How this build quantizes with qmap (numbered as zero_bnb_widest_path); for tests and measurements.
int zero_bnb_quantizer_path(const float* qmap, int is_signed) {
    const Map& map = map_for(qmap, is_signed != 0);
    const int widest = zero_bnb_widest_path();
    if (!map.steps.usable && (widest == 2 || widest == 4)) return widest == 2 ? 1 : 0;
    return widest;
}

}  // extern "C"
