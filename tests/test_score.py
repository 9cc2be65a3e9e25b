"""`logitless score`: numbers against the model's own float64 logits, batching, windows, inputs, errors.

Tiny randomly initialised models of several families are saved with a tiny BPE tokenizer to a temporary folder (no
downloads). Each family exercises one thing the command must get right: BOS added by the tokenizer (llama), BOS
prepended by us (gpt2), no BOS at all and a bias on the head (phi), the final logit softcap (gemma2), logit scales
(cohere and hyperclovax multiply, granite divides by the attribute hyperclovax multiplies by), a scale of the hidden
states before the head (minicpm3).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import assert_within_rule, rel_err

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("tqdm")

from logitless.apps import score  # noqa: E402
from logitless.apps.model import Model, Source  # noqa: E402

VOCAB = 320  # model rows; the tokenizer uses ~300 of them, as real models often leave spare rows
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Language models assign a probability to every token of a text.",
    "Perplexity is the exponential of the mean negative log-likelihood.",
    "Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich.",
    "0123456789 +-*/ = () [] {} <> \"quotes\" and 'apostrophes'",
]
DOCS = [
    "The lazy dog sleeps.",
    "",
    "Perplexity of a quick brown fox, over and over again, is exponential in the log-likelihood of the text.",
    "Ü",
    "A model.",
]
LONG = " ".join(CORPUS)

# family -> (config class, config kwargs, tokenizer BOS behaviour: "added" by it, "prepended" by us, or "none")
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=128)
FAMILIES = {
    "llama": ("LlamaConfig", dict(_COMMON, num_key_value_heads=2), "added"),
    "gpt2": ("GPT2Config", dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128), "prepended"),
    "phi": ("PhiConfig", dict(_COMMON), "none"),
    "gemma2": ("Gemma2Config", dict(_COMMON, num_key_value_heads=2, head_dim=8, final_logit_softcapping=3.0),
               "added"),
    "cohere": ("CohereConfig", dict(_COMMON, num_key_value_heads=2, logit_scale=0.25), "added"),
    "granite": ("GraniteConfig", dict(_COMMON, num_key_value_heads=2, logits_scaling=4.0), "prepended"),
    # logits_scaling = hidden_size / dim_model_base = 4, dividing the hidden states
    "minicpm3": ("MiniCPM3Config", dict(_COMMON, num_key_value_heads=4, dim_model_base=8, q_lora_rank=16,
                                        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8),
                 "added"),
}
if hasattr(transformers, "HyperCLOVAXConfig"):
    FAMILIES["hyperclovax"] = ("HyperCLOVAXConfig", dict(_COMMON, num_key_value_heads=2, logits_scaling=0.25),
                               "added")


def _tokenizer(bos: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    if bos == "added":
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    specials = dict(eos_token="</s>", pad_token="<pad>")
    if bos != "none":
        specials["bos_token"] = "<s>"
    return PreTrainedTokenizerFast(tokenizer_object=tok, **specials)


def _build(path, family: str) -> None:
    cls_name, kwargs, bos = FAMILIES[family]
    torch.manual_seed(sum(map(ord, family)))
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls_name)(**kwargs))
    head = model.get_output_embeddings()
    with torch.no_grad():
        if head.bias is not None:
            head.bias.normal_(0.0, 2.0)
        # Random init predicts almost uniformly; scale the head so logits spread over ~+-10 (peaked distributions,
        # a softcap that bites, log-probs and entropies that differ from token to token).
        ids = torch.arange(2, 40)[None]
        spread = model(input_ids=ids).logits.std()
        head.weight.mul_(4.0 / spread)
    model.save_pretrained(path)
    _tokenizer(bos).save_pretrained(path)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # The models are tiny: threads buy nothing, and on a busy CI machine their spin-waits cost seconds per test.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    dirs = {}
    for family in FAMILIES:
        dirs[family] = root / family
        _build(dirs[family], family)
    return dirs


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def _jsonl(tmp_path, docs, name="docs.jsonl"):
    return _write(tmp_path / name, [json.dumps({"id": f"doc-{i}", "text": t}) for i, t in enumerate(docs)])


def _score(argv, capsys):
    """Run main() in-process; return the JSON records it printed. float32 unless the test names a dtype (the
    default, auto, is bf16 on a GPU)."""
    if "--dtype" not in argv:
        argv = [*argv, "--dtype", "fp32"]
    rc = score.main([*argv, "--quiet"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return [json.loads(line) for line in out.splitlines()]


def _expected_ids(tok, text: str, bos: str) -> list[int]:
    ids = tok(text)["input_ids"]
    if bos == "added":
        assert ids[:1] == [tok.bos_token_id]
    return [tok.bos_token_id, *ids] if bos == "prepended" else ids


# `logitless score --device auto` runs on this device; PyTorch in the same dtype runs there too, so that the rule
# compares the head alone (a GPU backbone differs from a CPU one by more than the head's rounding).
SCORE_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _truth(model_dir, ids_list, dtype, device="cpu", one_by_one=False):
    """Per document: log p of each next token and the entropy of each prediction, from the model's own logits.

    One right-padded forward for all documents: under causal attention a token never sees the padding after it.
    one_by_one: a forward per document instead (the shapes of `--batch-size 1`, so that a GPU backbone, whose
    kernels round differently for other batch shapes, computes the same hidden states as the command's).
    """
    if one_by_one:
        return [_truth(model_dir, [ids], dtype, device)[0] for ids in ids_list]
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval().to(device)
    lengths = [len(ids) for ids in ids_list]
    batch = torch.zeros(len(ids_list), max(lengths), dtype=torch.long)
    for i, ids in enumerate(ids_list):
        batch[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
    mask = (torch.arange(batch.shape[1]) < torch.tensor(lengths)[:, None]).long()
    with torch.no_grad():
        logits = model(input_ids=batch.to(device), attention_mask=mask.to(device)).logits
        logp = torch.log_softmax(logits, dim=-1).cpu()
    out = []
    for i, n in enumerate(lengths):
        lp = logp[i, :max(n - 1, 0)]
        out.append((lp.gather(1, batch[i, 1:n, None])[:, 0], -(lp.exp() * lp).sum(-1)))
    return out


def _head_truth(model_dir, ids_list, dtype, device):
    """Like _truth in float64, but for the model's own head (softcap included) applied in float64 to the hidden
    states of its `dtype` backbone, one document per forward: the reference for the head alone, whatever the
    backbone's rounding (a bf16 backbone's error is shared by every head computed on it, and can dominate)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval().to(device)
    backbone = getattr(model, model.base_model_prefix)
    head = model.get_output_embeddings()
    cap = getattr(model.config, "final_logit_softcapping", None)
    out = []
    for ids in ids_list:
        x = torch.tensor([ids], device=device)
        with torch.no_grad():
            h = backbone(input_ids=x, attention_mask=torch.ones_like(x)).last_hidden_state[0].double()
        z = h @ head.weight.double().T
        if head.bias is not None:
            z = z + head.bias.double()
        if cap:
            z = cap * torch.tanh(z / cap)
        lp = torch.log_softmax(z, dim=-1).cpu()[:max(len(ids) - 1, 0)]
        out.append((lp.gather(1, torch.tensor(ids[1:], dtype=torch.long)[:, None])[:, 0], -(lp.exp() * lp).sum(-1)))
    return out


