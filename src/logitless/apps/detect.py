"""The `logitless detect` command: the Binoculars score of text under two related local HF causal LMs.

Per document (docs/detect.md): the observer's mean negative log-likelihood of the text, ``nll = -mean_i log
p_obs(x_i | x_<i)``, the cross term ``cross_nll = mean_i -sum_j p_perf(j | x_<i) log p_obs(j | x_<i)`` (how
surprising the performer's next-token distribution is to the observer, in nats), and their ratio ``binoculars =
nll / cross_nll``. Both models run their backbones; their heads are computed by :func:`logitless.linear_log_probs`
and :func:`logitless.linear_soft_cross_entropy`, so neither model's logits are built. Documents longer than
``--max-length`` tokens are truncated (the score compares two numbers of one context; windows would mix contexts).
Reading the documents and writing the lines are documents.py's, model loading, tokenizing and the head check
model.py's: both shared with `logitless score`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

from . import files
from .documents import (
    FORMATS,
    NO_ID,
    ScoreError,
    all_documents,
    check_inputs,
    check_output,
    exp_or_inf,
    finite,
    first_document,
    json_floats,
    output_sink,
    scan,
)
from .documents import say as say_line
from .model import Model, describe, head_inputs, model_source, parse_dtype

# The length the Binoculars paper scores documents at (their tokens truncated to it).
_DEFAULT_MAX_LENGTH = 512


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="logitless detect",
        description="Binoculars score of each document under an observer and a performer model that share a "
                    "tokenizer: the observer's NLL, the cross-entropy of the performer's predictions under the "
                    "observer (cross_nll) and their ratio (lower: more typical of machine-generated text). No "
                    "logits tensor is built. Writes one JSON line per document, in input order.",
    )
    p.add_argument("files", nargs="+", metavar="FILE", help="input files; '-' reads standard input")
    p.add_argument("--observer", required=True, metavar="DIR",
                   help="local directory of the observer model and its tokenizer (its log-probs are scored)")
    p.add_argument("--performer", required=True, metavar="DIR",
                   help="local directory of the performer model (same tokenizer and vocabulary)")
    p.add_argument("--dtype", default="auto", type=parse_dtype,
                   help="bf16, fp16 or fp32; auto (default): bf16 on CUDA, fp32 elsewhere")
    p.add_argument("--device", default="auto", help="auto (default), cpu, cuda, cuda:N (both models)")
    p.add_argument("--batch-size", type=int, default=8, metavar="N", help="documents per forward pass (default 8)")
    p.add_argument("--max-length", type=int, default=None, metavar="L",
                   help=f"tokens per document, BOS included; longer documents are truncated (default "
                        f"{_DEFAULT_MAX_LENGTH}, or the models' maximum positions if fewer)")
    p.add_argument("--format", choices=FORMATS, default="auto",
                   help="text, lines, jsonl or auto, as in `logitless score`")
    p.add_argument("--text-field", default="text", metavar="NAME", help="JSONL field with the text (default: text)")
    p.add_argument("--id-field", default="id", metavar="NAME", help="JSONL field copied as 'id' (default: id)")
    p.add_argument("--per-token", action="store_true", help="also write token_ids, nlls and cross_nlls per token")
    p.add_argument("--output", "-o", default="-", metavar="FILE", help="output JSONL file (default: stdout)")
    p.add_argument("--no-clobber", "-n", action="store_true",
                   help="refuse to overwrite an existing --output file (checked before anything loads)")
    p.add_argument("--backend", choices=("auto", "triton", "torch"), default="auto",
                   help="backend of the head computations (default auto)")
    p.add_argument("--quiet", "-q", action="store_true", help="no summary on stderr")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        return _run(args)
    except ScoreError as e:
        print(f"logitless detect: error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _check_pair(obs: Model, perf: Model) -> None:
    """One tokenizer, one vocabulary, one logit transform: otherwise the cross term compares unrelated classes."""
    if obs.tokenizer.get_vocab() != perf.tokenizer.get_vocab():
        raise ScoreError("the observer's and the performer's tokenizers differ: Binoculars needs one tokenizer")
    if obs.vocab != perf.vocab:
        raise ScoreError(f"the observer's head has {obs.vocab} classes but the performer's has {perf.vocab}")
    if obs.transform != perf.transform:
        raise ScoreError(f"the models transform their logits differently ({describe(obs.transform)} / "
                         f"{describe(perf.transform)}); not supported")


def _run(args) -> int:
    if args.batch_size < 1:
        raise ScoreError(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.max_length is not None and args.max_length < 2:
        raise ScoreError(f"--max-length must be at least 2, got {args.max_length}")
    check_inputs(args.files)
    sources = [_source(path, flag) for path, flag in ((args.observer, "--observer"), (args.performer, "--performer"))]
    check_output(args)
    scan(args)  # every line checked, and an input without text refused, before anything loads
    docs = first_document(all_documents(args), args.files)
    sink = output_sink(args)  # renamed into place only when every document is scored
    say = None if args.quiet else (lambda message: say_line(message, "logitless detect"))
    n_docs = 0
    try:
        n_docs = _detect(args, sources, docs, sink, say)
    except files.OutputError as e:  # --no-clobber: the output appeared during the run
        raise ScoreError(str(e)) from None
    if not args.quiet:
        print(f"logitless detect: {n_docs} documents", file=sys.stderr)
    return 0


def _detect(args, sources, docs, sink, say) -> int:
    n_docs = 0
    with sink as out, torch.inference_mode():
        obs, perf = (Model(src, args.dtype, args.device, args.backend, say=say) for src in sources)
        if args.max_length is None:
            args.max_length = min([_DEFAULT_MAX_LENGTH] + [m.max_positions for m in (obs, perf)
                                                           if m.max_positions is not None])
        for m in (obs, perf):
            if m.max_positions is not None and args.max_length > m.max_positions:
                raise ScoreError(f"--max-length {args.max_length} exceeds a model's maximum positions "
                                 f"({m.max_positions})")
        _load(obs, perf)
        batch = []
        for doc in docs:
            batch.append(doc)
            if len(batch) == args.batch_size:
                n_docs += _write(out, batch, obs, perf, args)
                batch = []
        if batch:
            n_docs += _write(out, batch, obs, perf, args)
    return n_docs


def _source(path: str, flag: str):
    """score's model location (a model folder or a GGUF file), checked before anything loads, named by `flag`."""
    try:
        return model_source(argparse.Namespace(model=path, gguf=None))
    except ScoreError as e:
        raise ScoreError(str(e).replace("--model", flag)) from None


