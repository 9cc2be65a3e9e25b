"""`logitless bench --job finetune` end to end on a tiny randomly initialised Llama built here (no download), and
its precision rule on made-up loss trajectories."""

import json
import math

import pytest

from logitless.apps.bench import finetune, finetune_cli, finetune_report

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A 2-layer Llama with a byte-level BPE tokenizer of 384 tokens trained on the job's own text."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from logitless.apps.bench import real

    folder = tmp_path_factory.mktemp("tiny-llama")
    prose, code, _ = real.corpus()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=["<s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(prose[:12] + code[:1], trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>")
    fast.save_pretrained(str(folder))
    torch.manual_seed(0)
    conf = transformers.LlamaConfig(vocab_size=len(fast), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                    bos_token_id=fast.bos_token_id, tie_word_embeddings=True)
    transformers.LlamaForCausalLM(conf).save_pretrained(str(folder))
    return folder


def test_finetune_job_runs_checks_and_reports(tiny_llama, tmp_path, monkeypatch, capsys):
    from logitless.apps.bench.cli import main

    # The variants' processes inherit it: at these sizes a second thread only waits on the first (on a busy
    # machine, OpenMP's barrier made a 32-wide matrix product take 16 ms instead of 10 us).
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "out"
    rc = main(["--job", "finetune", "--device", "cpu", "--model-file", str(tiny_llama), "--batch", "2", "--seq",
               "16", "--steps", "5", "--warmup", "1", "--check-steps", "4", "--lr", "1e-3", "--out", str(out),
               "--no-progress", "--no-clobber"])
    assert rc == 0
    # --no-clobber: a second run into the same folder is refused before it trains, the files left as they are.
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert sorted(before) == ["finetune.json", "finetune.md", "finetune.svg", "finetune.txt"]
    monkeypatch.setattr(finetune_cli, "run", lambda *a, **k: 1 / 0)
    with pytest.raises(SystemExit) as e:
        main(["--job", "finetune", "--device", "cpu", "--model-file", str(tiny_llama), "--out", str(out), "-n"])
    assert e.value.code == 2 and "already holds finetune.txt" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    res = json.loads((out / "finetune.json").read_text())
    ref = res["reference"]
    assert ref["status"] == "ok" and ref["dtype"] == "fp64" and len(ref["losses"]) == 4
    hf, ours = res["variants"]["hf"], res["variants"]["logitless"]
    for r in (hf, ours):
        assert r["status"] == "ok" and r["check"] == "ok", r
        assert len(r["losses"]) == 5 and all(math.isfinite(x) for x in r["losses"])
        assert r["median_ms"] > 0 and r["tokens_per_s"] > 0 and r["peak_step_bytes"] > 0
        assert len(r["step_ms"]) == 5 - 1 - 1  # after the warm-up step and the step that measures the memory
    # Training on text lowers the loss of a random model; and the runs are the same steps on the same batches:
    # float32 against float64 agree to far better than the loss's change.
    assert hf["losses"][3] < hf["losses"][0]
    assert max(abs(a - b) for a, b in zip(ours["losses"][:4], ref["losses"], strict=True)) < 1e-4
    text = (out / "finetune.txt").read_text()
    assert "losses of the first 5 steps" in text and "logitless" in text
    assert (out / "finetune.svg").read_text().startswith("<svg")


def test_rule_refuses_a_diverging_trajectory():
    ref = [5.0, 4.8, 4.6, 4.4]
    scale = [5.0, 4.799, 4.602, 4.401]  # errors 0, 1e-3, 2e-3, 1e-3: tolerance 2x the largest, 4e-3
    close = [5.0015, 4.8019, 4.5965, 4.404]  # the first step's error is not held to stock's (by chance zero) own
    assert finetune.judge(ref, scale, close, 4)["ok"]
    drift = [5.0015, 4.8019, 4.61, 4.5]
    v = finetune.judge(ref, scale, drift, 4)
    assert not v["ok"] and v["first_bad_step"] == 3
    assert not finetune.judge(ref, scale, [5.0, 4.8, math.nan, 4.4], 4)["ok"]
    assert not finetune.judge(ref, scale, close[:3], 4)["ok"]  # fewer steps than asked is no pass