def _check_against_model(records, model_dir, ids_list, dtype, head_only=False):
    """Every number in `records` within the error rule against float64, next to PyTorch on the model's logits.
    head_only: the float64 reference is the head on the same `dtype` hidden states (_head_truth), and PyTorch runs
    one document per forward, as the command does with --batch-size 1."""
    if head_only:
        truth = _head_truth(model_dir, ids_list, dtype, SCORE_DEVICE)
    else:
        truth = _truth(model_dir, ids_list, torch.float64)
    same = _truth(model_dir, ids_list, dtype, SCORE_DEVICE, one_by_one=head_only)
    for rec, ids in zip(records, ids_list, strict=True):
        assert rec["token_ids"] == ids[1:]
        assert rec["num_tokens"] == max(0, len(ids) - 1)
    cat = lambda parts: torch.cat(parts) if parts else torch.zeros(0)
    ours_lp = cat([torch.tensor(r["log_probs"], dtype=torch.float64) for r in records])
    ours_h = cat([torch.tensor(r["entropies"], dtype=torch.float64) for r in records])
    assert_within_rule("log_probs", ours_lp, cat([s[0] for s in same]), cat([t[0] for t in truth]))
    assert_within_rule("entropies", ours_h, cat([s[1] for s in same]), cat([t[1] for t in truth]))
    scored = [i for i, r in enumerate(records) if r["num_tokens"]]
    nll = lambda parts: torch.tensor([-parts[i][0].double().mean().item() for i in scored])
    assert_within_rule("nll", torch.tensor([records[i]["nll"] for i in scored]), nll(same), nll(truth))
    # ppl = exp(nll): its relative error is nll's absolute error, so it is checked through nll and the identity.
    for i in scored:
        assert records[i]["ppl"] == pytest.approx(math.exp(records[i]["nll"]), rel=1e-12)
    for r in records:
        if not r["num_tokens"]:
            assert r["nll"] is None and r["ppl"] is None and r["log_probs"] == []


