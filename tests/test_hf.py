"""logitless.patch on tiny, randomly initialised transformers causal LMs: same loss and gradients as the stock model.

Each comparison runs three copies of one model in training mode: float64 stock (the truth), float32 stock (PyTorch's
own error) and float32 patched (ours), and applies the error rule to the loss and every parameter's gradient.
"""

import copy
import functools
import inspect
import os
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

import logitless  # noqa: E402
from logitless import testing  # noqa: E402
from logitless.integrations import heads, hf  # noqa: E402
from tests.helpers import assert_within_rule, spy_later_grads  # noqa: E402

V = 97  # odd vocabulary
B, T = 3, 11
NO_DROPOUT = dict(attention_dropout=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
LLAMA_LIKE = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=64, initializer_range=0.2,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)

# name -> (model class, config class, config kwargs); one line of reason each.
MODELS = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", LLAMA_LIKE),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(LLAMA_LIKE, sliding_window=6)),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(LLAMA_LIKE, attention_dropout=0.0)),  # q/k/v biases
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", LLAMA_LIKE),  # q/k norms
    # Softcap 2 on logits of std ~1: far from the identity, so dropping it fails the test.
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", dict(LLAMA_LIKE, final_logit_softcapping=2.0,
                                                        query_pre_attn_scalar=8, sliding_window=6)),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", dict(LLAMA_LIKE, resid_pdrop=0.0, embd_pdrop=0.0)),
    "phi": ("PhiForCausalLM", "PhiConfig", dict(LLAMA_LIKE, **NO_DROPOUT)),  # lm_head with a bias
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", dict(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                                   initializer_range=0.2, attn_pdrop=0.0, resid_pdrop=0.0,
                                                   embd_pdrop=0.0)),  # tied head
    "cohere": ("CohereForCausalLM", "CohereConfig", dict(LLAMA_LIKE, logit_scale=0.5)),  # logits * scale, tied
    "granite": ("GraniteForCausalLM", "GraniteConfig", dict(LLAMA_LIKE, logits_scaling=4.0)),  # logits / scale
    # hidden states / scale before the head: logits_scaling = hidden_size / dim_model_base = 4; tied head.
    "minicpm3": ("MiniCPM3ForCausalLM", "MiniCPM3Config", dict(LLAMA_LIKE, num_key_value_heads=4, dim_model_base=8,
                                                              q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                                                              qk_rope_head_dim=8, v_head_dim=8)),
    # MoE with the router loss off; eager experts because the grouped matmul has no float64.
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(LLAMA_LIKE, num_local_experts=3, num_experts_per_tok=2,
                                                            experts_implementation="eager")),
}

if hasattr(transformers, "HyperCLOVAXForCausalLM"):  # logits * scale, where Granite divides by the same attribute
    MODELS["hyperclovax"] = ("HyperCLOVAXForCausalLM", "HyperCLOVAXConfig", dict(LLAMA_LIKE, logits_scaling=0.25))


@functools.cache
def _base(name):
    model_cls, config_cls, kwargs = MODELS[name]
    config = getattr(transformers, config_cls)(**kwargs)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config)
    head = model.get_output_embeddings()
    if head.bias is not None:
        with torch.no_grad():
            head.bias.normal_(0.0, 1.0)  # the init zeroes it, which would hide a dropped bias
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model.float().train()


def model_copy(name, dtype=torch.float32, patched=False, **options):
    model = copy.deepcopy(_base(name)).to(dtype)
    return logitless.patch(model, **options) if patched else model


def batch(seed=0, padded=True):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (B, T), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100  # prompt tokens
    mask = torch.ones(B, T, dtype=torch.long)
    if padded:
        labels[2, -3:] = -100  # right padding
        mask[2, -3:] = 0
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def shift_targets(n_rows, n_cols, seed=1):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, V, (n_rows, n_cols), generator=g)
    t[torch.rand(n_rows, n_cols, generator=g) < 0.3] = -100
    return t


def run(model, kwargs):
    model.zero_grad(set_to_none=True)
    out = model(**kwargs)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return out, grads


