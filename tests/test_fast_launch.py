"""kernels/_launch.py: launches that repeat a specialization go to the compiled kernel, others through the JIT.

On a CPU there are no compiled kernels: a stand-in JIT function records which path each launch took and what the
compiled kernel received. On a GPU (`gpu` marker) the real backward's launches are compared with the JIT's, bit for
bit."""

import pytest
import torch

from logitless.kernels import _launch


class _Compiled:
    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        return lambda *args: self.log.append(("compiled", grid, args))


class _Jit:
    """A JIT function's interface as _launch uses it: .fn (the Python function), [grid](*args, **kwargs) -> the
    compiled kernel."""

    def __init__(self):
        self.log = []

        def kernel(a, n, f, desc_or_none, FLAG, SIZE, EXTRA=7):
            pass
        self.fn = kernel
        self.compiled = _Compiled(self.log)

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("jit", grid, args, kwargs))
            return self.compiled
        return run


class _Launcher:
    """launch_cached with a cache of its own, as launch runs it where compiled kernels exist."""

    def __init__(self):
        self.cache = {}

    def launch(self, fn, grid, *args, **kwargs):
        _launch.launch_cached(self.cache, 0, fn, grid, args, kwargs)


@pytest.fixture
def fast():
    return _Launcher()


def _paths(fn):
    return [entry[0] for entry in fn.log]


def test_repeat_goes_to_the_compiled_kernel_in_parameter_order(fast):
    fn = _Jit()
    a = torch.zeros(64)
    fast.launch(fn, (3,), a, 32, 0.5, None, FLAG=True, SIZE=16, num_warps=4)
    fast.launch(fn, (5,), a[16:], 48, 1.5, None, FLAG=True, SIZE=16, num_warps=4)
    assert _paths(fn) == ["jit", "compiled"]
    # every parameter in order, the keyword ones and the default included; options (num_warps) left out; the grid
    # padded to three dimensions
    assert fn.log[1][1] == (5, 1, 1)
    args = fn.log[1][2]
    assert args[0].data_ptr() == a[16:].data_ptr() and args[1:] == (48, 1.5, None, True, 16, 7)


@pytest.mark.parametrize("change", ["misaligned", "int_one", "int_not_div16", "int_wide", "dtype", "constexpr",
                                    "constexpr_type", "option", "none_to_tensor"])
def test_a_new_specialization_goes_through_the_jit(fast, change):
    fn = _Jit()
    a = torch.zeros(64)
    base = dict(args=[a, 32, 0.5, None], kw=dict(FLAG=True, SIZE=16, num_warps=4))
    fast.launch(fn, (1,), *base["args"], **base["kw"])
    args, kw = list(base["args"]), dict(base["kw"])
    if change == "misaligned":
        args[0] = a[1:]
    elif change == "int_one":
        args[1] = 1
    elif change == "int_not_div16":
        args[1] = 33
    elif change == "int_wide":
        args[1] = 2 ** 33
    elif change == "dtype":
        args[0] = torch.zeros(64, dtype=torch.float16)
    elif change == "constexpr":
        kw["SIZE"] = 32
    elif change == "constexpr_type":
        kw["FLAG"] = 1  # equal to True as a value, not as a constexpr
    elif change == "option":
        kw["num_warps"] = 8
    elif change == "none_to_tensor":
        args[3] = a
    fast.launch(fn, (1,), *args, **kw)
    assert _paths(fn) == ["jit", "jit"]
    fast.launch(fn, (1,), *args, **kw)  # the new specialization is cached in its turn
    assert _paths(fn) == ["jit", "jit", "compiled"]


def test_descriptors_are_keyed_in_full(fast):
    if _launch.TensorDescriptor is None:
        pytest.skip("this Triton has no host tensor descriptors")
    desc = _launch.TensorDescriptor.from_tensor
    a = torch.zeros(64, 64)
    fn = _Jit()
    for d in (desc(a[:32], [16, 16]), desc(a[32:], [16, 16]),  # another base, the same shape: a repeat
              desc(a[:48], [16, 16]),  # another shape
              desc(a[:32], [16, 32])):  # another block
        fast.launch(fn, (1,), a, 32, 0.5, d, FLAG=True, SIZE=16)
    assert _paths(fn) == ["jit", "compiled", "jit", "jit"]


