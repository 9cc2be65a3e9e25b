"""The peers `logitless bench` compares logitless with, each built for one job: PyTorch eager, torch.compile of
it and F.linear_cross_entropy; Liger-Kernel; Cut Cross-Entropy (providers.py registers them).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ... import testing

# ---------------------------------------------------------------------------------------------------------------
# PyTorch: eager, torch.compile, F.linear_cross_entropy


EAGER = {
    "train": lambda x, w, t: testing.naive_linear_cross_entropy(x, w, t),
    "logprobs": lambda x, w, t: testing.naive_linear_log_probs(x, w, t),
    "ce": lambda logits, t: testing.naive_cross_entropy(logits, t),
    "distill": lambda x, w, xt, wt, t: naive_jsd(x, w, xt, wt, t),
}


def naive_jsd(x, w, xt, wt, t, upcast=True):
    from ...testing import naive_two_heads

    return naive_two_heads(x, w, xt, wt, kind="jsd", beta=0.5, target=t, upcast=upcast)


def compile_eager(job: str) -> Callable:
    import torch._dynamo as dynamo

    # One compilation per (D, V) and grad mode: the token count is marked dynamic so that the check slice and the
    # full batch share a graph, and automatic dynamic shapes are off so that D and V stay static as a model's are.
    dynamo.config.automatic_dynamic_shapes = False
    for knob in ("cache_size_limit", "recompile_limit"):
        if hasattr(dynamo.config, knob):
            setattr(dynamo.config, knob, max(64, getattr(dynamo.config, knob)))
    compiled = torch.compile(EAGER[job])

    def fn(*args):
        dynamo.maybe_mark_dynamic(args[0], 0)
        dynamo.maybe_mark_dynamic(args[-1], 0)
        return compiled(*args)

    return fn


def torch_lce_unavailable(job, device):
    if not hasattr(F, "linear_cross_entropy") or not hasattr(torch.nn, "LinearCrossEntropyOptions"):
        return f"torch.nn.functional.linear_cross_entropy needs torch >= 2.13 (installed: {torch.__version__})"
    return None


def torch_lce(job: str) -> Callable:
    opts = torch.nn.LinearCrossEntropyOptions()  # the chunked path, chunking and precision policy on "auto"
    if job == "train":
        return lambda x, w, t: F.linear_cross_entropy(x, w, t, options=opts)
    return lambda x, w, t: -F.linear_cross_entropy(x, w, t, reduction="none", options=opts)


# ---------------------------------------------------------------------------------------------------------------
# Liger-Kernel and Cut Cross-Entropy


def liger(job: str, accum_dtype=None, chunk_mem_const=None) -> Callable:
    if job == "train" and chunk_mem_const is not None:
        # The chunk size is an option of Liger's functional form only.
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        return lambda x, w, t: liger_fused_linear_cross_entropy(x, w, t, accum_dtype=accum_dtype,
                                                                chunk_mem_const=chunk_mem_const)
    if job == "train":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        mod = LigerFusedLinearCrossEntropyLoss(accum_dtype=accum_dtype)
        return lambda x, w, t: mod(w, x, t)  # Liger takes the weight first
    from liger_kernel.transformers import LigerCrossEntropyLoss

    mod = LigerCrossEntropyLoss()
    return lambda logits, t: mod(logits, t)


def liger_jsd(job: str) -> Callable:
    from liger_kernel.transformers import LigerFusedLinearJSD

    # Liger's jsd_beta is our beta. Older releases take no ignore_index and no labels (the job's targets ignore
    # no row, so the loss is the same).
    kw = {"ignore_index": -100} if "ignore_index" in inspect.signature(LigerFusedLinearJSD).parameters else {}
    mod = LigerFusedLinearJSD(jsd_beta=0.5, temperature=1.0, **kw)
    if "shift_labels" in inspect.signature(mod.forward).parameters:
        return lambda x, w, xt, wt, t: mod(x, w, xt, wt, t)
    return lambda x, w, xt, wt, t: mod(x, w, xt, wt)


def cce(impl: str, job: str, **kw) -> Callable:
    from cut_cross_entropy import linear_cross_entropy

    if job == "train":
        return lambda x, w, t: linear_cross_entropy(x, w, t, impl=impl, **kw)
    return lambda x, w, t: -linear_cross_entropy(x, w, t, reduction="none", impl=impl, **kw)