def compare(name, kwargs, dtype=torch.float32, truth_kwargs=None, stock_kwargs=None, **options):
    truth, g_truth = run(model_copy(name, torch.float64), truth_kwargs or kwargs)
    stock, g_stock = run(model_copy(name, dtype), stock_kwargs or kwargs)
    ours, g_ours = run(model_copy(name, dtype, patched=True, **options), kwargs)
    assert ours.logits is None and stock.logits is not None
    assert type(ours) is type(stock)
    assert ours.loss.dtype == stock.loss.dtype == torch.float32
    assert_within_rule(f"{name} loss", ours.loss, stock.loss, truth.loss)
    assert g_ours.keys() == g_truth.keys()
    for pname in g_truth:
        assert_within_rule(f"{name} grad {pname}", g_ours[pname], g_stock[pname], g_truth[pname])
    return ours, stock


def case_kwargs(case):
    kw = batch()
    if case == "num_items_tensor":
        # Gradient accumulation: the count covers more tokens than this micro-batch holds.
        kw["num_items_in_batch"] = (kw["labels"][:, 1:] != -100).sum() * 2 + 3
    elif case == "num_items_int":
        kw["num_items_in_batch"] = 41
    elif case == "shift_labels":
        kw["shift_labels"] = shift_targets(B, T)
    elif case == "keep_int":
        kw["logits_to_keep"] = 5
        kw["shift_labels"] = shift_targets(B, 5)
    elif case == "keep_positions":
        kw["logits_to_keep"] = torch.tensor([0, 4, 7, 10])
        kw["shift_labels"] = shift_targets(B, 4)
    return kw


CASES = ("padded", "num_items_tensor", "num_items_int", "shift_labels", "keep_int", "keep_positions")


# Every model with padding, every case on llama and gemma2 (softcap) in the quick subset; the rest of the grid
# (each case's slicing and reduction is the same code for every model) is marked slow.
@pytest.mark.parametrize("name, case", [
    pytest.param(n, c, marks=() if c == "padded" or n in ("llama", "gemma2") else pytest.mark.slow)
    for n in sorted(MODELS) for c in CASES
])
def test_matches_stock(name, case):
    compare(name, case_kwargs(case))


def test_tied_and_biased_heads_are_what_the_grid_covers():
    # The grid's gpt2 and cohere cases test a tied head, phi a head with a bias; make sure the configs still do.
    gpt2, cohere, phi = _base("gpt2"), _base("cohere"), _base("phi")
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight
    assert cohere.lm_head.weight is cohere.model.embed_tokens.weight
    assert phi.lm_head.bias is not None


# One model per kind of logit transform, each far from the identity here (a scale of 4 or 1/4 on logits of std ~1, a
# softcap of 2 on them), so that a transform left out or applied the wrong way round fails both comparisons.
TRANSFORMS = {
    "multiply": "hyperclovax" if "hyperclovax" in MODELS else "cohere",
    "divide": "granite",
    "hidden": "minicpm3",
    "softcap": "gemma2",
}
EXPECTED_TRANSFORM = {
    "hyperclovax": heads.LogitTransform(logit_scale=0.25), "cohere": heads.LogitTransform(logit_scale=0.5),
    "granite": heads.LogitTransform(logit_scale=0.25), "minicpm3": heads.LogitTransform(hidden_scale=0.25),
    "gemma2": heads.LogitTransform(softcap=2.0),
}


