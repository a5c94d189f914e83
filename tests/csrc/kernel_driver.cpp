// The fused kernel's contract checks for a machine Python cannot load it on (an aarch64 build run under
// qemu-aarch64 on an x86-64 host): a standalone program, compiled with the kernel's own source, that reads calls
// from stdin, runs them and writes their results to stdout. tests/test_kernels_cross.py writes the calls and
// compares the results with zero_bnb.kernels.reference, computed on the host, bit for bit.
//
// Every number is little-endian, as on both hosts. Each call starts with an int32 kind:
//   0 quantize: int32 signed, int64 n, float qmap[256], float x[n]        -> uint8 codes[n]
//   1 update:   int32 family, int32 threads, int64 n, Scalars (15 float, 2 int32), float p[n], float g[n],
//               uint8 state1[rows n], float absmax1[rows blocks], float qmap1[256]
//               and for Adam and AdEMAMix uint8 state2[n], float absmax2[blocks], float qmap2[256]
//                                                                           -> int32 status, p, state1, absmax1
//                                                                              (and state2, absmax2)
//   2 path:     int32 signed, float qmap[256]                              -> int32 zero_bnb_quantizer_path
//   3 widest:                                                              -> int32 zero_bnb_widest_path
#include "blockwise_update.cpp"

#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

void fail(const char* what) {
    std::fprintf(stderr, "kernel_driver: %s\n", what);
    std::exit(2);
}

template <typename T>
T take() {
    T value;
    if (std::fread(&value, sizeof value, 1, stdin) != 1) fail("truncated input");
    return value;
}

template <typename T>
std::vector<T> take(int64_t count) {
    std::vector<T> values(static_cast<size_t>(count));
    if (count && std::fread(values.data(), sizeof(T), values.size(), stdin) != values.size()) fail("truncated input");
    return values;
}

template <typename T>
void give(const T* values, int64_t count) {
    if (count && std::fwrite(values, sizeof(T), static_cast<size_t>(count), stdout) != static_cast<size_t>(count))
        fail("cannot write the output");
}

void update_call() {
    const int32_t family = take<int32_t>(), threads = take<int32_t>();
    const int64_t n = take<int64_t>();
    const Scalars scalars = take<Scalars>();
    const bool two = family == ADAM || family == ADEMAMIX;
    const int64_t rows = family == ADEMAMIX ? 2 : 1, blocks = (n + kBlock - 1) / kBlock;
    auto p = take<float>(n), g = take<float>(n);
    auto state1 = take<uint8_t>(rows * n);
    auto absmax1 = take<float>(rows * blocks);
    const auto qmap1 = take<float>(256);
    std::vector<uint8_t> state2;
    std::vector<float> absmax2, qmap2;
    if (two) {
        state2 = take<uint8_t>(n);
        absmax2 = take<float>(blocks);
        qmap2 = take<float>(256);
    }
    const int32_t status = zero_bnb_blockwise_update(family, &scalars, n, p.data(), g.data(), state1.data(),
                                                     two ? state2.data() : nullptr, absmax1.data(),
                                                     two ? absmax2.data() : nullptr, qmap1.data(),
                                                     two ? qmap2.data() : nullptr, threads);
    give(&status, 1);
    give(p.data(), n);
    give(state1.data(), rows * n);
    give(absmax1.data(), rows * blocks);
    if (two) {
        give(state2.data(), n);
        give(absmax2.data(), blocks);
    }
}

}  // namespace

int main() {
    static_assert(sizeof(Scalars) == 17 * 4, "Scalars is 15 floats and 2 int32, as zero_bnb.kernels.fused packs it");
    for (int kind; std::fread(&kind, sizeof kind, 1, stdin) == 1;) {
        if (kind == 0) {
            const int32_t is_signed = take<int32_t>();
            const int64_t n = take<int64_t>();
            const auto qmap = take<float>(256);
            const auto x = take<float>(n);
            std::vector<uint8_t> codes(static_cast<size_t>(n));
            zero_bnb_quantize(qmap.data(), is_signed, x.data(), n, codes.data());
            give(codes.data(), n);
        } else if (kind == 1) {
            update_call();
        } else if (kind == 2) {
            const int32_t is_signed = take<int32_t>();
            const auto qmap = take<float>(256);
            const int32_t path = zero_bnb_quantizer_path(qmap.data(), is_signed);
            give(&path, 1);
        } else if (kind == 3) {
            const int32_t path = zero_bnb_widest_path();
            give(&path, 1);
        } else if (kind == 4) {  // the bf16 residual split: n, cap, n master bits, n weight bits
            const int64_t n = take<int64_t>();
            const int64_t cap = take<int64_t>();
            const auto master = take<uint32_t>(n);
            const auto weight = take<uint16_t>(n);
            std::vector<uint16_t> low(static_cast<size_t>(n));
            std::vector<int64_t> index(static_cast<size_t>(cap));
            const int64_t count = zero_bnb_split_rounded_bf16(master.data(), weight.data(), n, low.data(),
                                                              index.data(), cap);
            give(&count, 1);
            give(low.data(), n);
            give(index.data(), count < 0 ? 0 : (count < cap ? count : cap));
        } else {
            fail("unknown call kind");
        }
    }
    return std::fflush(stdout) == 0 ? 0 : 1;
}