@pytest.mark.parametrize("family", list(FAMILIES))
def test_matches_model_logits(family, model_dirs, tmp_path, capsys):
    # Batches of 3 mix long, short and empty documents: padding, sorting and reassembly in input order.
    d = model_dirs[family]
    records = _score(["--model", str(d), "--per-token", "--batch-size", "3", str(_jsonl(tmp_path, DOCS))], capsys)
    assert [r["id"] for r in records] == [f"doc-{i}" for i in range(len(DOCS))]
    assert [r["index"] for r in records] == list(range(len(DOCS)))
    tok = transformers.AutoTokenizer.from_pretrained(d)
    ids_list = [_expected_ids(tok, t, FAMILIES[family][2]) for t in DOCS]
    _check_against_model(records, d, ids_list, torch.float32)
    for r in records:
        assert r["tokens"] == tok.convert_ids_to_tokens(r["token_ids"])
        if r["num_tokens"]:
            assert r["ppl"] == pytest.approx(math.exp(r["nll"]), rel=1e-12)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_bf16_matches_model_logits(family, model_dirs, tmp_path, capsys):
    # bf16 weights and activations, on the two RoPE families (gemma2 with its softcap): ours within 2x PyTorch's own
    # bf16 error against float64 for the head alone (the bf16 backbone is not ours, and its error, the same for
    # every head computed on its hidden states, can hide the head's in either direction) ...
    d = model_dirs[family]
    docs = [*DOCS, " ".join(CORPUS[:3])]  # ~110 tokens: positions where rounded rotary angles would show
    records = _score(["--model", str(d), "--dtype", "bf16", "--per-token", "--batch-size", "1",
                      str(_jsonl(tmp_path, docs))], capsys)
    tok = transformers.AutoTokenizer.from_pretrained(d)
    ids_list = [_expected_ids(tok, t, "added") for t in docs]
    _check_against_model(records, d, ids_list, torch.bfloat16, head_only=True)
    # ... and the whole model is the one transformers loads in bf16: the reference runs the backbone of
    # from_pretrained(dtype=bfloat16), so our numbers agree with it to the float32 head's rounding (measured
    # 5e-8 relative; a model cast with .to(bfloat16), which rounds RoPE's float32 inv_freq, is 4e-4 off).
    ours = torch.tensor(sum((r["log_probs"] for r in records), []), dtype=torch.float64)
    ref = torch.cat([t[0] for t in _head_truth(d, ids_list, torch.bfloat16, SCORE_DEVICE)])
    assert rel_err(ours, ref) < 1e-5
    # The model's own bf16 forward agrees within its bf16 rounding: its logits (softcap included) and its
    # log-softmax are rounded to bf16, an ulp (2**-7 relative) of the largest logit and of the log-prob per token.
    for rec, (lp, _), ids in zip(records, _truth(d, ids_list, torch.bfloat16, SCORE_DEVICE, one_by_one=True),
                                 ids_list, strict=True):
        if rec["num_tokens"]:
            bound = 2.0**-7 * (_max_logit(d, ids) + lp.float().abs())
            assert ((torch.tensor(rec["log_probs"]) - lp.float()).abs() <= bound).all()


def _max_logit(model_dir, ids) -> float:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits.abs().max().item()


