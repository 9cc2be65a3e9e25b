"""Outputs of a run: the terminal table (also saved as Markdown), results.json, results.csv and one SVG plot per job."""

from __future__ import annotations

import csv
import json
import math
import os

from . import cases as C
from . import svg
from .runner import Result, Run

STATUS_SHORT = {"ok": "ok", "failed check": "FAIL", "error": "error", "OOM": "OOM", "too slow": "slow",
                "not timed": "-"}


def _num(v) -> str:
    """Three significant digits, never in exponent form above 1; "-" for a missing value."""
    if v is None or (isinstance(v, float) and (math.isnan(v) or math.isinf(v))):
        return "-"
    a = abs(v)
    if a >= 100:
        return f"{v:.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.2f}"
    return f"{v:.3g}"


def _row(r: Result, phase: str, first: bool) -> list[str]:
    pr = r.phases.get(phase)
    head = [r.provider if first else "", _check_cell(r) if first else "", phase]
    if pr is None:
        return head + ["-"] * 8
    if pr.status != "ok":
        return head + [STATUS_SHORT.get(pr.status, pr.status)] + ["-"] * 7
    split = phase == "fwd+bwd"
    fwd, bwd = (_num(pr.fwd_ms), _num(pr.bwd_ms)) if split else ("-", "-")
    if split and pr.grads_in_forward:
        fwd, bwd = fwd + FOLDED_MARK, bwd + FOLDED_MARK
    skipped = "-" if math.isnan(pr.skipped) else f"{100 * pr.skipped:.0f}%"
    if skipped != "-" and pr.skip_state == "dense":
        skipped += " (dense)"  # the gate's last probe found too little cold: the timed calls ran the dense plans
    return head + [_num(pr.total_ms), fwd, bwd,
                   _num(pr.x_ours), _num(pr.x_floor), _num(C.mib(pr.peak_bytes)), _num(pr.rate), skipped]


FOLDED_MARK = "*"
FOLDED_NOTE = (f"{FOLDED_MARK} the gradients are computed in the forward (the fused path of the PyTorch path, "
               "docs/usage.md): fwd holds the backward's work, bwd only hands the gradients over")


def _check_cell(r: Result) -> str:
    if not r.checks:
        return "n/a" if r.status == "ok" else STATUS_SHORT.get(r.status, r.status)
    return "ok" if r.status != "failed check" else "FAIL"


def _align(row: list[str], widths: list[int]) -> str:
    # Names left-aligned, numbers right-aligned.
    return "  ".join(c.ljust(w) if k < 3 else c.rjust(w) for k, (c, w) in enumerate(zip(row, widths, strict=True)))


def tables(run: Run, markdown: bool = False) -> str:
    """One table per case, a row per provider and phase; failures and their messages listed under it."""
    out = []
    seen = []
    for r in run.results:
        if r.case not in seen:
            seen.append(r.case)
    for case in seen:
        rows = [r for r in run.results if r.case == case]
        header = ["provider", "check", "phase", "ms", "fwd ms", "bwd ms", "x ours", "x floor", "peak MiB",
                  "GB/s" if case.job == "ce" else "TFLOP/s", "skipped"]
        body = [_row(r, phase, k == 0) for r in rows for k, phase in enumerate(C.PHASES[case.job])]
        title = case.label
        if case in run.case_notes:
            title += f"; {run.case_notes[case]}"
        out.append(("### " if markdown else "") + title)
        if markdown:
            out.append("")
            out.append("| " + " | ".join(header) + " |")
            out.append("|" + "|".join(" --- " for _ in header) + "|")
            out += ["| " + " | ".join(row) + " |" for row in body]
        else:
            widths = [max(len(h), *(len(row[k]) for row in body)) for k, h in enumerate(header)]
            out += [_align(row, widths) for row in [header, *body]]
        notes = []
        if any(pr.grads_in_forward for r in rows for pr in r.phases.values()):
            notes.append(FOLDED_NOTE)
        for r in rows:
            if r.error:
                notes.append(f"{r.provider}: {r.status}: {r.error}")
            for pr in r.phases.values():
                if pr.error:
                    notes.append(f"{r.provider} [{pr.phase}]: {pr.status}: {pr.error}")
        if notes:
            out.append("")
            out += [("- " if markdown else "  ") + n for n in notes]
        out.append("")
    return "\n".join(out)


def legend(run: Run) -> str:
    by_name: dict[str, list[str]] = {}
    for job, name in sorted(run.ours.items()):
        by_name.setdefault(name, []).append(job)
    ours = "; ".join(f"{name}'s ({', '.join(jobs)})" for name, jobs in by_name.items())
    lines = [f"x ours: time over {ours}; x floor: over the dense floor's; both in the same phase of the same run"]
    for name, reason in run.unavailable.items():
        lines.append(f"not run: {name}: {reason}")
    return "\n".join(lines)


