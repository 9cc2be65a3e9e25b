"""Kernel launches that skip Triton's argument binding when a launch repeats a specialization seen before.

Triton's JIT entry binds every argument of every launch, specializes it (pointer alignment, integers equal to 1 or
divisible by 16, the constexprs) and builds a cache key from the result before it finds the compiled kernel: a cost
that grows with the parameter count (ours have dozens), which a small head's step pays for each of its launches
while the GPU waits on the host (measured in docs/design/host_time.md). `launch(fn, grid, *args, **constexprs)` keys the
compiled kernel by a cheap description of the same facts instead, made only of what Triton's specialization can
depend on:

- a tensor: its dtype and whether its address is 16-byte aligned;
- an integer: whether it is 1, whether it is divisible by 16, and its width (32, 64 bits or unsigned);
- a float: nothing (Triton passes floats unspecialized);
- a host tensor descriptor: its base's dtype and alignment, its shape, strides, block shape and padding, in full;
- None, bools and every keyword argument (constexprs and launch options): their values and types.

The first launch of a key goes through Triton's JIT (which compiles or finds the kernel and returns it); later ones
call the compiled kernel with the arguments in the kernel's parameter order, as the JIT itself does (the compiled
kernel's own launch also computes the launch metadata and calls the launch hooks that profilers install). A key is
never coarser than Triton's specialization, so a cached kernel is the one the JIT would pick.

The JIT is used for every launch under the interpreter, for values this cannot describe (a runtime argument of
another type, a keyword value that is not plain), and where Tuning.fast_launch is off.
"""

from __future__ import annotations

import functools
import inspect

import torch

from ._tuning import current_tuning

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # an older Triton: no host descriptors
    TensorDescriptor = None

_PLAIN = (bool, int, float, str, type(None))
_cache: dict = {}
# Distinct keys kept: a step has a few dozen (kernel, specialization) pairs; the bound only guards against a
# caller whose shapes never repeat.
_MAX_KEYS = 4096


class _NotPlain(Exception):
    pass


def _feature(v):
    t = type(v)
    if t is int:
        return (v == 1, v % 16 == 0, v >= 2 ** 31 or v < -2 ** 31, v >= 2 ** 63)
    # (Each kind's features differ from every other kind's: 0.0 == False == 0 as Python values.)
    if t is float:
        return float
    if v is None:
        return None
    if t is bool:
        return bool, v
    if t is torch.Tensor or isinstance(v, torch.Tensor):
        return (v.dtype, v.data_ptr() % 16 == 0)
    if TensorDescriptor is not None and t is TensorDescriptor:
        return (v.base.dtype, v.base.data_ptr() % 16 == 0, tuple(v.shape), tuple(v.strides), tuple(v.block_shape),
                getattr(v, "padding", None), getattr(v, "round_f32_to_tf32", None))
    raise _NotPlain


@functools.cache
def _new_enough() -> bool:
    """This Triton's JIT passes every parameter, constexprs included, to the compiled kernel in parameter order
    (Triton >= 3.3; older releases passed a subset)."""
    try:
        import triton

        major, minor = (int(p) for p in triton.__version__.split(".")[:2])
    except Exception:  # noqa: BLE001 - no Triton, or a version string this cannot read: the JIT path
        return False
    return (major, minor) >= (3, 3)


@functools.cache
def _params(fn) -> tuple[tuple[str, ...], dict]:
    """The kernel's parameter names in order, and the defaults of those that have one."""
    sig = inspect.signature(fn.fn)
    names = tuple(sig.parameters)
    defaults = {n: p.default for n, p in sig.parameters.items() if p.default is not inspect.Parameter.empty}
    return names, defaults


def key_of(fn, args: tuple, kwargs: dict, device: int = -1):
    """The cache key of a launch on `device`, or None where the launch must go through the JIT (a value this cannot
    describe)."""
    try:
        feats = tuple(map(_feature, args))
    except _NotPlain:
        return None
    kw = tuple(kwargs.items())
    types = tuple(map(type, kwargs.values()))  # True and 1 are equal keys, not equal constexprs
    for t in types:
        if t not in _PLAIN:
            return None
    return fn, device, feats, kw, types


def launch(fn, grid: tuple, *args, **kwargs) -> None:
    """fn[grid](*args, **kwargs), through the compiled kernel where this specialization was launched before (the
    module docstring). Arguments of the kernel's signature after the positional ones are passed by keyword."""
    # (Only Triton's JIT functions have compiled kernels: the interpreter's run in Python, and have no device caches.)
    if not (hasattr(fn, "device_caches") and _new_enough() and current_tuning().fast_launch):
        fn[grid](*args, **kwargs)
        return
    launch_cached(_cache, torch.cuda.current_device(), fn, grid, args, kwargs)


def launch_cached(cache: dict, device: int, fn, grid: tuple, args: tuple, kwargs: dict) -> None:
    """launch where compiled kernels exist, with its cache and the current device given: the first launch of a key
    through fn's JIT (which returns the compiled kernel, kept in `cache`), a repeat through the compiled kernel."""
    key = key_of(fn, args, kwargs, device)
    kernel = None if key is None else cache.get(key)
    if kernel is None:
        kernel = fn[grid](*args, **kwargs)
        if key is not None and kernel is not None and len(cache) < _MAX_KEYS:
            cache[key] = kernel
        return
    names, defaults = _params(fn)
    rest = [kwargs[n] if n in kwargs else defaults[n] for n in names[len(args):]]
    g = tuple(grid) + (1,) * (3 - len(grid))
    kernel[g](*args, *rest)
