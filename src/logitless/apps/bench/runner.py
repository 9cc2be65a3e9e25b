"""Runs every (case, provider): the correctness gate, then memory and time per phase; collects the results.

Cases that share a head (same shape, dtype and data kind) run one after the other, so each head is built once.
Every failure is contained to its provider and phase: out-of-memory is reported as "OOM", an exception as
"error" with its message, a run longer than the limit as "too slow", a check that fails as "failed check" (and
then the provider is not timed unless asked).
"""

from __future__ import annotations

import gc
import math
import time
from dataclasses import dataclass, field

import torch

from ... import skip_gate
from . import cases as C
from .check import Comparison, Reference
from .measure import TooSlow, peak_extra_bytes, time_step, warm_up
from .providers import Provider


@dataclass
class Options:
    device: torch.device
    budget_s: float = 1.0  # time spent on the timed repetitions of one phase, about
    min_reps: int = 3
    max_reps: int = 100
    warmup: int = 3
    max_iter_s: float = 30.0
    check_rows: int = 512
    time_failing: bool = False
    seed: int = 0
    progress: bool = True
    data_file: str | None = None  # --data real: the prepared file (or its parts)
    cache_dir: str | None = None  # --data real without a file: where it is prepared and kept
    skipped: list[str] = field(default_factory=list)  # cases left out because their data cannot serve them


@dataclass
class PhaseResult:
    phase: str
    status: str  # "ok", "OOM", "error", "too slow", "not timed"
    error: str = ""
    total_ms: float = math.nan
    fwd_ms: float = math.nan
    bwd_ms: float = math.nan
    reps: int = 0
    peak_bytes: float = math.nan
    rate: float = math.nan  # TFLOP/s (train, logprobs) or GB/s (ce)
    x_ours: float = math.nan
    x_floor: float = math.nan
    grads_in_forward: bool = False  # the provider's forward computed the gradients (its "bwd" only hands them over)
    # Share of the (token block, tile) pairs the last skipping plan of the timed calls skipped (logitless's
    # skip_threshold; NaN where no plan was made: the dense plans, or a peer).
    skipped: float = math.nan
    # Whether the gate of skip_threshold="auto" ran the timed calls skipping ("skip") or dense ("dense", the share
    # above then its last probe's); "" where no gate kept a record.
    skip_state: str = ""


@dataclass
class Result:
    case: C.Case
    provider: str
    status: str  # "ok", "failed check", "error", "OOM"
    error: str = ""
    checks: list[Comparison] = field(default_factory=list)
    phases: dict[str, PhaseResult] = field(default_factory=dict)
    wall_s: float = math.nan  # seconds spent on this provider and case: check, compilation, warm-up, timing


@dataclass
class Run:
    results: list[Result]
    data: dict[str, str]  # data kind -> how it was built
    case_notes: dict[C.Case, str]  # e.g. the float64 loss on the checked rows
    ours: dict[str, str]  # job -> provider name whose times are the "x ours" denominators
    unavailable: dict[str, str]  # provider -> reason (for the jobs asked)


def _is_oom(e: BaseException) -> bool:
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return True
    return isinstance(e, RuntimeError) and ("out of memory" in str(e).lower() or "can't allocate" in str(e))


