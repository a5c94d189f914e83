"""Turn raw benchmark measurements into figures, ratios against the targets, a markdown table and a plot."""

from __future__ import annotations

import json
import os
import platform
import statistics
from dataclasses import asdict

__all__ = ["KERNEL_CPU_FLAGS", "TARGETS", "cell", "cores_per_rank", "cpu_features", "kernel_path", "machine",
           "percentile", "summarise", "write_reports"]

#: (figure, variant compared with, largest allowed ratio zero_bnb / that variant)
TARGETS = (
    ("step_s", "stock-adam8bit", 1.01),
    ("state_bytes", "stock-adamw", 0.3),
    ("checkpoint_bytes", "stock-adamw", 0.6),
    ("resume_s", "stock-adamw", 0.5),
)


def percentile(values: list[float], fraction: float) -> float:
    """The ``fraction`` quantile of ``values`` (nearest rank below)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def machine() -> dict:
    """Where a benchmark ran: platform, CPU model (from ``/proc/cpuinfo`` where ``platform`` has none), CPU count."""
    processor = platform.processor()
    try:
        with open("/proc/cpuinfo") as handle:
            processor = next((line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")),
                             processor)
    except OSError:
        pass
    return {"platform": platform.platform(), "processor": processor or platform.machine(), "cpus": os.cpu_count()}


#: ``/proc/cpuinfo`` flags that decide which path the fused kernel builds (and DeepSpeedCPUAdam's SIMD width): x86-64
#: levels v3 (avx2, fma) and v4 (avx512f/bw/vl), VBMI (the permute quantizer); on aarch64 asimd (NEON), sve, sve2.
KERNEL_CPU_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512vbmi", "amx_tile",
                    "asimd", "sve", "sve2")


def cpu_features() -> dict:
    """The CPU a benchmark ran on: its model (``model name``; on aarch64 the implementer and part numbers), the
    :data:`KERNEL_CPU_FLAGS` it has, and its logical CPU count."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    model = fields.get("model name") or " ".join(
        f"{key} {fields[key]}" for key in ("CPU implementer", "CPU part") if key in fields) or platform.processor()
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    return {"model": model or platform.machine(), "machine": platform.machine(),
            "flags": [flag for flag in KERNEL_CPU_FLAGS if flag in flags], "cpus": os.cpu_count()}


def kernel_path() -> dict:
    """Which build of zero_bnb's fused kernel this process loads: its ``-march`` and the quantizer path it takes for
    bitsandbytes' maps (``zero-bnb build-kernels`` prints the same), or why it could not be built."""
    from zero_bnb.kernels.build import MARCH_ENV, KernelBuildError, QUANTIZER_PATHS, load_library

    march = os.environ.get(MARCH_ENV) or "native"
    try:
        path = QUANTIZER_PATHS[load_library().zero_bnb_widest_path()]
    except KernelBuildError as error:
        return {"march": march, "quantizer": None, "error": str(error)}
    return {"march": march, "quantizer": path}


