"""`logitless detect`: the Binoculars fields against the two models' own float64 logits, and its refusals.

Two tiny random Llamas (different seeds) share one tiny BPE tokenizer, saved to a temporary folder (no downloads).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import assert_within_rule

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from logitless.apps import cli, detect  # noqa: E402

VOCAB = 300
CORPUS = ["The quick brown fox jumps over the lazy dog.", "Language models assign a probability to every token.",
          "Perplexity is the exponential of the mean negative log-likelihood."]
DOCS = ["The lazy dog sleeps over the brown fox.", "A", "Language models jump.", ""]


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=280, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def _build(path, seed, vocab=VOCAB, softcap=None):
    torch.manual_seed(seed)
    cls, extra = (transformers.LlamaConfig, {}) if softcap is None else (
        transformers.Gemma2Config, dict(head_dim=8, final_logit_softcapping=softcap))
    cfg = cls(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, **extra)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # logits spread over about +-8, as a trained model's: peaked, distinct distributions
        head = model.get_output_embeddings()
        head.weight.mul_(4.0 / model(input_ids=torch.arange(2, 40)[None]).logits.std())
    model.save_pretrained(path)
    _tokenizer().save_pretrained(path)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("detect")
    out = {"observer": root / "observer", "performer": root / "performer", "wide": root / "wide",
           "capped": root / "capped"}
    _build(out["observer"], 1)
    _build(out["performer"], 2)
    _build(out["wide"], 3, vocab=VOCAB + 8)
    _build(out["capped"], 4, softcap=5.0)
    yield out
    torch.set_num_threads(before)


def _truth(obs_dir, perf_dir, texts, dtype):
    """Per document: the observer's -log p of each next token and -sum_j p_perf log p_obs of each prediction,
    from the models' own logits (one document per forward) in `dtype`."""
    tok = transformers.AutoTokenizer.from_pretrained(obs_dir)
    obs = transformers.AutoModelForCausalLM.from_pretrained(obs_dir, dtype=dtype).eval()
    perf = transformers.AutoModelForCausalLM.from_pretrained(perf_dir, dtype=dtype).eval()
    out = []
    for text in texts:
        ids = torch.tensor([tok(text)["input_ids"]])
        with torch.no_grad():
            lo = torch.log_softmax(obs(input_ids=ids).logits[0, :-1], -1)
            lp = torch.log_softmax(perf(input_ids=ids).logits[0, :-1], -1)
        nll = -lo.gather(1, ids[0, 1:, None])[:, 0]
        out.append((nll, -(lp.exp() * lo).sum(-1)))
    return out


def _detect(argv, capsys):
    rc = cli.main(["detect", *argv, "--quiet", "--dtype", "fp32", "--backend", "torch"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return [json.loads(line) for line in out.splitlines()]


def test_fields_match_the_models(dirs, tmp_path, capsys):
    # per-token values and the document means within the error rule (float32 against float64, PyTorch's float32
    # logits as the yardstick); empty and one-token documents give no tokens and null scores
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(DOCS)))
    recs = _detect([str(path), "--observer", str(dirs["observer"]), "--performer", str(dirs["performer"]),
                    "--per-token", "--batch-size", "3"], capsys)
    assert [r["id"] for r in recs] == list(range(len(DOCS)))
    truth = _truth(dirs["observer"], dirs["performer"], DOCS, torch.float64)
    same = _truth(dirs["observer"], dirs["performer"], DOCS, torch.float32)
    for rec, (nll, x), (nll32, x32) in zip(recs, truth, same, strict=True):
        assert rec["num_tokens"] == nll.numel()
        if nll.numel() == 0:
            assert rec["nll"] is None and rec["binoculars"] is None
            continue
        assert_within_rule("nll", torch.tensor(rec["nlls"]), nll32, nll, tiny=1e-5)
        assert_within_rule("cross_nll", torch.tensor(rec["cross_nlls"]), x32, x, tiny=1e-5)
        assert abs(rec["nll"] - nll.mean().item()) <= 1e-5 * nll.mean().item()
        assert abs(rec["cross_nll"] - x.mean().item()) <= 1e-5 * x.mean().item()
        assert abs(rec["binoculars"] - nll.mean().item() / x.mean().item()) <= 1e-4
    # swapping the models swaps the roles: the observer's NLL becomes the other model's
    swapped = _detect([str(path), "--observer", str(dirs["performer"]), "--performer", str(dirs["observer"])],
                      capsys)
    assert swapped[0]["nll"] != recs[0]["nll"]


def test_truncation(dirs, tmp_path, capsys):
    path = tmp_path / "long.txt"
    path.write_text(" ".join(CORPUS))
    (rec,) = _detect([str(path), "--observer", str(dirs["observer"]), "--performer", str(dirs["performer"]),
                      "--max-length", "9"], capsys)
    assert rec["num_tokens"] == 8


@pytest.mark.parametrize("other,needle", [("wide", "classes"), ("capped", "differently")])
def test_refuses_unrelated_models(dirs, tmp_path, capsys, other, needle):
    path = tmp_path / "a.txt"
    path.write_text("The dog.")
    rc = detect.main([str(path), "--observer", str(dirs["observer"]), "--performer", str(dirs[other]),
                      "--dtype", "fp32", "--backend", "torch", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 1 and needle in err and err.count("\n") == 1


def test_no_clobber_and_empty_input_are_refused_before_the_models_load(dirs, tmp_path, capsys, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    models = ["--observer", str(dirs["observer"]), "--performer", str(dirs["performer"])]
    text, empty, out = tmp_path / "a.txt", tmp_path / "empty.txt", tmp_path / "out.jsonl"
    text.write_text("The dog.")
    empty.write_text("")
    out.write_text("theirs\n")
    for argv, words in (([str(text), "-o", str(out), "--no-clobber"], f"--output {out} exists"),
                        ([str(empty), "-o", str(tmp_path / "new.jsonl")], f"{empty} hold no text")):
        assert detect.main([*argv, *models, "--quiet"]) == 1
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1, err
    assert out.read_text() == "theirs\n" and not (tmp_path / "new.jsonl").exists()
