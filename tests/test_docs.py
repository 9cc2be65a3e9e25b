"""The repository's documents stand on their own: every relative Markdown link resolves (file and heading), and
nothing cites what a reader of the repository cannot see (a lab log that is gone, files outside it, issue numbers).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _tracked(*patterns: str) -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / f for f in out.stdout.split() if (ROOT / f).is_file()]


def _anchors(md: Path) -> set[str]:
    # GitHub's rule: lower case, punctuation dropped, spaces to hyphens.
    out = set()
    for line in md.read_text(encoding="utf-8").splitlines():
        m = re.match(r"#+\s+(.*)", line)
        if m:
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


def test_markdown_links_resolve():
    bad = []
    for md in _tracked("*.md"):
        text = re.sub(r"```.*?```", "", md.read_text(encoding="utf-8"), flags=re.S)  # code blocks hold no links
        for m in re.finditer(r"\]\(([^)\s]+)\)", text):
            url = m.group(1)
            if re.match(r"[a-z]+:", url):
                continue
            path, _, frag = url.partition("#")
            target = (md.parent / path).resolve() if path else md
            rel = md.relative_to(ROOT)
            if not target.exists():
                bad.append(f"{rel}: {url} does not exist")
            elif frag and target.suffix == ".md" and frag not in _anchors(target):
                bad.append(f"{rel}: no heading #{frag} in {path or rel}")
    assert not bad, "\n".join(bad)


# What a reader cannot follow: the old lab log, a style guide kept outside the repository, numbered issues.
# (A lab-log version tag reads "(v20)"; "[v0, v1)" is an interval.)
_CITATIONS = re.compile(r"notes/linear_head|STYLE\.md|\b[Ii]ssue\s+#?\d{1,2}\b|\(v(?:[1-9]|1\d|2[01])\)")


def test_no_citations_a_reader_cannot_follow():
    bad = []
    for f in _tracked("*.md", "*.py", "*.toml", "*.cfg", ".ci/*"):
        if f.resolve() == Path(__file__).resolve():
            continue
        for i, line in enumerate(f.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if _CITATIONS.search(line):
                bad.append(f"{f.relative_to(ROOT)}:{i}: {line.strip()[:120]}")
    assert not bad, "\n".join(bad)


# A path into the package, the tools or the tests, as documents and comments name them.
_NAMED_PATH = re.compile(r"(?<![\w/.])((?:src/logitless/|logitless/)?(?:kernels|integrations|apps|bench|tools|tests)"
                         r"/[\w/]+\.py|src/logitless/\w+\.py)")


def _resolves(path: str) -> bool:
    p = path.removeprefix("src/").removeprefix("logitless/")
    return any((ROOT / base / p).is_file() for base in ("", "src/logitless"))


def test_named_paths_exist():
    # A file that moved leaves its old name behind in prose and docstrings; links are checked above, this checks
    # the names written as code.
    bad = []
    for f in _tracked("*.md", "*.py"):
        if f.resolve() == Path(__file__).resolve():
            continue
        for i, line in enumerate(f.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            for m in _NAMED_PATH.finditer(line):
                if not _resolves(m.group(1)):
                    bad.append(f"{f.relative_to(ROOT)}:{i}: {m.group(1)}")
    assert not bad, "\n".join(bad)


def test_tools_indexed():
    index = (ROOT / "tools" / "README.md").read_text(encoding="utf-8")
    missing = [f.name for f in _tracked("tools/*.py") if f"]({f.name})" not in index]
    assert not missing, f"tools/README.md does not index {missing}"


def test_module_map_names_existing_modules():
    text = (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
    table = text[text.index("## Module map"):text.index("## A PyTorch twin")]
    pkg = ROOT / "src" / "logitless"
    names = re.findall(r"`([\w/]+(?:\.py|/))`", table)
    missing = [n for n in names if not ((pkg / n).exists() or any(pkg.rglob(n.rstrip("/"))))]
    assert names and not missing, missing


# README's sizes, shrunk so that every snippet runs in well under a second on a CPU; each size maps to one smaller
# size, so the shapes still agree with each other.
_SHRINK = {"50257": "503", "32000": "320", "5000": "500", "4096": "256", "2048": "128", "1024": "64", "512": "32"}


def test_readme_python_snippets_run():
    """Every Python block of README.md runs, in order and in one namespace (the distillation blocks continue the
    first one's), at shrunk sizes; only the block that needs a process group of several GPUs is left out, and the
    TRL fragment, whose whole program is an example that tests/test_trl.py runs."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 10
    ran = skipped = 0
    namespace: dict = {}
    for block in blocks:
        if "process_group=tp_group" in block:
            continue
        if "GRPOTrainer(" in block:  # a fragment of examples/rl_grpo.py, which tests/test_trl.py runs whole
            skipped += 1
            continue
        if "transformers" in block:
            pytest.importorskip("transformers")
        assert 'from_pretrained("' not in re.sub(r"#.*", "", block), "a README snippet downloads a model"
        code = re.sub(r"\b(" + "|".join(_SHRINK) + r")\b", lambda m: _SHRINK[m.group(1)], block)
        exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - the repository's own documentation
        ran += 1
    assert ran == len(blocks) - 1 - skipped


# A commit hash in prose: a reader of a release cannot resolve it (the date of the code says what is meant).
_HEX_WORD = re.compile(r"\b[0-9a-f]{7,40}\b")


def _prose_files() -> list[Path]:
    files = [ROOT / name for name in ("BENCHMARKS.md", "README.md", "CONTRIBUTING.md")]
    return [f for f in files if f.is_file()] + sorted((ROOT / "docs").rglob("*.md"))


def _commits(words: set[str]) -> set[str]:
    """The words that name a commit of this repository (skips without git or outside a work tree)."""
    try:
        inside = subprocess.run(["git", "rev-parse", "--is-inside-work-tree"], cwd=ROOT, capture_output=True,
                                text=True)
    except OSError:
        pytest.skip("git is not available")
    if inside.returncode != 0 or inside.stdout.strip() != "true":
        pytest.skip("not inside a git work tree")
    ordered = sorted(words)
    out = subprocess.run(["git", "cat-file", "--batch-check"], cwd=ROOT, capture_output=True, text=True, check=True,
                         input="".join(f"{w}^{{commit}}\n" for w in ordered))
    # One line per query: "<sha> commit <size>" for a commit; "<query> missing" or "... ambiguous" otherwise.
    answers = out.stdout.splitlines()
    return {w for w, a in zip(ordered, answers, strict=True) if a.split()[1:2] == ["commit"]}


def test_no_commit_hash_in_prose():
    sites = [(f, i, m.group()) for f in _prose_files()
             for i, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1)
             for m in _HEX_WORD.finditer(line)]
    commits = _commits({w for _, _, w in sites}) if sites else set()
    bad = [f"{f.relative_to(ROOT)}:{i}: {w}" for f, i, w in sites if w in commits]
    assert not bad, "name the date of the code instead of its commit:\n" + "\n".join(bad)


def test_the_commit_check_finds_a_commit():
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    sha = head.stdout.strip()
    assert _commits({sha[:7], sha, "0000000", "deadbeefdeadbeef"}) == {sha[:7], sha}


# Source comments and docstrings give the reason; the measured ms and the GPU live in the docs pages (apps/bench's
# report strings name devices as data, and it is left out).
_MEASURED = re.compile(r"\bH[12]00\b|\d (?:ms|us|µs)\b")


def _comments_and_docstrings(path: Path) -> list[tuple[int, str]]:
    import ast
    import io
    import tokenize

    text = path.read_text(encoding="utf-8")
    out = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(text).readline)
           if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                first = node.body[0].lineno
                out += [(first + k, line) for k, line in enumerate(doc.splitlines())]
    return out


def test_no_measurement_in_source_comments():
    src = ROOT / "src" / "logitless"
    bench = src / "apps" / "bench"
    bad = [f"{path.relative_to(ROOT)}:{line}: {text.strip()[:120]}"
           for path in sorted(src.rglob("*.py")) if bench not in path.parents
           for line, text in _comments_and_docstrings(path) if _MEASURED.search(text)]
    assert not bad, "move the measurement to BENCHMARKS.md or docs/design, keep the reason:\n" + "\n".join(bad)