def test_keys_never_coarser_than_tritons_own_specialization():
    # Any two runtime values with one key must get one specialization from Triton (where it exposes its own).
    try:
        from triton.backends.compiler import BaseBackend
        from triton.runtime.jit import native_specialize_impl
    except ImportError:
        pytest.skip("this Triton does not expose its specialization")
    a = torch.zeros(256)
    values = [0, 1, 2, 15, 16, 17, 32, -1, -16, 2 ** 31 - 16, 2 ** 31, 2 ** 31 + 1, 2 ** 40, 2 ** 63, 2 ** 63 + 16,
              0.0, 1.0, 2.5, True, False, None, a, a[1:], a[4:], a[8:], a.half(), a.half()[8:], a.to(torch.int32),
              a.to(torch.int64)[2:]]
    if _launch.TensorDescriptor is not None:
        desc = _launch.TensorDescriptor.from_tensor
        m = torch.zeros(64, 64)
        values += [desc(m, [16, 16]), desc(m[:48], [16, 16]), desc(m, [16, 32]), desc(m.half(), [16, 16])]
    for u in values:
        for v in values:
            if _launch._feature(u) == _launch._feature(v):
                assert (native_specialize_impl(BaseBackend, u, False, True, True)
                        == native_specialize_impl(BaseBackend, v, False, True, True)), (u, v)


def test_values_it_cannot_describe_always_go_through_the_jit(fast):
    fn = _Jit()
    a = torch.zeros(64)
    for _ in range(2):
        fast.launch(fn, (1,), a, 32, 0.5, object(), FLAG=True, SIZE=16)  # a runtime argument of unknown type
        fast.launch(fn, (1,), a, 32, 0.5, None, FLAG=a, SIZE=16)  # a keyword that is not a plain value
    assert _paths(fn) == ["jit"] * 4
    assert fast.cache == {}


def test_the_jit_alone_for_interpreted_kernels_or_when_tuned_off(tune):
    from logitless._dispatch import interpreter_enabled
    from logitless.kernels.linear_head import backward_kernels as bk

    # The interpreter's kernels have no compiled launches (no device caches): launch hands them to the JIT.
    assert hasattr(bk._dz_kernel, "device_caches") == (not interpreter_enabled())
    fn = _Jit()
    fn.device_caches = {}  # a stand-in for a compiled JIT function
    a = torch.zeros(64)
    tune(fast_launch=False)
    for _ in range(2):
        _launch.launch(fn, (1,), a, 32, 0.5, None, FLAG=True, SIZE=16)
    assert _paths(fn) == ["jit", "jit"]


@pytest.mark.gpu
def test_backward_bitwise_equal_with_and_without(tune):
    import logitless

    torch.manual_seed(0)
    N, D, V = 1000, 640, 50000
    x = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(V, D, device="cuda") * 0.05).to(torch.bfloat16)
    t = torch.randint(0, V, (N,), device="cuda")
    t[::7] = -100
    out = {}
    for fast_launch in (False, True, True):
        tune(fast_launch=fast_launch)
        xs, ws = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        for skip in (None, 1e-4):
            loss = logitless.linear_cross_entropy(xs, ws, t, skip_threshold=skip)
            loss.backward()
            out.setdefault((fast_launch, skip), []).append((loss.detach(), xs.grad.clone(), ws.grad.clone()))
            xs.grad = ws.grad = None
    assert _launch._cache, "no launch was cached"
    for skip in (None, 1e-4):
        ref = out[(False, skip)][0]
        for got in out[(True, skip)]:
            for r, g in zip(ref, got, strict=True):
                assert torch.equal(r, g)
