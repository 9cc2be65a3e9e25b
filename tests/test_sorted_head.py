"""A head that sorts itself (logitless.patch's default vocab_order="learn", and SortedHead for the plain functions):
a model trained patched, its rows reordered several times on the way, is the model trained stock, step after step,
within the error rule; its state_dict, its optimizer's state_dict, a resumed run, generation and unpatch see class
order."""

from __future__ import annotations

import copy
import gc
import io

import pytest
import torch

transformers = pytest.importorskip("transformers")

import logitless  # noqa: E402
from logitless import sorted_head  # noqa: E402
from tests.helpers import assert_within_rule  # noqa: E402

V, B, T = 97, 3, 11
STEPS = 5


@pytest.fixture(autouse=True)
def _early_refreshes(monkeypatch):
    # New orders after optimizer steps 1, 2 and 4.
    monkeypatch.setattr(sorted_head, "REFRESH_AT", (1, 2, 4))
    monkeypatch.setattr(sorted_head, "REFRESH_EVERY", 10**6)


def _base(tied: bool):
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=64, initializer_range=0.2, tie_word_embeddings=tied,
                                   pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).float().train()


def _batches(n):
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(n):
        # Skewed token frequencies, so that the classes' masses differ and the orders move rows far.
        ids = (torch.rand(B, T, generator=g) ** 3 * (V - 3)).long() + 3
        labels = ids.clone()
        labels[0, :3] = -100
        out.append(dict(input_ids=ids, labels=labels))
    return out


def _optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _steps(model, opt, batches, accumulate):
    """Train; yield the state_dict after each optimizer step (a copy)."""
    for i in range(0, len(batches), accumulate):
        for b in batches[i:i + accumulate]:
            (model(**b).loss / accumulate).backward()
        opt.step()
        opt.zero_grad()
        yield {k: v.detach().clone() for k, v in model.state_dict().items()}


def _check(name, ours: dict, stock: dict, truth: dict):
    assert ours.keys() == stock.keys() == truth.keys()
    for k in truth:
        if truth[k].is_floating_point():
            assert_within_rule(f"{name} {k}", ours[k], stock[k], truth[k])


def _stock_runs(tied, accumulate, n=STEPS):
    batches = _batches(n * accumulate)
    runs = {}
    for dtype in (torch.float64, torch.float32):
        model = copy.deepcopy(_base(tied)).to(dtype)
        runs[dtype] = list(_steps(model, _optimizer(model), batches, accumulate))
    return batches, runs


@pytest.mark.parametrize("tied, optimizer_first, accumulate", [(True, True, 1), (False, False, 2), (True, False, 2)])
def test_trained_patched_is_trained_stock(tied, optimizer_first, accumulate):
    # AdamW (its state permuted with the rows) built before or after patch; with accumulate=2 the sample is the
    # last micro-batch's and the gradients are permuted with the rows (the loop zeroes them after the step).
    batches, stock = _stock_runs(tied, accumulate)
    model = copy.deepcopy(_base(tied))
    opt = _optimizer(model) if optimizer_first else None
    logitless.patch(model)
    opt = opt or _optimizer(model)
    sorter = model.forward.args[1].sorter
    for step, ours in enumerate(_steps(model, opt, batches, accumulate)):
        _check(f"step {step}", ours, stock[torch.float32][step], stock[torch.float64][step])
    assert sorter.version == 3
    w = model.lm_head.weight.detach()
    assert not torch.equal(sorter.ids, torch.arange(V))
    assert torch.equal(model.state_dict()["lm_head.weight"], sorter.unsort(w))  # class order outside
    assert not torch.equal(model.state_dict()["lm_head.weight"], w)  # stored order inside
    if tied:
        sd = model.state_dict()
        assert sd["model.embed_tokens.weight"] is sd["lm_head.weight"]  # still one tensor for save_pretrained
    # The optimizer's state_dict is in class order: the stock optimizer's, within the rule.
    stock_model = copy.deepcopy(_base(tied))
    stock_opt = _optimizer(stock_model)
    list(_steps(stock_model, stock_opt, batches, accumulate))
    ours_state, stock_state = opt.state_dict()["state"], stock_opt.state_dict()["state"]
    names = [n for n, _ in model.named_parameters()]
    head = names.index("lm_head.weight") if not tied else names.index("model.embed_tokens.weight")
    for key in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(ours_state[head][key], stock_state[head][key], rtol=1e-4, atol=1e-6)


