"""A small SVG writer for the bench's plots: panels of grouped bars with axes, ticks, labels and a legend.

Written here rather than taken from a plotting library so that `logitless bench` draws its plots with the base
install (a plotting stack is as large as the rest of a CPU install but PyTorch). The viewer lays out the text, so
widths below are estimates (0.6 em a character), used only to leave room.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from xml.sax.saxutils import escape, quoteattr

# matplotlib's "tab10" cycle: colours that stay distinct next to each other and in grey print
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf"]
FONT = 11


@dataclass
class Panel:
    """One chart: `series` maps a name to one value per group (None: no bar); `lines` draws a dashed segment
    across each group where its value is not None; `log` picks a logarithmic y axis."""

    title: str
    ylabel: str
    groups: list[str]
    series: dict[str, list[float | None]]
    lines: list[float | None] = field(default_factory=list)
    log: bool = False
    labels: list[list[str]] | None = None  # text above each bar, per series and group; default: none


def _fmt(v: float, step_exp: int) -> str:
    """A tick label with as many decimals as its tick spacing (10**step_exp) needs."""
    if v == 0:
        return "0"
    if step_exp >= 5 or step_exp <= -5:
        return f"{v:.0e}".replace("e+0", "e").replace("e-0", "e-").replace("e+", "e")
    return f"{v:.{max(0, -step_exp)}f}"


def ticks(lo: float, hi: float, log: bool) -> list[tuple[float, str]]:
    """Tick values and labels within [lo, hi]: multiples of 1, 2 or 5 times a power of ten (about six of them)
    on a linear axis; powers of ten on a log axis, with 2x and 5x added when the range spans up to 2.5 decades,
    and more steps within about one."""
    if log:
        e0, e1 = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
        every = max(1, math.ceil((e1 - e0) / 8))
        span = math.log10(hi / lo)
        mults = (1, 2, 3, 5, 7) if span <= 1.2 else (1, 2, 5) if span <= 2.5 else (1,)
        out = [(m * 10.0**e, _fmt(m * 10.0**e, e)) for e in range(e0, e1 + 1) if e % every == 0
               for m in mults]
    else:
        raw = (hi - lo) / 6
        e = math.floor(math.log10(raw))
        step = next(m * 10.0**e for m in (1, 2, 5, 10) if m * 10.0**e >= raw * (1 - 1e-9))
        se = math.floor(math.log10(step) + 1e-9)
        k0 = math.ceil(lo / step - 1e-9)
        out = [(k * step, _fmt(k * step, se)) for k in range(k0, int(hi / step + 1e-9) + 1)]
    return [(v, s) for v, s in out if lo * (1 - 1e-9) <= v <= hi * (1 + 1e-9)]


def _range(values: list[float], log: bool) -> tuple[float, float]:
    """The y range: from 0 (linear) or a quarter of the data's log span below its smallest value (log), to a quarter
    of the span above its largest, so that the labels above the bars fit."""
    if log:
        lo, hi = (min(values), max(values)) if values else (1.0, 10.0)
        if hi / lo < 3:
            lo, hi = lo / 2, hi * 2
        pad = 0.25 * math.log10(hi / lo)
        return lo / 10**pad, hi * 10**pad
    hi = max(values, default=0.0)
    return 0.0, hi * 1.25 if hi > 0 else 1.0


def _text(x, y, s, size=FONT, anchor="middle", rotate=False, extra=""):
    tr = f' transform="rotate(-90 {x:.1f} {y:.1f})"' if rotate else ""
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}"{tr}{extra}>'
            f"{escape(s)}</text>")


def panel(p: Panel, colors: dict[str, str], x0: float, y0: float, w: float, h: float) -> list[str]:
    """SVG elements of one panel whose outer box is (x0, y0, w, h): the plot area leaves room for the title above,
    the tick labels and y label on the left and the group names below."""
    ax, ay, aw, ah = x0 + 70, y0 + 24, w - 84, h - 52
    values = [v for vs in p.series.values() for v in vs if v is not None and math.isfinite(v)]
    values += [v for v in p.lines if v is not None and math.isfinite(v)]
    if p.log:
        values = [v for v in values if v > 0]
    lo, hi = _range(values, p.log)
    f = math.log10 if p.log else float

    def ypx(v: float) -> float:
        v = min(max(v, lo), hi)
        return ay + ah - (f(v) - f(lo)) / (f(hi) - f(lo)) * ah

    out = [_text(ax + aw / 2, y0 + 14, p.title, FONT + 1)]
    for v, s in ticks(lo, hi, p.log):
        y = ypx(v)
        out.append(f'<line x1="{ax:.1f}" y1="{y:.1f}" x2="{ax + aw:.1f}" y2="{y:.1f}" stroke="#000" '
                   f'stroke-opacity="0.15"/>')
        out.append(f'<line x1="{ax - 4:.1f}" y1="{y:.1f}" x2="{ax:.1f}" y2="{y:.1f}" stroke="#000"/>')
        out.append(_text(ax - 6, y + 4, s, FONT - 1, "end"))
    out.append(_text(x0 + 14, ay + ah / 2, p.ylabel, FONT - 1, rotate=True))
    ng, names = max(1, len(p.groups)), list(p.series)
    gw = aw / ng
    bw = 0.8 * gw / max(1, len(names))
    for j, g in enumerate(p.groups):
        cx = ax + (j + 0.5) * gw
        out.append(_text(cx, ay + ah + 16, g, FONT - 1))
        for k, name in enumerate(names):
            v = p.series[name][j]
            if v is None or not math.isfinite(v) or (p.log and v <= 0):
                continue
            bx, top = cx + (k - len(names) / 2) * bw, ypx(v)
            out.append(f'<rect x="{bx:.1f}" y="{top:.1f}" width="{bw:.1f}" height="{ay + ah - top:.1f}" '
                       f'fill="{colors[name]}"><title>{escape(f"{name}, {g}: {v:g}")}</title></rect>')
            if p.labels is not None:
                out.append(_text(bx + bw / 2 + 3, top - 3, p.labels[k][j], FONT - 3, "start", rotate=True))
        v = p.lines[j] if j < len(p.lines) else None
        if v is not None and math.isfinite(v) and (v > 0 or not p.log):
            y = ypx(v)
            out.append(f'<line x1="{cx - 0.45 * gw:.1f}" y1="{y:.1f}" x2="{cx + 0.45 * gw:.1f}" y2="{y:.1f}" '
                       f'stroke="#000" stroke-width="1.5" stroke-dasharray="6 4"/>')
    out.append(f'<rect x="{ax:.1f}" y="{ay:.1f}" width="{aw:.1f}" height="{ah:.1f}" fill="none" stroke="#000"/>')
    return out


def figure(rows: list[list[Panel]], colors: dict[str, str], line_label: str | None, panel_w: float = 700,
           panel_h: float = 380) -> str:
    """A whole SVG document: the panels in a grid and, centred below them, one legend entry per colour (and one
    for the dashed line when `line_label` is given)."""
    ncol = max((len(r) for r in rows), default=1)
    width, height = ncol * panel_w, len(rows) * panel_h + 36
    body = []
    for i, row in enumerate(rows):
        for j, p in enumerate(row):
            body += panel(p, colors, j * panel_w, i * panel_h, panel_w, panel_h)
    entries = [(name, "bar") for name in colors] + ([(line_label, "line")] if line_label else [])
    widths = [28 + 0.6 * (FONT - 1) * len(name) + 18 for name, _ in entries]
    x, y = (width - sum(widths)) / 2, height - 16
    for (name, kind), ew in zip(entries, widths, strict=True):
        if kind == "bar":
            body.append(f'<rect x="{x:.1f}" y="{y - 9:.1f}" width="20" height="10" fill="{colors[name]}"/>')
        else:
            body.append(f'<line x1="{x:.1f}" y1="{y - 4:.1f}" x2="{x + 20:.1f}" y2="{y - 4:.1f}" stroke="#000" '
                        f'stroke-width="1.5" stroke-dasharray="6 4"/>')
        body.append(_text(x + 26, y, name, FONT - 1, "start"))
        x += ew
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
            f'viewBox="0 0 {width:.0f} {height:.0f}" font-family={quoteattr("DejaVu Sans, Arial, sans-serif")}>')
    return "\n".join([head, f'<rect width="{width:.0f}" height="{height:.0f}" fill="#fff"/>', *body, "</svg>"]) + "\n"