def test_model_is_loaded_as_transformers_loads_it(model_dirs):
    # Parameters in the requested dtype, every buffer (RoPE's inv_freq) in the dtype from_pretrained gives it.
    d = model_dirs["llama"]
    m = Model(Source(str(d), None), "bf16", "cpu", "torch")
    m.load()
    stock = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16)
    assert {n: b.dtype for n, b in m.model.named_buffers()} == {n: b.dtype for n, b in stock.named_buffers()}
    assert any(b.dtype == torch.float32 for n, b in m.model.named_buffers() if "inv_freq" in n)
    assert {p.dtype for p in m.model.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("family", ["llama", "phi"])
def test_batch_size_invariant(family, model_dirs, tmp_path, capsys, monkeypatch):
    # Padding to the longest window of a batch must not change any number (windows included), nor must the
    # buffers that documents are sorted in (4 documents each for the batch-size-1 run, one for the other).
    src = str(_jsonl(tmp_path, [*DOCS, LONG, DOCS[2] * 2]))
    args = ["--model", str(model_dirs[family]), "--per-token", "--max-length", "32", "--stride", "11", src]
    monkeypatch.setattr(score, "BUFFER_DOCS", 2)
    one = _score([*args, "--batch-size", "1"], capsys)
    many = _score([*args, "--batch-size", "5"], capsys)
    assert [r["id"] for r in one] == [r["id"] for r in many] == [f"doc-{i}" for i in range(len(DOCS) + 2)]
    assert [r["token_ids"] for r in one] == [r["token_ids"] for r in many]
    for key in ("log_probs", "entropies"):
        a = torch.tensor(sum((r[key] for r in one), []), dtype=torch.float64)
        b = torch.tensor(sum((r[key] for r in many), []), dtype=torch.float64)
        assert rel_err(b, a) < 1e-6, key


@pytest.mark.parametrize("family", ["llama", "phi"])
def test_windows(family, model_dirs, tmp_path, capsys):
    # A document of ~4x --max-length: every token scored once, each with the context docs/score.md promises.
    d = model_dirs[family]
    bos = FAMILIES[family][2]
    max_length, stride = 20, 6
    tok = transformers.AutoTokenizer.from_pretrained(d)
    ids = _expected_ids(tok, LONG, bos)
    assert len(ids) > 4 * max_length
    src = _write(tmp_path / "long.txt", [LONG])
    (rec,) = _score(["--model", str(d), "--per-token", "--format", "lines", "--max-length", str(max_length),
                     "--stride", str(stride), str(src)], capsys)
    assert rec["token_ids"] == ids[1:] and rec["num_tokens"] == len(ids) - 1

    # Naive reference, token by token: body = tokens after BOS; window = max_length - 1 body tokens after BOS (or
    # max_length without BOS); the first window ends at `window`, each next one `stride` later; a token is scored by
    # the window whose end passes it first, with that window's tokens before it as context.
    prefix, body = (ids[:1], ids[1:]) if bos != "none" else ([], ids)
    window = max_length - len(prefix)
    ends = [min(window, len(body))]
    while ends[-1] < len(body):
        ends.append(min(ends[-1] + stride, len(body)))
    contexts = []
    for j in range(0 if prefix else 1, len(body)):
        end = next(e for e in ends if e > j)
        contexts.append(prefix + body[max(0, end - window):j + 1])
    truth = _truth(d, contexts, torch.float64)
    same = _truth(d, contexts, torch.float32, SCORE_DEVICE)
    last = lambda parts, k: torch.stack([p[k][-1] for p in parts])
    assert_within_rule("windowed log_probs", torch.tensor(rec["log_probs"]), last(same, 0), last(truth, 0))
    assert_within_rule("windowed entropies", torch.tensor(rec["entropies"]), last(same, 1), last(truth, 1))
    # ... and the windows matter: with full context some tokens get other log-probs.
    (full,) = _truth(d, [ids], torch.float64)
    assert rel_err(torch.tensor(rec["log_probs"]), full[0]) > 1e-3


def test_progress_counts_tokens(model_dirs, tmp_path, capsys):
    # One long document in many windows: the bar moves by scored tokens and ends at their total, documents beside.
    d = str(model_dirs["llama"])
    src = _write(tmp_path / "long.txt", [LONG, "A model."])
    assert score.main(["--model", d, "--dtype", "fp32", "--format", "lines", "--max-length", "16", "--stride", "5",
                       "--batch-size", "2", "-o", str(tmp_path / "out.jsonl"), str(src)]) == 0
    err = capsys.readouterr().err
    recs = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    n = sum(r["num_tokens"] for r in recs)
    final = err.replace("\r", "\n").splitlines()
    assert any(f"{n}/{n}" in line and "tok" in line and "2/2 documents" in line for line in final), err


def test_plan_windows_covers_each_token_once():
    for has_bos in (True, False):
        for n in (0, 1, 2, 5, 17, 64):
            for window, stride in ((1, 1), (4, 4), (8, 3), (8, 7), (16, 1)):
                if not has_bos and stride >= window:
                    continue
                plan = score.plan_windows(n, window, stride, has_bos)
                scored = [j for s, e, f in plan for j in range(f, e)]
                assert scored == list(range(0 if has_bos else 1, n)), (has_bos, n, window, stride)
                for k, (s, e, f) in enumerate(plan):
                    assert 0 <= s <= f < e <= n and e - s <= window
                    if k:
                        assert f - s >= min(window - stride, f)


def test_text_lines_and_jsonl_agree(model_dirs, tmp_path, capsys):
    # The same texts as plain text (one per file), lines, and JSONL give the same numbers; empty lines are documents.
    d = str(model_dirs["gpt2"])
    files = []
    for i, text in enumerate(DOCS):
        files.append(tmp_path / f"doc{i}.txt")
        files[-1].write_text(text, encoding="utf-8")
    as_text = _score(["--model", d, *map(str, files)], capsys)
    as_lines = _score(["--model", d, "--format", "lines", str(_write(tmp_path / "all.txt", DOCS))], capsys)
    as_jsonl = _score(["--model", d, str(_jsonl(tmp_path, DOCS))], capsys)
    assert [r["source"] for r in as_text] == list(map(str, files)) and {r["index"] for r in as_text} == {0}
    assert [r["index"] for r in as_lines] == list(range(len(DOCS)))
    assert all("id" not in r for r in as_text + as_lines)
    for a, b, c in zip(as_text, as_lines, as_jsonl, strict=True):
        assert a["num_tokens"] == b["num_tokens"] == c["num_tokens"]
        if a["num_tokens"]:
            assert a["nll"] == pytest.approx(b["nll"], rel=1e-6) and a["nll"] == pytest.approx(c["nll"], rel=1e-6)
    # A text file is one document, newlines and all.
    multi = tmp_path / "multi.txt"
    multi.write_text("first line\r\nsecond line\n", encoding="utf-8")
    (rec,) = _score(["--model", d, "--per-token", str(multi)], capsys)
    tok = transformers.AutoTokenizer.from_pretrained(d)
    assert rec["token_ids"] == tok("first line\r\nsecond line\n")["input_ids"]


def test_subprocess_writes_output_file(model_dirs, tmp_path, capsys):
    d = str(model_dirs["llama"])
    src = str(_jsonl(tmp_path, DOCS))
    out = tmp_path / "scores.jsonl"
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "logitless.apps.cli", "score", "--model", d, "--dtype", "fp32",
                           "--output", str(out), src],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    assert "scored tokens" in proc.stderr and "perplexity" in proc.stderr
    got = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    ref = _score(["--model", d, src], capsys)
    assert [r["num_tokens"] for r in got] == [r["num_tokens"] for r in ref]
    for a, b in zip(got, ref, strict=True):
        assert (a["nll"] is None) == (b["nll"] is None)
        if a["nll"] is not None:
            assert a["nll"] == pytest.approx(b["nll"], rel=1e-6)