@pytest.mark.parametrize("kind", sorted(TRANSFORMS))
def test_logit_transform_matches_the_model(kind):
    # The transform heads finds, then patch()'s loss and gradients, and score's per-token log-probs (its head on the
    # backbone's hidden states), each within the error rule of the model's own forward in float32, against float64.
    from logitless.apps.model import head_log_probs

    name = TRANSFORMS[kind]
    assert heads.find_transform(_base(name)) == EXPECTED_TRANSFORM[name]
    compare(name, batch())
    kw = {k: v for k, v in batch().items() if k != "labels"}
    targets = kw["input_ids"][:, 1:].reshape(-1)

    def own(dtype):
        logits = model_copy(name, dtype).eval()(**kw).logits[:, :-1].reshape(-1, V)
        return torch.log_softmax(logits, dim=-1).gather(1, targets[:, None])[:, 0]

    model = model_copy(name).eval()
    head = heads.find_head(model)
    with torch.no_grad():
        hidden = head.backbone(**kw).last_hidden_state[:, :-1].reshape(-1, head.weight.shape[1])
        ours = head_log_probs(head, hidden, targets, backend="torch")
        assert_within_rule(f"{name} log-probs", ours, own(torch.float32), own(torch.float64))


def _forward_text(class_name):
    """The source of a transformers class's forward, read from its file without importing the module (importing
    every causal LM of transformers takes seconds); None where it cannot be found."""
    module = getattr(transformers, "_class_to_module", {}).get(class_name)
    if module is None:
        return None
    path = os.path.join(os.path.dirname(transformers.__file__), *module.split(".")) + ".py"
    with open(path, encoding="utf-8") as f:
        text = f.read()
    end = r"(?=^    (?:@|def |async def )|^\S)"  # the next method, or the end of the class
    cls = re.search(rf"^class {class_name}\(.*?^    def forward\(.*?{end}", text, re.S | re.M)
    return cls.group(0)[cls.group(0).index("    def forward("):] if cls else None


def test_transform_rules_match_the_installed_transformers():
    # Every rule names what its class's forward does (the pattern, operator included, is found in its source), and
    # every causal LM of the installed transformers whose forward transforms its logits has rules: a model added to
    # transformers with a new transform fails here rather than being trained or scored on the wrong logits.
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    checked = 0
    for model_type, class_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        text = _forward_text(class_name if isinstance(class_name, str) else class_name[0])
        if text is None:
            continue
        src = heads._code_only(text)
        lines = heads.transform_lines(src)
        rules = heads.RULES.get(model_type)
        if rules is None:
            assert not lines, f"{class_name} ({model_type}) transforms its logits without a rule: {lines}"
            continue
        for rule in rules:
            found = re.search(rule.pattern(), src) is not None
            # Gemma 3's multimodal forward has no softcap in some transformers versions: a rule may then not apply,
            # but one that transforms must.
            assert found or not lines, f"{class_name}: {rule} does not match its forward"
            checked += found
    assert checked >= len(TRANSFORMS)  # the families of the tests above at least


def test_unknown_logit_transform_is_refused(monkeypatch):
    # A model type without rules whose forward scales its logits: patch refuses it (and scoring would too).
    monkeypatch.delitem(heads.RULES, "granite")
    with pytest.raises(NotImplementedError, match="logits_scaling"):
        logitless.patch(model_copy("granite"))
    with pytest.raises(heads.UnknownTransformError, match="no rule"):
        heads.find_head(_base("granite"))
    heads.find_head(_base("llama"))  # a plain head needs no rule


def test_head_fed_by_another_module_is_refused():
    # A head applied to another module's output (a prediction MLP between the backbone and the output embedding)
    # is not hidden @ W.T: the fused loss would not be the model's.
    model = model_copy("llama")
    src = heads._code_only(inspect.getsource(type(model).forward)).replace("self.lm_head(", "self.lm_head(self.norm(")
    assert not heads.head_applied_directly(model, model.lm_head, src)
    assert heads.head_applied_directly(model, model.lm_head, heads.forward_source(model))


def test_keep_boolean_mask():
    # A 2-D boolean logits_to_keep keeps a different number of positions per row (packed sequences).
    if "bool" not in (transformers.modeling_utils.slice_logits_to_keep.__doc__ or ""):
        pytest.skip("this transformers version has no boolean logits_to_keep")
    keep = torch.rand(B, T, generator=torch.Generator().manual_seed(3)) < 0.5
    kw = dict(batch(), logits_to_keep=keep, shift_labels=shift_targets(1, int(keep.sum())).reshape(-1))
    compare("llama", kw)


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_bfloat16(name):
    compare(name, batch(), dtype=torch.bfloat16)


