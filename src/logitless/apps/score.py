"""The `logitless score` command: per-token log-probs, NLL and perplexity of text under a local causal LM.

The model is a local Hugging Face checkpoint folder or a GGUF file (dequantized by transformers). Pipeline: check
the arguments, the output path and every input line -> load the tokenizer and the config, check the windows ->
load the weights in the requested dtype as transformers does (never cast afterwards: buffers such as RoPE's
``inv_freq`` keep their float32) -> read documents (plain text, one per file or per line, or JSONL) -> tokenize
with the model's own tokenizer (prepending BOS where the tokenizer has one and did not add it) -> cut documents
longer than ``--max-length`` into strided windows -> sort the windows of a buffer of documents by length and batch
them, right-padded -> run the model's backbone -> compute log p(token) (and the entropy) of the scored positions
only with :func:`logitless.linear_log_probs`, so no (tokens x vocabulary) logits tensor is ever built -> write one
JSON line per document, in input order, to a temporary file renamed over ``--output`` when the run succeeds.
``docs/score.md`` explains each choice; ``main(argv)`` is the entry point. The documents are read and written by
documents.py, the model is loaded by model.py (both shared with `logitless detect`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Iterator

import torch

from . import files
from .documents import (
    FORMATS,
    NO_ID,
    Document,
    ScoreError,
    all_documents,
    buffers,
    check_inputs,
    check_output,
    exp_or_inf,
    finite,
    first_document,
    json_floats,
    output_sink,
    say,
    scan,
)
from .model import Model, Window, model_source, parse_dtype

_DEFAULT_MAX_LENGTH = 4096
# Documents are sorted by length (less padding) within buffers of this many documents (or 4 x --batch-size, if
# more) or characters: enough to fill batches well, small enough that output streams and a buffer's token ids
# (Python lists) stay ~100s of MB. Read at each run: tests set them lower to make several buffers of a few documents.
BUFFER_DOCS = 1024
BUFFER_CHARS = 1 << 23


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="logitless score",
        description="Score text with a local causal LM (a Hugging Face folder or a GGUF file): per document, the "
                    "token count, mean negative log-likelihood (nats) and perplexity, and with --per-token each "
                    "token's log-prob and the entropy of the prediction. The head is computed with "
                    "logitless.linear_log_probs: no logits tensor. Writes one JSON line per document, in input "
                    "order.",
    )
    p.add_argument("files", nargs="+", metavar="FILE", help="input files; '-' reads standard input")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", metavar="DIR|FILE.gguf",
                     help="local folder with the model and its tokenizer (what save_pretrained writes), or a GGUF "
                          "file (model and tokenizer in one; needs the gguf package); nothing is downloaded")
    src.add_argument("--gguf", metavar="FILE", help="a GGUF file, whatever its name ends with (like --model FILE.gguf)")
    p.add_argument("--dtype", default="auto", type=parse_dtype,
                   help="bf16, fp16 or fp32; auto (default): bf16 on CUDA (fp16 where bf16 is unsupported), "
                        "fp32 elsewhere (a CPU computes bf16 no faster than fp32, and less accurately)")
    p.add_argument("--device", default="auto", help="auto (default: cuda if available, else cpu), cpu, cuda, cuda:N")
    p.add_argument("--batch-size", type=int, default=8, metavar="N", help="windows per forward pass (default 8)")
    p.add_argument("--max-length", type=int, default=None, metavar="L",
                   help=f"tokens per window, BOS included (default: the model's maximum positions, at most "
                        f"{_DEFAULT_MAX_LENGTH}); longer documents are scored in strided windows")
    p.add_argument("--stride", type=int, default=None, metavar="S",
                   help="new tokens scored per window after the first (default: half a window); every such token "
                        "sees at least L - S (- 1 with BOS) tokens of the document before it")
    p.add_argument("--format", choices=FORMATS, default="auto",
                   help="text: one document per file; lines: one per line; jsonl: one JSON object per line; "
                        "auto (default): jsonl for *.jsonl / *.ndjson, text otherwise")
    p.add_argument("--text-field", default="text", metavar="NAME", help="JSONL field with the text (default: text)")
    p.add_argument("--id-field", default="id", metavar="NAME",
                   help="JSONL field copied to the output as 'id' when present (default: id)")
    p.add_argument("--per-token", action="store_true",
                   help="also write token_ids, tokens, log_probs and entropies of every scored token")
    p.add_argument("--output", "-o", default="-", metavar="FILE",
                   help="output JSONL file (default: stdout); written to a temporary file beside it and renamed "
                        "into place when the run succeeds, so a failed run leaves an existing file untouched; "
                        "it may not be one of the inputs")
    p.add_argument("--no-clobber", "-n", action="store_true",
                   help="refuse to overwrite an existing --output file (checked before anything loads)")
    p.add_argument("--backend", choices=("auto", "triton", "torch"), default="auto",
                   help="backend of linear_log_probs (default auto)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar and no summary on stderr")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help or a usage error, already printed by argparse
        return int(e.code or 0)
    try:
        return _run(args)
    except ScoreError as e:
        print(f"logitless score: error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # the reader went away (`... | head`): stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        print("logitless score: interrupted", file=sys.stderr)
        return 130


def plan_windows(num_body: int, window: int, stride: int, has_bos: bool) -> list[tuple[int, int, int]]:
    """Cut a document body (its tokens after BOS) into windows; return (start, end, score_from) per window.

    Window k holds body[start:end] (after BOS when the model uses one) and scores body[score_from:end]. The first
    window starts at 0 and scores every token that has a predecessor (all of them after BOS, else all but
    body[0]); each next window moves its end `stride` tokens on and keeps `window` tokens, so every body token is
    scored exactly once and, past the first window, with at least `window - stride` body tokens before it.
    """
    first = 0 if has_bos else 1
    end = min(window, num_body)
    plan = [(0, end, first)] if end > first else []
    while end < num_body:
        new_end = min(end + stride, num_body)
        plan.append((max(0, new_end - window), new_end, end))
        end = new_end
    return plan


def _check_args(args) -> None:
    """What can be checked from the arguments alone, before anything is read or loaded."""
    if args.batch_size < 1:
        raise ScoreError(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.max_length is not None and args.max_length < 2:
        raise ScoreError(f"--max-length must be at least 2, got {args.max_length}")
    if args.stride is not None and args.stride < 1:
        raise ScoreError(f"--stride must be at least 1, got {args.stride}")
    if args.stride is not None and args.max_length is not None and args.stride > args.max_length:
        raise ScoreError(f"--stride {args.stride} is larger than --max-length {args.max_length}")


def _window_plan(args, model: Model) -> tuple[int, int]:
    """(body tokens per window, stride), checked against the model's positions and BOS, and each other."""
    max_len = args.max_length
    if max_len is None:
        max_len = min(model.max_positions or _DEFAULT_MAX_LENGTH, _DEFAULT_MAX_LENGTH)
    if max_len < 2:
        raise ScoreError(f"--max-length must be at least 2, got {max_len}")
    if model.max_positions is not None and max_len > model.max_positions:
        raise ScoreError(f"--max-length {max_len} exceeds the model's maximum positions ({model.max_positions})")
    has_bos = model.bos is not None
    window = max_len - int(has_bos)
    # Without BOS the first token of a window has no context: at least one token must be carried.
    top = window if has_bos else window - 1
    stride = args.stride if args.stride is not None else max(1, window // 2)
    if not 1 <= stride <= top:
        raise ScoreError(f"--stride must be in [1, {top}] for --max-length {max_len}"
                         f"{' (the BOS token takes one position)' if has_bos else ''}, got {stride}")
    return window, stride


def _record(doc: Document, ids: list[int], parts, per_token: bool, tokenizer) -> tuple[dict, float]:
    """The output line of one document, and the sum of its log-probs (float64) for the corpus summary."""
    rec = {} if doc.id is NO_ID else {"id": doc.id}
    rec.update(source=doc.source, index=doc.index)
    logp = torch.cat([p[0] for p in parts]) if parts else torch.zeros(0)
    n = logp.numel()
    total = logp.double().sum().item()
    nll = -total / n if n else math.nan
    rec.update(num_tokens=n, nll=finite(nll), ppl=finite(exp_or_inf(nll)))
    if per_token:
        scored = ids[len(ids) - n:]  # every token after the first is scored exactly once
        ent = torch.cat([p[1] for p in parts]) if parts else torch.zeros(0)
        rec.update(token_ids=scored, tokens=tokenizer.convert_ids_to_tokens(scored), log_probs=json_floats(logp),
                   entropies=json_floats(ent))
    return rec, total


def _run(args) -> int:
    _check_args(args)
    check_inputs(args.files)
    source = model_source(args)
    check_output(args)
    totals = scan(args)
    docs = first_document(all_documents(args), args.files)
    try:
        with output_sink(args) as out, torch.inference_mode():
            model = Model(source, args.dtype, args.device, args.backend, say=None if args.quiet else say)
            window, stride = _window_plan(args, model)
            if totals is not None:
                model.load()  # before the progress bar starts; standard input loads it at its first window
            stats = _score_all(args, model, window, stride, out, docs, totals)
    except files.OutputError as e:  # --no-clobber: the output appeared during the run
        raise ScoreError(str(e)) from None
    n_docs, tokens, nll_sum = stats
    if not args.quiet:
        nll = nll_sum / tokens if tokens else math.nan
        print(f"logitless score: {n_docs} documents, {tokens} scored tokens, NLL {nll:.4f} nats/token, "
              f"perplexity {exp_or_inf(nll):.4f} (token-weighted over all documents)",
              file=sys.stderr)
    return 0


def _score_all(args, model: Model, window: int, stride: int, out, docs: Iterator[Document],
               totals: tuple[int, int] | None) -> tuple[int, int, float]:
    """Score every document, writing its line as soon as it and all documents before it are done.

    The progress bar counts scored tokens, so that a few long documents move it too. Their total is known only
    once the text is tokenized, a buffer at a time: until the last buffer it is estimated from the characters
    still to come at the tokens-per-character rate seen so far (exact for inputs of one buffer)."""
    try:
        from tqdm import tqdm
    except ImportError:  # the progress bar is a convenience: score without it
        tqdm = _NoBar
    # Non-ASCII text as is where the output takes UTF-8, \u escapes (still the same JSON) where it may not.
    ascii_only = (getattr(out, "encoding", None) or "").lower().replace("-", "") != "utf8"
    max_docs = max(BUFFER_DOCS, 4 * args.batch_size)
    total_docs, total_chars = totals if totals is not None else (None, None)
    n_docs = n_tokens = 0
    logp_sum = 0.0
    seen = {"tokens": 0, "chars": 0}

    def planned(buf_tokens: int, buf_chars: int) -> None:
        seen["tokens"] += buf_tokens
        seen["chars"] += buf_chars
        estimate = seen["tokens"]
        if total_chars is not None and seen["chars"]:
            estimate += round((total_chars - seen["chars"]) * seen["tokens"] / seen["chars"])
        bar.total = max(estimate, bar.n)
        bar.refresh()

    with tqdm(total=None, unit="tok", unit_scale=True, desc="scoring", file=sys.stderr, disable=args.quiet,
              dynamic_ncols=True) as bar:
        for buf in buffers(docs, max_docs, BUFFER_CHARS):
            for rec, doc_sum in _score_buffer(buf, model, window, stride, args, bar, planned):
                out.write(json.dumps(rec, ensure_ascii=ascii_only, allow_nan=False) + "\n")
                out.flush()
                n_docs += 1
                n_tokens += rec["num_tokens"]
                logp_sum += doc_sum
                bar.set_postfix_str(f"{n_docs}/{total_docs if total_docs is not None else '?'} documents",
                                    refresh=False)
    return n_docs, n_tokens, -logp_sum


class _NoBar:
    def __init__(self, *args, **kwargs):
        self.n = 0
        self.total = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n=1):
        self.n += n

    def refresh(self):
        pass

    def set_postfix_str(self, *args, **kwargs):
        pass


