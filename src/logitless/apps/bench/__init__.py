"""The `logitless bench` command: cases, providers, correctness gate, timing, tables and plots.

Layout: cases.py (jobs, phases, presets, inputs), data.py (the synthetic heads), providers.py (every implementation
behind one calling convention), check.py (the error rule against float64), measure.py (time and peak memory),
runner.py (runs it all), report.py (table, JSON, CSV, plots), svg.py (the plots' SVG writer), cli.py
(arguments), real.py (real data: a real model's head on real text), finetune*.py (--job finetune, full training
steps of a real model, its own machinery).
"""
