"""The package's layers: every module imports, no import cycle, and no module imports from a layer above its own.

Imports inside functions count as much as those at the top: a lazy import still ties the two modules together.
A call then reads downward, public function -> head op -> backend -> kernels, without going back up.
Also: no file over MAX_LINES lines, no private name used outside the package it is private to, and the public ops
reach the backends and kernels through the head op only. Their allowlists hold today's exceptions, exactly: an entry
that is no longer needed fails the test, so they only shrink.
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
    ("_autograd", "_dispatch", "shards", "testing", "vocab", "sorted_head", "later_grad"),  # autograd hygiene, what
    # runs where, a vocabulary shard's layout and collectives, oracles, a vocabulary's stored order, the head that
    # keeps it learned, and a weight's gradient made in part by a later node
    ("loss_math",),  # the head op's contract, the losses on its statistics, the memory policy
    ("kernels", "torch_backend"),  # Triton kernels and launchers; the chunked PyTorch backend
    ("triton_backend", "triton_two_heads", "triton_cross_entropy", "skip_gate"),  # the kernels as torch.library
    # ops; whether skipping pays
    ("head",),  # the head op: backend choice, skip plan, sharding, one call per loss
    ("_validate",),  # the checks, and the prepared head they give the head op
    ("linear_cross_entropy", "log_probs", "cross_entropy", "distill"),  # public ops
    ("nn", "distributed", "integrations", "apps", ""),  # modules, the public ops with a vocabulary layout given,
    # integrations, the commands; "": __init__
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


def _import_base(node: ast.ImportFrom, package: str) -> str:
    """The absolute module a `from ... import` reads from, relative levels resolved against `package`."""
    if not node.level:
        return node.module or ""
    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
    return f"{base}.{node.module}" if node.module else base


def _import_sites(name: str, path: Path) -> set[tuple[str, bool]]:
    """(module, lazy) for each of the package's modules that `name` imports: lazy where the import statement is
    inside a function."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    lazy = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
            for n in ast.walk(f)}
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _import_base(node, package)
            # `from . import x` names a module x; `from .m import y` names something in m.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        out.update((t, id(node) in lazy) for t in targets if t in MODULES and t != name)
    return out


def _imports(name: str, path: Path) -> set[str]:
    """The package's modules that `name` imports, anywhere in its file."""
    return {t for t, _ in _import_sites(name, path)}


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
    assert "logitless.triton_backend" in GRAPH["logitless.head"]  # an import inside a function
    assert "logitless.testing" in GRAPH["logitless.apps.bench.check"]


# Files over this many lines are split by what they do. Those below are being split now; each entry goes when its
# file is under the limit (the test fails while an entry is no longer needed).
MAX_LINES = 500
OVERSIZED: set[str] = set()  # files still to be split (none)


