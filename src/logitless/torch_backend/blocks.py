"""The PyTorch backend's blocks: how large a (token chunk x vocabulary chunk) block is, how a block of logits is
computed and transformed (softcap, temperature), and the chain rule back through that transform.

Every module of the backend builds its logits here (linear_chunk), so a softcap or a temperature is applied, and
differentiated, one way whatever the op. A block takes a share of the memory policy's budget
(loss_math.default_workspace_bytes) and never N x V elements.
"""

from __future__ import annotations

import torch

from .._autograd import first_order_only
from ..loss_math import acc_dtype, default_workspace_bytes

# This path's (token chunk x vocab chunk) float32 block takes half of the budget, or a third with the options that
# need a temporary of the block's size (the softcap's chain factor in the backward, the entropy, smoothing).
_BLOCK_SHARE = 2
# Vocabulary chunks narrower than this make the products inefficient: below it the tokens are chunked instead.
MIN_COLS = 1024
# Part of the budget that the blocks of the fused training path and of the forward leave to the products' own
# buffers (at most a quarter of the budget): MKL's sgemm takes 6-10 MiB of packing space for a product against all of
# W (measured as peak RSS, at V = 32000 and D = 128 to 1024).
_PRODUCTS_RESERVE = 8 << 20
# The head op's blocks (head_forward, head_backward) are products of a multiple of ROW_BLOCK rows (the input padded
# with zero rows to a multiple of it) and HEAD_COLS classes (the last chunk V mod HEAD_COLS): CPU GEMM kernels round a
# row differently with the number of rows of the product when it is small or odd (MKL: 1-3, 5-7 and 9-11 rows differ
# from 16 and more), not between multiples of 16, and the chunk width sets where the online statistics rescale. Both
# fixed, a row's statistics and its input gradient do not depend on the batch it is in (docs/rl.md;
# tests/test_batch_invariance.py checks it on the machine it runs on). One product per block, not one per ROW_BLOCK
# rows, which were several times slower (docs/rl.md).
ROW_BLOCK = 16
HEAD_COLS = 2048
# cross_entropy on given logits and the two-head losses walk chunks of this many classes...
VOCAB_CHUNK = 4096
# ... and of token_chunk(V) rows: blocks of at most this many elements.
CHUNK_ELEMS = 1 << 20


