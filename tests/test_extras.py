"""Each extra of pyproject.toml installs what its documented commands import.

A fresh virtual environment per extra would take minutes; instead the command runs in a child interpreter started
without site-packages (`python -S`) whose import path is a folder of symbolic links to the installed distributions
that the extra's requirements reach (the base requirements, the extra's, and theirs, recursively): what a fresh
install of that extra would hold, in the versions installed here. A package the extra forgot is then missing, as it
would be for a user, even where it is installed here (the tests install `[dev]`, which holds it).
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
packaging_requirements = pytest.importorskip("packaging.requirements")
tomllib = pytest.importorskip("tomllib")  # Python >= 3.11


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _installed() -> dict[str, md.Distribution]:
    out = {}
    for d in md.distributions():
        name = d.metadata["Name"]
        if name:
            out.setdefault(_norm(name), d)
    return out


def _closure(requirements: list[str], installed: dict[str, md.Distribution]) -> tuple[set[str], list[str]]:
    """(distributions the requirements reach, requirements not installed here), markers evaluated for this
    interpreter, each distribution's own extras followed where a requirement names them."""
    seen: set[str] = set()
    missing: list[str] = []
    todo = [(r, "") for r in requirements]
    while todo:
        text, extra = todo.pop()
        req = packaging_requirements.Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        name = _norm(req.name)
        if name not in installed:
            missing.append(text)
            continue
        for want in [""] + sorted(req.extras):
            key = f"{name}[{want}]"
            if key in seen:
                continue
            seen.add(key)
            todo += [(r, want) for r in installed[name].requires or []]
    return {k.split("[")[0] for k in seen}, missing


def _view(extra: str, folder: Path) -> Path:
    """A folder of links to what `pip install logitless[extra]` would install (logitless itself excepted: the
    child imports it from src/)."""
    project = _project()
    reqs = list(project["dependencies"]) + (list(project["optional-dependencies"][extra]) if extra else [])
    installed = _installed()
    dists, missing = _closure(reqs, installed)
    if missing:
        pytest.skip(f"not installed here, so the [{extra}] view cannot be built: {', '.join(missing)}")
    folder.mkdir()
    for name in dists:
        d = installed[name]
        top = {Path(str(f)).parts[0] for f in d.files or () if not str(f).startswith("..")}
        base = Path(d.locate_file(""))
        for entry in top - {"__pycache__"}:
            src, dst = base / entry, folder / entry
            if src.exists() and not dst.exists() and not entry.endswith(".pth"):
                dst.symlink_to(src)
    return folder


def _run_in(view: Path, code: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(view)]), OMP_NUM_THREADS="1",
               HF_HUB_OFFLINE="1", TRANSFORMERS_NO_ADVISORY_WARNINGS="1")
    return subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=view.parent)


def test_the_view_hides_what_an_extra_does_not_install(tmp_path):
    # The check can fail: the base install has no transformers, and the child says so.
    view = _view("", tmp_path / "base")
    proc = _run_in(view, "import importlib.util as u; print(u.find_spec('numpy') is not None, "
                         "u.find_spec('transformers') is not None)")
    assert proc.stdout.split() == ["True", "False"], proc.stdout + proc.stderr


def test_hf_extra_scores_a_gguf_file(tmp_path):
    # `logitless score` on a GGUF file (a tiny Llama and its tokenizer, written here with the gguf package) in
    # what `pip install logitless[hf]` installs: transformers reads GGUF files only with accelerate.
    ts = pytest.importorskip("tests.test_score")
    folder = tmp_path / "llama"
    ts._build(folder, "llama")
    gguf_file = tmp_path / "tiny.gguf"
    ts._write_gguf(folder, gguf_file)
    docs = tmp_path / "docs.txt"
    docs.write_text("The quick brown fox jumps over the lazy dog.\nA model.\n", encoding="utf-8")
    out = tmp_path / "scores.jsonl"
    view = _view("hf", tmp_path / "hf")
    argv = ["score", "--model", str(gguf_file), "--format", "lines", "--dtype", "fp32", str(docs), "-o", str(out)]
    proc = _run_in(view, f"import sys; from logitless.apps import cli; sys.exit(cli.main({argv!r}))")
    assert proc.returncode == 0, proc.stderr
    lines = out.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 2 and '"nll": ' in lines[0] and '"nll": null' not in lines[0], lines
    assert f"loading the model {gguf_file}" in proc.stderr, proc.stderr


def test_bench_extra_runs_a_bench(tmp_path):
    # `logitless bench` in what `pip install logitless[bench]` installs (the base draws the plots), at a tiny shape.
    view = _view("bench", tmp_path / "bench")
    argv = ["bench", "--job", "train", "--shape", "64,32,256", "--providers", "logitless-torch,torch-eager",
            "--min-reps", "1", "--max-reps", "1", "--warmup", "1", "--out", str(tmp_path / "out")]
    proc = _run_in(view, f"import sys; from logitless.apps import cli; sys.exit(cli.main({argv!r}))")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out" / "results.json").exists()


def test_extras_that_load_models_hold_the_hf_stack():
    # [real] prepares data by loading a GGUF model through transformers, as `logitless score` does; [dev] runs the
    # tests of every command. Each holds [hf]'s packages (the progress bar aside for [real]).
    extras = {k: {_norm(packaging_requirements.Requirement(r).name) for r in v}
              for k, v in _project()["optional-dependencies"].items()}
    hf = extras["hf"]
    assert {"transformers", "accelerate", "tokenizers", "gguf"} <= hf
    assert hf - {"tqdm"} <= extras["real"], hf - extras["real"]
    assert hf | extras["bench"] <= extras["dev"], (hf | extras["bench"]) - extras["dev"]