def test_no_file_over_the_limit():
    over = {str(p.relative_to(ROOT)): n for p in sorted(ROOT.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert set(over) - OVERSIZED == set(), f"over {MAX_LINES} lines: {over}"
    assert OVERSIZED - set(over) == set(), f"no longer over {MAX_LINES} lines, remove from OVERSIZED: " \
                                           f"{sorted(OVERSIZED - set(over))}"


def test_no_namedtuple_replace():
    # The ops' code runs under torch.compile's tracer, and torch 2.11's dynamo fails on NamedTuple._replace
    # (IndexError) where newer ones do not: the package builds its named tuples field by field.
    found = [f"{p.relative_to(ROOT)}:{i}" for p in sorted(ROOT.rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if "._replace(" in line]
    assert not found, f"NamedTuple._replace in {found}"


def _package(module: str) -> str:
    return module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]


def _private_imports(name: str, path: Path) -> set[tuple[str, str]]:
    """(importer, imported dotted name) for each private name (a leading underscore, dunders aside) that `name`
    imports from outside where it is private: a private module (kernels/_common.py) is its package's, subpackages
    included; a private name in a module (_x in foo.py) is the package's that holds the module, not its subpackages'."""
    package = _package(name)
    tree = ast.parse(path.read_text(), str(path))
    bound: dict[str, str] = {}  # local name -> the package's module it is bound to by an import
    imported = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _import_base(node, package)
            imported += [f"{base}.{alias.name}" for alias in node.names]
            bound.update({alias.asname or alias.name: f"{base}.{alias.name}" for alias in node.names
                          if f"{base}.{alias.name}" in MODULES})
    # `module._x` after `from . import module` reaches into the module as an import of _x would.
    imported += [f"{bound[node.value.id]}.{node.attr}" for node in ast.walk(tree)
                 if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound]
    out = set()
    for full in imported:
        parts = full.split(".")
        for i in range(1, len(parts)):
            if parts[0] != "logitless" or not parts[i].startswith("_") or parts[i].endswith("__"):
                continue
            if ".".join(parts[: i + 1]) in MODULES:  # a private module: its package's and their subpackages'
                owner = ".".join(parts[:i])
                ok = package == owner or package.startswith(owner + ".")
            else:  # a private name in a module: that module's package's
                ok = package == _package(".".join(parts[:i]))
            if not ok:
                out.add((name, full))
                break
    return out


# Private names imported across packages today; each entry goes when the import does.
PRIVATE_IMPORTS: set[tuple[str, str]] = set()  # exceptions (none)


def test_no_private_name_imported_from_another_package():
    found = set().union(*(_private_imports(n, p) for n, p in MODULES.items()))
    assert found - PRIVATE_IMPORTS == set(), "\n".join(f"{a} imports {b}" for a, b in sorted(found - PRIVATE_IMPORTS))
    assert PRIVATE_IMPORTS - found == set(), f"no longer imported, remove: {sorted(PRIVATE_IMPORTS - found)}"


# The public ops reach the backends and kernels through the head op only (head.py: the one-head statistics, the
# fused plans, the one-class closed form, the two-head losses, cross-entropy on given logits), and vocabulary
# parallelism through the head op too. Imports that do not (none); an entry would go when its import does.
OPS = ("linear_cross_entropy", "log_probs", "cross_entropy", "distill", "nn")
BELOW_THE_HEAD_OP = ("torch_backend", "triton_backend", "triton_two_heads", "triton_cross_entropy", "kernels")
BYPASSES: set[tuple[str, str]] = set()


def _bypasses() -> set[tuple[str, str]]:
    found = set()
    for a, targets in GRAPH.items():
        top = a.split(".")[1] if "." in a else ""
        for b in targets:
            below = b.split(".")[1] if "." in b else ""
            if (top in OPS and below in BELOW_THE_HEAD_OP) or (top == "distributed" and below in BELOW_THE_HEAD_OP[:2]):
                found.add((a, b))
    return found


def test_public_ops_go_through_the_head_op():
    found = _bypasses()
    assert found - BYPASSES == set(), "\n".join(f"{a} imports {b}" for a, b in sorted(found - BYPASSES))
    assert BYPASSES - found == set(), f"no longer imported, remove: {sorted(BYPASSES - found)}"


# One head-op call per loss: each public op of a linear head validates (and prepares the head, its backend and
# sharding included), then calls the head op once; the backend, the one-class closed form, the fused plan, skipping
# and the exchange of a sharded head's statistics are all behind that call (head.Skip only packs options).
ONE_CALL_OPS = {"linear_cross_entropy": ("linear_cross_entropy",),
                "log_probs": ("linear_log_probs", "linear_logsumexp")}


def _head_calls(module: str, function: str) -> list[str]:
    """The calls `head.<name>(...)` in `function` of logitless.<module>, head.Skip aside."""
    tree = ast.parse(MODULES[f"logitless.{module}"].read_text())
    fn = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function][-1]  # after @overloads
    return [n.func.attr for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and isinstance(n.func.value, ast.Name) and n.func.value.id == "head" and n.func.attr != "Skip"]


@pytest.mark.parametrize("module, function", [(m, f) for m, fs in ONE_CALL_OPS.items() for f in fs])
def test_one_head_op_call_per_loss(module, function):
    assert _head_calls(module, function) == [function], _head_calls(module, function)


def _fake_registrations(path: Path) -> list[str]:
    """The fake implementations that `path` registers, by name: a lambda is "<lambda>", a function named `_` is
    "_" (names that a traceback or a profile of a traced graph cannot tell apart)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.FunctionDef):
            names += [node.name for d in node.decorator_list
                      if isinstance(d, ast.Attribute) and d.attr == "register_fake"]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "register_fake" and node.args):
            arg = node.args[0]
            names.append("<lambda>" if isinstance(arg, ast.Lambda) else getattr(arg, "id", "?"))
    return names


def test_fake_registrations_are_named():
    found = {name: _fake_registrations(path) for name, path in MODULES.items()}
    assert sum(map(len, found.values())) >= 5, found  # the parser sees the registrations
    unnamed = [f"{m}: {n}" for m, names in found.items() for n in names if n in ("_", "<lambda>", "?")]
    assert not unnamed, "\n".join(unnamed)


# The one lazy boundary to Triton: the Triton backends import Triton (with the kernels they launch), so the head op
# imports them inside the calls that chose Triton, and nothing else does; past that boundary every call from a
# backend to a launcher is a plain name, imported at the top of the backend's file.
TRITON_BACKENDS = ("logitless.triton_backend", "logitless.triton_two_heads", "logitless.triton_cross_entropy")
TRITON_KERNELS = ("logitless.kernels.linear_head", "logitless.kernels.two_heads", "logitless.kernels.cross_entropy")


def _in(module: str, packages) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_one_lazy_boundary_to_triton():
    wrong = []
    for a, path in MODULES.items():
        for b, lazy in sorted(_import_sites(a, path)):
            if b in TRITON_BACKENDS and not (a == "logitless.head" and lazy):
                wrong.append(f"{a} imports the Triton backend {b}{'' if lazy else ' at the top'}: only head.py may, "
                             "inside the call that chose Triton")
            if _in(b, TRITON_KERNELS) and not _in(a, ("logitless.kernels",)):
                if a not in TRITON_BACKENDS:
                    wrong.append(f"{a} imports the kernels {b}: only a Triton backend may")
                elif lazy:
                    wrong.append(f"{a} imports the kernels {b} inside a function: import the launchers at the top")
    assert not wrong, "\n".join(wrong)
    lazy_sites = {b for b, lazy in _import_sites("logitless.head", MODULES["logitless.head"]) if lazy}
    assert lazy_sites == set(TRITON_BACKENDS), lazy_sites  # the parser sees the boundary


_WITHOUT_TRITON = """
import importlib.abc, sys
class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("no triton here")
sys.meta_path.insert(0, NoTriton())
import torch
import logitless
from logitless import _dispatch
assert not _dispatch.triton_importable()
x = torch.randn(6, 8, requires_grad=True)
w = torch.randn(11, 8, requires_grad=True)
t = torch.randint(0, 11, (6,))
logitless.linear_cross_entropy(x, w, t).backward()
logitless.linear_log_probs(x, w, t, return_entropy=True)[1].sum().backward()
logitless.linear_kl_div(x, w, x, w).backward()
logitless.cross_entropy(torch.randn(6, 11, requires_grad=True), t, inplace_backward=True).backward()
try:
    logitless.linear_cross_entropy(x, w, t, backend="triton")
except RuntimeError as e:
    assert "Triton is not installed" in str(e), e
else:
    raise AssertionError("backend='triton' ran without Triton")
loaded = sorted(m for m in sys.modules if m.startswith(("logitless.triton", "logitless.kernels.")))
assert loaded == [], loaded
"""


def test_without_triton_the_package_imports_and_runs():
    # A CPU-only install where Triton is absent (or does not import): every op runs on the PyTorch backend and no
    # Triton backend or kernel module is loaded.
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT.parent), os.environ.get("PYTHONPATH", "")])}
    env.pop("LOGITLESS_BACKEND", None)
    run = subprocess.run([sys.executable, "-c", _WITHOUT_TRITON], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]


# Tests observe the kernels' planning through public functions and kernels.Tuning's recorders (debug_plans,
# debug_backwards), never by patching a private name of the package: a private name may be renamed or inlined
# freely, and a patched one tests the patch. Patching public names, and third-party or standard-library ones, is
# allowed.
TESTS = ROOT.parent.parent / "tests"
PATCHERS = {"setattr", "delattr", "patch", "object"}  # monkeypatch.setattr / delattr, unittest.mock.patch(.object)


def _is_private(dotted: str) -> bool:
    parts = dotted.split(".")
    return parts[0] == "logitless" and any(p.startswith("_") and not p.endswith("__") for p in parts[1:])


def _private_patches(source: str, filename: str = "<test>") -> list[str]:
    """'file:line: what' for each patch of a private name inside the package in a test module's source: a
    setattr / delattr / mock.patch on an object the file imports from logitless of a name with a leading underscore
    (or through one), the same as a dotted string, and spy_launches of a private name."""
    tree = ast.parse(source, filename)
    bound: dict[str, str] = {}  # local name -> what it names in the package, from the file's imports anywhere
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound.update({(a.asname or a.name).split(".")[0]: (a.name if a.asname else a.name.split(".")[0])
                          for a in node.names if a.name.split(".")[0] == "logitless"})
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "logitless":
            bound.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})

    def dotted(expr) -> str | None:
        # What an expression names in the package (a bound name and its attributes), or None.
        if isinstance(expr, ast.Name):
            return bound.get(expr.id)
        if isinstance(expr, ast.Attribute):
            base = dotted(expr.value)
            return None if base is None else f"{base}.{expr.attr}"
        return None

    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        fn = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        args = node.args
        strings = [a.value for a in args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        target = None
        if fn == "spy_launches":
            target = next((s for s in strings if s.startswith("_")), None)
        elif fn in PATCHERS and args:
            first = args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):  # "pkg.mod.name"
                target = first.value if _is_private(first.value) else None
            else:
                base = dotted(first)
                name = args[1].value if len(args) > 1 and isinstance(args[1], ast.Constant) else None
                if base is not None and isinstance(name, str) and _is_private(f"{base}.{name}"):
                    target = f"{base}.{name}"
        if target is not None:
            found.append(f"{filename}:{node.lineno}: {fn} of {target}")
    return found


def test_tests_patch_no_private_name():
    found = [hit for path in sorted(TESTS.glob("*.py")) for hit in _private_patches(path.read_text(), path.name)]
    assert not found, "patched private names (read Tuning's recorders or a public name instead):\n" + "\n".join(found)


def test_private_patches_are_found():
    # The scanner sees each form (a scanner that found nothing would pass the test above).
    source = '''
import logitless
import transformers
from logitless.kernels.linear_head import plans as lh_plans
from logitless import score
def test(monkeypatch):
    from logitless.kernels import two_heads
    monkeypatch.setattr(lh_plans, "_plan", None)
    monkeypatch.setattr(score, "BUFFER_DOCS", 2)
    monkeypatch.setattr("logitless.apps.score._BUFFER_DOCS", 2)
    monkeypatch.setattr("logitless.apps.score.BUFFER_DOCS", 2)
    setattr(logitless.kernels._tuning, "DEFAULT", None)
    monkeypatch.setattr(transformers, "_private", None)
    monkeypatch.setattr("transformers.models._x", None)
    spy_launches(monkeypatch, two_heads.launch, "_two_dz_kernel", None)
'''
    assert _private_patches(source) == [
        "<test>:8: setattr of logitless.kernels.linear_head.plans._plan",
        "<test>:10: setattr of logitless.apps.score._BUFFER_DOCS",
        "<test>:12: setattr of logitless.kernels._tuning.DEFAULT",
        "<test>:15: spy_launches of _two_dz_kernel",
    ]
