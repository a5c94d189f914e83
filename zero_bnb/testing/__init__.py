"""Helpers for the demo, the tests and the benchmarks: a toy model and training loop (``toy``), a
local gloo launcher (``launch``), whole-state gathering for comparisons (``consolidate``), fp16 engines on CPU ranks
(``cpu_fp16``).

May import: anything in zero_bnb.
"""
