"""Where the fused CPU 8-bit kernel's time goes (issue 19): one AdamW step on a partition small enough for L2,
split into the two requantizations and the rest, for this machine's build (AVX512-VBMI: the permute quantizer),
a build without VBMI (the 16-bit table's gathers, as before the permute quantizer) and, on x86-64, one for AVX2
(``-march=x86-64-v3``), in one run, next to DeepSpeedCPUAdam's whole step on the same partition.

Reproduce (CPU, from the repository root):

    PYTHONPATH=. python benchmarks/cpu_kernel_stages.py                 # 512 blocks (131 072 parameters), 1 thread

Per element and one thread, the median process CPU time of ``--repeats`` calls (steady on a loaded machine), less
that of the same call on one block (Python and ctypes overhead):
``step`` is ``fused_update`` (AdamW, state from 10 earlier steps); ``quantize m`` and ``quantize v`` are the
quantizer alone (``fused_quantize``: the division by absmax, the code, the sign fix) on that step's moments
divided by their block's absmax; ``rest`` is the step minus the two (dequantizations, update, absmax, the
parameter's load and store). Writes ``benchmarks/results/cpu_kernel_stages.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from datetime import datetime, timezone

import bitsandbytes.functional as F
import torch

from zero_bnb.kernels import build
from zero_bnb.kernels.fused import fused_quantize, fused_update, quantizer_path
from zero_bnb.kernels.hyper import BLOCK, UpdateHyper, step_scalars

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
HYPER = UpdateHyper(name="adam", lr=1e-3, weight_decay=0.01)


def _cpu_s(function, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.process_time()
        function()
        samples.append(time.process_time() - start)
    return statistics.median(samples)


def _adam_state(numel: int, library) -> dict:
    """A partition after 10 AdamW steps, and the next step's gradient."""
    gen = torch.Generator().manual_seed(0)
    state = dict(p=torch.randn(numel, generator=gen) * 0.02, state1=torch.full((numel,), 127, dtype=torch.uint8),
                 absmax1=torch.zeros(numel // BLOCK), qmap1=F.create_dynamic_map(signed=True),
                 state2=torch.zeros(numel, dtype=torch.uint8), absmax2=torch.zeros(numel // BLOCK),
                 qmap2=F.create_dynamic_map(signed=False))
    for step in range(1, 11):
        fused_update(HYPER, step_scalars(HYPER, step), g=torch.randn(numel, generator=gen) * 1e-3, threads=1,
                     library=library, **state)
    return state | {"g": torch.randn(numel, generator=gen) * 1e-3}


def stages(library, numel: int, repeats: int) -> dict:
    """The step and its two requantizations with ``library``, in ns per element: each call's CPU time less that
    of the same call on one block (the Python and ctypes overhead, and the one block's work: under 1%)."""
    scalars = step_scalars(HYPER, 11)
    out = {"quantizer": quantizer_path(F.create_dynamic_map(signed=True), True, library=library)}
    times = {}
    for size in (numel, BLOCK):
        state = _adam_state(size, library)
        times[size, "step"] = _cpu_s(lambda: fused_update(HYPER, scalars, threads=1, library=library, **state),
                                     repeats)
        for key, codes, absmax, qmap, signed in (("quantize m", "state1", "absmax1", "qmap1", True),
                                                 ("quantize v", "state2", "absmax2", "qmap2", False)):
            x = state[qmap][state[codes].long()]  # the moments divided by their block's absmax
            times[size, key] = _cpu_s(lambda: fused_quantize(x, state[qmap], signed, library=library), repeats)
    for key in ("step", "quantize m", "quantize v"):
        out[key] = (times[numel, key] - times[BLOCK, key]) / (numel - BLOCK) * 1e9
    out["rest"] = out["step"] - out["quantize m"] - out["quantize v"]
    return out


def deepspeed_step(numel: int, repeats: int) -> float:
    """DeepSpeedCPUAdam's step in ns per element, less its CPU time on one block, as :func:`stages`."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    times = []
    for size in (numel, BLOCK):
        param = torch.nn.Parameter(torch.randn(size) * 0.02)
        param.grad = torch.randn(size) * 1e-3
        optimizer = DeepSpeedCPUAdam([param], lr=HYPER.lr, weight_decay=HYPER.weight_decay, adamw_mode=True)
        for _ in range(3):
            optimizer.step()
        times.append(_cpu_s(optimizer.step, repeats))
    return (times[0] - times[1]) / (numel - BLOCK) * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=201)
    parser.add_argument("--output", default=os.path.join(RESULTS, "cpu_kernel_stages"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    numel = args.blocks * BLOCK
    builds = {"this machine": build.load_library()}
    with tempfile.TemporaryDirectory() as folder:
        os.environ[build.CACHE_ENV], cxx = folder, os.environ.get("CXX")
        os.environ["CXX"] = f"{cxx or 'c++'} -mno-avx512vbmi"
        try:
            builds["without VBMI"] = build.bind(build.build_library())
            if platform.machine() in ("x86_64", "AMD64"):
                os.environ["CXX"], os.environ[build.MARCH_ENV] = cxx or "c++", "x86-64-v3"
                builds["AVX2 (x86-64-v3)"] = build.bind(build.build_library())
        finally:
            del os.environ[build.CACHE_ENV]
            os.environ.pop(build.MARCH_ENV, None)
            if cxx is None:
                del os.environ["CXX"]
            else:
                os.environ["CXX"] = cxx
    rows = {}
    for round_index in range(2):  # alternate, keep the second round (warm, and drift hits both)
        for name in (list(builds) if round_index == 0 else list(builds)[::-1]):
            rows[name] = stages(builds[name], numel, args.repeats)
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 platform.processor())
    result = {"machine": {"cpu": model, "cores": os.cpu_count(), "load_average_at_start": os.getloadavg(),
                          "torch": torch.__version__,
                          "date": datetime.now(timezone.utc).isoformat(timespec="seconds")},
              "numel": numel, "builds": rows, "deepspeed_cpu_adam_step": deepspeed_step(numel, args.repeats)}
    with open(args.output + ".json", "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=1)
    info = result["machine"]
    lines = [f"Fused kernel stages, AdamW, {numel} parameters ({args.blocks} blocks), 1 thread, median process CPU "
             f"time per element of {args.repeats} calls; {info['cpu']}, {info['cores']} cores, {info['date']} (load "
             f"average at start {', '.join(f'{x:.1f}' for x in info['load_average_at_start'])}).", "",
             "| build | quantizer | step | quantize m (signed map) | quantize v (unsigned map) | rest: dequantize x2, "
             "update, absmax |", "|---|---|---|---|---|---|"]
    for name, row in rows.items():
        lines.append(f"| {name} | {row['quantizer']} | {row['step']:.3f} ns | {row['quantize m']:.3f} ns | "
                     f"{row['quantize v']:.3f} ns | {row['rest']:.3f} ns |")
    lines += ["", "(Without VBMI the dequantizations gather too, so only its quantize columns stand for the quantizer this "
              "machine used before the permute one.)",
              f"DeepSpeedCPUAdam, whole step on the same partition: {result['deepspeed_cpu_adam_step']:.3f} ns."]
    text = "\n".join(lines) + "\n"
    with open(args.output + ".md", "w", encoding="utf-8") as handle:
        handle.write(text)
    print(text)


if __name__ == "__main__":
    main()
