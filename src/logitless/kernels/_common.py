"""Constants and host helpers shared by the kernel modules."""

import functools

import torch
import triton.language as tl

# log2(e): exponentials are computed as exp2(x * LOG2E) (one multiply and the hardware's EX2).
LOG2E = tl.constexpr(1.4426950408889634)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host-side grid and plan arithmetic. triton.cdiv is a JIT-aware wrapper in recent Triton
    releases (~2 us a call on the host): the backward's planner makes a few hundred such calls per step."""
    return -(-a // b)


@functools.cache
def cuda_facts(index: int) -> tuple[int, bool]:
    """(multiprocessors, has the copy engine: compute capability >= 9) of CUDA device `index`, asked once: torch's
    queries take microseconds, and the linear-head backward asks before each of its launches."""
    return (torch.cuda.get_device_properties(index).multi_processor_count,
            torch.cuda.get_device_capability(index)[0] >= 9)


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
