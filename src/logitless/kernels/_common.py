"""Host helpers shared by the kernel families: grid arithmetic, device facts, and new buffers."""

import functools

import torch

from ._tuning import current_tuning

# Multiprocessors assumed under the Triton interpreter, which has no device to ask. One per use, each kept at the
# value the tests were written against (they pin the plans these counts produce):
# - the linear-head backward's planners: 2, a small GPU, on which the split of a dW reduction happens only for a
#   chunk of one dW tile (tests that exercise the splits set their own count);
# - the linear-head and two-head forwards: 8, enough that the tests' small shapes split each row over both phases
#   of the forward's layout (with 2, most rows would run whole in one program);
# - cross_entropy on stored logits: 4, which sets the tiles its config picks at the tests' shapes and the scale
#   kernel's grid.
INTERPRETER_SMS_BACKWARD = 2
INTERPRETER_SMS_FORWARD = 8
INTERPRETER_SMS_CE = 4


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host-side grid and plan arithmetic. triton.cdiv is a JIT-aware wrapper in recent Triton
    releases, slower on the host (docs/design/host_time.md): the backward's planner makes a few hundred such calls
    per step."""
    return -(-a // b)


def device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def cuda_facts(index: int) -> tuple[int, bool]:
    """(multiprocessors, has the copy engine: compute capability >= 9) of CUDA device `index`, asked once: torch's
    queries take microseconds, and the linear-head backward asks before each of its launches."""
    return (torch.cuda.get_device_properties(index).multi_processor_count,
            torch.cuda.get_device_capability(index)[0] >= 9)


@functools.cache
def max_shared_mem(index: int) -> int:
    """Bytes of shared memory one block of CUDA device `index` may use (opt-in maximum), asked once: the tile
    configs of every kernel family depend on it (sm_120's 99 KiB against Hopper's 227)."""
    from triton.runtime import driver

    return driver.active.utils.get_device_properties(index)["max_shared_mem"]


def num_sms(device: torch.device, interpreter_stand_in: int) -> int:
    """Streaming multiprocessors of a CUDA device; `interpreter_stand_in` (one of the INTERPRETER_SMS_*) elsewhere."""
    if device.type != "cuda":
        return interpreter_stand_in
    return cuda_facts(device_index(device))[0]


@functools.cache
def dram_bytes_per_s(index: int) -> float | None:
    """Peak DRAM bandwidth of CUDA device `index` in bytes per second (two transfers per memory clock over the bus),
    from the driver's properties as Triton reads them; None where the driver does not say."""
    try:
        from triton.runtime import driver

        props = driver.active.utils.get_device_properties(index)
        clock_khz, bus_bits = props.get("mem_clock_rate", 0), props.get("mem_bus_width", 0)
    except Exception:  # noqa: BLE001 - an older Triton or driver: no figure, not an error
        return None
    return 2.0 * clock_khz * 1e3 * bus_bits / 8 if clock_khz and bus_bits else None


def new_buffer(shape, **kw) -> torch.Tensor:
    """torch.empty, or filled with NaN under Tuning.debug_poison (an element never written then shows up)."""
    t = torch.empty(shape, **kw)
    return t.fill_(float("nan")) if current_tuning().debug_poison and t.is_floating_point() else t


def gradient_buffers(x: torch.Tensor, w: torch.Tensor, need_dx: bool, need_dw: bool, need_db: bool,
                     dw: torch.Tensor | None = None):
    """A head backward's outputs (dx, dW, db), None where not wanted: dx and dW in the inputs' dtypes (dW is `dw`
    when given: the forward's stash), db in float32 until the caller casts it. Empty (N = 0 or D = 0) heads get
    them zeroed at once: the returned flag says so."""
    N, D = x.shape
    V = w.shape[0]
    dx = new_buffer((N, D), device=x.device, dtype=x.dtype) if need_dx else None
    if dw is None and need_dw:
        dw = new_buffer((V, D), device=x.device, dtype=w.dtype)
    db = new_buffer(V, device=x.device, dtype=torch.float32) if need_db else None
    empty = N == 0 or D == 0
    if empty:
        for g in (dx, dw, db):
            if g is not None:
                g.zero_()
    return dx, dw, db, empty


def narrow(x: torch.Tensor) -> bool:
    """The narrow-D rule of both kernel families' backwards: a bfloat16 / float16 input of fewer than
    Tuning.narrow_d features takes its gradients with dL/dz kept in float32 for the products (a linear head: the
    backward on float32 copies; two heads: the PyTorch backend's backward). At such a width the products cost next
    to nothing, and dL/dz rounded to half precision before them is the whole error, which a sum over a few nearly
    cancelling terms amplifies."""
    return x.dtype != torch.float32 and 0 < x.shape[1] < current_tuning().narrow_d