def test_patch_keeps_the_model_as_transformers_loads_it(tmp_path):
    # from_pretrained(dtype=bfloat16) keeps RoPE's inv_freq in float32; patching and a fused training step must
    # leave every buffer as it is (dtype and values), and the loss is that of this model, not of a cast one.
    _base("llama").save_pretrained(tmp_path)
    load = lambda dtype: transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype).train()
    model = load(torch.bfloat16)
    before = {n: b.clone() for n, b in model.named_buffers()}
    assert any(b.dtype == torch.float32 for n, b in before.items() if "inv_freq" in n)
    logitless.patch(model)
    ours, g_ours = run(model, batch())
    after = dict(model.named_buffers())
    assert after.keys() == before.keys()
    for n, b in before.items():
        assert after[n].dtype == b.dtype and torch.equal(after[n], b), n
    stock, g_stock = run(load(torch.bfloat16), batch())
    truth, g_truth = run(load(torch.float64), batch())
    assert_within_rule("loss", ours.loss, stock.loss, truth.loss)
    for pname in g_truth:
        assert_within_rule(f"grad {pname}", g_ours[pname], g_stock[pname], g_truth[pname])


def test_cpu_autocast():
    # float32 weights under bfloat16 autocast: the head runs in bfloat16, as nn.Linear does there.
    kw = batch()
    truth, g_truth = run(model_copy("llama", torch.float64), kw)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        stock, g_stock = run(model_copy("llama"), kw)
        ours, g_ours = run(model_copy("llama", patched=True), kw)
    assert ours.logits is None
    assert_within_rule("loss", ours.loss, stock.loss, truth.loss)
    for pname in g_truth:
        assert_within_rule(pname, g_ours[pname], g_stock[pname], g_truth[pname])


@pytest.mark.parametrize("smoothing,z_loss", [(0.1, 0.0), (0.0, 1e-2), (0.2, 1e-3)])
def test_options_reach_the_loss(smoothing, z_loss):
    # Against F.cross_entropy (+ z-loss) on the stock model's own shifted logits.
    kw = batch()
    target = torch.nn.functional.pad(kw["labels"], (0, 1), value=-100)[:, 1:]
    nolabels = {k: v for k, v in kw.items() if k != "labels"}

    def stock_loss(dtype):
        logits = model_copy("llama", dtype)(**nolabels).logits
        return testing.naive_cross_entropy(logits, target, label_smoothing=smoothing, z_loss=z_loss)

    ours = model_copy("llama", patched=True, label_smoothing=smoothing, z_loss=z_loss)(**kw).loss
    assert_within_rule("loss", ours, stock_loss(torch.float32), stock_loss(torch.float64))


def test_ignore_index_option_and_keyword():
    kw = batch()
    kw["labels"] = torch.where(kw["labels"] == -100, -1, kw["labels"])
    stock = model_copy("llama")(**kw, ignore_index=-1).loss
    truth = model_copy("llama", torch.float64)(**kw, ignore_index=-1).loss
    by_option = model_copy("llama", patched=True, ignore_index=-1)(**kw).loss
    by_keyword = model_copy("llama", patched=True)(**kw, ignore_index=-1).loss
    assert_within_rule("option", by_option, stock, truth)
    assert_within_rule("keyword", by_keyword, stock, truth)


def test_outputs_pass_through_and_return_dict():
    kw = dict(batch(), output_hidden_states=True)
    stock = model_copy("llama")(**kw)
    ours = model_copy("llama", patched=True)(**kw)
    assert len(ours.hidden_states) == len(stock.hidden_states) == 3
    for a, b in zip(ours.hidden_states, stock.hidden_states, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    as_tuple = model_copy("llama", patched=True)(**kw, return_dict=False)
    assert isinstance(as_tuple, tuple)
    torch.testing.assert_close(as_tuple[0], ours.loss, rtol=0, atol=0)


def test_gradient_checkpointing():
    # The backbone's own checkpointing keeps working under the fused loss.
    kw = batch()
    models = [model_copy("llama", torch.float64), model_copy("llama"), model_copy("llama", patched=True)]
    for m in models:
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(use_reentrant=False))
    (truth, g_truth), (stock, g_stock), (ours, g_ours) = (run(m, kw) for m in models)
    assert ours.logits is None
    assert_within_rule("loss", ours.loss, stock.loss, truth.loss)
    for pname in g_truth:
        assert_within_rule(pname, g_ours[pname], g_stock[pname], g_truth[pname])