def _score_buffer(buf: list[Document], model: Model, window: int, stride: int, args, bar, planned):
    """Yield (record, sum of log-probs) for the documents of `buf` in order, each once it is complete.
    `planned(tokens, characters)` is told the buffer's scored tokens once they are known; `bar` moves by the
    tokens of each scored batch."""
    has_bos = model.bos is not None
    p = int(has_bos)
    encoded = model.encode([d.text for d in buf])
    windows: list[Window] = []
    for i, ids in enumerate(encoded):
        prefix, body = ids[:p], ids[p:]
        for k, (s, e, f) in enumerate(plan_windows(len(body), window, stride, has_bos)):
            windows.append(Window(i, k, prefix + body[s:e], len(prefix) + f - s))
    parts: list[list] = [[] for _ in buf]
    for w in windows:
        parts[w.doc].append(None)
    pending = [len(p) for p in parts]
    if windows:
        model.load()
        model.check_ids(encoded)
    planned(sum(len(w.ids) - w.first for w in windows), sum(len(d.text) for d in buf))
    # Longest first: a batch that does not fit in memory fails at once, not after hours.
    windows.sort(key=lambda w: len(w.ids), reverse=True)
    ready = 0
    # One more step than there are batches, so that a buffer of only empty documents is written too.
    for b0 in range(0, len(windows) + 1, args.batch_size):
        batch = windows[b0:b0 + args.batch_size]
        if batch:
            for w, res in zip(batch, model.score(batch, args.per_token), strict=True):
                parts[w.doc][w.part] = res
                pending[w.doc] -= 1
            bar.update(sum(len(w.ids) - w.first for w in batch))
        while ready < len(buf) and pending[ready] == 0:
            yield _record(buf[ready], encoded[ready], parts[ready], args.per_token, model.tokenizer)
            ready += 1
