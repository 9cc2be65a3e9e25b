"""Tile configurations of the linear-head kernels, per architecture, and the operand helpers that depend on them.

`config_for(x)` is what every launch uses: Tuning.linear_config when set, the interpreter's tiles on the CPU, else
the device's (gpu_config, asked once per device and dtype).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from .._common import INTERPRETER_SMS_BACKWARD, cuda_facts, device_index, max_shared_mem, num_sms
from .._tuning import current_tuning

try:  # Triton >= 3.4
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    block_n: int  # forward / dz tiles: tokens
    block_v: int  # forward / dz tiles: classes
    block_k: int  # reduction step of the logits product
    fwd_warps: int
    fwd_stages: int
    block_m: int  # gradient products: output rows
    block_d: int  # gradient products: output columns
    block_kg: int  # gradient products: reduction step
    grad_warps: int
    grad_stages: int
    group: int  # programs that run together share this many token blocks (their operands stay in L2)
    waves: int  # forward: programs per multiprocessor of the equal-split layout _fwd_layout starts from (and bounds)
    dz_block_v: int  # classes per dz tile (its epilogue is heavier than the forward's)
    # With a softcap, the dz tiles that recompute their logits (not the stash's, not when skipping) take this many
    # classes and pipeline stages (0: dz_block_v, fwd_stages): the softcap's slope is one more live tile.
    cap_dz_block_v: int = 0
    cap_dz_stages: int = 0
    tma: bool = False  # forward / dz operands through tensor descriptors (the copy engine) where possible
    balance: bool = True  # split the dW reduction when a chunk's few long dW tiles would idle most of the GPU
    wide: int = 4096  # first-pass chunks up to this many classes while their dz fits in unwritten dW rows
    grad_tma: bool = False  # gradient products' operands through tensor descriptors where possible
    # dx output tiles' columns in the Triton gradient products (0: block_d). Narrower dx tiles give each token
    # block more programs, but measured slower when skipping (docs/design/skipping.md), so the GPU configs keep
    # block_d.
    dx_block_d: int = 0
    # First-pass chunks of up to this many classes when the backward skips (0: wide). A skipping chunk's kernels
    # are short, so each chunk's fixed costs (launches, the dx accumulator's round trip) weigh more, and wider
    # chunks measured faster (docs/design/skipping.md).
    skip_wide: int = 0
    # Gradient products of skipping chunks: output tiles of this many columns in this many pipeline stages where
    # the last block_d tile of D would be at most half full (0: block_d and grad_stages). At D = 640 the 256-column
    # tiles compute 768 columns for 640, and the 128-column ones, 5 stages deep, measured faster; where D fills its
    # 256-column tiles they measured slower (docs/design/skipping.md).
    skip_block_d: int = 0
    skip_grad_stages: int = 0
    # The dz launches of chunks that recompute their logits as a persistent grid that stores dz through the copy
    # engine (operands through descriptors, dz rows the copy engine can address; not when skipping, nor with the
    # entropy's term or a softcap)
    dz_persistent: bool = False
    # Forward: tiles per vocabulary chunk, the unit of its split layout and of its partial statistics (merged in
    # chunk order). Fixed per configuration, so that a row's statistics are the same whatever N (docs/rl.md); small
    # enough that one token block still spreads over the GPU (V / (block_v chunk_tiles) programs), large enough
    # that the chunks' epilogues stay a small part of a program (Hopper: 8; docs/rl.md, "What it costs").
    chunk_tiles: int = 2

    @property
    def dx_d(self) -> int:
        return self.dx_block_d or self.block_d

    def skip_products(self, D: int) -> Config:
        """This config with the gradient products' tiles of a skipping backward over D columns (skip_block_d)."""
        if self.skip_block_d and 0 < D % self.block_d <= self.block_d // 2:
            return self.replace(block_d=self.skip_block_d, grad_stages=self.skip_grad_stages or self.grad_stages)
        return self

    def replace(self, **changes) -> Config:
        return dataclasses.replace(self, **changes)


def hopper_config() -> Config:
    """Hopper-class GPUs (>= 200 KB of shared memory a block), bfloat16 / float16, each choice measured
    (docs/design/tiles.md, forward.md, backward.md): forward 128 x 256 x 64 tiles, 8 warps, 3 stages; dz tiles
    128 x 256; gradient products 128 x 256 x 64, 4 stages; forward, dz and gradient-product operands through tensor
    descriptors (a flattened forward tile loop was slower); first-pass chunks of up to 8192 classes (half the dx
    accumulator's round trips of 4096); forward chunks of 8 tiles (docs/rl.md). With a softcap, dz tiles of
    128 x 128 x 64 in 4 stages: its slope is a second live tile, and at 128 x 256 the dz kernel took twice its time.
    The backward's logits must be the forward's bitwise (a recomputed maximum meets its own m exactly): the 128-class
    dz tiles gave gradients bitwise equal to the 256-class ones on the GPU; the interpreter's numpy products round
    differently per tile shape, so its config keeps one dz tile (test_softcap_dz_tiles forces the other path)."""
    return Config(block_n=128, block_v=256, block_k=64, fwd_warps=8, fwd_stages=3,
                  block_m=128, block_d=256, block_kg=64, grad_warps=8, grad_stages=4,
                  group=8, waves=8, dz_block_v=256, tma=True, grad_tma=True, wide=8192, skip_wide=32768,
                  skip_block_d=128, skip_grad_stages=5, cap_dz_block_v=128, cap_dz_stages=4, dz_persistent=True,
                  chunk_tiles=8)