def test_without_labels_or_in_eval_it_is_the_stock_forward():
    kw = batch()
    nolabels = {k: v for k, v in kw.items() if k != "labels"}
    stock, ours = model_copy("gemma2"), model_copy("gemma2", patched=True)
    torch.testing.assert_close(ours(**nolabels).logits, stock(**nolabels).logits, rtol=0, atol=0)
    stock.eval(), ours.eval()
    a, b = ours(**kw), stock(**kw)
    torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=0)
    torch.testing.assert_close(a.loss, b.loss, rtol=0, atol=0)


def test_patch_is_per_instance_and_unpatch_restores():
    cls_forward = transformers.LlamaForCausalLM.forward
    model, other = model_copy("llama"), model_copy("llama")
    assert logitless.patch(model) is model
    assert transformers.LlamaForCausalLM.forward is cls_forward
    assert "forward" not in vars(other) and other(**batch()).logits is not None
    assert model(**batch()).logits is None
    twin = copy.deepcopy(model)  # a deep copy is patched too, and bound to itself
    assert twin.forward.args[0] is twin and twin(**batch()).logits is None
    assert logitless.unpatch(model) is model
    assert "forward" not in vars(model)
    restored = model(**batch())
    torch.testing.assert_close(restored.logits, other(**batch()).logits, rtol=0, atol=0)
    with pytest.raises(ValueError, match="not patched"):
        logitless.unpatch(model)


def test_patch_twice_replaces_options():
    model = logitless.patch(model_copy("llama"), z_loss=1.0)
    logitless.patch(model)
    plain = model_copy("llama", patched=True)
    torch.testing.assert_close(model(**batch()).loss, plain(**batch()).loss, rtol=0, atol=0)
    logitless.unpatch(model)
    assert "forward" not in vars(model)


def test_trainer_runs_patched(tmp_path):
    pytest.importorskip("accelerate")
    data = [{k: v[i % B] for k, v in batch(seed=i // B).items()} for i in range(8)]
    history = {}
    for patched in (False, True):
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / str(patched)), max_steps=3, per_device_train_batch_size=2,
            gradient_accumulation_steps=2, learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no",
            use_cpu=True, seed=0, disable_tqdm=True,
        )
        model = model_copy("llama", patched=patched)
        # each forward the Trainer runs: the fused loss returns no logits, the model's own forward does
        calls = []
        model.register_forward_hook(lambda module, args, out, seen=calls: seen.append(out.logits is None))
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
        # The patched forward keeps the signature, so the Trainer still passes num_items_in_batch.
        assert trainer.model_accepts_loss_kwargs
        trainer.train()
        history[patched] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        assert calls == [patched] * 3 * 2  # 3 steps of 2 accumulated batches
    assert len(history[True]) == 3
    torch.testing.assert_close(torch.tensor(history[True]), torch.tensor(history[False]), rtol=1e-5, atol=0)


def _tiny(model_cls, config_cls, **kwargs):
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs)).train()


def test_bad_options():
    model = model_copy("llama")
    with pytest.raises(ValueError, match="z_loss"):
        logitless.patch(model, z_loss=-1.0)
    with pytest.raises(ValueError, match="label_smoothing"):
        logitless.patch(model, label_smoothing=1.5)
    with pytest.raises(ValueError, match="backend"):
        logitless.patch(model, backend="cuda")
    with pytest.raises(TypeError):
        logitless.patch(model, reduction="sum")
    with pytest.raises(TypeError, match="workspace_bytes"):
        logitless.patch(model, workspace_bytes=1.5)
    assert "forward" not in vars(model)

