"""logitless.integrations.trl on tiny, randomly initialised models: TRL's fused-head calls through linear_log_probs.

Three copies of one model are compared, each under the error rule: a float64 copy scored naively (full float64
logits, log-softmax; the truth), a float32 copy with TRL's own fused head (PyTorch's error in the same dtype) and a
float32 copy with TRL's head and logitless.integrations.trl.patch (ours).
"""

import copy
import functools
import json
import os
import runpy
import string
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("trl")

from trl.trainer.utils import add_fused_lm_head  # noqa: E402

import logitless  # noqa: E402
from logitless.integrations import trl as ltrl  # noqa: E402
from tests.helpers import assert_within_rule  # noqa: E402

V = 97  # odd vocabulary; also the size of the test tokenizer
B, T = 3, 13
TEMPERATURE = 0.7
ALL_FIELDS = ("log_probs", "entropy", "mean_logits", "is_top1", "log_sum_sq_probs")
LLAMA_LIKE = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=64, initializer_range=0.2,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
MODELS = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", LLAMA_LIKE),  # untied head
    # A softcap of 2 on logits of std ~1, with a tied head: dropping the cap fails the test.
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", dict(LLAMA_LIKE, final_logit_softcapping=2.0,
                                                        query_pre_attn_scalar=8, sliding_window=6,
                                                        tie_word_embeddings=True)),
    "phi": ("PhiForCausalLM", "PhiConfig", dict(LLAMA_LIKE, attention_dropout=0.0, resid_pdrop=0.0,
                                                embd_pdrop=0.0)),  # a head with a bias
}


@functools.cache
def _base(name):
    model_cls, config_cls, kwargs = MODELS[name]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs))
    head = model.get_output_embeddings()
    if head.bias is not None:
        with torch.no_grad():
            head.bias.normal_(0.0, 1.0)  # the init zeroes it, which would hide a dropped bias
    return model.float().train()


