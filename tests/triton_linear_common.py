"""What the test_triton_linear*.py files share: the kernels' device, their cases, the NaN poisoning every test runs
with (import `poison` to turn it on), the check of linear_cross_entropy against float64, and the backward's
workspace arrangements."""


import pytest
import torch

import logitless
from logitless import testing
from tests.helpers import (
    check_against_truth,
    make_case,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def case(*args, **kw):
    """tests.helpers.make_case on the device the kernels run on."""
    return tuple(None if a is None else a.to(DEV) for a in make_case(*args, **kw))


@pytest.fixture(autouse=True)
def poison(tune):
    tune(debug_poison=True)
    # The forward's stash wherever it fits (its threshold of saved work is for GPU-sized heads; where the products
    # are torch's, test_stash_conditions checks the threshold itself).
    tune(stash_min_flop=0)


def lce_check(x, w, b, t, **kw):
    up = None
    if kw.get("reduction") == "none":  # a random upstream gradient, made on the kernels' device
        up = torch.randn(t.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(DEV)
    check_against_truth(logitless.linear_cross_entropy, testing.naive_linear_cross_entropy, x, w, b, t,
                        upstream=up, backend="triton", **kw)


# Where the backward's workspaces live (kernels/linear_head/plans.py, _plan): each case forces one arrangement with a
# small Tuning.scratch_bytes. (dtype, N, D, V, scratch columns, which inputs require grad, SMs seen by the launcher[,
# the caller's workspace_bytes])
WORKSPACES = {
    # bf16, both gradients: dz of D classes in dx, dx accumulator in the last 2N rows of dW; the second pass puts
    # one chunk's dz into still-unwritten dW rows and the last into the scratch.
    "alias_both": (torch.bfloat16, 37, 130, 300, 32, "xwb", 2),
    # ... and the second pass splits the token reduction (few dW tiles, many SMs): float32 partials + sum kernel.
    "alias_split_k": (torch.bfloat16, 140, 64, 300, 120, "xw", 16),
    # ... and the second pass's last chunks, whose dz fills the scratch, put the split partials of their few dW
    # tiles into the dW rows after them (odd N and D).
    "second_pass_tail_split": (torch.bfloat16, 257, 33, 650, 32, "xw", 16),
    # ... and the first pass splits the token reduction of its few dW tiles next to the dx tiles (small D, many SMs).
    "first_pass_split": (torch.bfloat16, 200, 40, 500, 32, "xwb", 16),
    # ... and wide first-pass chunks (128, then 64 classes) put their dz into dW rows after them, then chunks of D.
    "wide_chunks": (torch.bfloat16, 100, 40, 1500, 32, "xwb", 2),
    # float32: dx accumulates in place; dz goes to the scratch, several chunks.
    "fp32_in_place": (torch.float32, 37, 45, 300, 64, "xwb", 2),
    # frozen head: dx only, its float32 accumulator is allocated.
    "dx_only": (torch.float16, 37, 130, 300, 32, "x", 2),
    # frozen input: dW (and bias) only, dz in the scratch.
    "dw_only": (torch.bfloat16, 37, 45, 300, 64, "wb", 2),
    "bias_only": (torch.bfloat16, 37, 45, 300, 64, "b", 2),
    # V < 2N: the dx accumulator does not fit in dW and is allocated.
    "small_vocab": (torch.bfloat16, 70, 80, 100, 64, "xwb", 2),
    # workspace_bytes of 4 N D bytes more than 4 scratches: the dx accumulator gets its own buffer (no second pass),
    # the scratch is 4 times the default.
    "own_acc": (torch.bfloat16, 37, 130, 700, 32, "xwb", 2, 4 * 37 * 130 + 4 * 37 * 32 * 2),
    # ... only 4 scratches: the accumulator stays in dW, the second pass's last chunk in the scratch is wider (one
    # chunk of 124 classes where the default makes two).
    "wide_scratch": (torch.bfloat16, 37, 130, 700, 32, "xwb", 2, 4 * 37 * 32 * 2),
}