def _records(run: Run):
    for r in run.results:
        s = r.case.shape
        base = {"job": r.case.job, "shape": s.name, "N": s.N, "D": s.D, "V": s.V, "dtype": r.case.dtype,
                "data": r.case.data, "provider": r.provider, "status": r.status, "error": r.error,
                "wall_s": r.wall_s}
        for phase in C.PHASES[r.case.job]:
            pr = r.phases.get(phase)
            if pr is None:
                continue
            yield {**base, "phase": phase, "phase_status": pr.status, "phase_error": pr.error,
                   "median_ms": pr.total_ms, "fwd_ms": pr.fwd_ms, "bwd_ms": pr.bwd_ms, "reps": pr.reps,
                   "peak_mib": C.mib(pr.peak_bytes),
                   "tflops": pr.rate if r.case.job != "ce" else math.nan,
                   "gbps": pr.rate if r.case.job == "ce" else math.nan,
                   "x_ours": pr.x_ours, "x_floor": pr.x_floor, "skipped_share": pr.skipped,
                   "skip_state": pr.skip_state}
        if not r.phases:
            yield {**base, "phase": "", "phase_status": "", "phase_error": ""}


def _clean(v):
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return None
    return v


def write_json(run: Run, meta: dict, path: str, opener=open) -> None:
    doc = {
        "meta": meta,
        "data": run.data,
        "ours": run.ours,
        "unavailable": run.unavailable,
        "cases": [{"label": c.label, "note": n} for c, n in run.case_notes.items()],
        "checks": [{"job": r.case.job, "shape": r.case.shape.name, "dtype": r.case.dtype, "data": r.case.data,
                    "provider": r.provider, "comparisons": [{k: _clean(v) for k, v in c.as_dict().items()}
                                                            for c in r.checks]}
                   for r in run.results if r.checks],
        "results": [{k: _clean(v) for k, v in rec.items()} for rec in _records(run)],
    }
    with opener(path, "w") as f:
        json.dump(doc, f, indent=1)


CSV_FIELDS = ["job", "shape", "N", "D", "V", "dtype", "data", "provider", "status", "phase", "phase_status",
              "median_ms", "fwd_ms", "bwd_ms", "reps", "peak_mib", "tflops", "gbps", "x_ours", "x_floor",
              "skipped_share", "skip_state", "wall_s",
              "error", "phase_error"]


def write_csv(run: Run, path: str, opener=open) -> None:
    with opener(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for rec in _records(run):
            w.writerow({k: ("" if _clean(v) is None else v) for k, v in rec.items()})


def _value(results: list[Result], provider: str, shape: str, phase: str, fld: str):
    r = next((r for r in results if r.provider == provider and r.case.shape.name == shape), None)
    pr = r.phases.get(phase) if r else None
    return getattr(pr, fld) if pr is not None and pr.status == "ok" else None


def write_plots(run: Run, out_dir: str, opener=open) -> list[str]:
    """One SVG per job: time and peak memory of the headline phase, per shape (groups) and provider (bars), one row
    of two panels per dtype and data kind. The dense floor is drawn as a dashed line across each group on the time
    panel and left off the memory panel (its memory is that of its own outputs, which says nothing). The memory
    axis is logarithmic, the time axis when its values span more than 20x. `opener(path, mode)` opens each file
    (the CLI's writes to a temporary file renamed into place when the whole run has succeeded)."""
    paths = []
    for job in C.ALL_JOBS:
        rs = [r for r in run.results if r.case.job == job]
        if not rs:
            continue
        phase = C.PHASES[job][0]
        kinds = list(dict.fromkeys((r.case.dtype, r.case.data) for r in rs))
        names = [p for p in dict.fromkeys(r.provider for r in rs) if p != "floor"]
        colors = {p: svg.PALETTE[k % len(svg.PALETTE)] for k, p in enumerate(names)}  # one colour per provider
        rows, floor_drawn = [], False
        for dtype, kind in kinds:
            sub = [r for r in rs if (r.case.dtype, r.case.data) == (dtype, kind)]
            shapes = list(dict.fromkeys(r.case.shape.name for r in sub))
            provs = [p for p in colors if any(r.provider == p for r in sub)]
            row = []
            for fld, ylabel in (("total_ms", f"{phase}: median time, ms"),
                                ("peak_bytes", f"{phase}: peak MiB above inputs+outputs")):
                series = {}
                for prov in provs:
                    vs = [_value(sub, prov, sh, phase, fld) for sh in shapes]
                    series[prov] = [v if v is None or fld == "total_ms" else max(C.mib(v), 0.01) for v in vs]
                lines = [_value(sub, "floor", sh, phase, fld) for sh in shapes] if fld == "total_ms" else []
                floor_drawn |= any(v is not None for v in lines)
                positive = [v for vs in [*series.values(), lines] for v in vs if v is not None and v > 0]
                log = fld == "peak_bytes" or bool(positive and max(positive) / min(positive) > 20)
                labels = [["" if v is None else _num(v) for v in vs] for vs in series.values()]
                row.append(svg.Panel(f"{job}, {dtype}, data={kind}", ylabel, shapes, series, lines, log, labels))
            rows.append(row)
        path = os.path.join(out_dir, f"bench_{job}.svg")
        with opener(path, "w") as f:
            f.write(svg.figure(rows, colors, "dense floor" if floor_drawn else None))
        paths.append(path)
    return paths
