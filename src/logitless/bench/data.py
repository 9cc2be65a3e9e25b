"""Synthetic heads for tests and benchmarks: LM-like (peaked softmax, Zipf targets) and uniform (initialisation).

lm:      what a trained model's last layer looks like. Classifier rows W_j ~ N(0, 1/D) (unit norm on average).
         Token frequencies follow Zipf's law (p(rank k) ~ 1/k^1.1) over a random permutation of the vocabulary.
         Each hidden state is a weighted sum of the classifier rows of 16 distinct "plausible next tokens" drawn
         from that Zipf law (weights falling linearly from 1 to 0.8). The overall scale is found by bisection
         on a sample of rows so that the mean entropy of the softmax is `target_loss` nats (2.5 by default),
         and each target is then sampled from that softmax (a calibrated model), so the expected loss is 2.5
         nats too: most of each row's probability sits on a handful of tokens, and frequent tokens hold most of
         the mass, as in a real LM.
uniform: the head at initialisation: hidden states ~ N(0, 1) (what RMSNorm produces), W ~ N(0, 0.02^2) (the usual
         initializer_range), uniform random targets. The softmax is near-uniform: loss ~ log V.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

KINDS = ("lm", "uniform", "real")


class Head(NamedTuple):
    input: torch.Tensor  # (N, D)
    weight: torch.Tensor  # (V, D)
    target: torch.Tensor  # (N,) int64
    description: str


def _zipf_sample(n: int, V: int, gen: torch.Generator, device, s: float = 1.1) -> torch.Tensor:
    # Inverse-CDF sampling of ranks 1..V with p(k) ~ k^-s, in float64 for the large-V tail.
    k = torch.arange(1, V + 1, dtype=torch.float64, device=device)
    cdf = torch.cumsum(k.pow(-s), 0)
    cdf /= cdf[-1].clone()
    u = torch.rand(n, dtype=torch.float64, device=device, generator=gen)
    return torch.searchsorted(cdf, u).clamp_(max=V - 1)


def _entropy(z: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(z.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def _sample_targets(h: torch.Tensor, w: torch.Tensor, gen: torch.Generator, rows_per_chunk: int) -> torch.Tensor:
    # Gumbel-max sampling from softmax(h @ w.T), a few rows at a time so the logits never exist whole.
    out = []
    for i in range(0, h.shape[0], rows_per_chunk):
        z = h[i:i + rows_per_chunk].float() @ w.float().T
        u = torch.rand(z.shape, device=z.device, generator=gen).clamp_(min=1e-20)
        out.append(torch.argmax(z - torch.log(-torch.log(u)), dim=-1))
    return torch.cat(out)


def lm_like(N: int, D: int, V: int, *, dtype=torch.bfloat16, device="cpu", seed: int = 0,
            target_loss: float = 2.5, calib_rows: int = 256) -> Head:
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(V, D, device=device, generator=gen) / math.sqrt(D)
    perm = torch.randperm(V, device=device, generator=gen)  # rank -> token id
    K = 16
    ranks = _zipf_sample(N * K, V, gen, device).view(N, K).sort(dim=1).values
    dup = torch.zeros_like(ranks, dtype=torch.bool)
    dup[:, 1:] = ranks[:, 1:] == ranks[:, :-1]
    # A repeated candidate would sum its weights and dominate the row; replace repeats by random tokens.
    ranks = torch.where(dup, torch.randint(0, V, ranks.shape, device=device, generator=gen), ranks)
    ranks = ranks[:, torch.randperm(K, device=device, generator=gen)]
    coef = 1.0 - 0.2 * torch.arange(K, device=device) / (K - 1)
    base = torch.zeros(N, D, device=device)
    for k in range(K):  # sum of weighted classifier rows, one candidate at a time to stay O(N D) in memory
        base += coef[k] * w[perm[ranks[:, k]]]
    rows = torch.arange(0, N, max(1, N // calib_rows), device=device)[:calib_rows]
    lo, hi = 0.0, 256.0
    for _ in range(30):  # the mean entropy falls as the scale grows
        mid = 0.5 * (lo + hi)
        if _entropy((base[rows] * mid) @ w.T).mean().item() > target_loss:
            lo = mid
        else:
            hi = mid
    scale = 0.5 * (lo + hi)
    h = base * scale
    # Targets drawn from the head's own softmax: a calibrated model, so the expected loss is the entropy.
    t = _sample_targets(h, w, gen, max(1, (1 << 24) // V))
    desc = (f"lm: hidden = {scale:.2f} * sum of the classifier rows of 16 distinct Zipf(1.1)-drawn tokens "
            f"(weights 1..0.8); targets sampled from the softmax; scale set for {target_loss} nats of entropy")
    return Head(h.to(dtype), w.to(dtype), t, desc)


def uniform(N: int, D: int, V: int, *, dtype=torch.bfloat16, device="cpu", seed: int = 0) -> Head:
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    h = torch.randn(N, D, device=device, generator=gen)
    w = torch.randn(V, D, device=device, generator=gen) * 0.02
    t = torch.randint(0, V, (N,), device=device, generator=gen)
    return Head(h.to(dtype), w.to(dtype), t, "uniform: hidden ~ N(0,1), W ~ N(0, 0.02^2), uniform targets")


_loaded: dict = {}  # the last real-data file read: the cases of one run share it


def _real_source(V: int, data_file=None, cache_dir=None) -> dict:
    """The prepared real data for vocabulary V: `data_file`, or the cache (prepared there on first use)."""
    from . import real

    if data_file is not None:
        key = ("file", str(data_file))
        if key not in _loaded:
            _loaded.clear()
            _loaded[key] = real.load(data_file)
        return _loaded[key]
    model = real.model_for(V)
    key = ("cache", model, str(cache_dir))
    if key not in _loaded:
        _loaded.clear()
        _loaded[key] = real.load(real.cached(model, cache_dir))
    return _loaded[key]


def real_head(N: int, D: int, V: int, *, dtype=torch.bfloat16, device="cpu", seed: int = 0, data_file=None,
              cache_dir=None) -> Head:
    """A pretrained model's head on real text (see real.py): the first N tokens, lifted to D; V must be the model's."""
    from . import real

    src = _real_source(V, data_file, cache_dir)
    why = real.serves(src["V"], src["D"], src["input"].shape[0], N, D, V)
    if why:
        raise ValueError(f"shape (N={N}, D={D}, V={V}): {why}")
    device = torch.device(device)
    x = src["input"][:N].to(device)
    w = src["weight"].to(device)
    x, w = real.lift(x, w, D, seed=seed, dtype=dtype)
    return Head(x, w, src["target"][:N].to(device), real.describe(src, D))


def make_head(kind: str, N: int, D: int, V: int, *, data_file=None, cache_dir=None, **kw) -> Head:
    if kind == "lm":
        return lm_like(N, D, V, **kw)
    if kind == "uniform":
        return uniform(N, D, V, **kw)
    if kind == "real":
        return real_head(N, D, V, data_file=data_file, cache_dir=cache_dir, **kw)
    raise ValueError(f"unknown data kind {kind!r}; expected one of {KINDS}")


THRESHOLDS = (2.0**-12, 2.0**-8, 2.0**-6)


def skip_stats(x: torch.Tensor, w: torch.Tensor, target: torch.Tensor | None = None, *, rows: int = 128,
               cols: int = 256, thresholds=THRESHOLDS, chunk_rows: int | None = None) -> dict:
    """How much of a head's backward could skip, from the exact per-row softmax masses of (rows x cols) pairs.

    The batch is cut into blocks of `rows` consecutive tokens (a partial last block is left out) and the vocabulary
    into tiles of `cols` classes (the last one may be partial), in two orders: the identity (class ids as they are)
    and the vocabulary sorted by the batch's total probability mass, largest first. A row's mass in a pair is the
    sum of its softmax over the tile's classes. For each order:

      cold    fraction of pairs in which every row's mass is <= thresholds[0];
      skip    for each threshold t, the fraction of pairs a backward could skip while each row's skipped mass, in
              total over its block's skipped tiles, stays <= t: per block, tiles taken greedily in increasing order
              of their largest row mass, as long as every row's running total stays within t.

    Also the mean loss (when `target` is given) and the mean entropy, in nats. Float64 sums over float32 softmaxes
    of `rows` rows at a time: the N x V logits never exist whole (memory O(rows x V)), so small N runs on a CPU.
    """
    N, V = x.shape[0], w.shape[0]
    nb = N // rows
    if nb < 1:
        raise ValueError(f"skip_stats needs at least rows = {rows} tokens, got N = {N}")
    T = -(-V // cols)
    wf = w.float()
    step = chunk_rows or rows

    def softmax_block(i):
        z = x[i:i + step].float() @ wf.T
        lse = torch.logsumexp(z, dim=-1, keepdim=True)
        return z, lse

    loss = ent = 0.0
    colmass = torch.zeros(V, dtype=torch.float64, device=x.device)
    for i in range(0, nb * rows, step):
        z, lse = softmax_block(i)
        p = torch.exp(z - lse)
        colmass += p.sum(0, dtype=torch.float64)
        ent += (lse.squeeze(1).double() - (p.double() * z.double()).sum(-1)).sum().item()
        if target is not None:
            zt = z.gather(1, target[i:i + step].view(-1, 1).to(z.device))
            loss += (lse - zt).double().sum().item()
    n = nb * rows
    perm = torch.argsort(colmass, descending=True)
    pad = T * cols - V
    acc = {o: {"cold": 0, "skip": [0] * len(thresholds)} for o in ("identity", "sorted")}
    for b in range(nb):
        z = x[b * rows:(b + 1) * rows].float() @ wf.T
        p = torch.exp(z - torch.logsumexp(z, dim=-1, keepdim=True))
        for order, q in (("identity", p), ("sorted", p[:, perm])):
            if pad:
                q = torch.nn.functional.pad(q, (0, pad))
            m = q.view(rows, T, cols).sum(-1, dtype=torch.float64)  # (rows, T): each row's mass per tile
            top = m.max(0).values
            acc[order]["cold"] += int((top <= thresholds[0]).sum())
            run = m[:, torch.argsort(top)].cumsum(1).max(0).values  # the worst row's running skipped mass
            for k, t in enumerate(thresholds):
                acc[order]["skip"][k] += int((run <= t).sum())
    pairs = nb * T
    out = {"N": n, "V": V, "rows": rows, "cols": cols, "thresholds": list(thresholds), "entropy": ent / n}
    if target is not None:
        out["loss"] = loss / n
    for order, a in acc.items():
        out[order] = {"cold": a["cold"] / pairs, "skip": [s / pairs for s in a["skip"]]}
    return out


def format_stats(s: dict) -> str:
    """One line per order: the figures of skip_stats in percent."""
    ts = "/".join(f"2^{round(math.log2(t))}" for t in s["thresholds"])
    head = f"N={s['N']} V={s['V']} {s['rows']}x{s['cols']}: loss {s.get('loss', math.nan):.3f} entropy " \
           f"{s['entropy']:.3f} nats"
    lines = [head]
    for order in ("identity", "sorted"):
        o = s[order]
        lines.append(f"  {order:8s} cold {100 * o['cold']:.1f}%  skip at {ts}: "
                     + " / ".join(f"{100 * v:.1f}" for v in o["skip"]) + "%")
    return "\n".join(lines)
