"""Bad input gets a ValueError/TypeError that names the argument, before any kernel runs."""

import pytest
import torch

import logitless

# Load the kernels now, while the interpreter is on (conftest): test_backend_selection turns it off for a while,
# and a @triton.jit function decorated then could not run under the interpreter afterwards.
from logitless.kernels import cross_entropy as _ce_kernels  # noqa: F401
from logitless.kernels import linear_head as _lh_kernels  # noqa: F401

V, D = 11, 5


def base():
    return torch.randn(4, D), torch.randn(V, D), torch.randint(0, V, (4,))


LCE_CASES = [
    # (description, kwargs-transform, exception type, message fragment)
    ("weight not 2-D", lambda x, w, t: (x, w[0], t, {}), ValueError, "linear_weight must be 2-D"),
    ("D mismatch", lambda x, w, t: (x[:, :3], w, t, {}), ValueError, "last dimension"),
    ("integer input", lambda x, w, t: (x.long(), w, t, {}), TypeError, "input must have a floating dtype"),
    ("mixed dtypes", lambda x, w, t: (x.double(), w, t, {}), TypeError, "use one dtype"),
    ("target shape", lambda x, w, t: (x, w, t[:3], {}), ValueError, "target has shape"),
    ("float target", lambda x, w, t: (x, w, t.float(), {}), TypeError, "int64 or int32"),
    ("target too large", lambda x, w, t: (x, w, torch.full_like(t, V), {}), ValueError, "outside [0, 11)"),
    ("negative target", lambda x, w, t: (x, w, torch.full_like(t, -3), {}), ValueError, "outside [0, 11)"),
    ("reduction", lambda x, w, t: (x, w, t, {"reduction": "avg"}), ValueError, "reduction must be one of"),
    ("backend", lambda x, w, t: (x, w, t, {"backend": "cuda"}), ValueError, "backend must be one of"),
    ("smoothing", lambda x, w, t: (x, w, t, {"label_smoothing": 1.5}), ValueError, "label_smoothing must be in"),
    ("z_loss", lambda x, w, t: (x, w, t, {"z_loss": -1e-4}), ValueError, "z_loss must be >= 0"),
    ("softcap", lambda x, w, t: (x, w, t, {"softcap": 0.0}), ValueError, "softcap must be a positive"),
    ("bias shape", lambda x, w, t: (x, w, t, {"linear_bias": torch.zeros(V + 1)}), ValueError, "linear_bias"),
    ("class weights", lambda x, w, t: (x, w, t, {"weight": torch.ones(V - 1)}), ValueError, "class weights"),
    ("empty vocab", lambda x, w, t: (x, w[:0], t, {}), ValueError, "vocabulary must not be empty"),
]


@pytest.mark.parametrize("desc,make,exc,msg", LCE_CASES, ids=[c[0] for c in LCE_CASES])
def test_linear_cross_entropy_rejects(desc, make, exc, msg):
    x, w, t, kw = make(*base())
    with pytest.raises(exc, match=msg.replace("[", r"\[").replace(")", r"\)").replace("(", r"\(")):
        logitless.linear_cross_entropy(x, w, t, **kw)


def test_meta_device_mismatch():
    x, w, t = base()
    with pytest.raises(ValueError, match="input is on cpu but linear_weight is on meta"):
        logitless.linear_cross_entropy(x, w.to("meta"), t)


def test_ignore_index_is_accepted_out_of_range():
    x, w, t = base()
    t[0] = -1
    logitless.linear_cross_entropy(x, w, t, ignore_index=-1)
    with pytest.raises(ValueError, match="outside"):
        logitless.linear_cross_entropy(x, w, t)


@pytest.mark.parametrize("kw,exc,msg", [
    ({"temperature": 0.0}, ValueError, "temperature must be a positive"),
    ({"temperature": float("nan")}, ValueError, "temperature must be a positive"),
    ({"softcap": -2.0}, ValueError, "softcap must be a positive"),
    ({"ignore_index": 1.5}, TypeError, "ignore_index must be an int"),
    ({"ignore_index": True}, TypeError, "ignore_index must be an int"),
    ({"return_entropy": "no"}, TypeError, "return_entropy must be a bool"),
    # A bool is not a number here: softcap=True would silently mean a cap of 1.
    ({"temperature": True}, TypeError, "temperature must be a Python float"),
    ({"softcap": True}, TypeError, "softcap must be a Python float"),
])
def test_log_probs_rejects(kw, exc, msg):
    x, w, t = base()
    with pytest.raises(exc, match=msg):
        logitless.linear_log_probs(x, w, t, **kw)


