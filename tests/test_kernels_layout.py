"""The kernels package's tuning object and its import rules (no GPU, no kernel launch)."""

import ast
import pathlib
import threading

import pytest

from logitless import kernels
from logitless.kernels import Tuning, current_tuning, tuning

KERNELS = pathlib.Path(kernels.__file__).parent


def test_tuning_nests_and_restores():
    assert current_tuning() == Tuning()
    with tuning(scratch_bytes=1024, stash_logits=False) as outer:
        assert current_tuning() is outer and outer.scratch_bytes == 1024 and not outer.stash_logits
        with tuning(scratch_bytes=0) as inner:
            assert (inner.scratch_bytes, inner.stash_logits) == (0, False)  # on top of the outer block's
        assert current_tuning() is outer
        with tuning(Tuning(), ce_tiles_per_program=2) as based:  # from a given Tuning, not the current one
            assert based.stash_logits and based.ce_tiles_per_program == 2
    assert current_tuning() == Tuning()


def test_tuning_restores_after_an_error_and_refuses_unknown_fields():
    with pytest.raises(RuntimeError), tuning(debug_poison=True):
        raise RuntimeError
    assert current_tuning() == Tuning()
    with pytest.raises(TypeError, match="SCRATCH_BYTES"), tuning(SCRATCH_BYTES=0):
        pass


def test_tuning_reaches_other_threads():
    # autograd runs the backward of CUDA tensors on a thread of its own: the launchers there see the block's Tuning.
    seen = []
    with tuning(scratch_bytes=123):
        t = threading.Thread(target=lambda: seen.append(current_tuning().scratch_bytes))
        t.start()
        t.join()
    assert seen == [123]


def test_planners_read_the_tuning_when_called():
    from logitless.kernels.linear_head import plans

    with tuning(scratch_bytes=4096):
        assert plans._workspace(64, 1000, 32, 2, 0) == (4096, False)
    assert plans._workspace(64, 1000, 32, 2, 0) == (Tuning().scratch_bytes, False)


def _imports(path: pathlib.Path) -> set[str]:
    """Modules a file imports, relative ones resolved against the logitless package."""
    parts = ("logitless", *path.relative_to(KERNELS.parent).with_suffix("").parts)
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = parts[:len(parts) - node.level] if node.level else ()
            mod = ".".join(base + ((node.module,) if node.module else ()))
            out.update(f"{mod}.{a.name}" for a in node.names)
            out.add(mod)
    return out


def test_kernels_import_nothing_above_them_but_the_workspace_policy():
    # The kernels are the bottom layer: they import each other, torch and triton; of the package above them only
    # loss_math's pieces that the PyTorch path shares, so that both backends use one formula: the default workspace
    # budget, and the two heads' merge of their near-agreement sums (move_t, log_ratio). The dispatcher's table of
    # ops with kernels is static, so the kernels do not register with it.
    above = {}
    for path in sorted(KERNELS.rglob("*.py")):
        got = {m for m in _imports(path) if m.startswith("logitless") and not m.startswith("logitless.kernels")}
        if got:
            above[str(path.relative_to(KERNELS))] = got
    assert above == {"linear_head/plans.py": {"logitless.loss_math", "logitless.loss_math.default_workspace_bytes"},
                     "two_heads/launch.py": {"logitless.loss_math", "logitless.loss_math.log_ratio",
                                      "logitless.loss_math.move_t"}}
