"""Compile the Triton 8-bit update for NVIDIA GPUs on a machine without one (issue 45): ``python
tests/triton_compile_scenarios.py ARCH...`` (compute capabilities such as 80 and 90) compiles every family
with the options :func:`~zero_bnb.kernels.triton_update.triton_update` launches with, and once more with multiply-adds
allowed (the control), then prints one JSON object: per variant, whether a cubin came out and the PTX instructions
the bit-exactness with the reference rests on. Run in its own process: Triton must not be in interpreter mode."""

from __future__ import annotations

import inspect
import json
import re
import sys

from zero_bnb.kernels.hyper import BLOCK, Family
from zero_bnb.kernels.triton_update import BLOCKS_PER_PROGRAM, COMPILE_OPTIONS

#: PTX instructions counted: IEEE-rounded division and square root, their approximate forms, fused multiply-adds.
COUNTED = {"div.rn.f32": r"\bdiv\.rn\.f32\b", "div.approx": r"\bdiv\.(approx|full)\.", "sqrt.rn.f32": r"\bsqrt\.rn\.f32\b",
           "sqrt.approx": r"\bsqrt\.approx\.", "fma": r"\bfma\.\S*f32\b"}


def _compile(arch: int, family: Family, decay: bool, skip_zeros: bool, options: dict) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from zero_bnb.kernels.triton_kernel import update

    names = list(inspect.signature(update.fn).parameters)
    signature = {name: ("*u8" if name.startswith("state") else "*fp32") if name.endswith("_ptr") else
                 "i32" if name in ("n", "n_blocks", "step") else "constexpr" if name.isupper() else "fp32"
                 for name in names}
    constexprs = {"FAMILY": family.kernel, "DECAY": decay, "SKIP_ZEROS": skip_zeros, "ROWS": BLOCKS_PER_PROGRAM,
                  "BLOCK": BLOCK}
    source = ASTSource(fn=update, signature=signature,
                       constexprs={(names.index(name),): value for name, value in constexprs.items()})
    kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    ptx = kernel.asm["ptx"]
    return {"cubin": bool(kernel.asm.get("cubin")), **{name: len(re.findall(pattern, ptx))
                                                       for name, pattern in COUNTED.items()}}


def main(archs: list[int]) -> dict:
    """Every family, with weight decay and (1-state families) ``skip_zeros``, for each architecture; and the control
    (Adam with multiply-adds allowed) for the first."""
    found = {}
    for arch in archs:
        for family in Family:
            found[f"sm_{arch} {family.value}"] = _compile(arch, family, True, not family.two_state, COMPILE_OPTIONS)
    found[f"sm_{archs[0]} adam control: multiply-adds allowed"] = _compile(
        archs[0], Family.ADAM, True, False, {**COMPILE_OPTIONS, "enable_fp_fusion": True})
    return found


if __name__ == "__main__":
    print(json.dumps(main([int(arch) for arch in sys.argv[1:]])))