def test_logsumexp_and_cross_entropy_reject():
    x, w, t = base()
    with pytest.raises(ValueError, match="temperature"):
        logitless.linear_logsumexp(x, w, temperature=-1.0)
    with pytest.raises(TypeError, match="logits must have a floating dtype"):
        logitless.cross_entropy(torch.zeros(4, V, dtype=torch.long), t)
    with pytest.raises(ValueError, match="target has shape"):
        logitless.cross_entropy(torch.zeros(4, V), t[:2])
    with pytest.raises(ValueError, match="outside"):
        logitless.cross_entropy(torch.zeros(4, V), torch.full_like(t, V))
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        logitless.cross_entropy([[0.0] * V], t)


def test_backend_selection(monkeypatch):
    from logitless._dispatch import resolve_backend

    monkeypatch.delenv("LOGITLESS_BACKEND", raising=False)
    assert resolve_backend("auto", torch.device("cpu"), "linear_cross_entropy") == "torch"
    assert resolve_backend("torch", torch.device("cpu"), "linear_cross_entropy") == "torch"
    monkeypatch.setenv("LOGITLESS_BACKEND", "bogus")
    with pytest.raises(ValueError, match="LOGITLESS_BACKEND"):
        resolve_backend("auto", torch.device("cpu"), "linear_cross_entropy")
    monkeypatch.setenv("LOGITLESS_BACKEND", "torch")
    assert resolve_backend("auto", torch.device("cuda"), "linear_cross_entropy") == "torch"
    # An explicit backend wins over the environment.
    monkeypatch.setenv("LOGITLESS_BACKEND", "triton")
    assert resolve_backend("torch", torch.device("cpu"), "linear_cross_entropy") == "torch"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        resolve_backend("triton", torch.device("cpu"), "linear_cross_entropy")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ("torch", "auto"))