def test_workspace_bytes_reaches_the_loss(monkeypatch):
    # patch(workspace_bytes=...) is passed on to linear_cross_entropy (the PyTorch path here, which ignores it)
    seen = []
    lce = hf.linear_cross_entropy
    monkeypatch.setattr(hf, "linear_cross_entropy",
                        lambda *a, **kw: seen.append(kw["workspace_bytes"]) or lce(*a, **kw))
    assert torch.isfinite(logitless.patch(model_copy("llama"), workspace_bytes=64 << 20)(**batch()).loss)
    assert seen == [64 << 20]


def test_refuses_what_it_cannot_reproduce():
    with pytest.raises(TypeError, match="ForCausalLM"):
        logitless.patch(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="backbone|head"):
        logitless.patch(transformers.LlamaModel(transformers.LlamaConfig(**LLAMA_LIKE)))
    model = model_copy("llama")
    model.lm_head = torch.nn.Sequential(model.lm_head)
    with pytest.raises(TypeError, match="Sequential"):
        logitless.patch(model)
    model = model_copy("llama")
    model.lm_head.register_forward_pre_hook(lambda *a: None)
    with pytest.raises(TypeError, match="hooks"):
        logitless.patch(model)
    bart = _tiny("BartForCausalLM", "BartConfig", vocab_size=V, d_model=16, decoder_layers=1, encoder_layers=1,
                 decoder_attention_heads=2, encoder_attention_heads=2, decoder_ffn_dim=16, encoder_ffn_dim=16)
    with pytest.raises(ValueError, match="its own way"):  # no label shift: not the causal-LM loss
        logitless.patch(bart)
    moe = dict(LLAMA_LIKE, num_local_experts=2, num_experts_per_tok=1)
    with pytest.raises(NotImplementedError, match="output_router_logits"):
        logitless.patch(_tiny("MixtralForCausalLM", "MixtralConfig", **moe, output_router_logits=True))
    mixtral = logitless.patch(_tiny("MixtralForCausalLM", "MixtralConfig", **moe))
    with pytest.raises(NotImplementedError, match="output_router_logits"):
        mixtral(**batch(), output_router_logits=True)
    model = model_copy("llama")
    model.loss_function = lambda *a, **k: None
    with pytest.raises(ValueError, match="custom loss_function"):
        logitless.patch(model)


def test_kept_positions_must_match_the_targets():
    model = model_copy("llama", patched=True)
    with pytest.raises(ValueError, match="logits_to_keep"):
        model(**batch(), logits_to_keep=4)


@pytest.mark.gpu
def test_cuda_large_vocab_matches_and_saves_memory():
    config = transformers.LlamaConfig(**dict(LLAMA_LIKE, vocab_size=32000, hidden_size=256, intermediate_size=512,
                                             num_attention_heads=4, head_dim=64, max_position_embeddings=1024,
                                             initializer_range=0.02))
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(config).cuda().train()
    ids = torch.randint(3, 32000, (8, 512), device="cuda")
    kw = dict(input_ids=ids, labels=ids)

    def measured(model):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out, grads = run(model, kw)
        torch.cuda.synchronize()
        return out, grads, torch.cuda.max_memory_allocated() - before

    truth, g_truth, _ = measured(copy.deepcopy(base).double())
    stock, g_stock, mem_stock = measured(copy.deepcopy(base).bfloat16())
    ours, g_ours, mem_ours = measured(logitless.patch(copy.deepcopy(base).bfloat16()))
    assert_within_rule("loss", ours.loss, stock.loss, truth.loss)
    for pname in g_truth:
        assert_within_rule(pname, g_ours[pname], g_stock[pname], g_truth[pname])
    # The stock step holds (8 * 512) x 32000 logits in bf16 plus their float32 copy and gradient: over 1 GiB.
    assert mem_ours < mem_stock - 2 ** 29


