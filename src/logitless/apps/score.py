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
``docs/score.md`` explains each choice; ``main(argv)`` is the entry point.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import sys
from collections.abc import Iterator
from typing import NamedTuple

import torch

from .._dispatch import resolve_backend
from . import files

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
           "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "auto": None}
_FORMATS = ("auto", "text", "lines", "jsonl")
_JSONL_SUFFIXES = (".jsonl", ".ndjson")
# Tokens of the start-up check that the head we compute is the model's own (see _Model.check_head).
_PROBE_TOKENS = 16
# Relative error of our log-probs against the model's own on the probe, above which the head is not what we
# assume. bf16/fp16 logits are rounded to 8/11 bits (relative error ~4e-3 at worst, averaging lower), a wrong scale
# or a missing softcap is O(1e-1) or more.
_PROBE_TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-2}
_DEFAULT_MAX_LENGTH = 4096
# Documents are sorted by length (less padding) within buffers of this many documents or characters: enough to
# fill batches well, small enough that output streams and a buffer's token ids (Python lists) stay ~100s of MB.
_BUFFER_DOCS = 1024
_BUFFER_CHARS = 1 << 23


class ScoreError(Exception):
    """A problem with the command's inputs or model, reported as one line without a traceback."""


class Document(NamedTuple):
    source: str          # the file it came from ("-" for standard input)
    index: int           # 0-based position of the document in that file
    id: object           # the JSONL record's id field, or _NO_ID
    text: str


class Window(NamedTuple):
    """One model input: `ids` = a slice of the document after BOS (when used); targets ids[first:] are scored."""

    doc: int             # position of the document in its buffer
    part: int            # window number within the document
    ids: list[int]
    first: int