def test_resume_from_a_checkpoint_matches_an_uninterrupted_run():
    # Model and optimizer state_dicts saved after 3 steps, loaded into fresh objects (a fresh patch, which learns
    # its order again), 2 more steps: the uninterrupted stock run's parameters, within the rule.
    batches, stock = _stock_runs(tied=True, accumulate=1)
    model = logitless.patch(copy.deepcopy(_base(True)))
    opt = _optimizer(model)
    list(_steps(model, opt, batches[:3], 1))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    fresh = logitless.patch(copy.deepcopy(_base(True)))
    fresh.load_state_dict(saved["model"])
    fresh_opt = _optimizer(fresh)
    fresh_opt.load_state_dict(saved["opt"])
    resumed = list(_steps(fresh, fresh_opt, batches[3:], 1))
    assert fresh.forward.args[1].sorter.version == 2
    _check("resumed", resumed[-1], stock[torch.float32][-1], stock[torch.float64][-1])


def test_generate_and_unpatch():
    # After training in a learned order: eval logits and greedy generation are the stock model's with the same
    # (class-order) weights; unpatch puts the rows and the optimizer's state back exactly and removes every hook.
    model = logitless.patch(copy.deepcopy(_base(True)))
    opt = _optimizer(model)
    list(_steps(model, opt, _batches(4), 1))
    sorter = model.forward.args[1].sorter
    assert sorter.version == 3
    stock = copy.deepcopy(_base(True))
    stock.load_state_dict(model.state_dict())
    prompt = _batches(1)[0]["input_ids"][:, :5]
    model.eval(), stock.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=prompt).logits, stock(input_ids=prompt).logits, rtol=0, atol=0)
        gen = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(prompt, **gen), stock.generate(prompt, **gen))
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt_before = copy.deepcopy(opt.state_dict())
    gc.collect()  # other tests' patched models
    logitless.unpatch(model)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert torch.equal(model.lm_head.weight.detach(), before["lm_head.weight"])
    for i, entry in opt.state_dict()["state"].items():
        for k, v in entry.items():
            assert torch.equal(v, opt_before["state"][i][k]), (i, k)
    assert not model._state_dict_hooks and not model._load_state_dict_pre_hooks
    assert not model.get_input_embeddings()._forward_pre_hooks
    assert not opt._optimizer_state_dict_post_hooks and not opt._optimizer_load_state_dict_post_hooks
    assert model.lm_head.weight not in sorted_head._HEADS
    assert not sorted_head._HEADS and sorted_head._STEP_HOOKS is None


def test_save_pretrained_in_class_order(tmp_path):
    model = logitless.patch(copy.deepcopy(_base(True)))
    list(_steps(model, _optimizer(model), _batches(3), 1))
    assert model.forward.args[1].sorter.version == 2
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    logitless.unpatch(model)


def test_deepcopy_of_a_patched_model_sorts_its_own_rows():
    model = logitless.patch(copy.deepcopy(_base(False)))
    list(_steps(model, _optimizer(model), _batches(2), 1))
    twin = copy.deepcopy(model)
    a, b = model.forward.args[1].sorter, twin.forward.args[1].sorter
    assert b is not a and b.weight is twin.lm_head.weight and sorted_head._HEADS[twin.lm_head.weight]() is b
    list(_steps(twin, _optimizer(twin), _batches(2), 1))
    assert b.version == 3 and a.version == 2
    logitless.unpatch(twin)
    assert torch.equal(twin.lm_head.weight, b.unsort(twin.lm_head.weight))  # class order: the tables are identity