def test_gpu_out_of_range_target_trips_device_assert(backend):
    # A device-side assertion poisons the CUDA context, so it runs in its own process.
    import subprocess
    import sys

    code = (
        "import torch, logitless\n"
        "x = torch.randn(8, 16, device='cuda'); w = torch.randn(32, 16, device='cuda')\n"
        "t = torch.randint(0, 32, (8,), device='cuda'); t[3] = 32\n"
        f"loss = logitless.linear_cross_entropy(x, w, t, backend={backend!r})\n"
        "torch.cuda.synchronize()\n"
        "print('NO ERROR')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "NO ERROR" not in out.stdout
    assert out.returncode != 0
    assert "outside [0, 32)" in out.stderr or "device-side assert" in out.stderr, out.stderr[-2000:]


@pytest.mark.parametrize("kw", [{"softcap": True}, {"label_smoothing": True}, {"z_loss": True}])
def test_bools_are_not_numbers(kw):
    x, w, t = base()
    with pytest.raises(TypeError, match=f"{next(iter(kw))} must be a Python float"):
        logitless.linear_cross_entropy(x, w, t, **kw)
    with pytest.raises(TypeError, match=f"{next(iter(kw))} must be a Python float"):
        logitless.cross_entropy(x @ w.T, t, **kw)


def test_ignore_index_none_and_integer_types():
    # None means -100 everywhere (as in F.linear_cross_entropy); any integer type is an index.
    import numpy as np

    x, w, t = base()
    t[1] = -100
    want = logitless.linear_log_probs(x, w, t)
    for ii in (None, np.int64(-100), -100):
        assert torch.equal(logitless.linear_log_probs(x, w, t, ignore_index=ii), want)
    t = torch.tensor([2, -100, 5, 0])
    t2 = torch.tensor([2, 7, 5, 0])
    assert torch.equal(logitless.linear_cross_entropy(x, w, t2, ignore_index=np.int32(7)),
                       logitless.linear_cross_entropy(x, w, t))


@pytest.mark.parametrize("backend", ("torch", "triton"))
def test_empty_feature_dimension(backend):
    # D = 0: every logit is 0 (plus the bias), so the loss is log V, as PyTorch's own head gives.
    x = torch.zeros(5, 0, requires_grad=True)
    w = torch.zeros(V, 0, requires_grad=True)
    t = torch.randint(0, V, (5,))
    loss = logitless.linear_cross_entropy(x, w, t, backend=backend)
    loss.backward()
    assert torch.allclose(loss, torch.tensor(V).log())
    assert x.grad.shape == (5, 0) and w.grad.shape == (V, 0)
    assert torch.allclose(logitless.linear_logsumexp(x, w, backend=backend), torch.tensor(V).log().expand(5))
    assert torch.allclose(logitless.linear_log_probs(x, w, t, backend=backend), -torch.tensor(V).log().expand(5))


@pytest.mark.parametrize("backend", ("torch", "triton"))
@pytest.mark.parametrize("inplace", (False, True))
def test_gradients_are_not_differentiable(backend, inplace):
    # No double backward: differentiating a gradient raises logitless's message (on the torch path too, where
    # once_differentiable used to leave the gradient detached and torch said "does not require grad"), and the
    # first-order gradient that create_graph=True returns is the plain one.
    x, w, t = base()
    x.requires_grad_(True)
    w.requires_grad_(True)
    ops = [lambda: logitless.cross_entropy(x @ w.T, t, inplace_backward=inplace, backend=backend)]
    if not inplace:
        ops += [lambda: logitless.linear_cross_entropy(x, w, t, backend=backend),
                lambda: logitless.linear_log_probs(x, w, t, return_entropy=True, backend=backend)[1].sum(),
                lambda: logitless.linear_logsumexp(x, w, backend=backend).sum()]
    for op in ops:
        (plain,) = torch.autograd.grad(op(), x)
        (g,) = torch.autograd.grad(op(), x, create_graph=True)
        assert g.requires_grad
        assert torch.equal(g.detach(), plain)
        with pytest.raises(RuntimeError, match="not differentiable"):
            g.sum().backward()


# Options are used as float32 numbers: values that float32 cannot hold as normal numbers would be inf (softcap=1e300
# gave a NaN loss), 0, or a float64 kernel argument (label_smoothing=1e-40 broke the interpreter with bf16).
F32_RANGE_CASES = [
    ("softcap", 1e300), ("softcap", 1e-40), ("z_loss", 1e300), ("z_loss", 1e-40), ("label_smoothing", 1e-40),
    ("temperature", 1e300), ("temperature", 1e-40), ("temperature", 1e-38),  # 1 / 1e-38 overflows float32
]


@pytest.mark.parametrize("backend", ("torch", "triton"))
@pytest.mark.parametrize("name,value", F32_RANGE_CASES)
def test_options_outside_float32_are_refused(backend, name, value):
    x, w, t = (a.bfloat16() if a.is_floating_point() else a for a in base())
    ops = []
    if name != "temperature":
        ops += [lambda: logitless.linear_cross_entropy(x, w, t, backend=backend, **{name: value}),
                lambda: logitless.cross_entropy(x @ w.T, t, backend=backend, **{name: value})]
    if name in ("softcap", "temperature"):
        ops += [lambda: logitless.linear_log_probs(x, w, t, backend=backend, **{name: value}),
                lambda: logitless.linear_logsumexp(x, w, backend=backend, **{name: value})]
    for op in ops:
        with pytest.raises(ValueError, match=f"{name} must be .*float32"):
            op()


@pytest.mark.parametrize("backend", ("torch", "triton"))
def test_options_at_the_float32_limits_work(backend):
    # The largest and smallest accepted values give the float64 answer: a softcap of 3e38 caps nothing.
    x, w, t = base()
    want = logitless.linear_cross_entropy(x.double(), w.double(), t, backend="torch")
    got = logitless.linear_cross_entropy(x, w, t, softcap=3e38, z_loss=1.2e-38, label_smoothing=1.2e-38,
                                         backend=backend)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=0)


def _transforms():
    f = torch.func
    return {
        "grad": lambda fn, a: f.grad(lambda a: fn(a).sum())(a),
        "vjp": lambda fn, a: f.vjp(fn, a)[1](torch.ones(())),
        "jvp": lambda fn, a: f.jvp(fn, (a,), (torch.ones_like(a),)),
        "vmap": lambda fn, a: f.vmap(fn)(a.unsqueeze(0).expand(2, *a.shape)),
        "jacrev": lambda fn, a: f.jacrev(fn)(a),
        "jacfwd": lambda fn, a: f.jacfwd(fn)(a),
        "functionalize": lambda fn, a: f.functionalize(fn)(a),
    }


@pytest.mark.parametrize("backend", ("torch", "triton"))
@pytest.mark.parametrize("transform", list(_transforms()))
def test_func_transforms_are_refused_clearly(backend, transform):
    # Each op's backward is hand-written (no forward-mode or batching rule): a transform raises an error naming it,
    # on both backends; jvp through the Triton path used to return a zero tangent.
    x, w, t = base()
    run = _transforms()[transform]
    ops = {
        "linear_cross_entropy": (lambda a: logitless.linear_cross_entropy(a, w, t, backend=backend), x),
        "linear_log_probs": (lambda a: logitless.linear_log_probs(a, w, t, backend=backend).sum(), x),
        "linear_logsumexp": (lambda a: logitless.linear_logsumexp(a, w, backend=backend).sum(), x),
        "cross_entropy": (lambda a: logitless.cross_entropy(a, t, backend=backend), x @ w.T),
    }
    for name, (fn, arg) in ops.items():
        with pytest.raises(RuntimeError, match=rf"logitless\.{name} does not support torch\.func\.") as info:
            run(fn, arg)
        assert transform in str(info.value) or transform in ("jacrev", "jacfwd")  # those are vjp/jvp under vmap


