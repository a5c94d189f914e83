"""Write golden vectors: bitsandbytes' blockwise 8-bit update on a GPU over zero_bnb.testing.golden's cases.

    python benchmarks/gpu/golden_vectors.py OUTDIR             # on a machine with CUDA (benchmarks/gpu/check.sh)
    python benchmarks/gpu/golden_vectors.py OUTDIR --device cpu  # dry run: bitsandbytes' CPU path, same files
    python benchmarks/gpu/golden_vectors.py --check DIR          # how the fused kernel and the reference agree

Each case becomes OUTDIR/<case>.safetensors (format: zero_bnb/testing/golden.py). Copy a GPU run's files into
tests/golden/, where tests/test_golden.py checks the fused CPU kernel and the reference against them. A CPU run's
files are marked ``device: cpu`` and refused there: they check nothing independent.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from zero_bnb.kernels.hyper import TWO_STATE  # noqa: E402
from zero_bnb.testing.golden import golden_cases, write_fixture  # noqa: E402
from zero_bnb.versions import installed  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("outdir", nargs="?")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--check", metavar="DIR", help="print the agreement of the fixtures in DIR and exit")
    args = parser.parse_args(argv)
    if args.check:
        return check(args.check)
    if not args.outdir:
        parser.error("OUTDIR is required unless --check is given")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("golden_vectors: no CUDA device; use --device cpu for a dry run", file=sys.stderr)
        return 2
    import bitsandbytes.functional as F

    os.makedirs(args.outdir, exist_ok=True)
    device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    versions = {**installed(), "cuda": str(torch.version.cuda)}
    for case in golden_cases():
        t = {name: value.clone().to(args.device) for name, value in case.inputs.items()}
        h = case.hyper
        two = h.name in TWO_STATE
        try:
            F.optimizer_update_8bit_blockwise(
                h.name, t["g"], t["p"], t["state1"], t["state2"] if two else None, h.beta1, h.beta2, h.beta3, h.alpha,
                h.eps, case.step, h.lr, t["qmap1"], t["qmap2"] if two else None, t["absmax1"],
                t["absmax2"] if two else None, weight_decay=h.weight_decay, gnorm_scale=1.0, skip_zeros=h.skip_zeros)
        except RuntimeError as error:
            if args.device == "cuda":
                raise
            # bitsandbytes 0.50.2's CPU path cannot run AdEMAMix's stacked state: a dry run notes it and goes on.
            print(f"golden_vectors: {case.name}: bitsandbytes' CPU path failed ({error}); skipped in this dry run")
            continue
        if args.device == "cuda":
            torch.cuda.synchronize()
        updated = ("p", "state1", "absmax1") + (("state2", "absmax2") if two else ())
        path = write_fixture(args.outdir, case, {name: t[name] for name in updated}, device_name, versions)
        print(f"golden_vectors: {path} ({case.inputs['p'].numel()} elements, {case.features})")
    return 0


def check(folder: str) -> int:
    """Print, per fixture, how the fused kernel and the reference differ from the outputs it holds."""
    from zero_bnb.kernels.fused import fused_update
    from zero_bnb.kernels.reference import reference_update
    from zero_bnb.testing.golden import agreement, read_fixtures

    fixtures = read_fixtures(folder)
    for case, outputs, metadata in fixtures:
        for label, update in (("fused", fused_update), ("reference", reference_update)):
            print(f"golden_vectors: {case.name} ({metadata['device']}) {label}: {agreement(case, outputs, update)}")
    print(f"golden_vectors: {len(fixtures)} fixtures in {folder}")
    return 0 if fixtures else 1


if __name__ == "__main__":
    sys.exit(main())
