"""The `logitless bench` command: cases, providers, correctness gate, timing, tables and plots.

Layout: cases.py (jobs, phases, presets, inputs), data.py (the synthetic heads), real.py and real_files.py (a real
model's head on real text, its file), providers.py and peers.py (every implementation behind one calling
convention, the peers built apart), check.py (the error rule against float64), measure.py (time and peak memory),
runner.py (runs it all), report.py (table, JSON, CSV, plots), svg.py (the plots' SVG writer), selection.py (the
cases and providers the arguments choose), cli.py (arguments), finetune*.py (--job finetune: full training steps of
a real model, its own machinery).
"""