def small_smem_config() -> Config:
    """GPUs with less shared memory a block (A100's 163 KB, the 99 KB of sm_86 / sm_89 / sm_120), bfloat16 /
    float16: 128 x 128 x 32 tiles everywhere. The Hopper tiles' gradient products need 112 KB there, and on sm_80
    every big-tile kernel spills (tools/compile_check.py: 96-1736 bytes of stack per thread), while these compile
    in at most 48 KB with at most 8 bytes of stack on sm_80, sm_86, sm_89 and sm_120. Not timed: no such GPU was
    at hand."""
    return hopper_config().replace(block_v=128, block_k=32, block_d=128, block_kg=32, dz_block_v=128, skip_block_d=0,
                                   skip_grad_stages=0)


def fp32_config() -> Config:
    """float32 inputs on any GPU: small tiles (float32 operands take twice the shared memory and registers)."""
    return Config(block_n=64, block_v=64, block_k=32, fwd_warps=4, fwd_stages=2,
                  block_m=64, block_d=64, block_kg=32, grad_warps=4, grad_stages=2,
                  group=8, waves=8, dz_block_v=64, chunk_tiles=8)


def interpreter_config() -> Config:
    """The Triton interpreter: small tiles, so that the tests' small shapes still have several partial tiles in
    every direction."""
    return Config(block_n=32, block_v=64, block_k=32, fwd_warps=1, fwd_stages=1,
                  block_m=32, block_d=32, block_kg=32, grad_warps=1, grad_stages=1,
                  group=2, waves=4, dz_block_v=64, wide=160, dx_block_d=16, skip_wide=320, skip_block_d=16)


def gpu_config(dtype: torch.dtype, major: int, max_smem: int) -> Config:
    """The tiles for a CUDA device of compute capability `major`.x whose blocks may use `max_smem` bytes of shared
    memory; tensor descriptors wherever the copy engine exists (compute capability >= 9)."""
    if dtype == torch.float32:
        return fp32_config()
    cfg = hopper_config() if max_smem >= 200 * 1024 else small_smem_config()
    if major < 9:
        cfg = cfg.replace(tma=False, grad_tma=False)
    return cfg


@functools.cache
def _device_config(index: int, dtype: torch.dtype) -> Config:
    return gpu_config(dtype, torch.cuda.get_device_capability(index)[0], max_shared_mem(index))


def config_for(x: torch.Tensor) -> Config:
    """The tiles every launch for input x uses."""
    override = current_tuning().linear_config
    if override is not None:
        return override
    if x.device.type != "cuda":
        return interpreter_config()
    return _device_config(device_index(x.device), x.dtype)


def dot_flags(x: torch.Tensor) -> dict:
    # float32 inputs get true float32 products (PyTorch's default), not tf32.
    upcast = x.device.type != "cuda" and x.dtype == torch.bfloat16
    return dict(DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", UPCAST=upcast)


def backward_sms(device: torch.device) -> int:
    """Multiprocessors the backward's planners assume."""
    return num_sms(device, INTERPRETER_SMS_BACKWARD)


def use_tma(cfg: Config, x: torch.Tensor, w: torch.Tensor, perm) -> bool:
    """Tensor descriptors need Triton's descriptor API, a GPU with the copy engine (Hopper or newer; the interpreter
    emulates it), no vocabulary order (the copy engine reads whole blocks of rows, not gathered ones), a unit last
    stride and 16-byte aligned bases and row strides."""
    return cfg.tma and perm is None and tma_ok(x, w)


def tma_ok(*tensors: torch.Tensor) -> bool:
    # The descriptor API, the copy engine, and 2-D operands it can address (see use_tma).
    if TensorDescriptor is None:
        return False
    if tensors[0].device.type == "cuda" and not cuda_facts(device_index(tensors[0].device))[1]:
        return False
    return all(t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0
               for t in tensors)


def descriptor(t: torch.Tensor, block: list[int]):
    """A tensor descriptor of t's [block] tiles (through this module's TensorDescriptor, which tests replace)."""
    return TensorDescriptor.from_tensor(t, block)


def operands(x, w, use_tma: bool, block_n: int, block_v: int, block_k: int):
    # What the logits product reads: the tensors, or descriptors of their [block, block_k] tiles.
    if not use_tma:
        return x, w
    return descriptor(x, [block_n, block_k]), descriptor(w, [block_v, block_k])