def budget_block(n: int, V: int, temporaries: bool = False, share: int = _BLOCK_SHARE, item: int = 4,
                 budget: int | None = None) -> tuple[int, int]:
    """(token rows, vocabulary columns) of one block of this path (`item` bytes an element: float32, or float64):
    1 / `share` of `budget` (by default the policy's) (of share + 1 with `temporaries` of the block's size; by
    default half, or a third), all n tokens at once while that leaves at least MIN_COLS classes (the
    backward then writes each dW chunk once, and reads x once), else chunks of tokens."""
    budget = default_workspace_bytes(n, V) if budget is None else budget
    elems = max(1, budget // (item * (share + bool(temporaries))))
    cols = min(V, max(MIN_COLS, elems // max(n, 1)))
    return max(1, min(n, elems // max(cols, 1))), max(1, cols)


def chunks(n: int, size: int):
    for start in range(0, n, size):
        yield start, min(start + size, n)


def token_chunk(V: int) -> int:
    return max(16, CHUNK_ELEMS // min(V, VOCAB_CHUNK))


def apply_softcap(z: torch.Tensor, softcap: float | None, *, inplace: bool = False) -> torch.Tensor:
    """softcap * tanh(z / softcap), the logit cap of every PyTorch-side path (None: z unchanged). `inplace` writes
    it over z (a block that owns its memory, differentiated by chain_transform); otherwise a new tensor whose
    autograd slope is softcap_slope's (_Softcap)."""
    if softcap is None:
        return z
    if inplace:
        return z.div_(softcap).tanh_().mul_(softcap)
    return _Softcap.apply(z, float(softcap))


def transform(raw: torch.Tensor, softcap: float | None, inv_temp: float) -> torch.Tensor:
    """Raw float32 logits -> softcapped, temperature-scaled logits, in a new tensor (raw is kept for the chain
    rule, chain_transform)."""
    z = apply_softcap(raw.clone() if softcap is not None else raw, softcap, inplace=True)
    return z * inv_temp if inv_temp != 1.0 else z


def chain_transform(dz, raw, softcap, inv_temp):
    """dL/dz (after softcap and temperature) -> dL/d(raw logits). `raw` is the logit block before the transform."""
    if inv_temp != 1.0:
        dz = dz * inv_temp
    if softcap is not None:
        dz = dz * softcap_slope(raw, softcap)
    return dz


def softcap_slope(raw, softcap):
    """d(softcap tanh(u))/du at u = raw / softcap, as 4 s (1 - s) with s = sigmoid(-2 |u|) (= 1 / cosh(u)^2), in
    one block-sized buffer. PyTorch's 1 - tanh(u)^2 cancels where tanh saturates (20-60x PyTorch's float32 error
    there); this form has no cancellation (s <= 1/2) and stays within a few ulp everywhere."""
    s = (raw / softcap).abs_().mul_(-2.0).sigmoid_()
    return s.addcmul_(s, s, value=-1.0).mul_(4.0)



def linear_chunk(x_c, w_c, b_c, softcap, inv_temp, out=None):
    """float32 logits of a (token chunk, vocab chunk) block: [Cn, Cv], a new tensor (or `out`), transformed in
    place."""
    acc = acc_dtype(x_c.dtype)
    # The bias enters the product's accumulation (addmm: one rounding of x w^T + b, as F.linear), not after it:
    # with few features a separate add's rounding was as large as the product's (entropy gradients at D = 3 went
    # from 2.7 to 1.0 x PyTorch's typical error).
    if b_c is None:
        z = torch.mm(x_c.to(acc), w_c.to(acc).T, out=out)
    else:
        z = torch.addmm(b_c.to(acc), x_c.to(acc), w_c.to(acc).T, out=out)
    apply_softcap(z, softcap, inplace=True)
    if inv_temp != 1.0:
        z.mul_(inv_temp)
    return z


def row_log(s: torch.Tensor) -> torch.Tensor:
    # PyTorch's CPU log rounds an element of a vector's scalar tail differently from one in its SIMD lanes, so the
    # log of a row's sum would depend on the row's position and on the batch's length. Taken in float64 and rounded
    # once, the two agree unless the float64 results straddle a rounding boundary of the float32 one (a chance of
    # about 2^-29 per row).
    if s.dtype == torch.float32 and s.device.type == "cpu":
        return torch.log(s.double()).float()
    return torch.log(s)


def budget_beside_products(n: int, V: int) -> int:
    """The policy's budget less the products' own buffers (_PRODUCTS_RESERVE): what the blocks of the fused
    training path and of the forward may take."""
    budget = default_workspace_bytes(n, V)
    return budget - min(budget // 4, _PRODUCTS_RESERVE)


def stats_block(n: int, V: int, temporaries: bool, item: int) -> tuple[int, int]:
    """(token rows, vocabulary columns) of the forward's blocks on a linear head whose weight is already in the
    accumulation dtype: budget_block's shape with the whole budget beside the products' buffers for the block (and
    a temporary of its size for the smoothing and the entropy, linear_head._RowStats.update), since the forward
    holds nothing else of that size. Fewer blocks, hence calls, than the backward's half budget: on a loaded 2-core
    machine each call waits for both threads. Full-vocabulary rows, as many blocks, were slower: each block's
    product packs all of W (docs/design/backward.md, "The PyTorch path (CPU)")."""
    return budget_block(n, V, temporaries, share=1, item=item, budget=budget_beside_products(n, V))


def pad_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x with zero rows added up to a multiple of ROW_BLOCK (x itself when it is one), and that row count."""
    n = x.shape[0]
    n_pad = -(-n // ROW_BLOCK) * ROW_BLOCK
    return (x if n_pad == n else torch.nn.functional.pad(x, (0, 0, 0, n_pad - n))), n_pad


def fixed_block(elems: int, V: int) -> tuple[int, int]:
    """(rows, cols) of a block of about `elems` elements for the head op's fixed shapes: HEAD_COLS classes (all V
    when fewer) and a multiple of ROW_BLOCK rows (at least one). A budget below ROW_BLOCK x HEAD_COLS elements
    halves the classes until one row block fits (down to 128): the policy's floor (loss_math.POLICY_MIN_BYTES) is
    far above that, so only a budget set below it makes the width, and with it the rounding, depend on N."""
    cols = min(V, HEAD_COLS)
    while cols > 128 and elems < ROW_BLOCK * cols:
        cols //= 2
    return max(1, elems // (cols * ROW_BLOCK)) * ROW_BLOCK, cols


class _Softcap(torch.autograd.Function):
    """softcap tanh(z / softcap) with the slope of softcap_slope: 1 - tanh^2, the slope of torch.tanh's backward,
    cancels where tanh saturates (and is exactly 0 past |u| ~ 19 in float64)."""

    @staticmethod
    def forward(ctx, z, softcap):
        ctx.save_for_backward(z)
        ctx.softcap = softcap
        return softcap * torch.tanh(z / softcap)

    @staticmethod
    @first_order_only
    def backward(ctx, g):
        (z,) = ctx.saved_tensors
        return g * softcap_slope(z, ctx.softcap), None

