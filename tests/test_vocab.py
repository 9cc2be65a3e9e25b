"""VocabOrder: a vocabulary stored in another order (the head's rows permuted once, ids mapped to positions) gives
the same losses and gradients up to the permutation, on both backends; bad orders are refused by name."""

from __future__ import annotations

import pytest
import torch

import logitless
from logitless import VocabOrder

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_orders_and_their_inverses():
    order = VocabOrder.by_counts(torch.tensor([3, 9, 0, 9, 5]))
    assert order.ids.tolist() == [1, 3, 4, 0, 2]  # decreasing, ties in id order
    assert order.positions.tolist() == [3, 0, 4, 1, 2]
    t = torch.tensor([0, 1, -100, 4, 2, 7], dtype=torch.int32)
    m = order.map_ids(t)
    assert m.dtype == torch.int32 and m.tolist() == [3, 0, -100, 2, 4, 7]  # outside 0..V-1: left for the loss
    assert torch.equal(order.unmap_ids(m), t)
    w = torch.randn(5, 3)
    assert torch.equal(order.unsort(order.sort(w)), w)
    assert torch.equal(order.sort(w)[0], w[1])
    z = torch.randn(2, 5)
    assert torch.equal(order.unsort(order.sort(z, dim=1), dim=1), z)
    assert len(order) == 5 and "V=5" in repr(order)


@pytest.mark.parametrize("ids, error", [
    (torch.tensor([0, 1, 1]), ValueError), (torch.tensor([0, 1, 3]), ValueError),
    (torch.tensor([-1, 0, 1]), ValueError),
    (torch.tensor([0.0, 1.0]), TypeError), (torch.zeros(2, 2, dtype=torch.long), TypeError),
    (torch.tensor([], dtype=torch.long), ValueError),
])
def test_bad_orders_are_refused(ids, error):
    with pytest.raises(error, match="ids"):
        VocabOrder(ids)


def test_shape_mismatch_is_named():
    order = VocabOrder(torch.arange(4))
    with pytest.raises(ValueError, match="3 classes along dim 0, the order 4"):
        order.sort(torch.zeros(3, 2))
    with pytest.raises(ValueError, match="share D"):
        VocabOrder.by_mass(torch.zeros(2, 3), torch.zeros(4, 2))
    with pytest.raises(TypeError, match="integer"):
        order.map_ids(torch.zeros(2))


def test_by_mass_orders_by_softmax_mass():
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(37, 8, generator=g), torch.randn(50, 8, generator=g), torch.randn(50, generator=g)
    order = VocabOrder.by_mass(x.view(1, 37, 8), w, b, softcap=3.0, temperature=0.7, rows=5)
    z = 3.0 * torch.tanh((x.double() @ w.double().T + b.double()) / 3.0)
    mass = torch.softmax(z / 0.7, 1).sum(0)
    assert torch.equal(order.ids, torch.argsort(mass, descending=True, stable=True))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_same_loss_and_gradients_in_stored_order(backend):
    g = torch.Generator().manual_seed(1)
    N, D, V = 29, 16, 97
    x = torch.randn(N, D, generator=g)
    w = torch.randn(V, D, generator=g) / D**0.5
    b = torch.randn(V, generator=g)
    cw = torch.rand(V, generator=g) + 0.5
    t = torch.randint(0, V, (N,), generator=g)
    t[3] = -100
    order = VocabOrder.by_mass(torch.randn(11, D, generator=g), w, b)
    kw = dict(label_smoothing=0.1, z_loss=1e-3, backend=backend)
    leaves = [a.to(DEV).clone().requires_grad_() for a in (x, w, b)]
    loss = logitless.linear_cross_entropy(leaves[0], leaves[1], t.to(DEV), linear_bias=leaves[2], weight=cw.to(DEV),
                                          **kw)
    loss.backward()
    o = order.to(DEV)
    sl = [leaves[0].detach().clone().requires_grad_(), o.sort(w.to(DEV)).requires_grad_(),
          o.sort(b.to(DEV)).requires_grad_()]
    loss_s = logitless.linear_cross_entropy(sl[0], sl[1], o.map_ids(t.to(DEV)), linear_bias=sl[2],
                                            weight=o.sort(cw.to(DEV)), **kw)
    loss_s.backward()
    torch.testing.assert_close(loss_s, loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sl[0].grad, leaves[0].grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(o.unsort(sl[1].grad), leaves[1].grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(o.unsort(sl[2].grad), leaves[2].grad, rtol=1e-4, atol=1e-5)
    lp = logitless.linear_log_probs(x.to(DEV), w.to(DEV), t.clamp(min=0).to(DEV), backend=backend)
    lp_s = logitless.linear_log_probs(x.to(DEV), o.sort(w.to(DEV)), o.map_ids(t.clamp(min=0).to(DEV)), backend=backend)
    torch.testing.assert_close(lp_s, lp, rtol=1e-5, atol=1e-5)


def _tiny_llama(tied: bool):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=64, tie_word_embeddings=tied)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).train()