def cores_per_rank(ranks_per_node: int) -> int:
    """The threads a launcher that divides the machine would give each of ``ranks_per_node`` processes:
    ``nproc // ranks`` (logical CPUs; the ``deepspeed`` launcher's ``--bind_cores_to_rank`` divides physical cores,
    the same number where each core runs one thread, as on the machines the results come from)."""
    return max(1, (os.cpu_count() or 1) // max(1, ranks_per_node))


def versions() -> dict:
    """The versions a benchmark ran with (zero_bnb, torch, deepspeed, bitsandbytes, Python)."""
    import bitsandbytes
    import deepspeed
    import torch

    import zero_bnb

    return {"zero_bnb": zero_bnb.__version__, "torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "bitsandbytes": bitsandbytes.__version__, "python": platform.python_version()}


def summarise(raw: dict, *, model: str, config, args: dict, step_bytes_per_param: dict[str, int]) -> dict:
    """Figures per variant and the target ratios for one model."""
    variants = {}
    dp = args["dp"]
    for variant in ("stock-adamw", "stock-adam8bit", "zero_bnb"):
        record = raw[variant]
        step = statistics.median(record["step_s"])
        optimizer_step = statistics.median(record["optimizer_step_s"])
        figures = {
            "step_s": step,
            "step_s_p10": percentile(record["step_s"], 0.1),
            "step_s_p90": percentile(record["step_s"], 0.9),
            "samples_per_s": args["micro_batch"] * dp / step,
            "optimizer_step_s": optimizer_step,
            "memory_bytes_per_rank": statistics.median(record["memory_bytes"]),
            # GPU: peak allocated over what was allocated before the engine, per phase (median of rounds); what a
            # load kept allocated; what was left once the engine was destroyed (0: nothing leaked into later readings)
            "memory_bytes_by_phase": {phase: statistics.median(values)
                                      for phase, values in record.get("memory_bytes_by_phase", {}).items() if values},
            "kept_after_load_bytes": record.get("kept_after_load_bytes"),
            "left_after_destroy_bytes": max(record.get("left_after_destroy_bytes") or [0]),
            # os.getloadavg() beside each round (1, 5, 15 minutes): how busy the (shared) machine was
            "loadavg": record.get("loadavg"),
            "state_bytes": record["state_bytes"],
            "parameters": record["parameters"],
            "checkpoint_bytes": record["checkpoint_bytes"],
            "checkpoint_bytes_per_param": record["checkpoint_bytes"] / record["parameters"],
            "save_s": statistics.median(record["save_s"]),  # every round's save
            "load_s": record["load_s"],
        }
        # zero_bnb's asynchronous saves, median of the rounds: the second save of an engine (its staging buffers
        # reused, as at every later save of a run), and the first's blocking and stall
        for key in ("blocking_s", "stall_s", "control_extra_s", "background_s", "first_blocking_s", "first_stall_s"):
            if record.get("async_save") and key in record["async_save"][0]:
                figures[f"async_save_{key}"] = statistics.median(row[key] for row in record["async_save"])
        if "copy_bandwidth_bytes_per_s" in raw:
            moved = step_bytes_per_param[variant] * record["parameters"] / dp
            figures["optimizer_bandwidth_bytes_per_s"] = moved / optimizer_step
            figures["bandwidth_fraction_of_copy"] = moved / optimizer_step / raw["copy_bandwidth_bytes_per_s"]
        variants[variant] = figures
    resume = raw.get("resume")
    if resume:
        variants["stock-adamw"]["resume_s"] = resume["convert_s"] + statistics.median(resume["load_s"]["stock-adamw"])
        variants["stock-adamw"]["resume_convert_s"] = resume["convert_s"]
        variants["zero_bnb"]["resume_s"] = statistics.median(resume["load_s"]["zero_bnb"])
        variants["stock-adam8bit"]["resume_s"] = "not possible"
    targets = {}
    for figure, baseline, limit in TARGETS:
        ours, theirs = variants["zero_bnb"].get(figure), variants[baseline].get(figure)
        if isinstance(ours, (int, float)) and isinstance(theirs, (int, float)) and theirs:
            ratio = ours / theirs
            targets[figure] = {"vs": baseline, "ratio": ratio, "target": limit, "met": ratio <= limit}
        else:
            targets[figure] = {"vs": baseline, "ratio": None, "target": limit, "met": None,
                               "note": "not measured in this mode"}
    stall, stock_save = variants["zero_bnb"].get("async_save_stall_s"), variants["stock-adam8bit"].get("save_s")
    if isinstance(stall, (int, float)) and stock_save:  # issue 35: the stall of an asynchronous save vs stock's save
        targets["async_save_stall_s / stock save_s"] = {"vs": "stock-adam8bit", "ratio": stall / stock_save,
                                                        "target": 0.1, "met": stall / stock_save <= 0.1}
    return {"model": model, "config": asdict(config), "dp": dp, "resume_dp": resume["dp"] if resume else None,
            "copy_bandwidth_bytes_per_s": raw.get("copy_bandwidth_bytes_per_s"), "variants": variants,
            "targets": targets}


def cell(value, unit: str = "") -> str:
    """A table cell: text as it is, ``-`` for none, bytes (``B``) in MiB, seconds as ``ms`` or ``s``, else 2 decimals."""
    if isinstance(value, str):
        return value
    if value is None:
        return "-"
    if unit == "B":
        return f"{value / 2**20:,.1f} MiB"
    if unit == "ms":
        return f"{value * 1e3:,.1f} ms"
    if unit == "s":
        return f"{value:,.2f} s"
    return f"{value:,.2f}"


def _markdown(report: dict) -> str:
    machine = report["machine"]
    where = machine["gpu"] or f"{machine['processor']} ({machine['cpus']} CPUs)"
    lines = [f"Benchmark `{report['mode']}` mode, {report['date']}, on {where}; "
             + ", ".join(f"{k} {v}" for k, v in report["versions"].items()) + "."]
    for row in report["results"]:
        title = (f"**{row['model']}** ({row['variants']['zero_bnb']['parameters'] / 1e6:,.1f}M parameters, "
                 f"DP={row['dp']}, resume at DP={row['resume_dp']})")
        lines += ["", title, "",
                  "| figure | stock DeepSpeed + AdamW | stock DeepSpeed + Adam8bit | zero_bnb + Adam8bit |",
                  "| --- | --- | --- | --- |"]
        figures = [("step time (median)", "step_s", "ms"), ("step time p10-p90", None, "ms"),
                   ("samples/s", "samples_per_s", ""), ("optimizer step alone", "optimizer_step_s", "ms"),
                   ("memory per rank", "memory_bytes_per_rank", "B"), ("optimizer state per rank", "state_bytes", "B"),
                   ("checkpoint on disk", "checkpoint_bytes", "B"),
                   ("checkpoint bytes / parameter", "checkpoint_bytes_per_param", ""),
                   ("save (blocks training)", "save_s", "s"),
                   ("asynchronous save: blocks", "async_save_blocking_s", "s"),
                   ("asynchronous save: stall (blocks + slower overlapping steps)", "async_save_stall_s", "s"),
                   ("asynchronous save: control (as many steps after it, nothing pending)", "async_save_control_extra_s",
                    "s"),
                   ("asynchronous save: committed after", "async_save_background_s", "s"),
                   ("asynchronous save: the first save blocks", "async_save_first_blocking_s", "s"),
                   ("asynchronous save: the first save's stall", "async_save_first_stall_s", "s"),
                   ("load, same DP", "load_s", "s"),
                   ("resume at another DP", "resume_s", "s")]
        if row["copy_bandwidth_bytes_per_s"]:
            figures.append(("optimizer step bandwidth / copy bandwidth", "bandwidth_fraction_of_copy", ""))
        phases = list(row["variants"]["zero_bnb"].get("memory_bytes_by_phase") or {})
        figures += [(f"peak allocated: {phase.replace('_', ' ')}", ("memory_bytes_by_phase", phase), "B")
                    for phase in phases]
        for label, key, unit in figures:
            cells = []
            for variant in ("stock-adamw", "stock-adam8bit", "zero_bnb"):
                figures_of = row["variants"][variant]
                if key is None:
                    cells.append(f"{cell(figures_of['step_s_p10'], unit)} - {cell(figures_of['step_s_p90'], unit)}")
                elif isinstance(key, tuple):
                    cells.append(cell((figures_of.get(key[0]) or {}).get(key[1]), unit))
                else:
                    cells.append(cell(figures_of.get(key), unit))
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        loads = [load[0] for variant in row["variants"].values() for load in variant.get("loadavg") or []]
        if loads:
            lines.append(f"| load average (1 min) beside the rounds | {min(loads):.2f} - {max(loads):.2f} | | |")
        lines += ["", "| target (zero_bnb / baseline) | baseline | ratio | limit | met |", "| --- | --- | --- | --- | --- |"]
        for figure, target in row["targets"].items():
            met = {True: "yes", False: "**no**", None: "-"}[target["met"]]
            lines.append(f"| {figure} | {target['vs']} | {cell(target['ratio'])} | {target['target']} | {met} |")
    return "\n".join(lines) + "\n"


def _plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    keys = [("step_s", "step time"), ("optimizer_step_s", "optimizer step"), ("state_bytes", "optimizer state"),
            ("checkpoint_bytes", "checkpoint bytes"), ("resume_s", "resume at other DP")]
    figure, axes = plt.subplots(2, len(rows), figsize=(9 * len(rows), 9), squeeze=False)
    for axis, row in zip(axes[1], rows):
        _plot_memory(axis, row, report["mode"])
    for axis, row in zip(axes[0], rows):
        base = row["variants"]["stock-adamw"]
        width = 0.27
        for offset, variant in enumerate(("stock-adamw", "stock-adam8bit", "zero_bnb")):
            values = [row["variants"][variant].get(k) for k, _ in keys]
            ratios = [v / base[k] if isinstance(v, (int, float)) and isinstance(base.get(k), (int, float)) else float("nan")
                      for v, (k, _) in zip(values, keys)]
            axis.bar([i + (offset - 1) * width for i in range(len(keys))], ratios, width, label=variant)
        axis.set_xticks(range(len(keys)), [label for _, label in keys])
        axis.axhline(1.0, color="grey", linewidth=0.8)
        axis.set_yscale("log")
        axis.set_ylabel("relative to stock DeepSpeed + AdamW (log scale)")
        axis.set_title(f"{row['model']} ({report['mode']}, DP={row['dp']})")
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _plot_memory(axis, row: dict, mode: str) -> None:
    """Peak bytes allocated per phase (MiB), one bar per variant."""
    variants = ("stock-adamw", "stock-adam8bit", "zero_bnb")
    phases = list(row["variants"]["zero_bnb"].get("memory_bytes_by_phase") or {})
    if not phases:
        axis.set_axis_off()
        return
    width = 0.27
    for offset, variant in enumerate(variants):
        by_phase = row["variants"][variant].get("memory_bytes_by_phase") or {}
        axis.bar([i + (offset - 1) * width for i in range(len(phases))],
                 [by_phase.get(phase, float("nan")) / 2**20 for phase in phases], width, label=variant)
    axis.set_xticks(range(len(phases)), [phase.replace("_", " ") for phase in phases])
    axis.set_ylabel("peak allocated per rank (MiB)")
    axis.set_title(f"{row['model']}: peak memory by phase ({mode}; transient buffers included)")
    axis.legend()


def write_json_and_markdown(report: dict, markdown: str, stem: str) -> None:
    """Write ``report`` to ``stem``.json and ``markdown`` to ``stem``.md (the folder made if needed)."""
    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    with open(f"{stem}.json", "w") as handle:
        json.dump(report, handle, indent=1)
    with open(f"{stem}.md", "w") as handle:
        handle.write(markdown)


def write_reports(report: dict, stem: str) -> str:
    """Write ``stem``.json, .md and .png; returns the markdown."""
    markdown = _markdown(report)
    write_json_and_markdown(report, markdown, stem)
    _plot(report, f"{stem}.png")
    return markdown
