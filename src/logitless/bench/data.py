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

KINDS = ("lm", "uniform")


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


def make_head(kind: str, N: int, D: int, V: int, **kw) -> Head:
    if kind == "lm":
        return lm_like(N, D, V, **kw)
    if kind == "uniform":
        return uniform(N, D, V, **kw)
    raise ValueError(f"unknown data kind {kind!r}; expected one of {KINDS}")