def test_hf_model_with_a_tied_head_in_stored_order_by_hand():
    # Sorting a tied head's rows sorts the embedding's too, so the model is fed positions (order.map_ids) for its
    # inputs and labels; loss and logits are the same, the logits in stored order.
    model = _tiny_llama(tied=True)
    assert model.get_input_embeddings().weight is model.lm_head.weight
    ids = torch.randint(3, 97, (2, 9))
    labels = ids.clone()
    labels[0, :2] = -100
    with torch.no_grad():
        ref_loss = model(input_ids=ids, labels=labels).loss
        ref_logits = model(input_ids=ids).logits
    order = VocabOrder.by_counts(torch.bincount(ids.flatten(), minlength=97))
    with torch.no_grad():
        model.lm_head.weight.data = order.sort(model.lm_head.weight.data)
    logitless.patch(model)
    try:
        loss = model(input_ids=order.map_ids(ids), labels=order.map_ids(labels)).loss
    finally:
        logitless.unpatch(model)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        logits = model(input_ids=order.map_ids(ids)).logits
    torch.testing.assert_close(order.unsort(logits, dim=-1), ref_logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tied", [True, False])
def test_patch_keeps_the_head_in_order(tied):
    # patch(vocab_order=...) stores the head (and a tied embedding) in the order and maps ids inside: the model is
    # the same function (training loss and gradients, eval logits) on class ids; unpatch puts the rows back.
    model = _tiny_llama(tied)
    ids = torch.randint(3, 97, (2, 9))
    labels = ids.clone()
    labels[1, -3:] = -100
    w0 = model.lm_head.weight.detach().clone()
    ref_loss = model(input_ids=ids, labels=labels).loss
    ref_loss.backward()
    ref_grad = model.lm_head.weight.grad.clone()
    ref_emb_grad = model.get_input_embeddings().weight.grad.clone()
    model.zero_grad()
    with torch.no_grad():
        model.eval()
        ref_logits = model(input_ids=ids).logits
        ref_gen = model.generate(ids[:, :5], max_new_tokens=4, do_sample=False, pad_token_id=0)
        model.train()
    order = VocabOrder.by_mass(torch.randn(20, 32), w0)
    logitless.patch(model, vocab_order=order, skip_threshold="auto")
    assert torch.equal(model.lm_head.weight.detach(), order.sort(w0))
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(order.unsort(model.lm_head.weight.grad), ref_grad, rtol=1e-4, atol=1e-6)
    if not tied:
        torch.testing.assert_close(model.get_input_embeddings().weight.grad, ref_emb_grad, rtol=1e-4, atol=1e-6)
    with torch.no_grad():
        model.eval()
        torch.testing.assert_close(model(input_ids=ids).logits, ref_logits, rtol=1e-5, atol=1e-5)
        eval_loss = model(input_ids=ids, labels=labels).loss  # the model's own loss, labels mapped inside
        torch.testing.assert_close(eval_loss, ref_loss, rtol=1e-5, atol=1e-6)
        assert torch.equal(model.generate(ids[:, :5], max_new_tokens=4, do_sample=False, pad_token_id=0), ref_gen)
        model.train()
    logitless.unpatch(model)
    assert torch.equal(model.lm_head.weight.detach(), w0)
    with torch.no_grad():
        model.eval()
        torch.testing.assert_close(model(input_ids=ids).logits, ref_logits, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="vocab_order has 5 classes"):
        logitless.patch(model, vocab_order=VocabOrder(torch.arange(5)))
    with pytest.raises(TypeError, match="VocabOrder"):
        logitless.patch(model, vocab_order=torch.arange(97))
