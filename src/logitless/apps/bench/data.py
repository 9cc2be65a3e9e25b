"""Heads for tests and benchmarks: calibrated LM-like, uniform (initialisation), real (a pretrained model's).

lm:      what a trained model's last layer looks like, calibrated on a real one (Gemma 3 270M on standard-library
         text, docs/data.md): a prior shared by every row that falls with the class's frequency rank, a per-row
         spread around it that also falls with the rank, a few rare classes each row finds plausible, class ids
         loosely in frequency order; one temperature set for 2.0 nats of entropy, targets sampled from the
         softmax. Its entropy, loss and skip statistics (skip_stats) are the real head's within a few points.
lm-v1:   the previous generator: hidden states sums of 16 Zipf-drawn classifier rows, W ~ N(0, 1/D).
uniform: the head at initialisation: hidden states ~ N(0, 1) (what RMSNorm produces), W ~ N(0, 0.02^2) (the usual
         initializer_range), uniform random targets. The softmax is near-uniform: loss ~ log V.
real:    a pretrained model's head, hidden states and real next tokens (real.py), for the model's V only.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ...vocab import VocabOrder

KINDS = ("lm", "uniform", "real", "real-sorted", "lm-v1")
REAL_KINDS = ("real", "real-sorted")

# The calibrated `lm` generator, measured on Gemma 3 270M's head with its hidden states on 4096 tokens of
# standard-library text (docs/data.md). Its logits, centred per row, by the class's rank in the batch's
# probability mass: the mean over rows (the prior every row shares) and the std of a row's deviation from it.
LM_RANKS = (0, 3, 30, 300, 3000, 22000, 72000, 141000, 230000)  # rank points (log-interpolated between them)
LM_PRIOR = (14.9, 13.9, 10.6, 8.6, 5.7, 2.9, 1.15, -0.1, -3.6)  # nats, mean logit at those ranks
LM_NOISE = (5.5, 4.8, 4.7, 4.5, 4.1, 3.7, 3.1, 2.5, 2.3)  # nats, std of a row's logit around the prior
LM = {
    "offset": 1.6,  # nats, std of a per-class offset of the prior (classes of one rank differ)
    # Rare classes that a row finds plausible: K candidates per row drawn by Zipf(zipf) over the ranks, lifted
    # by peak * decay^k nats. Without them a row's tail is far colder than a real one's (the batch's mass beyond
    # the 10000 most likely classes would be 0.2%, not 0.8%).
    "K": 4, "peak": 20.0, "decay": 0.85, "zipf": 0.5,
    "peak_ranks": 0.25,  # share of the ranks (most frequent first) the candidates are drawn from
    "topic": 0.0,  # share of a row's noise common to its document of `doc` tokens (0: rows independent)
    "doc": 1024,
    "id_noise": 1.55,  # class ids follow log-rank up to this much noise (Spearman about 0.45 between id and rank)
    "reserved": 0.08,  # share of the rarest classes kept, in order, at the end of the ids (unused tokens)
    "entropy": 2.0,  # nats, mean entropy of the softmax (real: 2.0-2.2)
    "target_temp": 1.05,  # targets sampled from a flatter softmax: loss above entropy, as measured
}


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


def _interp_rank(rank: torch.Tensor, values) -> torch.Tensor:
    # Piecewise linear in log(1 + rank) through (LM_RANKS, values), flat outside.
    xp = torch.log1p(torch.tensor(LM_RANKS, dtype=torch.float32, device=rank.device))
    fp = torch.tensor(values, dtype=torch.float32, device=rank.device)
    x = torch.log1p(rank.float()).clamp(xp[0], xp[-1])
    i = torch.searchsorted(xp, x, right=True).clamp(1, len(xp) - 1)
    f = (x - xp[i - 1]) / (xp[i] - xp[i - 1])
    return fp[i - 1] + f * (fp[i] - fp[i - 1])


def lm_like(N: int, D: int, V: int, *, dtype=torch.bfloat16, device="cpu", seed: int = 0,
            target_loss: float = LM["entropy"], calib_rows: int = 128, **params) -> Head:
    """A trained model's head, calibrated on a real one (LM_* above, docs/data.md); O(N D + V D) memory."""
    p = {**LM, **params}
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    u = torch.randn(D, device=device, generator=gen)
    u /= u.norm()

    def off_u(a):  # the part of a's rows orthogonal to u: u carries the shared prior alone
        return a - (a @ u).unsqueeze(1) * u

    # Frequency ranks over the full vocabulary of a large model, squeezed into V classes when V is smaller.
    rank = torch.arange(V, device=device, dtype=torch.float32) * (262144 / max(V, 1))
    lr = torch.log1p(rank)
    # Class ids follow the ranks loosely (a tokenizer's ids are roughly in frequency order).
    # The rarest `reserved` share of the classes sits at the end of the ids, in order (a tokenizer's unused and
    # rare-script tokens); the others get ids that follow log-rank up to `id_noise` of noise.
    key = lr + p["id_noise"] * torch.randn(V, device=device, generator=gen)
    key = torch.where(rank >= (1 - p["reserved"]) * 262144, 1e3 + lr, key)
    rank_of_id = torch.argsort(torch.argsort(key))
    r = rank[rank_of_id]
    prior = _interp_rank(r, LM_PRIOR) + p["offset"] * torch.randn(V, device=device, generator=gen)
    spread = _interp_rank(r, LM_NOISE)
    g = off_u(torch.randn(V, D, device=device, generator=gen))
    g /= g.norm(dim=1, keepdim=True)
    w = spread.unsqueeze(1) * g + prior.unsqueeze(1) * u  # W_j = spread_j g_j + prior_j u, g_j a unit vector
    # Hidden state: u (the prior) + noise n_i with n_i . g_j ~ N(0, 1), a share of it common to its document.
    noise = torch.randn(N, D, device=device, generator=gen)
    if p["topic"] > 0:
        docs = -(-N // int(p["doc"]))
        common = torch.randn(docs, D, device=device, generator=gen).repeat_interleave(int(p["doc"]), 0)[:N]
        noise = math.sqrt(1 - p["topic"]) * noise + math.sqrt(p["topic"]) * common
    h = u.unsqueeze(0) + off_u(noise)
    K = int(p["K"])
    if K > 0:  # explicit peaks: K candidates drawn by Zipf over the ranks, `peak` nats each, decaying
        id_of_rank = torch.argsort(rank_of_id)
        span = max(1, min(V, round(p["peak_ranks"] * V)))
        cand = id_of_rank[_zipf_sample(N * K, span, gen, device, s=p["zipf"]).view(N, K)]
        for k in range(K):  # one candidate at a time: O(N D) memory
            h += (p["peak"] * p["decay"] ** k) * g[cand[:, k]] / spread[cand[:, k]].unsqueeze(1)
    rows = torch.arange(0, N, max(1, N // calib_rows), device=device)[:calib_rows]
    z = h[rows] @ w.T
    lo, hi = 0.0, 8.0
    for _ in range(24):  # one temperature for all logits: the mean entropy falls as it grows
        mid = 0.5 * (lo + hi)
        if _entropy(z * mid).mean().item() > target_loss:
            lo = mid
        else:
            hi = mid
    scale = 0.5 * (lo + hi)
    del z
    h *= scale
    # Targets drawn from a slightly flatter softmax than the head's: a real model is not perfectly calibrated on
    # the text it scores, its loss exceeds its entropy.
    t = _sample_targets(h / p["target_temp"], w, gen, max(1, (1 << 24) // V))
    topic = f", topic share {p['topic']:g} per {int(p['doc'])} tokens" if p["topic"] > 0 else ""
    desc = (f"lm: logits = a prior by frequency rank + per-row noise, both as measured on a real model's head "
            f"(docs/data.md){topic}, x {scale:.3f} for "
            f"{target_loss:g} nats of entropy; targets sampled at temperature {p['target_temp']:g}")
    return Head(h.to(dtype), w.to(dtype), t, desc)


def lm_like_v1(N: int, D: int, V: int, *, dtype=torch.bfloat16, device="cpu", seed: int = 0,
               target_loss: float = 2.5, calib_rows: int = 256) -> Head:
    """The previous `lm` generator (its rows' tails spread evenly over the vocabulary: nothing skippable)."""
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


def real_source(V: int, data_file=None, cache_dir=None) -> dict:
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
              cache_dir=None, sorted_vocab: bool = False) -> Head:
    """A pretrained model's head on real text (see real.py): the first N tokens, lifted to D; V must be the model's.

    sorted_vocab: the head's rows (and the targets) in order of decreasing softmax mass over the prepared tokens
    that are not in the batch (the tokens after the first N; the batch itself when fewer than min(N, 1024) are
    left): the
    same losses and gradients (up to the permutation), with the vocabulary stored as a module that keeps its
    classes in the order of earlier batches' mass would store it."""
    from . import real

    src = real_source(V, data_file, cache_dir)
    why = real.serves(src["V"], src["D"], src["input"].shape[0], N, D, V)
    if why:
        raise ValueError(f"shape (N={N}, D={D}, V={V}): {why}")
    device = torch.device(device)
    x = src["input"][:N].to(device)
    w = src["weight"].to(device)
    target = src["target"][:N].to(device)
    desc = real.describe(src, D)
    if sorted_vocab:
        held_out = src["input"].shape[0] - N >= min(1024, N)
        held = src["input"][N:] if held_out else src["input"][:N]
        order = VocabOrder.by_mass(held.to(device), w)
        w = order.sort(w)
        target = order.map_ids(target)
        where = "held-out tokens" if held_out else "the batch itself (too few tokens left out)"
        desc += f"; vocabulary sorted by softmax mass over {where}"
    x, w = real.lift(x, w, D, seed=seed, dtype=dtype)
    return Head(x, w, target, desc)


def make_head(kind: str, N: int, D: int, V: int, *, data_file=None, cache_dir=None, **kw) -> Head:
    if kind == "lm":
        return lm_like(N, D, V, **kw)
    if kind == "uniform":
        return uniform(N, D, V, **kw)
    if kind == "lm-v1":
        return lm_like_v1(N, D, V, **kw)
    if kind in REAL_KINDS:
        return real_head(N, D, V, data_file=data_file, cache_dir=cache_dir, sorted_vocab=kind == "real-sorted", **kw)
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