def _copy(name, dtype=torch.float32, patched=False, outputs=ALL_FIELDS, **options):
    model = copy.deepcopy(_base(name)).to(dtype)
    add_fused_lm_head(model, temperature=TEMPERATURE, outputs=outputs)
    return ltrl.patch(model, **options) if patched else model


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[2, -2:] = 0  # a completion that ended early (left padding makes float64 Gemma 2 attention NaN)
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-6] = -100  # only the completion is scored, as GRPO does
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def _naive(model, input_ids, attention_mask, labels, temperature=TEMPERATURE):
    """Per-token fields from the model's full logits (its own forward, transform included), as the float64 truth."""
    logits = type(model).forward(model, input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
    z = logits / temperature
    target = labels[:, 1:]
    mask = target != -100
    logp_all = torch.log_softmax(z, -1)
    logp = logp_all.gather(-1, target.clamp(min=0)[..., None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return dict(
        log_probs=logp.masked_fill(~mask, 0), entropy=ent.masked_fill(~mask, 0),
        mean_logits=z.mean(-1).masked_fill(~mask, 0),
        log_sum_sq_probs=torch.logsumexp(2 * logp_all, -1).masked_fill(~mask, 0),
        is_top1=(z.argmax(-1) == target) & mask,
    )


def _objective(fields, seed=3):
    """An RL-like objective: advantages times log-probs plus an entropy bonus, so both carry a gradient."""
    g = torch.Generator().manual_seed(seed)
    adv = torch.randn(fields["log_probs"].shape, generator=g, dtype=torch.float64)
    return (fields["log_probs"] * adv.to(fields["log_probs"].dtype)).sum() + 0.1 * fields["entropy"].sum()


def _run(model, batch, fused=True):
    model.zero_grad(set_to_none=True)
    if fused:
        out = model(**batch, fused_lm_head=True)
        fields = {k: getattr(out, k) for k in ALL_FIELDS}
    else:
        fields = _naive(model, **batch)
    _objective(fields).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return fields, grads


@pytest.mark.parametrize("name", list(MODELS))
def test_fields_and_gradients_match_trl_within_the_rule(name):
    batch = _batch()
    with torch.no_grad():  # every other scored label the model's top token, so that is_top1 is not all False
        top = _base(name)(input_ids=batch["input_ids"]).logits.argmax(-1)
    batch["labels"][:, -5::2] = top[:, -6:-1:2]
    truth, g_truth = _run(copy.deepcopy(_base(name)).double(), batch, fused=False)
    stock, g_stock = _run(_copy(name), batch)
    ours, g_ours = _run(_copy(name, patched=True), batch)
    for field in ("log_probs", "entropy", "mean_logits", "log_sum_sq_probs"):
        assert ours[field].dtype == torch.float32 and ours[field].shape == truth[field].shape
        assert_within_rule(f"{name} {field}", ours[field], stock[field], truth[field])
    assert torch.equal(ours["is_top1"], truth["is_top1"]) and truth["is_top1"].any()
    assert torch.equal(ours["log_probs"] == 0, batch["labels"][:, 1:] == -100)  # 0 exactly where not scored
    for pname in g_truth:
        assert_within_rule(f"{name} grad {pname}", g_ours[pname], g_stock[pname], g_truth[pname])


@pytest.mark.parametrize("skip_threshold", [None, 2.0**-12])
def test_skip_threshold_reaches_the_log_probs(skip_threshold):
    # patch(skip_threshold=...) is linear_log_probs's: a fixed threshold makes a skip plan in each backward (on the
    # kernels, here through the interpreter), None none.
    from logitless import kernels

    plans = []
    batch = _batch(seed=2)
    model = _copy("llama", patched=True, backend="triton", skip_threshold=skip_threshold)
    with kernels.tuning(debug_plans=plans):
        out = model(**batch, fused_lm_head=True)
        (out.log_probs.sum() + out.entropy.sum()).backward()
    assert len(plans) == (0 if skip_threshold is None else 1)


def test_no_grad_pass_shift_labels_and_loss():
    batch = _batch(seed=1)
    stock, ours = _copy("llama", outputs=("log_probs",)), _copy("llama", patched=True, outputs=("log_probs",))
    with torch.no_grad():
        s = stock(**batch, fused_lm_head=True, num_items_in_batch=torch.tensor(7))
        o = ours(**batch, fused_lm_head=True, num_items_in_batch=torch.tensor(7))
    assert o.entropy is None and o.is_top1 is None and not o.log_probs.requires_grad
    torch.testing.assert_close(o.log_probs, s.log_probs)
    torch.testing.assert_close(o.loss, -o.log_probs.sum() / 7)
    assert torch.equal(o.label_mask, s.label_mask)
    # Pre-shifted labels are scored as given.
    shifted = dict(batch, labels=None, shift_labels=batch["labels"])
    o2 = ours(**shifted, fused_lm_head=True)
    s2 = stock(**shifted, fused_lm_head=True)
    assert o2.log_probs.shape == (B, T)
    torch.testing.assert_close(o2.log_probs, s2.log_probs)
    # The sync-free path (every position, ignored targets) gives the same values.
    ltrl.patch(ours, compact=False)
    torch.testing.assert_close(ours(**batch, fused_lm_head=True).log_probs, o.log_probs)


def test_patch_is_per_instance_and_unpatch_restores():
    model, other = _copy("llama"), _copy("llama")
    trl_forward = vars(model)["forward"]
    ltrl.patch(model)
    assert ltrl.is_patched(model) and not ltrl.is_patched(other)
    assert "forward" not in vars(type(model)) or type(model).forward is transformers.LlamaForCausalLM.forward
    batch = _batch()
    # Without fused_lm_head the call is TRL's forward, which is the model's: logits come back.
    assert model(input_ids=batch["input_ids"]).logits.shape == (B, T, V)
    ltrl.unpatch(model)
    assert vars(model)["forward"] == trl_forward and not ltrl.is_patched(model)
    with pytest.raises(ValueError, match="not patched"):
        ltrl.unpatch(model)
    with pytest.raises(ValueError, match="no TRL fused LM head"):
        ltrl.patch(copy.deepcopy(_base("llama")))
    with pytest.raises(ValueError, match="backend"):
        ltrl.patch(model, backend="cuda")
    with pytest.raises(ValueError, match="skip_threshold"):
        ltrl.patch(model, skip_threshold="always")
    with pytest.raises(TypeError, match="trainer or a model"):
        ltrl.patch(object())


def test_unsupported_head_falls_back_with_one_warning_or_raises():
    model = _copy("llama")
    model.lm_head.register_forward_hook(lambda m, i, o: o * 2)
    with pytest.warns(UserWarning, match="forward hooks"):
        ltrl.patch(model)
        out = model(**_batch(), fused_lm_head=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        again = model(**_batch(), fused_lm_head=True)
    torch.testing.assert_close(again.log_probs, out.log_probs)
    stock = _copy("llama")
    stock.lm_head.register_forward_hook(lambda m, i, o: o * 2)
    torch.testing.assert_close(out.log_probs, stock(**_batch(), fused_lm_head=True).log_probs)  # TRL's own head
    with pytest.raises(ltrl.UnsupportedModelError, match="forward hooks"):
        ltrl.patch(model, strict=True)


# --- A few GRPO steps, stock and patched, from the same seed --------------------------------------------------------

def _tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = (string.digits + string.ascii_letters + string.punctuation)[: V - 3]
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>",
                                                eos_token="<eos>", padding_side="left")


def _reward(completions, **kwargs):
    return [float(sum(map(ord, c)) % 11) for c in completions]


def _naive_head(model, *args, fused_lm_head=False, labels=None, **kwargs):
    """The float64 run's fused head: full float64 logits, log-softmax (the truth of the training run)."""
    if not fused_lm_head:
        return type(model).forward(model, *args, labels=labels, **kwargs)
    from trl.trainer.utils import FusedCausalLMOutput

    kwargs.pop("num_items_in_batch", None)
    f = _naive(model, kwargs["input_ids"], kwargs["attention_mask"], labels, temperature=GRPO_TEMPERATURE)
    mask = labels[:, 1:] != -100
    return FusedCausalLMOutput(loss=-f["log_probs"].sum() / mask.sum(), log_probs=f["log_probs"],
                               entropy=f["entropy"], label_mask=mask)


GRPO_TEMPERATURE = 0.9


def _grpo(tmp_path, kind):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    dtype = torch.float64 if kind == "truth" else torch.float32
    model = copy.deepcopy(_base("llama")).to(dtype)
    saved = tmp_path / "model"
    if not saved.exists():
        model.save_pretrained(saved)
    model.config._name_or_path = str(saved)  # GRPO loads its reference model from the policy's path
    args = GRPOConfig(
        output_dir=str(tmp_path / kind), per_device_train_batch_size=4, num_generations=2, max_completion_length=5,
        max_steps=4, num_iterations=2, beta=0.1, temperature=GRPO_TEMPERATURE, learning_rate=0.5, optim="sgd",
        lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, seed=0,
        bf16=False, disable_tqdm=True,
    )
    # Prompts of one length: left padding makes float64 attention NaN at the padded positions.
    dataset = Dataset.from_dict({"prompt": ["abc", "xyz", "hey", "Q7!"]})
    trainer = GRPOTrainer(model=model, reward_funcs=_reward, args=args, train_dataset=dataset,
                          processing_class=_tokenizer())
    if kind == "truth":
        for m in (trainer.model, trainer.ref_model):
            m.forward = functools.partial(_naive_head, m)
        # Completions sampled in float32 from the float64 weights, so that all three runs draw the same tokens
        # (sampling from float64 probabilities takes other random numbers).
        shadow = copy.deepcopy(_base("llama"))

        def generate(*a, **kw):
            shadow.load_state_dict({k: v.float() for k, v in trainer.model.state_dict().items()})
            return shadow.generate(*a, **kw)

        trainer.model.generate = generate
    elif kind == "ours":
        ltrl.patch(trainer)
        assert ltrl.is_patched(trainer.model) and ltrl.is_patched(trainer.ref_model)
    losses = []
    compute_loss = trainer.compute_loss

    def recorded(*a, **kw):
        loss = compute_loss(*a, **kw)
        losses.append(loss.detach().double())
        return loss

    trainer.compute_loss = recorded
    trainer.train()
    params = {n: p.detach().double().clone() for n, p in trainer.model.named_parameters()}
    return torch.stack(losses), params


def test_grpo_steps_match_stock_within_the_rule(tmp_path, monkeypatch):
    truth, p_truth = _grpo(tmp_path, "truth")
    stock, p_stock = _grpo(tmp_path, "stock")
    grad_modes = []

    def spy(*args, **kwargs):
        grad_modes.append(torch.is_grad_enabled())
        return logitless.linear_log_probs(*args, **kwargs)

    monkeypatch.setattr(ltrl, "linear_log_probs", spy)
    ours, p_ours = _grpo(tmp_path, "ours")
    # 2 generations x 2 iterations: the loss passes, and per generation the old policy's and the reference model's
    # no-grad passes, all through linear_log_probs.
    assert len(ours) == len(truth) == 4
    assert grad_modes.count(True) == 4 and grad_modes.count(False) == 4
    assert (truth[1:].abs() > 1e-3).all()  # the first loss is 0: ratio 1, advantages of mean 0, no KL yet
    assert_within_rule("grpo losses", ours, stock, truth)
    moved = sum(float((p_truth[n] - _base("llama").state_dict()[n].double()).abs().max()) for n in p_truth)
    assert moved > 1e-3  # the steps changed the weights
    for n in p_truth:
        assert_within_rule(f"grpo param {n}", p_ours[n], p_stock[n], p_truth[n])


# --- Peak memory of the log-prob pass ------------------------------------------------------------------------------

MEMORY_SCRIPT = textwrap.dedent("""
    import json, sys, torch

    def rss_kib(field):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1])

    which = sys.argv[1]
    N, D, V, TEMP = 512, 64, 65536, 0.9
    torch.manual_seed(0)
    x = torch.randn(N, D).requires_grad_(True)
    w = (torch.randn(V, D) / D ** 0.5).requires_grad_(True)
    t = torch.randint(0, V, (N,))
    if which == "trl":
        from trl.kernels.chunked_logprob import ChunkedLogProbFunction
        from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE
        run = lambda x, w, t: ChunkedLogProbFunction.apply(x, w, None, t, TEMP, _CHUNKED_LOGPROB_CHUNK_SIZE, None,
                                                           1.0, ("log_probs", "entropy"))[:2]
    else:
        import logitless
        run = lambda x, w, t: logitless.linear_log_probs(x, w, t, temperature=TEMP, return_entropy=True,
                                                         backend="torch")
    lp, ent = run(x[:8], w[:512], t[:8] % 512)  # warm-up: thread pools and code loaded before the baseline
    (lp.sum() + ent.sum()).backward()
    x.grad = None; w.grad = None
    grad_bytes = x.numel() * 4 + w.numel() * 4
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = rss_kib("VmRSS")
    lp, ent = run(x, w, t)
    (lp.sum() + 0.1 * ent.sum()).backward()
    peak = rss_kib("VmHWM")
    print(json.dumps({"extra_bytes": peak * 1024 - base * 1024 - grad_bytes, "logits_bytes": N * V * 4,
                      "lp": float(lp.double().sum())}))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self for peak RSS")
def test_log_prob_pass_peak_memory_below_trl():
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin",
           "PYTHONPATH": str(Path(logitless.__file__).resolve().parents[1])}
    res = {}
    for which in ("trl", "logitless"):
        out = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, which], capture_output=True, text=True,
                             timeout=300, env=env)
        assert out.returncode == 0, out.stderr
        res[which] = json.loads(out.stdout.strip().splitlines()[-1])
    assert abs(res["trl"]["lp"] - res["logitless"]["lp"]) < 1e-3 * abs(res["trl"]["lp"])
    ours, theirs, logits = res["logitless"]["extra_bytes"], res["trl"]["extra_bytes"], res["trl"]["logits_bytes"]
    # TRL's head holds (tokens x 32768) float32 tiles and their temporaries; ours stays within the memory policy.
    assert ours < logits / 10 + (4 << 20), f"ours {ours / 2**20:.1f} MiB, logits {logits / 2**20:.0f} MiB"
    assert ours < theirs / 3, f"ours {ours / 2**20:.1f} MiB vs TRL's {theirs / 2**20:.1f} MiB"


def test_example_runs(monkeypatch, capsys):
    # examples/rl_grpo.py, the README's TRL section in full: one GRPO step, patched.
    monkeypatch.setattr(sys, "argv", ["rl_grpo.py", "--steps", "1", "--vocab", "128"])
    runpy.run_path(str(Path(__file__).resolve().parent.parent / "examples" / "rl_grpo.py"), run_name="__main__")
    assert "step   1  loss" in capsys.readouterr().out


def test_gpu_trl_tool_variants_and_interleaving(tmp_path):
    """tools/gpu_trl.py on CPU with its 2-layer model: a --variant adds a process of its own, --interleave times
    both heads on one model over rounds that start with either provider."""
    tool = Path(__file__).resolve().parent.parent / "tools" / "gpu_trl.py"
    out = tmp_path / "trl.json"
    res = subprocess.run([sys.executable, str(tool), "--tiny", "--batch", "2", "--prompt", "8", "--completion", "16",
                          "--repeats", "1", "--variant", "skip_wide=64", "--interleave", "3", "--json", str(out)],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [r["provider"] for r in report["rows"]] == ["trl", "logitless", "logitless[skip_wide=64]"]
    assert report["agree"] and set(report["logitless_over_trl"]) == {"on", "on logitless[skip_wide=64]"}
    ab = report["rows"][1]["interleaved"]
    assert ab["rounds"] == 3 and ab["trl_train_s"] > 0 and ab["logitless_no_grad_s"] > 0
    assert "interleaved" not in report["rows"][2]  # a variant's process times itself only
    assert not list(tmp_path.glob("gpu_trl_*"))  # its scratch files are gone
