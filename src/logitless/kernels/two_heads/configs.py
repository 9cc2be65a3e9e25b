"""The two-head kernels' tiles: per architecture (arch_config), under the interpreter, and as Tuning overrides."""

from __future__ import annotations

import functools

import torch

from .._common import device_index, max_shared_mem
from .._tuning import current_tuning
from ..linear_head.configs import Config, fp32_config


def gpu_config() -> Config:
    """bfloat16 / float16 on a GPU with the copy engine. Two accumulators of logits are live at once, so the tiles
    are half the single-head forward's (128 x 256 fp32 would need every register of the thread for the accumulators
    alone). From the tile sweep (docs/distill.md, "Measured"): 4 stages rather than 3; 5-6 stages, 64 x 256,
    block_k 32 or 128, 16 warps and both heads in one reduction loop were no faster. The forward
    fields (block_n, block_v, block_k, fwd_warps, fwd_stages) serve the forward and dz kernels, dz_block_v the dz
    kernel's classes, and wide the backward's widest first-pass chunk; the gradient products are cuBLAS's."""
    return Config(block_n=128, block_v=128, block_k=64, fwd_warps=8, fwd_stages=4,
                  block_m=128, block_d=256, block_kg=64, grad_warps=8, grad_stages=4,
                  group=8, waves=8, dz_block_v=128, tma=True, wide=8192)


def interpreter_config() -> Config:
    """The Triton interpreter: tiles small enough that the tests' shapes have several partial tiles each way."""
    return Config(block_n=16, block_v=32, block_k=16, fwd_warps=1, fwd_stages=1,
                  block_m=32, block_d=32, block_kg=32, grad_warps=1, grad_stages=1,
                  group=2, waves=4, dz_block_v=32, tma=True, wide=96)


def arch_config(dtype: torch.dtype, major: int, max_smem: int) -> Config:
    """The two-head tiles for a CUDA device of compute capability `major`.x whose blocks may use `max_smem` bytes of
    shared memory (tools/compile_check.py compiles them per architecture). Below Hopper's shared memory, reduction
    steps of 32: with 64, the dz kernel's stages and its copy-engine store took 129 KiB on sm_120 (99 KiB there)."""
    if dtype == torch.float32:
        return fp32_config()
    cfg = gpu_config()
    if max_smem < 200 * 1024:
        cfg = cfg.replace(block_k=32)
    if major < 9:
        cfg = cfg.replace(tma=False)
    return cfg


@functools.cache
def _device_config(index: int, dtype: torch.dtype) -> Config:
    return arch_config(dtype, torch.cuda.get_device_capability(index)[0], max_shared_mem(index))


def config(x: torch.Tensor) -> Config:
    override = current_tuning().two_heads_config
    if override is not None:
        return override
    if x.device.type != "cuda":
        return interpreter_config()
    return _device_config(device_index(x.device), x.dtype)


def dz_config(x: torch.Tensor) -> Config:
    """The backward's config: the dz kernel's tiles in the forward fields (block_n, block_v, block_k, fwd_warps,
    fwd_stages), which the memory plan also reads (chunks rounded to dz tiles); Tuning.two_heads_dz on CUDA."""
    cfg = config(x)
    dz_tiles = current_tuning().two_heads_dz
    if dz_tiles is not None and x.device.type == "cuda":
        bn, bv, bk, warps, stages = dz_tiles
        return cfg.replace(block_n=bn, block_v=bv, block_k=bk, fwd_warps=warps, fwd_stages=stages, dz_block_v=bv)
    return cfg.replace(block_v=cfg.dz_block_v)