def test_finetune_refuses_bad_options(tiny_llama, capsys):
    from logitless.apps.bench.cli import main

    for argv, words in ((["--job", "finetune,train"], "runs alone"),
                        (["--job", "finetune", "--providers", "nope"], "unknown finetune variant"),
                        (["--job", "finetune", "--shape", "8,8,8"], "does not apply"),
                        (["--job", "train", "--steps", "3"], "finetune only"),
                        (["--job", "finetune", "--steps", "2"], "--warmup")):
        with pytest.raises(SystemExit):
            main([*argv, "--device", "cpu", "--model-file", str(tiny_llama), "--no-progress"])
        assert words in capsys.readouterr().err


@pytest.mark.parametrize("time_failing", [False, True])
def test_a_diverging_variant_is_refused(monkeypatch, time_failing):
    ref = [5.0, 4.8, 4.6, 4.4]
    losses = {"hf": [5.0, 4.801, 4.602, 4.401], "logitless": [5.0, 4.801, 4.61, 4.5],
              "hf-compile": [5.0, 4.8, 4.601, 4.402]}
    info = {"model": "m", "source": "m.gguf", "model_type": "llama", "V": 10, "params": 1000, "text": "t"}
    monkeypatch.setattr(finetune, "prepare", lambda cfg, work, log: info)
    monkeypatch.setattr(finetune, "run_reference", lambda work, cfg: {"variant": "reference", "status": "ok",
                                                                     "losses": ref, "wall_s": 1.0})
    monkeypatch.setattr(finetune, "run_process", lambda work, name, cfg, steps: {
        "variant": name, "status": "ok", "error": "", "losses": losses[name], "median_ms": 10.0,
        "tokens_per_s": 100.0, "peak_step_bytes": 2**20, "peak_total_bytes": None, "first_step_s": 1.0,
        "step_ms": [10.0], "wall_s": 2.0})
    cfg = finetune.Config(device="cpu", dtype="fp32", batch=1, seq=8, steps=4, warmup=1, check_steps=4, lr=1e-3,
                          seed=0, variants=["hf", "logitless", "hf-compile"], time_failing=time_failing)
    res = finetune.run(cfg, log=lambda msg: None)
    bad = res["variants"]["logitless"]
    assert bad["status"] == "failed check" and bad["checks"]["first_bad_step"] == 3
    assert "at step 3" in bad["error"]
    assert ("median_ms" in bad) == time_failing  # refused: no time or memory unless asked
    assert res["variants"]["hf-compile"]["check"] == "ok" and res["variants"]["hf-compile"]["median_ms"] == 10.0
    text = finetune_report.tables(res)
    assert "FAIL" in text and "diverge" in text


def test_profile_busy_time_is_the_union_of_kernel_intervals():
    from logitless.apps.bench.finetune_profile import busy

    assert busy([]) == 0.0
    assert busy([(0.0, 2.0), (5.0, 6.0)]) == 3.0  # apart
    assert busy([(0.0, 4.0), (1.0, 2.0), (3.0, 6.0)]) == 6.0  # one inside another, one overlapping its end
    assert busy([(3.0, 6.0), (0.0, 4.0)]) == 6.0  # in any order


@pytest.mark.gpu
def test_profile_finds_a_synchronising_step():
    # A step whose .item() waits for the device: the sync sites name it, and the device's busy time is within the
    # profiled wall time.
    import torch

    from logitless.apps.bench.finetune_profile import profile

    w = torch.randn(1024, 1024, device="cuda")

    def step(ids):
        return float((ids @ w).sum().item())

    out = profile(step, [torch.randn(512, 1024, device="cuda") for _ in range(3)], steps=2)
    assert out["sync_sites"], out
    assert out["event_ms"] > 0 and out["issue_ms"] > 0
    assert 0 < out["gpu_busy_ms"] <= out["wall_ms"] + 1e-3
    assert out["kernels_ms"] and all(t >= 0 for _, t in out["kernels_ms"])
    assert [n for n, _ in out["kernel_launches"]] == [n for n, _ in out["kernels_ms"]]
    assert all(c > 0 for _, c in out["kernel_launches"])
    assert abs(out["kernel_ms_total"] - sum(t for _, t in out["kernels_ms"])) < 1e-6