def _fails(argv, capsys, *needles, rc=1):
    assert score.main(argv) == rc
    out, err = capsys.readouterr()
    assert out == ""
    for needle in needles:
        assert needle in err, err
    return err


def test_errors(model_dirs, tmp_path, capsys):
    d = str(model_dirs["llama"])
    good = str(_jsonl(tmp_path, DOCS))
    _fails(["--model", d, str(tmp_path / "missing.txt")], capsys, "input file not found", "missing.txt")
    _fails(["--model", d, "--dtype", "fp8", good], capsys, "unknown dtype 'fp8'", rc=2)
    _fails(["--model", str(tmp_path / "nowhere"), good], capsys, "does not exist", "nowhere", "local folder")
    _fails(["--model", d, "--batch-size", "0", good], capsys, "--batch-size")
    _fails(["--model", d, "--max-length", "1", good], capsys, "--max-length must be at least 2")
    _fails(["--model", d, "--max-length", "4096", good], capsys, "exceeds the model's maximum positions (128)")
    _fails(["--model", d, "--max-length", "16", "--stride", "16", good], capsys, "--stride must be in [1, 15]")
    _fails(["--model", d, "--device", "gpu0", good], capsys, "unknown --device")
    bad = _write(tmp_path / "bad.jsonl", ['{"text": "fine"}', '{"body": "no text"}'])
    _fails(["--model", d, str(bad)], capsys, "bad.jsonl:2", "no 'text' field")
    bad = _write(tmp_path / "bad2.jsonl", ['{"text": "fine"', ""])
    _fails(["--model", d, str(bad)], capsys, "bad2.jsonl:1", "not valid JSON")
    bad = _write(tmp_path / "bad3.jsonl", ['{"text": 3}'])
    _fails(["--model", d, str(bad)], capsys, "field 'text' must be a string")
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("café".encode("latin-1"))
    _fails(["--model", d, str(latin)], capsys, "not valid UTF-8")


def test_unknown_head_is_refused(model_dirs, tmp_path, capsys, monkeypatch):
    # With a logit scale applied the wrong way round (its rule's pattern made to match anything), granite's head is
    # not what we compute: the start-up probe must refuse it.
    from logitless.integrations import heads

    monkeypatch.setitem(heads.RULES, "granite", (heads.Rule("logits_scaling", heads.LOGITS_TIMES, marker=""),))
    _fails(["--model", str(model_dirs["granite"]), str(_jsonl(tmp_path, DOCS))], capsys, "GraniteForCausalLM",
           "cannot be scored correctly")


def test_unknown_logit_transform_is_refused(model_dirs, tmp_path, capsys, monkeypatch):
    # A model type without rules whose forward transforms its logits is refused before anything is scored.
    from logitless.integrations import heads

    monkeypatch.delitem(heads.RULES, "granite")
    _fails(["--model", str(model_dirs["granite"]), str(_jsonl(tmp_path, DOCS))], capsys, "GraniteForCausalLM",
           "logits_scaling", "no rule")