@pytest.mark.parametrize("backend", ("torch", "triton"))
def test_functional_call(backend):
    # torch.func.functional_call (swapping a module's parameters, as meta-learning and EMA code do) is no transform:
    # the loss and its gradients are those of a module holding the swapped parameters.
    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(D, D)
            self.lm_head = torch.nn.Linear(D, V)

        def forward(self, h, t):
            return logitless.linear_cross_entropy(torch.tanh(self.proj(h)), self.lm_head.weight, t,
                                                  linear_bias=self.lm_head.bias, backend=backend)

    torch.manual_seed(0)
    model, other = Head(), Head()
    x, _, t = base()
    params = {k: v.detach().clone().requires_grad_(True) for k, v in other.named_parameters()}
    loss = torch.func.functional_call(model, params, (x, t))
    got = torch.autograd.grad(loss, list(params.values()))
    want_loss = other(x, t)
    want = torch.autograd.grad(want_loss, list(other.parameters()))
    torch.testing.assert_close(loss, want_loss)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("backend", ("torch", "triton"))
def test_float64_class_weights_with_float32_input(backend):
    # Accepted on purpose, unlike F.cross_entropy (which raises for float64 weights with float32 logits): class
    # weights are converted to the float32 math (float64 for float64 input), so any floating dtype gives the result
    # of the float32 weights.
    x, w, t = base()
    cw = torch.rand(V, dtype=torch.float64) + 0.5
    for dtype in (torch.float64, torch.float16):
        got = logitless.linear_cross_entropy(x, w, t, weight=cw.to(dtype), backend=backend)
        assert torch.equal(got, logitless.linear_cross_entropy(x, w, t, weight=cw.to(dtype).float(), backend=backend))
        got = logitless.cross_entropy(x @ w.T, t, weight=cw.to(dtype), backend=backend)
        assert torch.equal(got, logitless.cross_entropy(x @ w.T, t, weight=cw.to(dtype).float(), backend=backend))


@pytest.mark.parametrize("backend", ("torch", "triton"))
@pytest.mark.parametrize("inplace", (False, True))
def test_one_class_with_strided_class_dimension(backend, inplace):
    # (N, 1) logits whose class stride is not 1 (a transposed (1, N) tensor): contiguous() keeps such a stride, and
    # the Triton launcher used to fail a bare assertion. The stride of a dimension of size 1 means nothing.
    from tests.helpers import check_cross_entropy

    t = torch.tensor([0, 0, -100, 0, 0, 0])
    for z, tt in (((torch.randn(1, 6) * 3).T, t), (torch.empty_strided((0, 1), (1, 5)), t[:0])):
        assert z.stride(1) != 1
        check_cross_entropy(z, tt, backend, z_loss=1e-3)  # under the error rule
        grads = []
        for ip in (False, inplace):
            zo = z.clone().requires_grad_(True)
            logitless.cross_entropy(zo, tt, z_loss=1e-3, inplace_backward=ip, backend=backend).backward()
            grads.append(zo.grad)
        assert torch.equal(*grads)


@pytest.mark.parametrize("backend", ("torch", "triton"))
def test_double_backward_names_logitless_for_every_input(backend):
    # Differentiating the input's gradient with respect to the weight (not the input) also raises logitless's
    # message; on the PyTorch path it used to be PyTorch's "appears to not have been used in the graph".
    x, w, t = base()
    b = torch.zeros(V, requires_grad=True)
    x.requires_grad_(True)
    w.requires_grad_(True)
    for op in (lambda: logitless.linear_cross_entropy(x, w, t, linear_bias=b, backend=backend, z_loss=1e-3),
               lambda: logitless.linear_logsumexp(x, w, linear_bias=b, backend=backend).sum()):
        (gx,) = torch.autograd.grad(op(), x, create_graph=True)
        for wrt in (w, b):
            with pytest.raises(RuntimeError, match="not differentiable"):
                torch.autograd.grad(gx.sum(), wrt)
    z = (x @ w.T).detach().requires_grad_(True)
    s = torch.ones((), requires_grad=True)
    (gz,) = torch.autograd.grad(logitless.cross_entropy(z, t, backend=backend) * s, z, create_graph=True)
    with pytest.raises(RuntimeError, match="not differentiable"):
        torch.autograd.grad(gz.sum(), s)
