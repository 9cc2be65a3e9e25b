"""Batch invariance: a row's log-prob, entropy, log-sum-exp and per-token cross-entropy are bitwise the same whatever
the batch it is in (its size, the row's position, the other rows), each backend against itself; on the PyTorch path
its input gradient too (docs/rl.md)."""

import pytest
import torch

import logitless

CUDA = torch.cuda.is_available()


def _head(dtype, n=70, V=331, D=24, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, D, generator=g) * 2).to(dtype)
    w = torch.randn(V, D, generator=g).to(dtype)
    t = torch.randint(0, V, (n,), generator=g)
    t[5] = -100
    return x.to(device), w.to(device), t.to(device)


def _scores(x, w, t, backend, softcap):
    lp, ent = logitless.linear_log_probs(x, w, t, return_entropy=True, backend=backend, softcap=softcap)
    lse = logitless.linear_logsumexp(x, w, backend=backend, softcap=softcap)
    ce = logitless.linear_cross_entropy(x, w, t, reduction="none", backend=backend, softcap=softcap)
    return lp, ent, lse, ce


def _assert_rows_equal(x, w, t, subsets, backend, softcap=None):
    full = _scores(x, w, t, backend, softcap)
    for idx in subsets:
        part = _scores(x[idx].contiguous(), w, t[idx].contiguous(), backend, softcap)
        for name, a, b in zip(("log-prob", "entropy", "lse", "cross-entropy"), part, full, strict=True):
            assert torch.equal(a, b[idx]), (name, len(idx), (a - b[idx]).abs().max().item())


@pytest.mark.parametrize("dtype,softcap", [(torch.bfloat16, None), (torch.float32, 30.0)])
def test_torch_path_rows_do_not_depend_on_the_batch(dtype, softcap):
    x, w, t = _head(dtype)
    perm = torch.randperm(70, generator=torch.Generator().manual_seed(3))
    subsets = [torch.arange(1), torch.arange(3), torch.arange(17), perm, perm[:33], torch.tensor([69, 5, 0])]
    _assert_rows_equal(x, w, t, subsets, "torch", softcap)


def test_torch_path_input_gradient_does_not_depend_on_the_batch():
    # Per-row d_input of log-probs and entropy (no reduction over rows): each row's gradient is a function of the row.
    x, w, t = _head(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    up_lp, up_ent = torch.randn(70, generator=g), torch.randn(70, generator=g)

    def dx(idx):
        xi = x[idx].clone().requires_grad_(True)
        lp, ent = logitless.linear_log_probs(xi, w, t[idx], return_entropy=True, backend="torch")
        (d,) = torch.autograd.grad((lp * up_lp[idx]).sum() + (ent * up_ent[idx]).sum(), xi)
        return d

    full = dx(torch.arange(70))
    perm = torch.randperm(70, generator=torch.Generator().manual_seed(4))
    for idx in (torch.arange(1), torch.arange(17), perm[:40], perm):
        assert torch.equal(dx(idx), full[idx]), len(idx)


def test_triton_forward_rows_do_not_depend_on_the_batch():
    # The kernels' partials are per fixed vocabulary chunk, whatever the split layout (which depends on N): 1, 17, 36
    # and 100 rows give 1, 2 and 4 token blocks and three layouts (test_triton_linear_plans.py). Under the interpreter
    # rows keep their position in a token block (subsets of whole blocks): its numpy products round a row
    # differently with its place in the tile, which the GPU's matrix instructions do not (the gpu test below moves
    # rows freely).
    x, w, t = _head(torch.bfloat16, n=100, V=600)
    dev = "cuda" if CUDA else "cpu"
    x, w, t = x.to(dev), w.to(dev), t.to(dev)
    blocks = [torch.arange(64, 96), torch.arange(0, 32), torch.arange(32, 40)]
    subsets = [torch.arange(1), torch.arange(17), torch.arange(64, 100), torch.cat(blocks)]
    _assert_rows_equal(x, w, t, [s.to(dev) for s in subsets], "triton")


@pytest.mark.gpu
@pytest.mark.parametrize("V,D", [(262144, 640), (128256, 2048)])
def test_triton_rows_do_not_depend_on_the_batch_gpu(V, D):
    x, w, t = _head(torch.bfloat16, n=4096, V=V, D=D, device="cuda")
    perm = torch.randperm(4096, generator=torch.Generator().manual_seed(5)).cuda()
    subsets = [torch.arange(1, device="cuda"), perm[:3], perm[:17], perm[:256], perm[:1000], perm]
    _assert_rows_equal(x, w, t, subsets, "triton")


def _grad_and_no_grad(device, backend="triton", n=100, V=600, D=24):
    # An RL step's old-policy (or reference) pass runs without gradients and its training pass with them: the
    # ratio of the two must start at exactly 1, so the forward's values may not depend on whether a backward follows
    # (with gradients the forward also sums each row's mass outside its target for the backward, and may keep
    # logits for it: on a GPU that changed the entropy's last bit until the forward stopped contracting
    # multiply-adds, kernels.Tuning.fwd_fp_fusion).
    x, w, t = _head(torch.bfloat16, n=n, V=V, D=D)
    x, w, t = x.to(device), w.to(device), t.to(device)
    with torch.no_grad():
        lp0, ent0 = logitless.linear_log_probs(x, w, t, return_entropy=True, backend=backend)
    xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    lp1, ent1 = logitless.linear_log_probs(xg, wg, t, return_entropy=True, backend=backend)
    assert torch.equal(lp0, lp1.detach()) and torch.equal(ent0, ent1.detach())
    (lp1.sum() + ent1.sum()).backward()  # and the backward that the training pass's forward prepared runs
    assert torch.isfinite(xg.grad).all() and torch.isfinite(wg.grad).all()


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_values_do_not_depend_on_grad_mode(backend):
    _grad_and_no_grad("cpu", backend)


@pytest.mark.gpu
@pytest.mark.parametrize("n,V,D", [(100, 600, 24), (4096, 128256, 2048), (8192, 262144, 640)])
def test_triton_values_do_not_depend_on_grad_mode_gpu(n, V, D):
    _grad_and_no_grad("cuda", n=n, V=V, D=D)