def test_unusable_backend_is_one_line_before_the_model_loads(model_dirs, tmp_path, capsys, monkeypatch):
    # Triton on a CPU without its interpreter cannot run; the dispatcher's message is the error, nothing is loaded.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the dispatcher reads it at call time

    def refuse(*args, **kwargs):
        raise AssertionError("the tokenizer was loaded before the backend was checked")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    argv = ["--model", str(model_dirs["llama"]), "--device", "cpu", "--backend", "triton", str(_jsonl(tmp_path, DOCS))]
    assert score.main(argv) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("logitless score: error: ") and err.count("\n") == 1, err
    assert "backend='triton' needs CUDA tensors" in err and "TRITON_INTERPRET=1" in err, err


def _no_model_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


def test_errors_come_before_the_model_loads(model_dirs, tmp_path, capsys, monkeypatch):
    # Arguments, windows and every input line are checked before the weights load (which takes long on real models).
    _no_model_load(monkeypatch)
    d = str(model_dirs["llama"])
    good = str(_jsonl(tmp_path, DOCS))
    _fails(["--model", d, "--max-length", "1", good], capsys, "--max-length must be at least 2")
    _fails(["--model", d, "--stride", "0", good], capsys, "--stride must be at least 1")
    _fails(["--model", d, "--max-length", "8", "--stride", "9", good], capsys, "--stride 9 is larger than")
    _fails(["--model", d, "--max-length", "4096", good], capsys, "exceeds the model's maximum positions (128)")
    _fails(["--model", d, "--max-length", "16", "--stride", "16", good], capsys, "--stride must be in [1, 15]")
    bad = _write(tmp_path / "late.jsonl", [json.dumps({"text": t}) for t in DOCS] + ["{oops"])
    _fails(["--model", d, good, str(bad)], capsys, f"late.jsonl:{len(DOCS) + 1}", "not valid JSON")
    # A folder that holds no model says so (not transformers' tokenizer error), and names the GGUF files it has.
    empty = tmp_path / "empty"
    empty.mkdir()
    _fails(["--model", str(empty), good], capsys, "has no config.json", "not a saved model")
    (empty / "tiny.gguf").write_bytes(b"")
    _fails(["--model", str(empty), good], capsys, "has no config.json", "tiny.gguf")
    _fails(["--model", good, good], capsys, "is a file")


def test_empty_input_is_refused_before_the_model_loads(model_dirs, tmp_path, capsys, monkeypatch):
    # Inputs without any text (empty files, blank JSONL lines, an empty standard input) are named at once: neither
    # the tokenizer nor the weights load (a GGUF file's take tens of seconds), and no output is written. An empty
    # document beside others with text is scored (a line with null scores: test_matches_model_logits).
    _no_model_load(monkeypatch)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: 1 / 0)
    d = str(model_dirs["llama"])
    blank = _write(tmp_path / "blank.jsonl", ["", "   "])
    (empty := tmp_path / "empty.txt").write_bytes(b"")
    only_empty = _jsonl(tmp_path, ["", ""], name="only_empty.jsonl")
    out = tmp_path / "out.jsonl"
    for bad in ([blank], [empty], [only_empty], [empty, only_empty]):
        _fails(["--model", d, *map(str, bad), "-o", str(out)], capsys, "nothing to score",
               ", ".join(map(str, bad)) + " hold no text")
    with open(empty) as stdin:
        monkeypatch.setattr(sys, "stdin", stdin)
        _fails(["--model", d, str(blank), "-", "-o", str(out)], capsys, f"{blank}, standard input hold no text")
    assert not out.exists()


def test_no_clobber(model_dirs, tmp_path, capsys, monkeypatch):
    d = str(model_dirs["llama"])
    src = str(_jsonl(tmp_path, DOCS))
    out = tmp_path / "scores.jsonl"
    assert score.main(["--model", d, "--dtype", "fp32", "--quiet", "--no-clobber", src, "-o", str(out)]) == 0
    first = out.read_bytes()
    assert len(first.splitlines()) == len(DOCS)
    capsys.readouterr()
    _no_model_load(monkeypatch)  # refused before anything loads
    _fails(["--model", d, "-n", src, "-o", str(out)], capsys, f"--output {out} exists", "--no-clobber")
    assert out.read_bytes() == first
    # A file that appears while the run scores is not overwritten either.
    monkeypatch.undo()
    real_load = Model.load

    def appear(self):
        out2.write_bytes(b"theirs\n")
        return real_load(self)

    out2 = tmp_path / "late.jsonl"
    monkeypatch.setattr(Model, "load", appear)
    _fails(["--model", d, "--dtype", "fp32", "-n", src, "-o", str(out2)], capsys, "appeared during the run")
    assert out2.read_bytes() == b"theirs\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl", "late.jsonl", "scores.jsonl"]


