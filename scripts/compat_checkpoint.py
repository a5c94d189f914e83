"""A checkpoint written in one cell of the compatibility matrix, read in another (run by scripts/compat.sh).

    python scripts/compat_checkpoint.py write DIR   # train Adam8bit at DP=2, save DIR/ckpt, keep the reference
    python scripts/compat_checkpoint.py read DIR    # load DIR/ckpt at DP=3 with this cell's versions and check it

``read`` checks that every parameter's fp32 master weights and dequantized optimizer state equal the
saved ones bit for bit, that the step count is the saved one, and that the next loss matches the
writer's uninterrupted run (reduction order aside); it prints one line and exits 1 on any difference.
The writer's and reader's versions come from the checkpoint's manifest and this interpreter.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import scenarios  # noqa: E402 - tests/scenarios.py, the suite's own launches
import torch  # noqa: E402

from zero_bnb.testing.consolidate import state_differences  # noqa: E402
from zero_bnb.testing.launch import run_distributed  # noqa: E402
from zero_bnb.tools.views import inspect_checkpoint  # noqa: E402
from zero_bnb.versions import installed  # noqa: E402

STEPS_BEFORE, STEPS_AFTER, READ_DP = 3, 2, 3


def _versions(found: dict[str, str]) -> str:
    return ", ".join(f"{name} {found[name]}" for name in ("deepspeed", "bitsandbytes", "torch") if name in found)


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("write", "read"):
        print(__doc__, file=sys.stderr)
        return 2
    command, workdir = argv[0], os.path.abspath(argv[1])
    if command == "write":
        os.makedirs(workdir, exist_ok=True)
        run_distributed(scenarios.train_save_continue, 2, workdir, "Adam8bit", STEPS_BEFORE, STEPS_AFTER)
        print(f"compat: wrote {workdir}/ckpt at DP=2 with {_versions(installed())}")
        return 0
    reference = torch.load(os.path.join(workdir, "reference_dp2.pt"), weights_only=False)
    run_distributed(scenarios.resume, READ_DP, workdir, "Adam8bit", STEPS_BEFORE, STEPS_AFTER)
    resumed = torch.load(os.path.join(workdir, f"resumed_dp{READ_DP}.pt"), weights_only=False)
    checked, different = state_differences(reference["saved"], resumed["loaded"])
    written = inspect_checkpoint(os.path.join(workdir, "ckpt"))["versions"]
    first, expected = resumed["losses"][0], reference["losses"][STEPS_BEFORE]
    problems = []
    if checked == 0 or different:
        problems.append(f"state differs after load: {different}")
    if resumed["global_steps"] != STEPS_BEFORE:
        problems.append(f"global_steps {resumed['global_steps']} != {STEPS_BEFORE}")
    if abs(first - expected) > 1e-6 * abs(expected):
        problems.append(f"first resumed loss {first!r} != the writer's {expected!r}")
    where = f"written with {_versions(written)}, read at DP={READ_DP} with {_versions(installed())}"
    if problems:
        print(f"compat: FAIL ({where}): " + "; ".join(problems))
        return 1
    print(f"compat: ok ({where}): {checked} tensors equal bit for bit, first resumed loss {first:.6g}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
