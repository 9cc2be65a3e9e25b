"""The package's layers: every module imports, no import cycle, and no module imports from a layer above its own.

Imports inside functions count as much as those at the top: a lazy import still ties the two modules together.
A call then reads downward, public function -> head op -> backend -> kernels, without going back up.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

import logitless

# Lowest first. A module's layer is that of its top-level name (logitless.kernels.linear_head: "kernels"); a module
# may import its own layer and those below.
LAYERS = (
    ("_validate", "_autograd", "_dispatch", "testing", "vocab"),  # checks, autograd hygiene, oracles, a
    # vocabulary's stored order
    ("loss_math",),  # the head op's contract, the losses on its statistics, the memory policy
    ("kernels", "torch_backend"),  # Triton kernels and launchers; the chunked PyTorch backend
    ("triton_backend",),  # the kernels as torch.library ops
    ("head",),  # the head op: backend choice, skip plan
    ("distributed",),  # vocab-parallel: the head op per shard + an exchange of the statistics
    ("linear_cross_entropy", "log_probs", "cross_entropy", "distill"),  # public ops
    ("nn", "integrations", "apps", ""),  # modules, integrations, the commands; "": __init__
)
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}
# Exceptions to the layer order (none: the dispatcher's table of ops with kernels is static).
ALLOWED: set[tuple[str, str]] = set()

ROOT = Path(logitless.__file__).parent


def _modules() -> dict[str, Path]:
    found = {"logitless": ROOT / "__init__.py"}
    for info in pkgutil.walk_packages([str(ROOT)], prefix="logitless."):
        rel = Path(*info.name.split(".")[1:])
        path = ROOT / rel / "__init__.py" if info.ispkg else (ROOT / rel).with_suffix(".py")
        found[info.name] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The package's modules that `name` imports, anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            # `from . import x` names a module x; `from .m import y` names something in m.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        out.update(t for t in targets if t in MODULES and t != name)
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    assert top in LAYER, f"{module} has no layer in tests/test_layers.py: add it to LAYERS"
    return LAYER[top]


@pytest.mark.parametrize("module", sorted(m for m in MODULES if not m.endswith(".__main__")))  # those run a CLI
def test_module_imports(module):
    importlib.import_module(module)


def test_no_upward_import():
    upward = [f"{a} (layer {_layer(a)}) imports {b} (layer {_layer(b)})"
              for a, targets in GRAPH.items() for b in sorted(targets)
              if _layer(b) > _layer(a) and (a, b) not in ALLOWED]
    assert not upward, "\n".join(upward)


def test_no_import_cycle():
    graph = {a: {b for b in targets if (a, b) not in ALLOWED} for a, targets in GRAPH.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(a):
        state[a] = 1
        path.append(a)
        for b in sorted(graph[a]):
            if state.get(b) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(b):] + [b]))
            if b not in state:
                visit(b)
        path.pop()
        state[a] = 2

    for a in sorted(graph):
        if a not in state:
            visit(a)


def test_the_graph_is_read():
    # A parser that missed imports would pass the tests above on an empty graph.
    assert "logitless.head" in GRAPH["logitless.linear_cross_entropy"]
    assert "logitless.loss_math" in GRAPH["logitless.kernels.linear_head.plans"]
    assert "logitless.kernels.linear_head" in GRAPH["logitless.triton_backend"]  # an import inside a function
    assert "logitless.testing" in GRAPH["logitless.apps.bench.check"]