def _load(obs, perf) -> bool:
    """Both models' weights (and score's head check), then the pair's check: once, before the first batch."""
    obs.load()
    perf.load()
    _check_pair(obs, perf)
    return True


def _write(out, docs, obs, perf, args) -> int:
    ids_list = [ids[: args.max_length] for ids in obs.encode([d.text for d in docs])]
    results = score_batch(obs, perf, ids_list, args.backend)
    for doc, ids, (nll, xnll) in zip(docs, ids_list, results, strict=True):
        rec = {} if doc.id is NO_ID else {"id": doc.id}
        n = nll.numel()
        mean_nll = nll.double().mean().item() if n else math.nan
        mean_x = xnll.double().mean().item() if n else math.nan
        ratio = mean_nll / mean_x if n and mean_x != 0 else math.nan
        rec.update(source=doc.source, index=doc.index, num_tokens=n, nll=finite(mean_nll),
                   ppl=finite(exp_or_inf(mean_nll)), cross_nll=finite(mean_x),
                   binoculars=finite(ratio))
        if args.per_token:
            rec.update(token_ids=ids[1:], nlls=json_floats(nll), cross_nlls=json_floats(xnll))
        out.write(json.dumps(rec, allow_nan=False) + "\n")
        out.flush()
    return len(docs)


def score_batch(obs, perf, ids_list: list[list[int]], backend: str = "auto"):
    """Per document (float32 CPU tensors of its len(ids) - 1 scored tokens): the observer's NLL of each next token
    and the cross-entropy -sum_j p_perf(j) log p_obs(j) of each prediction."""
    from ..distill import linear_soft_cross_entropy
    from ..log_probs import linear_log_probs

    B, L = len(ids_list), max(len(ids) for ids in ids_list)
    if L < 2:  # no document of the batch has a token to score: no model runs
        return [(torch.zeros(0), torch.zeros(0)) for _ in ids_list]
    ids = torch.full((B, L), obs.pad, dtype=torch.long)
    mask = torch.zeros((B, L), dtype=torch.long)
    rows, cols, counts = [], [], []
    for b, doc in enumerate(ids_list):
        n = len(doc)
        ids[b, :n] = torch.tensor(doc, dtype=torch.long)
        mask[b, :n] = 1
        rows.extend([b] * max(n - 1, 0))
        cols.extend(range(n - 1))
        counts.append(max(n - 1, 0))
    dev = obs.device
    ids, mask = ids.to(dev), mask.to(dev)
    r, c = torch.tensor(rows, device=dev, dtype=torch.long), torch.tensor(cols, device=dev, dtype=torch.long)
    # One transform for both (_check_pair): the softcap and temperature of either are those of both heads.
    h_obs, b_obs, softcap, temperature = head_inputs(obs.head, obs.hidden(ids, mask)[r, c])
    h_perf, b_perf, _, _ = head_inputs(perf.head, perf.hidden(ids, mask)[r, c])
    targets = ids[r, c + 1]
    lp = linear_log_probs(h_obs, obs.weight, targets, linear_bias=b_obs, softcap=softcap, temperature=temperature,
                          backend=backend)
    x = linear_soft_cross_entropy(h_obs, obs.weight, h_perf, perf.weight, linear_bias=b_obs, target_bias=b_perf,
                                  softcap=softcap, temperature=temperature, backend=backend)
    nll = (-lp).float().cpu().split(counts)
    xnll = x.float().cpu().split(counts)
    return list(zip(nll, xnll, strict=True))
