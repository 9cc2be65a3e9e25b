"""The finetune job's tables (text and Markdown) and its plot."""

from __future__ import annotations

from .finetune_train import SCALE

SHOW_STEPS = 20  # losses shown side by side


def show(v) -> str:
    from .report import _num as num

    return num(v)


def mib(b):
    return None if b is None else b / 2**20


def tables(res: dict, markdown: bool = False) -> str:
    cfg, info = res["config"], res["model"]
    B, T = cfg["batch"], cfg["seq"]
    prec = cfg["dtype"] if cfg["dtype"] == "fp32" or cfg["pure"] else f"{cfg['dtype']} autocast, float32 weights"
    title = (f"finetune {info['model']} ({show(info['params'] / 1e6)}M parameters, V = {info['V']}), {prec}, "
             f"B x T = {B} x {T}, {cfg['steps']} steps ({cfg['warmup']} warm-up), AdamW lr {cfg['lr']:g}")
    head = ["variant", "check", "step ms", "tokens/s", "x hf", "peak MiB (step)", "peak MiB (total)",
            "first step s", "max err/tol"]
    body = []
    for name, r in res["variants"].items():
        check = r.get("check", "-")
        if r["status"] in ("error", "OOM"):
            check = r["status"]
        ratio = r.get("checks", {}).get("max_ratio")
        body.append([name, "scale" if name == SCALE and check == "ok" else check, show(r.get("median_ms")),
                     show(r.get("tokens_per_s")), show(r.get("x_hf")), show(mib(r.get("peak_step_bytes"))),
                     show(mib(r.get("peak_total_bytes"))), show(r.get("first_step_s")), show(ratio)])
    names = list(res["variants"])
    n_show = min(SHOW_STEPS, cfg["steps"])
    lhead = ["step", "float64", *names]
    lbody = []
    ref = res["reference"].get("losses", [])
    for s in range(n_show):
        row = [str(s + 1), f"{ref[s]:.5f}" if s < len(ref) else "-"]
        for n in names:
            ls = res["variants"][n].get("losses", [])
            row.append(f"{ls[s]:.5f}" if s < len(ls) else "-")
        lbody.append(row)
    out = [("### " if markdown else "") + title, ""]
    out += _table(head, body, markdown)
    out += ["", ("### " if markdown else "") + f"losses of the first {n_show} steps", ""]
    out += _table(lhead, lbody, markdown)
    notes = [f"{n}: {r['error']}" for n, r in res["variants"].items() if r.get("error")]
    notes += [f"not run: {n}: {why}" for n, why in res["unavailable"].items()]
    if res["reference"]["status"] != "ok":
        notes.append(f"float64 reference: {res['reference'].get('error', '')}")
    notes.append(f"rule: {res['rule']}; step ms: median of the steps after the warm-up; tokens/s: B x T over it; "
                 "peak (step): allocated during one step above its start; peak (total): the device's peak, weights "
                 "and optimizer state included (GPU only)")
    out += [""] + [("- " if markdown else "") + n for n in notes]
    return "\n".join(out)


def _table(head, body, markdown):
    if markdown:
        return (["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
                + ["| " + " | ".join(r) + " |" for r in body])
    widths = [max(len(h), *(len(r[k]) for r in body)) if body else len(h) for k, h in enumerate(head)]
    return ["  ".join(c.ljust(w) if k == 0 else c.rjust(w) for k, (c, w) in enumerate(zip(row, widths, strict=True)))
            for row in [head, *body]]


def plot(res: dict) -> str:
    from . import svg

    names = list(res["variants"])
    colors = {n: svg.PALETTE[k % len(svg.PALETTE)] for k, n in enumerate(names)}
    group = [f"{res['model']['model']}, {res['config']['dtype']}"]
    panels = []
    for key, label, conv in (("median_ms", "median step time, ms", lambda v: v),
                             ("peak_step_bytes", "peak MiB during a step", mib)):
        series = {n: [conv(res["variants"][n][key]) if res["variants"][n].get(key) is not None else None]
                  for n in names}
        labels = [["" if v[0] is None else show(v[0])] for v in series.values()]
        panels.append(svg.Panel("finetune", label, group, series, [], key != "median_ms", labels))
    return svg.figure([panels], colors, None)