def test_loading_is_announced_before_the_progress_bar(model_dirs, tmp_path, capsys):
    d = str(model_dirs["llama"])
    assert score.main(["--model", d, "--dtype", "fp32", str(_jsonl(tmp_path, DOCS))]) == 0
    err = capsys.readouterr().err
    tok, weights, bar = (err.find(s) for s in ("reading the tokenizer and config of " + d,
                                               f"loading the model {d} (", "scoring"))
    assert 0 <= tok < weights < bar, err
    assert "in float32 on cpu" in err, err


def test_fp16_overflow_is_named(tmp_path, capsys):
    # A model whose activations exceed float16's range (as Gemma's do) gives inf logits in its own forward: the
    # probe says so and names the dtype that works, instead of blaming the head.
    path = tmp_path / "loud"
    _build(path, "llama")
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        model.model.norm.weight.fill_(1e6)  # final hidden states ~1e6: past float16's 65504, fine in float32
    model.save_pretrained(path)
    src = str(_jsonl(tmp_path, DOCS))
    err = _fails(["--model", str(path), "--dtype", "fp16", "--device", "cpu", src], capsys,
                 "LlamaForCausalLM in float16", "non-finite logits", "overflow float16", "--dtype fp32")
    assert "does not know" not in err
    assert _score(["--model", str(path), "--dtype", "fp32", src], capsys)[0]["num_tokens"] > 0


def test_missing_accelerate_is_named_before_loading(model_dirs, tmp_path, capsys, monkeypatch):
    # transformers refuses a GGUF file without accelerate only after it has read the tokenizer; we say it first.
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "accelerate" else
                        find_spec(name, *a))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: 1 / 0)
    gguf_file = tmp_path / "m.gguf"
    gguf_file.write_bytes(b"GGUF")
    _fails(["--model", str(gguf_file), str(_jsonl(tmp_path, DOCS))], capsys, "needs accelerate",
           "pip install 'logitless[hf]'")


# --- file safety: the output is written whole or not at all, and never over an input --------------------------


def _tree(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file() and not p.is_symlink()}


def test_output_that_is_an_input_is_refused(model_dirs, tmp_path, capsys, monkeypatch):
    # The same file by any name (the path itself, another spelling, a hard link, a symbolic link) is refused before
    # anything is loaded or written; the input keeps every byte.
    _no_model_load(monkeypatch)
    d = str(model_dirs["llama"])
    src = _jsonl(tmp_path, DOCS)
    before = src.read_bytes()
    hard = tmp_path / "hard.jsonl"
    os.link(src, hard)
    soft = tmp_path / "soft.jsonl"
    soft.symlink_to(src)
    monkeypatch.chdir(tmp_path)
    for out in (str(src), "./docs.jsonl", f"{tmp_path}/../{tmp_path.name}/docs.jsonl", str(hard), str(soft)):
        _fails(["--model", d, str(src), "-o", out], capsys, "is the same file as the input")
        _fails(["--model", d, "docs.jsonl", "-o", out], capsys, "is the same file as the input")
    _fails(["--model", d, str(soft), "-o", str(hard)], capsys, "is the same file as the input")
    with open(src) as stdin:
        monkeypatch.setattr(sys, "stdin", stdin)
        _fails(["--model", d, "--format", "jsonl", "-", "-o", str(hard)], capsys, "the input standard input")
    assert src.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl", "hard.jsonl", "soft.jsonl"]
    # Standard output appended to an input (`>> docs.jsonl`) would be read back while it is written.
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(score.__file__))))
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([package_root, *filter(None, [os.environ.get("PYTHONPATH")])]))
    with open(hard, "a") as stdout:
        proc = subprocess.run([sys.executable, "-m", "logitless.apps.cli", "score", "--model", d, str(src)],
                              stdout=stdout, stderr=subprocess.PIPE, text=True, env=env, timeout=120)
    assert proc.returncode == 1 and "standard output is redirected to the input" in proc.stderr, proc.stderr
    assert src.read_bytes() == before