def test_sorted_head_with_the_plain_function():
    # A user's own head and loss loop: SGD with momentum, the first-layer body untied from the head.
    g = torch.Generator().manual_seed(0)
    D, N = 16, 40
    body0, head0 = torch.randn(D, D, generator=g) / 4, torch.randn(V, D, generator=g) / 4
    bias0 = torch.randn(V, generator=g)
    xs = [torch.randn(N, D, generator=g) for _ in range(STEPS)]
    ts = [(torch.rand(N, generator=g) ** 3 * V).long() for _ in range(STEPS)]

    def run(dtype, sorted_):
        body = torch.nn.Parameter(body0.to(dtype, copy=True))
        head = torch.nn.Linear(D, V).to(dtype)
        with torch.no_grad():
            head.weight.copy_(head0), head.bias.copy_(bias0)
        opt = torch.optim.SGD([body, *head.parameters()], lr=0.1, momentum=0.9)
        sh = logitless.SortedHead(head.weight, head.bias, module=head) if sorted_ else None
        for x, t in zip(xs, ts, strict=True):
            h = torch.tanh(x.to(dtype) @ body)
            target = sh.targets(h, t) if sh is not None else t
            logitless.linear_cross_entropy(h, head.weight, target, linear_bias=head.bias).backward()
            opt.step()
            opt.zero_grad()
        if sh is not None:
            assert sh.version == 3
        return [body.detach(), *(v for v in head.state_dict().values())]

    truth, stock, ours = run(torch.float64, False), run(torch.float32, False), run(torch.float32, True)
    for i, (a, b, c) in enumerate(zip(ours, stock, truth, strict=True)):
        assert_within_rule(f"param {i}", a, b, c)


def test_options():
    model = copy.deepcopy(_base(False))
    w0 = model.lm_head.weight.detach().clone()
    with pytest.raises(ValueError, match="vocab_order"):
        logitless.patch(model, vocab_order="sorted")
    logitless.patch(model, vocab_order=None)
    assert model.forward.args[1].sorter is None
    list(_steps(model, _optimizer(model), _batches(3), 1))
    order = logitless.VocabOrder(torch.randperm(V, generator=torch.Generator().manual_seed(1)))
    logitless.patch(model, vocab_order=order)  # fixed: applied now, never changed
    w1 = model.state_dict()["lm_head.weight"]
    assert torch.equal(model.lm_head.weight.detach(), order.sort(w1)) and not torch.equal(w1, w0)
    list(_steps(model, _optimizer(model), _batches(3), 1))
    assert torch.equal(model.forward.args[1].sorter.ids, order.ids)
    with pytest.raises(ValueError, match="already stored"):
        logitless.SortedHead(model.lm_head.weight)
    logitless.unpatch(model)
    with pytest.raises(ValueError, match="bias"):
        logitless.SortedHead(model.lm_head.weight, torch.zeros(3))


def test_compiled_model_takes_new_orders_without_recompiling():
    # torch.compile (the eager backend: dynamo's guards without a code generator): the sample is kept inside the
    # graph (no graph break), new orders are applied between steps and change tensors in place, so nothing
    # recompiles.
    import torch._dynamo
    from torch._dynamo.utils import counters

    batches, stock = _stock_runs(tied=True, accumulate=1, n=4)
    model = logitless.patch(copy.deepcopy(_base(True)))
    compiled = torch.compile(model, backend="eager")
    opt = _optimizer(model)
    steps = _steps(compiled, opt, batches, 1)
    counters.clear()
    next(steps)  # compiles
    assert not counters["graph_break"], dict(counters["graph_break"])
    with torch._dynamo.config.patch(error_on_recompile=True):
        rest = list(steps)
    assert model.forward.args[1].sorter.version == 3
    ours = {k.removeprefix("_orig_mod."): v for k, v in rest[-1].items()}
    _check("compiled", ours, stock[torch.float32][-1], stock[torch.float64][-1])
