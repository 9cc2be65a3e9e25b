import os

import torch

# Without a GPU the Triton kernels run through the interpreter; this must be set before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# Under pytest-xdist (the README's test command runs one worker per core) each worker keeps to one PyTorch thread,
# so that the workers do not contend for the cores (CONTRIBUTING.md, "Before a commit").
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


def _interpreter_problem() -> str | None:
    """Why the installed Triton's interpreter cannot run the kernels, or None. Triton 3.6's interpreter converts a
    loop bound held in a 1-element array with int(), which NumPy >= 2.4 refuses ("only 0-dimensional arrays can be
    converted to Python scalars"); every kernel whose loop bounds are computed fails (with NumPy 2.3 the whole suite
    passes on Triton 3.6). Triton 3.9's interpreter squeezes the array first."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return None
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def probe(out_ptr, n):
        acc = 0
        for _ in range(0, n - tl.program_id(0)):
            acc += 1
        tl.store(out_ptr, acc)

    out = torch.zeros(1, dtype=torch.int32)
    try:
        probe[(1,)](out, 3)
    except Exception as e:  # noqa: BLE001 - whatever the interpreter raises, the reason is reported
        import numpy
        return (f"the Triton {triton.__version__} interpreter cannot run a loop with computed bounds under NumPy "
                f"{numpy.__version__} ({type(e).__name__}: {e}); use a newer Triton (3.9 works) or, with Triton 3.6, "
                "NumPy < 2.4")
    return None if int(out) == 3 else f"the Triton {triton.__version__} interpreter counted {int(out)} of 3 loop steps"


def pytest_sessionstart(session):
    problem = _interpreter_problem()
    if problem:
        pytest.exit(problem, returncode=3)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def tune():
    """tune(**overrides): the kernels' Tuning with these fields changed (logitless.kernels.tuning) until the test
    ends; later calls apply on top of earlier ones."""
    import contextlib

    from logitless import kernels

    with contextlib.ExitStack() as stack:
        yield lambda **overrides: stack.enter_context(kernels.tuning(**overrides))


@pytest.fixture(autouse=True)
def _fresh_skip_records():
    """Each test starts with no record of whether skipping paid for a head: the records are keyed by the weight's
    storage, which a later test's tensors may reuse."""
    from logitless import skip_gate

    skip_gate.forget()
    yield