def test_failed_run_leaves_the_output_untouched(model_dirs, tmp_path, capsys, monkeypatch):
    d = str(model_dirs["llama"])
    out = tmp_path / "scores.jsonl"
    out.write_bytes(b"previous results\n")
    os.chmod(out, 0o640)
    src = _jsonl(tmp_path, DOCS)
    expected = _tree(tmp_path)
    # Before scoring: a bad line, a missing model folder, a bad option.
    bad = _write(tmp_path / "bad.jsonl", ['{"text": "fine"}', "not json"])
    expected["bad.jsonl"] = bad.read_bytes()
    _fails(["--model", d, str(bad), "-o", str(out)], capsys, "bad.jsonl:2")
    _fails(["--model", str(tmp_path / "missing"), str(src), "-o", str(out)], capsys, "does not exist")
    _fails(["--model", d, "--max-length", "4096", str(src), "-o", str(out)], capsys, "maximum positions")
    assert _tree(tmp_path) == expected
    # During scoring, after some lines were written: an error, and an interrupt.
    real = Model.score
    calls = []

    def fail_second(self, windows, want_entropy, exc):
        calls.append(1)
        if len(calls) % 2 == 0:
            raise exc
        return real(self, windows, want_entropy)

    for exc, rc in ((RuntimeError("out of memory"), None), (KeyboardInterrupt(), 130)):
        monkeypatch.setattr(Model, "score", lambda self, w, e, exc=exc: fail_second(self, w, e, exc))
        argv = ["--model", d, "--dtype", "fp32", "--batch-size", "1", "--quiet", str(src), "-o", str(out)]
        if rc is None:
            with pytest.raises(RuntimeError, match="out of memory"):
                score.main(argv)
        else:
            assert score.main(argv) == rc
        assert _tree(tmp_path) == expected
    assert os.stat(out).st_mode & 0o777 == 0o640


def test_successful_run_replaces_the_output(model_dirs, tmp_path, capsys):
    d = str(model_dirs["llama"])
    src = _jsonl(tmp_path, DOCS)
    out = tmp_path / "scores.jsonl"
    out.write_bytes(b"previous results\n" * 1000)
    os.chmod(out, 0o640)
    link = tmp_path / "link.jsonl"
    link.symlink_to(out)
    assert score.main(["--model", d, "--dtype", "fp32", "--quiet", str(src), "-o", str(link)]) == 0
    capsys.readouterr()
    lines = out.read_text(encoding="utf-8").splitlines()
    assert len(lines) == len(DOCS) and json.loads(lines[0])["id"] == "doc-0"
    assert link.is_symlink() and os.stat(out).st_mode & 0o777 == 0o640  # the link stays, the mode is kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl", "link.jsonl", "scores.jsonl"]
    # An output in a folder that does not exist is refused before anything is loaded.
    _fails(["--model", d, str(src), "-o", str(tmp_path / "no" / "such.jsonl")], capsys, "does not exist")


# --- GGUF files --------------------------------------------------------------------------------------------------


def _write_gguf(model_dir, path) -> None:
    """The llama test model and its tokenizer as an unquantized (float32) GGUF file, laid out as llama.cpp's
    converter writes one (tensor names, rotary halves of q/k interleaved, byte-level BPE vocabulary and merges)."""
    gguf = pytest.importorskip("gguf")
    np = pytest.importorskip("numpy")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = getattr(cfg, "rope_parameters", None) or {"rope_theta": cfg.rope_theta}
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    spec = json.loads(tok.backend_tokenizer.to_str())["model"]
    tokens = [f"[PAD{i}]" for i in range(cfg.vocab_size)]  # the model's spare rows, as llama.cpp names them
    for t, i in spec["vocab"].items():
        tokens[i] = t
    special = set(tok.all_special_tokens)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 5 if t.startswith("[PAD") else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["merges"]])
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    w.add_add_bos_token(True)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)

    def interleave(a, heads):  # llama.cpp's order of the rotary halves within each head
        return a.reshape(heads, 2, a.shape[0] // heads // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)

    for name, p in model.state_dict().items():
        a = p.numpy()
        if name.endswith("q_proj.weight"):
            a = interleave(a, cfg.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            a = interleave(a, cfg.num_key_value_heads)
        w.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_file(model_dirs, tmp_path, capsys):
    # A GGUF file is scored directly (model and tokenizer from the one file), by --model FILE.gguf or --gguf FILE:
    # the same numbers as the folder it was written from, in float32 and in bf16 (loaded as transformers does).
    d = model_dirs["llama"]
    path = tmp_path / "tiny-llama.gguf"
    _write_gguf(d, path)
    other = tmp_path / "tiny-llama.bin"
    os.link(path, other)
    src = str(_jsonl(tmp_path, DOCS))
    for dtype in ("fp32", "bf16"):
        ref = _score(["--model", str(d), "--per-token", "--dtype", dtype, src], capsys)
        for how in (["--model", str(path)], ["--gguf", str(other)]):
            got = _score([*how, "--per-token", "--dtype", dtype, src], capsys)
            assert [r["token_ids"] for r in got] == [r["token_ids"] for r in ref]
            a = torch.tensor(sum((r["log_probs"] for r in got), []), dtype=torch.float64)
            b = torch.tensor(sum((r["log_probs"] for r in ref), []), dtype=torch.float64)
            assert rel_err(a, b) < 1e-6, (dtype, how)


def test_version(capsys):
    from logitless import __version__
    from logitless.apps import cli

    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"logitless {__version__}\n"