_NO_ID = object()


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
    p.add_argument("--dtype", default="auto", type=_parse_dtype,
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
    p.add_argument("--format", choices=_FORMATS, default="auto",
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


def _parse_dtype(text: str):
    key = text.strip().lower()
    if key not in _DTYPES:
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r}: choose bf16, fp16, fp32 or auto")
    return key


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


def _file_format(path: str, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    return "jsonl" if path.lower().endswith(_JSONL_SUFFIXES) else "text"


def _check_inputs(paths: list[str]) -> None:
    if paths.count("-") > 1:
        raise ScoreError("standard input ('-') can be read only once")
    for path in paths:
        if path == "-":
            continue
        if not os.path.exists(path):
            raise ScoreError(f"input file not found: {path}")
        if not os.path.isfile(path):
            raise ScoreError(f"input is not a regular file: {path}")


def _scan(args) -> tuple[int, int] | None:
    """(documents, characters) of all inputs, reading every file once before the model loads, so that a bad line
    (invalid JSON or UTF-8, a missing text field), or inputs without any text, stop the run at once; None when
    standard input is among them (it can be read only once: its lines are checked as they are scored, and
    first_document refuses inputs without text)."""
    docs = chars = 0
    for path in args.files:
        if path == "-":
            continue
        for d in iter_documents(path, args.format, args.text_field, args.id_field):
            docs += 1
            chars += len(d.text)
    if "-" in args.files:
        return None
    if not chars:
        raise ScoreError(empty_input_message(args.files))
    return docs, chars


def empty_input_message(files: list[str]) -> str:
    shown = ", ".join("standard input" if f == "-" else f for f in files)
    return (f"nothing to score: {'the input' if len(files) == 1 else 'the inputs'} {shown} hold no text (empty "
            "files, or only empty documents); check the path, --format and --text-field")


def first_document(docs: Iterator[Document], files: list[str]) -> Iterator[Document]:
    """`docs` unchanged, once inputs that include standard input are known to hold some text: inputs without any
    are refused before a model loads. Only the documents up to the first with text are read ahead."""
    if "-" not in files:
        return docs
    held = []
    for d in docs:
        held.append(d)
        if d.text:
            return itertools.chain(held, docs)
    raise ScoreError(empty_input_message(files))


def _open_text(path: str, newline):
    if path == "-":
        return open(sys.stdin.fileno(), encoding="utf-8", newline=newline, closefd=False)
    return open(path, encoding="utf-8", newline=newline)


def iter_documents(path: str, fmt: str, text_field: str = "text", id_field: str = "id") -> Iterator[Document]:
    """Documents of one input file; `fmt` is one of text/lines/jsonl/auto (see build_parser)."""
    kind = _file_format(path, fmt)
    try:
        if kind == "text":
            # newline="" keeps the file's text exactly as it is (no \r\n translation).
            with _open_text(path, newline="") as f:
                yield Document(path, 0, _NO_ID, f.read())
            return
        with _open_text(path, newline=None) as f:
            if kind == "lines":
                for i, line in enumerate(f):
                    yield Document(path, i, _NO_ID, line[:-1] if line.endswith("\n") else line)
                return
            index = 0
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                yield _jsonl_document(path, lineno, index, line, text_field, id_field)
                index += 1
    except UnicodeDecodeError as e:
        raise ScoreError(f"{path}: not valid UTF-8 ({e.reason} at byte {e.start})") from None


def _jsonl_document(path, lineno, index, line, text_field, id_field) -> Document:
    where = f"{path}:{lineno}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ScoreError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(record, dict):
        raise ScoreError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if text_field not in record:
        raise ScoreError(f"{where}: the record has no {text_field!r} field (--text-field names another)")
    text = record[text_field]
    if not isinstance(text, str):
        raise ScoreError(f"{where}: field {text_field!r} must be a string, got {type(text).__name__}")
    return Document(path, index, record.get(id_field, _NO_ID), text)


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


class _Source(NamedTuple):
    """Where the model is: a Hugging Face folder, or a GGUF file (`gguf` is its name within `folder`)."""

    folder: str
    gguf: str | None

    @property
    def kwargs(self) -> dict:
        return {"local_files_only": True, **({"gguf_file": self.gguf} if self.gguf else {})}

    def __str__(self) -> str:
        return os.path.join(self.folder, self.gguf) if self.gguf else self.folder


def _model_source(args) -> _Source:
    """The model's location, checked before anything is loaded."""
    path = args.gguf if args.gguf is not None else args.model
    if not os.path.exists(path):
        raise ScoreError(f"--{'gguf' if args.gguf is not None else 'model'} {path} does not exist (it must be a "
                         "local folder or a GGUF file; nothing is downloaded)")
    if args.gguf is not None or (os.path.isfile(path) and path.lower().endswith(".gguf")):
        if not os.path.isfile(path):
            raise ScoreError(f"--gguf {path} is not a file")
        folder, name = os.path.split(os.path.abspath(path))
        return _Source(folder, name)
    if os.path.isfile(path):
        raise ScoreError(f"--model {path} is a file: pass a model folder, or a GGUF file named *.gguf (or --gguf "
                         "FILE)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        ggufs = sorted(f for f in os.listdir(path) if f.lower().endswith(".gguf"))
        hint = (f"; it holds GGUF files: pass one, --model {os.path.join(path, ggufs[0])}" if ggufs else
                " (a Hugging Face model folder, as save_pretrained writes it, has config.json, the weights and the "
                "tokenizer files)")
        raise ScoreError(f"--model {path} has no config.json, so it is not a saved model{hint}")
    return _Source(path, None)


def say(message: str, prog: str = "logitless score") -> None:
    """One line on stderr, `prog: message`, that a progress bar, if one is drawn, is redrawn under."""
    try:
        from tqdm import tqdm
    except ImportError:
        print(f"{prog}: {message}", file=sys.stderr, flush=True)
    else:
        tqdm.write(f"{prog}: {message}", file=sys.stderr)


def _size(source: _Source) -> str:
    """The bytes on disk of a GGUF file or of a model folder's files, in words."""
    if source.gguf:
        n = os.path.getsize(str(source))
    else:
        n = sum(e.stat().st_size for e in os.scandir(source.folder) if e.is_file())
    return f"{n / 2**20:.0f} MiB"


def _check_hf_stack(gguf: bool) -> None:
    """Every package a load needs, in one message, before any of them loads (transformers refuses a GGUF file
    without accelerate only once it has read the tokenizer, tens of seconds in)."""
    import importlib.util

    need = ["transformers", "tokenizers"] + (["gguf", "accelerate"] if gguf else [])
    missing = [m for m in need if importlib.util.find_spec(m) is None]
    if missing:
        what = "a GGUF file" if gguf else "a model"
        raise ScoreError(f"loading {what} needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} "
                         "not installed: pip install 'logitless[hf]' (or pip install " + " ".join(missing) + ")")


class _Model:
    """A causal LM split into its backbone and its linear head, the head computed by linear_log_probs.

    Built in two steps, so that every argument is checked before the weights load: the constructor loads the
    tokenizer and the config (fast for a folder; a GGUF file's tokenizer is rebuilt from its vocabulary, seconds),
    `load()` the weights. `say`, when given, is told what loads from where before each step."""

    def __init__(self, source: _Source, dtype_key: str, device_arg: str, backend: str, say=None):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        _check_hf_stack(bool(source.gguf))
        from transformers import AutoConfig, AutoTokenizer

        self.source = source
        self.say = say or (lambda message: None)
        self.device = _resolve_device(device_arg)
        self.dtype = _resolve_dtype(dtype_key, self.device)
        self.backend = _check_backend(backend, self.device)
        self.say(f"reading the tokenizer and config of {source}")
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(source.folder, **source.kwargs)
        except Exception as e:  # transformers raises OSError, ValueError, KeyError... depending on what is missing
            raise ScoreError(f"cannot load a tokenizer from {source}: {_first_line(e)}") from None
        # The tokenizer warns about sequences longer than its model_max_length; windows take care of those.
        self.tokenizer.model_max_length = sys.maxsize
        try:
            config = AutoConfig.from_pretrained(source.folder, **source.kwargs)
        except Exception as e:
            raise ScoreError(f"cannot read the model's config from {source}: {_first_line(e)}") from None
        cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.max_positions = next((getattr(cfg, a) for a in ("max_position_embeddings", "n_positions", "n_ctx")
                                   if isinstance(getattr(cfg, a, None), int)), None)
        self.bos = self.tokenizer.bos_token_id
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    def load(self) -> None:
        """Load the weights in self.dtype, the way transformers does, find the backbone and the head, and check
        them on the probe (check_head); once, before the first batch, so that inputs with nothing to score (empty
        documents only) never load them."""
        if hasattr(self, "model"):
            return
        import transformers
        from transformers import AutoModelForCausalLM

        major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
        dtype_kw = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
        dequant = "; dequantizing a GGUF file takes a while" if self.source.gguf else ""
        self.say(f"loading the model {self.source} ({_size(self.source)}) in "
                 f"{str(self.dtype).removeprefix('torch.')} on {self.device}{dequant}")
        # Our own progress bar is the only one on stderr; transformers' weight-loading bar is restored afterwards.
        hf_logging = transformers.utils.logging
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            model = AutoModelForCausalLM.from_pretrained(self.source.folder, **self.source.kwargs,
                                                         **{dtype_kw: self.dtype})
        except Exception as e:
            raise ScoreError(f"cannot load a causal LM from {self.source}: {_first_line(e)}") from None
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        # Moved, never cast: from_pretrained(dtype=) has already put the parameters in the requested dtype and
        # kept the buffers that must stay float32 (RoPE's inv_freq) as they are; a .to(dtype) here would round
        # those too, and the positions' angles with them.
        self.model = model.to(device=self.device).eval()
        from ..integrations import heads

        try:
            head = heads.find_head(model)
        except (TypeError, ValueError, NotImplementedError) as e:
            raise ScoreError(f"{type(model).__name__}: {e}") from None
        self.head = head
        self.backbone, self.weight, self.bias, self.transform = head.backbone, head.weight, head.bias, head.transform
        self.vocab = self.weight.shape[0]
        self.check_head()

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, starting with BOS when the tokenizer has one (added here if it did not)."""
        out = []
        for ids in self.tokenizer(texts, add_special_tokens=True)["input_ids"]:
            if self.bos is not None and (not ids or ids[0] != self.bos):
                ids = [self.bos, *ids]
            out.append(ids)
        return out

    def check_ids(self, encoded: list[list[int]]) -> None:
        bad = [t for ids in encoded for t in ids if not 0 <= t < self.vocab]
        if bad:
            raise ScoreError(f"the tokenizer produced id {bad[0]} but the model's vocabulary has {self.vocab}")

    def score(self, windows: list[Window], want_entropy: bool):
        """(log-probs, entropies or None) of the scored tokens of each window, float32 CPU tensors."""
        B, L = len(windows), max(len(w.ids) for w in windows)
        ids = torch.full((B, L), self.pad, dtype=torch.long)
        mask = torch.zeros((B, L), dtype=torch.long)
        rows, cols, targets, counts = [], [], [], []
        for b, w in enumerate(windows):
            n = len(w.ids)
            ids[b, :n] = torch.tensor(w.ids)
            mask[b, :n] = 1
            # Right padding: real tokens never attend to the padding after them and keep positions 0..n-1.
            rows.extend([b] * (n - w.first))
            cols.extend(range(w.first - 1, n - 1))
            targets.extend(w.ids[w.first:])
            counts.append(n - w.first)
        dev = self.device
        hidden = self._hidden(ids.to(dev), mask.to(dev))                      # [B, L, D]
        h = hidden[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)]  # [N, D]: scored positions only
        out = self._head(h, torch.tensor(targets, device=dev), want_entropy)
        logp, ent = out if want_entropy else (out, None)
        logp = logp.float().cpu().split(counts)
        ent = ent.float().cpu().split(counts) if ent is not None else [None] * B
        return list(zip(logp, ent, strict=True))

    def _hidden(self, ids, mask):
        out = self.backbone(input_ids=ids, attention_mask=mask, use_cache=False)
        return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]

    def _head(self, h, targets, want_entropy):
        return head_log_probs(self.head, h, targets, want_entropy, self.backend)

    def check_head(self) -> None:
        """Compare our head with the model's own logits on a short probe; raise if the architecture differs.

        The backbone + linear (+ bias, the logit transform heads found) split is an assumption about the model
        class; a model that transforms its hidden states or logits in another way would be scored wrongly and
        silently without this check. The probe is 16 token ids drawn with a fixed seed, so its logits are tiny.
        """
        specials = set(self.tokenizer.all_special_ids)
        gen = torch.Generator().manual_seed(0)
        pool = [t for t in range(min(len(self.tokenizer), self.vocab)) if t not in specials] or list(range(self.vocab))
        picks = torch.randint(len(pool), (_PROBE_TOKENS,), generator=gen).tolist()
        probe = ([self.bos] if self.bos is not None else []) + [pool[i] for i in picks]
        ids = torch.tensor([probe], device=self.device)
        logits = self.model(input_ids=ids, use_cache=False).logits[0, :-1].float()
        if not torch.isfinite(logits).all():
            raise ScoreError(self._overflow_message())
        theirs = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0]
        ours = self._head(self._hidden(ids, torch.ones_like(ids))[0, :-1], ids[0, 1:], False).float()
        err = ((ours - theirs).norm() / theirs.norm().clamp_min(1e-30)).item()
        if not err <= _PROBE_TOL[self.dtype]:
            raise ScoreError(
                f"{type(self.model).__name__}: log-probs from the backbone's hidden states and the output "
                f"embedding ({_describe(self.transform)}) differ from the model's own by {err:.2e} (relative) on a "
                "probe; this architecture transforms its head in a way logitless score does not know, so it cannot "
                "be scored correctly"
            )


    def _overflow_message(self) -> str:
        """The model's own forward gave inf or NaN logits: a dtype whose range its activations exceed (Gemma's
        exceed float16's 65504), not a head this command does not know."""
        name = str(self.dtype).removeprefix("torch.")
        if self.dtype in (torch.float32, torch.float64):
            return (f"{type(self.model).__name__} in {name}: the model's own forward gives non-finite logits (inf "
                    f"or NaN) on a probe of {_PROBE_TOKENS} tokens; its weights hold inf or NaN, or overflow even "
                    f"{name}: the model file itself is broken")
        cuda_bf16 = (self.device.type == "cuda" and self.dtype == torch.float16 and torch.cuda.is_bf16_supported())
        fix = ("--dtype bf16 (same speed on this GPU, float32's range) or --dtype fp32" if cuda_bf16 else
               "--dtype fp32" + ("" if self.device.type == "cuda" else " (on a CPU also the fastest)"))
        return (f"{type(self.model).__name__} in {name}: the model's own forward gives non-finite logits (inf or "
                f"NaN) on a probe of {_PROBE_TOKENS} tokens, so its activations overflow {name}; nothing can be "
                f"scored in this dtype: use {fix}")


def _first_line(e: Exception) -> str:
    """The first line of an error message (transformers' can run to pages): enough to say what is missing."""
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def head_inputs(head, h: torch.Tensor):
    """(hidden states, bias, softcap, temperature) that give linear_log_probs with head.weight the model's logits
    at the final hidden states `h` (heads.Head: the weight, the bias and the logit transform of the model)."""
    return head.transform.for_log_probs(h.to(head.weight.dtype), head.bias)


def head_log_probs(head, h: torch.Tensor, targets: torch.Tensor, want_entropy: bool = False, backend: str = "auto"):
    """log p(target) of the model's head at the final hidden states `h` [N, D] (and the entropy of each prediction
    when `want_entropy`), computed by linear_log_probs: no [N, V] logits."""
    from ..log_probs import linear_log_probs

    x, bias, softcap, temperature = head_inputs(head, h)
    return linear_log_probs(x, head.weight, targets, linear_bias=bias, softcap=softcap, temperature=temperature,
                            return_entropy=want_entropy, backend=backend)


def _describe(transform) -> str:
    """A logit transform in the words of the error messages."""
    return (f"softcap={transform.softcap}, logit scale={transform.logit_scale:g}, hidden-state scale="
            f"{transform.hidden_scale:g}")


def _resolve_device(arg: str) -> torch.device:
    if arg == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(arg)
    except (RuntimeError, ValueError):
        raise ScoreError(f"unknown --device {arg!r}: use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ScoreError(f"--device {arg}: CUDA is not available on this machine")
    return device


def _check_backend(backend: str, device: torch.device) -> str:
    """`backend`, once the dispatcher agrees that it can run linear_log_probs on `device` (before the model loads)."""
    try:
        resolve_backend(backend, device, "linear_log_probs")
    except (RuntimeError, ValueError) as e:  # Triton asked for where it cannot run, a bad $LOGITLESS_BACKEND
        raise ScoreError(str(e)) from None
    return backend


def _resolve_dtype(key: str, device: torch.device) -> torch.dtype:
    if _DTYPES[key] is not None:
        return _DTYPES[key]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


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


def _window_plan(args, model: _Model) -> tuple[int, int]:
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


def _buffers(docs: Iterator[Document], max_docs: int, max_chars: int) -> Iterator[list[Document]]:
    """Groups of documents, each as large as `max_docs` documents or `max_chars` characters allow."""
    buf, chars = [], 0
    for d in docs:
        buf.append(d)
        chars += len(d.text)
        if len(buf) == max_docs or chars >= max_chars:
            yield buf
            buf, chars = [], 0
    if buf:
        yield buf


def _all_documents(args) -> Iterator[Document]:
    for path in args.files:
        yield from iter_documents(path, args.format, args.text_field, args.id_field)


def _json_floats(t: torch.Tensor) -> list:
    # str() of a float32 is its shortest round-trip form: exact values, short lines.
    return [_finite(float(s)) for s in map(str, t.numpy())]


def _finite(x: float):
    return x if math.isfinite(x) else None


def _exp(x: float) -> float:
    return math.inf if x > 709.0 else math.exp(x)  # math.exp raises past float64's range; NaN stays NaN


def _record(doc: Document, ids: list[int], parts, per_token: bool, tokenizer) -> tuple[dict, float]:
    """The output line of one document, and the sum of its log-probs (float64) for the corpus summary."""
    rec = {} if doc.id is _NO_ID else {"id": doc.id}
    rec.update(source=doc.source, index=doc.index)
    logp = torch.cat([p[0] for p in parts]) if parts else torch.zeros(0)
    n = logp.numel()
    total = logp.double().sum().item()
    nll = -total / n if n else math.nan
    rec.update(num_tokens=n, nll=_finite(nll), ppl=_finite(_exp(nll)))
    if per_token:
        scored = ids[len(ids) - n:]  # every token after the first is scored exactly once
        ent = torch.cat([p[1] for p in parts]) if parts else torch.zeros(0)
        rec.update(token_ids=scored, tokens=tokenizer.convert_ids_to_tokens(scored), log_probs=_json_floats(logp),
                   entropies=_json_floats(ent))
    return rec, total


def check_output(args) -> None:
    """--output (or standard output) is none of the input files: refused before anything loads."""
    try:
        if args.output != "-":
            files.check_output(args.output, args.files, what="--output",
                                no_clobber=getattr(args, "no_clobber", False))
        else:
            files.check_stdout(args.files)
    except files.OutputError as e:
        raise ScoreError(str(e)) from None


def output_sink(args):
    """Where the records go: standard output, or a temporary file beside --output renamed into place only when the
    run succeeds (a failed run leaves an existing output as it was)."""
    if args.output == "-":
        return contextlib.nullcontext(sys.stdout)
    try:
        return files.atomic_open(args.output, "w", no_clobber=getattr(args, "no_clobber", False), encoding="utf-8")
    except OSError as e:
        raise ScoreError(f"cannot write --output {args.output}: {e.strerror or e}") from None


def _run(args) -> int:
    _check_args(args)
    _check_inputs(args.files)
    source = _model_source(args)
    check_output(args)
    totals = _scan(args)
    docs = first_document(_all_documents(args), args.files)
    try:
        with output_sink(args) as out, torch.inference_mode():
            model = _Model(source, args.dtype, args.device, args.backend, say=None if args.quiet else say)
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
              f"perplexity {_exp(nll):.4f} (token-weighted over all documents)",
              file=sys.stderr)
    return 0


def _score_all(args, model: _Model, window: int, stride: int, out, docs: Iterator[Document],
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
    max_docs = max(_BUFFER_DOCS, 4 * args.batch_size)
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
        for buf in _buffers(docs, max_docs, _BUFFER_CHARS):
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


def _score_buffer(buf: list[Document], model: _Model, window: int, stride: int, args, bar, planned):
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