def _short(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().replace("\n", " ")
    return text if len(text) <= 300 else text[:297] + "..."


def _free(device):
    # Hand cached blocks back between providers so that one's cache does not become another's OOM. A full
    # collection costs ~0.1 s with torch imported, so it is done only where the memory matters.
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def ours_name(job: str, device: torch.device) -> str:
    from ..._dispatch import resolve_backend

    try:
        return f"logitless-{resolve_backend('auto', device, C.JOB_OP[job])}"
    except Exception:  # noqa: BLE001 - a broken environment variable is reported by the provider itself
        return "logitless-torch"


def run(cases: list[C.Case], providers: list[Provider], opts: Options, log=print) -> Run:
    device = opts.device
    heads = C.Heads(device, opts.seed, opts.data_file, opts.cache_dir)
    work = []  # (case, providers that can run it)
    unavailable: dict[str, str] = {}
    for case in cases:
        ps = []
        for p in providers:
            if case.job not in p.jobs:
                continue
            reason = p.unavailable(case.job, device)
            if reason:
                unavailable.setdefault(p.name, reason)
            else:
                ps.append(p)
        work.append((case, ps))
    order = sorted(range(len(work)), key=lambda i: (work[i][0].shape.N, work[i][0].shape.D, work[i][0].shape.V,
                                                    work[i][0].dtype, work[i][0].data, i))
    bar = _progress(sum(len(ps) for _, ps in work), opts.progress)
    results: list[Result] = []
    data_desc: dict[str, str] = {}
    notes: dict[C.Case, str] = {}
    for i in order:
        case, ps = work[i]
        s = case.shape
        try:
            head = heads.get(case.data, s, case.dtype)
        except Exception as e:  # noqa: BLE001 - e.g. real data that is missing or has too few tokens
            msg = f"data {case.data} unavailable: {_short(e)}"
            log(f"{case.label}: {msg}")
            results += [Result(case, p.name, "OOM" if _is_oom(e) else "error", msg) for p in ps]
            bar.update(len(ps))
            _free(device)
            continue
        if case.data not in data_desc:
            data_desc[case.data] = head.description
            log(f"data {head.description}")
        check_inp = C.make_inputs(case.job, head, rows=slice(0, min(s.N, opts.check_rows)), seed=opts.seed)
        phases = C.PHASES[case.job]
        try:
            ref = Reference(case.job, check_inp, phases)
        except Exception as e:  # noqa: BLE001 - without a reference nothing of this case can be judged
            msg = f"float64 reference failed: {_short(e)}"
            results += [Result(case, p.name, "OOM" if _is_oom(e) else "error", msg) for p in ps]
            bar.update(len(ps))
            _free(device)
            continue
        notes[case] = _describe_truth(case, ref, check_inp)
        inp = C.make_inputs(case.job, head, seed=opts.seed)
        for p in ps:
            bar.set_description(f"{case.job} {s.name} {case.data} {p.name}")
            t0 = time.perf_counter()
            results.append(_run_one(p, case, inp, ref, opts))
            results[-1].wall_s = time.perf_counter() - t0
            bar.update(1)
            _free(device)
        del inp, ref, check_inp
        _free(device)
    bar.close()
    ours = {job: ours_name(job, device) for job in {c.job for c in cases}}
    _ratios(results, ours)
    # Report in the order asked, not in the order run.
    rank = {c: k for k, c in enumerate(cases)}
    results.sort(key=lambda r: rank[r.case])
    return Run(results, data_desc, notes, ours, unavailable)


def _describe_truth(case: C.Case, ref: Reference, inp: C.Inputs) -> str:
    n = inp.t.shape[0]
    if case.job == "logprobs":
        return f"mean -log p(target) on the {n} checked rows: {-ref.truth_value('no-grad'):.3f} nats (float64)"
    return f"mean loss on the {n} checked rows: {ref.truth_value(C.PHASES[case.job][0]):.3f} nats (float64)"


def _leaves(job: str, inp: C.Inputs):
    return [inp.logits] if job == "ce" else [inp.x, inp.w]


def _run_one(p: Provider, case: C.Case, inp: C.Inputs, ref: Reference, opts: Options) -> Result:
    res = Result(case, p.name, "ok")
    if p.kind != "floor":
        try:
            res.checks = ref.compare(p.fn(case.job))
        except Exception as e:  # noqa: BLE001 - a provider that cannot run the check is reported, not timed
            res.status, res.error = ("OOM" if _is_oom(e) else "error"), _short(e)
            return res
        bad = [c for c in res.checks if not c.ok]
        if bad:
            res.status = "failed check"
            res.error = "; ".join(str(c) for c in bad)
            if not opts.time_failing:
                for phase in C.PHASES[case.job]:
                    res.phases[phase] = PhaseResult(phase, "not timed")
                return res
    for phase in C.PHASES[case.job]:
        res.phases[phase] = _run_phase(p, case, inp, phase, opts)
    if res.status == "ok" and any(r.status == "OOM" for r in res.phases.values()):
        res.status = "OOM"
    return res


def _run_phase(p: Provider, case: C.Case, inp: C.Inputs, phase: str, opts: Options) -> PhaseResult:
    grad = phase == "fwd+bwd"
    leaves = _leaves(case.job, inp)
    for leaf in leaves:
        leaf.grad = None
        leaf.requires_grad_(grad)

    def prepare():
        for leaf in leaves:
            leaf.grad = None
        if inp.pristine is not None:  # in-place providers overwrite the logits with their gradient
            with torch.no_grad():
                inp.logits.copy_(inp.pristine)

    out = PhaseResult(phase, "ok")
    skip_gate.forget()  # each provider finds for itself whether skipping pays on this data
    try:
        with torch.set_grad_enabled(grad):
            step = p.step(case.job, inp, grad)
            out.grads_in_forward = grad and p.grads_in_forward(case.job, inp)
            est = warm_up(step, prepare, opts.device, opts.warmup, opts.max_iter_s)
            out.peak_bytes = peak_extra_bytes(step, prepare, opts.device, inp.tensors(), leaves)
            t = time_step(step, prepare, opts.device, est_s=est, budget_s=opts.budget_s, min_reps=opts.min_reps,
                          max_reps=opts.max_reps)
        out.total_ms, out.fwd_ms, out.bwd_ms, out.reps = t.total_ms, t.fwd_ms, t.bwd_ms, t.reps
        share = skip_gate.last_share(inp.w) if inp.w is not None else None
        out.skipped = math.nan if share is None else share
        out.skip_state = (skip_gate.state(inp.w) or "") if share is not None else ""
        if case.job == "ce":
            out.rate = C.min_bytes(case.job, phase, case.shape, case.dtype) / (t.total_ms * 1e-3) / 1e9
        else:
            out.rate = C.flops(case.job, phase, case.shape) / (t.total_ms * 1e-3) / 1e12
    except TooSlow as e:
        out.status, out.error = "too slow", str(e)
    except Exception as e:  # noqa: BLE001 - contained to this provider and phase
        out.status, out.error = ("OOM" if _is_oom(e) else "error"), _short(e)
    finally:
        for leaf in leaves:
            leaf.grad = None
            leaf.requires_grad_(False)
        prepare()
    return out


def _ratios(results: list[Result], ours: dict[str, str]) -> None:
    by_case: dict[C.Case, dict[str, Result]] = {}
    for r in results:
        by_case.setdefault(r.case, {})[r.provider] = r
    for case, rs in by_case.items():
        for phase in C.PHASES[case.job]:
            o = rs.get(ours[case.job])
            f = rs.get("floor")
            o_ms = o.phases[phase].total_ms if o and phase in o.phases else math.nan
            f_ms = f.phases[phase].total_ms if f and phase in f.phases else math.nan
            for r in rs.values():
                pr = r.phases.get(phase)
                if pr is not None:
                    pr.x_ours = pr.total_ms / o_ms if o_ms > 0 else math.nan
                    pr.x_floor = pr.total_ms / f_ms if f_ms > 0 else math.nan


class _NoBar:
    def update(self, n=1):
        pass

    def set_description(self, text):
        pass

    def close(self):
        pass


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, unit="run", dynamic_ncols=True, leave=False)