def _gemma3_tied(dtype=torch.float32):
    # Gemma 3's own embedding class (scaled, padding_idx 0), the head tied to it; V x D dwarfs every other tensor.
    config = transformers.Gemma3TextConfig(vocab_size=4099, hidden_size=40, intermediate_size=48, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=20,
                                           max_position_embeddings=64, pad_token_id=0, initializer_range=0.2)
    torch.manual_seed(0)
    return transformers.Gemma3ForCausalLM(config).to(dtype).train()


def _live_vd_peak(model, step):
    """The most (V, D)-sized float32 blocks alive at once during step(), from the CPU allocator's events."""
    from torch.profiler import ProfilerActivity, profile

    size = model.lm_head.weight.numel() * 4
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += (e.nbytes() == size) - (e.nbytes() == -size)
        peak = max(peak, live)
    return peak


def test_tied_embedding_gradient_is_summed_in_place_on_the_cpu():
    # The head's dense gradient and the input embedding's rows meet in place: one (V, D) gradient alive at a time
    # where the stock model holds two; the gradients within the rule (the padding row's included), .grad dense.
    ids = torch.randint(3, 4099, (2, 12), generator=torch.Generator().manual_seed(0))
    ids[0, :3] = 0  # padding tokens: the embedding's backward leaves their row out
    kw = dict(input_ids=ids, labels=ids)
    truth, stock, ours = _gemma3_tied(torch.float64), _gemma3_tied(), logitless.patch(_gemma3_tied())
    emb = ours.get_input_embeddings()
    assert emb.weight is ours.lm_head.weight
    grads = {}
    for name, m in (("truth", truth), ("stock", stock), ("ours", ours)):
        m.zero_grad(set_to_none=True)
        grads[name] = _live_vd_peak(m, lambda m=m: m(**kw).loss.backward()), m.lm_head.weight.grad
    assert grads["stock"][0] >= 2 and grads["ours"][0] == 1, (grads["stock"][0], grads["ours"][0])
    assert grads["ours"][1].layout == torch.strided
    assert_within_rule("tied weight", grads["ours"][1], grads["stock"][1], grads["truth"][1])
    assert_within_rule("padding row", grads["ours"][1][0], grads["stock"][1][0], grads["truth"][1][0])
    assert emb._parameters["weight"] is ours.lm_head.weight and emb.sparse is False  # as it was, after the call
    # Kept graph: each backward sums into its own tensors. Only the embedding's gradient: made dense.
    ours.zero_grad(set_to_none=True)
    loss = ours(**kw).loss
    loss.backward(retain_graph=True)
    first = ours.lm_head.weight.grad.clone()
    loss.backward()
    torch.testing.assert_close(ours.lm_head.weight.grad, 2 * first, rtol=1e-6, atol=0)
    for m in (stock, ours):
        m.zero_grad(set_to_none=True)
        m(**kw, output_hidden_states=True).hidden_states[-1].square().sum().backward()
    assert ours.lm_head.weight.grad.layout == torch.strided
    logitless.unpatch(ours)  # the rows (and .grad) back in class order
    torch.testing.assert_close(ours.lm_head.weight.grad, stock.lm_head.weight.grad)
    assert emb._parameters["weight"] is ours.lm_head.weight and emb.sparse is False


def test_tied_head_leaves_half_of_its_gradient_to_the_tied_node(monkeypatch):
    # On a CPU the patched loss makes the tied head's gradient for the first half of the classes in its forward and
    # the tied node the rest, after the backbone's backward (logitless.later_grad): one maker left per step, the
    # whole gradient within the rule.

    left = spy_later_grads(monkeypatch)
    ids = torch.randint(3, 4099, (2, 12), generator=torch.Generator().manual_seed(1))
    truth, stock, ours = _gemma3_tied(torch.float64), _gemma3_tied(), logitless.patch(_gemma3_tied())
    for m in (truth, stock, ours):
        m(input_ids=ids, labels=ids).loss.backward()
    assert left == [1]
    assert_within_rule("tied weight", ours.lm_head.weight.grad, stock.lm_head.weight.grad,
                       truth.lm_head.weight.grad)
