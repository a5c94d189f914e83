"""Helpers for the demo, the tests and the benchmarks: a toy model and training loop (``toy``), a
local gloo launcher (``launch``), whole-state gathering for comparisons (``consolidate``), fp16 engines on CPU ranks
(``cpu_fp16``), jobs forked from a warm server and killed whole (``forks``), every file-system step of a save as a
named kill point (``io_trace``).

May import: anything in zero_bnb.
"""
