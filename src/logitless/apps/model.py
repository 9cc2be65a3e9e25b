"""The local causal LM that `logitless score` and `logitless detect` load, split into its backbone and its head.

The model is a Hugging Face checkpoint folder or a GGUF file (dequantized by transformers), found and checked before
anything loads; the tokenizer and config load first, the weights as transformers loads them (in the requested
dtype, never cast afterwards); the head, found by `integrations.heads`, is computed by
:func:`logitless.linear_log_probs` and checked against the model's own logits on a short probe.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NamedTuple

import torch

from .._dispatch import resolve_backend
from .documents import ScoreError

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
           "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "auto": None}
# Tokens of the start-up check that the head we compute is the model's own (see Model.check_head).
_PROBE_TOKENS = 16
# Relative error of our log-probs against the model's own on the probe, above which the head is not what we
# assume. bf16/fp16 logits are rounded to 8/11 bits (relative error ~4e-3 at worst, averaging lower), a wrong scale
# or a missing softcap is O(1e-1) or more.
_PROBE_TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-2}


class Window(NamedTuple):
    """One model input: `ids` = a slice of the document after BOS (when used); targets ids[first:] are scored."""

    doc: int             # position of the document in its buffer
    part: int            # window number within the document
    ids: list[int]
    first: int


def parse_dtype(text: str):
    key = text.strip().lower()
    if key not in _DTYPES:
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r}: choose bf16, fp16, fp32 or auto")
    return key


class Source(NamedTuple):
    """Where the model is: a Hugging Face folder, or a GGUF file (`gguf` is its name within `folder`)."""

    folder: str
    gguf: str | None

    @property
    def kwargs(self) -> dict:
        return {"local_files_only": True, **({"gguf_file": self.gguf} if self.gguf else {})}

    def __str__(self) -> str:
        return os.path.join(self.folder, self.gguf) if self.gguf else self.folder


def model_source(args) -> Source:
    """The model's location, checked before anything is loaded."""
    path = args.gguf if args.gguf is not None else args.model
    if not os.path.exists(path):
        raise ScoreError(f"--{'gguf' if args.gguf is not None else 'model'} {path} does not exist (it must be a "
                         "local folder or a GGUF file; nothing is downloaded)")
    if args.gguf is not None or (os.path.isfile(path) and path.lower().endswith(".gguf")):
        if not os.path.isfile(path):
            raise ScoreError(f"--gguf {path} is not a file")
        folder, name = os.path.split(os.path.abspath(path))
        return Source(folder, name)
    if os.path.isfile(path):
        raise ScoreError(f"--model {path} is a file: pass a model folder, or a GGUF file named *.gguf (or --gguf "
                         "FILE)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        ggufs = sorted(f for f in os.listdir(path) if f.lower().endswith(".gguf"))
        hint = (f"; it holds GGUF files: pass one, --model {os.path.join(path, ggufs[0])}" if ggufs else
                " (a Hugging Face model folder, as save_pretrained writes it, has config.json, the weights and the "
                "tokenizer files)")
        raise ScoreError(f"--model {path} has no config.json, so it is not a saved model{hint}")
    return Source(path, None)


def _size(source: Source) -> str:
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


class Model:
    """A causal LM split into its backbone and its linear head, the head computed by linear_log_probs.

    Built in two steps, so that every argument is checked before the weights load: the constructor loads the
    tokenizer and the config (fast for a folder; a GGUF file's tokenizer is rebuilt from its vocabulary, seconds),
    `load()` the weights. `say`, when given, is told what loads from where before each step."""

    def __init__(self, source: Source, dtype_key: str, device_arg: str, backend: str, say=None):
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
        hidden = self.hidden(ids.to(dev), mask.to(dev))                      # [B, L, D]
        h = hidden[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)]  # [N, D]: scored positions only
        out = self._head(h, torch.tensor(targets, device=dev), want_entropy)
        logp, ent = out if want_entropy else (out, None)
        logp = logp.float().cpu().split(counts)
        ent = ent.float().cpu().split(counts) if ent is not None else [None] * B
        return list(zip(logp, ent, strict=True))

    def hidden(self, ids, mask):
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
        ours = self._head(self.hidden(ids, torch.ones_like(ids))[0, :-1], ids[0, 1:], False).float()
        err = ((ours - theirs).norm() / theirs.norm().clamp_min(1e-30)).item()
        if not err <= _PROBE_TOL[self.dtype]:
            raise ScoreError(
                f"{type(self.model).__name__}: log-probs from the backbone's hidden states and the output "
                f"embedding ({describe(self.transform)}) differ from the model's own by {err:.2e} (relative) on a "
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


def describe(transform) -> str:
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
