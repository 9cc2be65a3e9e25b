"""Bad arguments of the Triton path's options (deterministic, workspace_bytes, the skip options): a clear error
before any kernel runs.

Split by concern: op semantics in test_triton_linear.py, the kernels' mechanics in test_triton_linear_kernels.py,
their host plans in test_triton_linear_plans.py, skipping in test_triton_linear_skip.py, bad arguments in
test_triton_linear_validation.py; what they share in triton_linear_common.py.
"""

import pytest
import torch

import logitless
from tests.triton_linear_common import (
    DEV,
    case,
    poison,  # noqa: F401 - autouse: every test runs with NaN-poisoned buffers
)


def test_bad_deterministic_flag():
    x, w, _, t = case(torch.float32)
    with pytest.raises(TypeError, match="deterministic"):
        logitless.linear_cross_entropy(x, w, t, backend="triton", deterministic=1)


def test_bad_workspace_bytes():
    x, w, _, t = case(torch.bfloat16)
    for bad, err in ((-1, ValueError), (1 << 63, ValueError), (1.5, TypeError), (True, TypeError), ("8MB", TypeError)):
        for fn, args in ((logitless.linear_cross_entropy, (x, w, t)), (logitless.linear_log_probs, (x, w, t)),
                         (logitless.linear_logsumexp, (x, w))):
            with pytest.raises(err, match="workspace_bytes"):
                fn(*args, workspace_bytes=bad, backend="triton")


def test_bad_skip_options():
    x, w, _, t = case(torch.bfloat16)
    for bad, err in ((-0.1, ValueError), (1.0, ValueError), ("0.1", ValueError), ("Auto", ValueError),
                     (b"auto", TypeError), (True, TypeError)):
        with pytest.raises(err, match="skip_threshold"):
            logitless.linear_cross_entropy(x, w, t, skip_threshold=bad, backend="triton")
    with pytest.raises(ValueError, match="skip_threshold"):
        logitless.linear_log_probs(x, w, t, skip_threshold=2.0, backend="triton")
    for bad, err in (("frequency", ValueError), (torch.ones(299, device=DEV), ValueError),
                     (torch.ones(300, dtype=torch.bool, device=DEV), TypeError)):
        with pytest.raises(err, match="vocab_order"):
            logitless.linear_cross_entropy(x, w, t, vocab_order=bad, backend="triton")
    with pytest.raises(ValueError, match="vocab_order"):
        logitless.LinearCrossEntropyLoss(vocab_order="batches")
