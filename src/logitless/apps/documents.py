"""The documents `logitless score` and `logitless detect` read and the lines they write.

Inputs are plain text (one document per file or per line) or JSONL, every line checked before a model loads; the
output goes to standard output or to a temporary file renamed over ``--output`` when the run succeeds. Errors are
:class:`ScoreError`: one line, no traceback.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import sys
from collections.abc import Iterator
from typing import NamedTuple

import torch

from . import files

FORMATS = ("auto", "text", "lines", "jsonl")
_JSONL_SUFFIXES = (".jsonl", ".ndjson")


class ScoreError(Exception):
    """A problem with the command's inputs or model, reported as one line without a traceback."""


class Document(NamedTuple):
    source: str          # the file it came from ("-" for standard input)
    index: int           # 0-based position of the document in that file
    id: object           # the JSONL record's id field, or NO_ID
    text: str


NO_ID = object()


def _file_format(path: str, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    return "jsonl" if path.lower().endswith(_JSONL_SUFFIXES) else "text"


def check_inputs(paths: list[str]) -> None:
    if paths.count("-") > 1:
        raise ScoreError("standard input ('-') can be read only once")
    for path in paths:
        if path == "-":
            continue
        if not os.path.exists(path):
            raise ScoreError(f"input file not found: {path}")
        if not os.path.isfile(path):
            raise ScoreError(f"input is not a regular file: {path}")


def scan(args) -> tuple[int, int] | None:
    """(documents, characters) of all inputs, reading every file once before the model loads, so that a bad line
    (invalid JSON or UTF-8, a missing text field), or inputs without any text, stop the run at once; None when
    standard input is among them (it can be read only once: its lines are checked as they are scored, and
    first_document refuses inputs without text)."""
    docs = chars = 0
    for path in args.files:
        if path == "-":
            continue
        for d in iter_documents(path, args.format, args.text_field, args.id_field):
            docs += 1
            chars += len(d.text)
    if "-" in args.files:
        return None
    if not chars:
        raise ScoreError(empty_input_message(args.files))
    return docs, chars


def empty_input_message(files: list[str]) -> str:
    shown = ", ".join("standard input" if f == "-" else f for f in files)
    return (f"nothing to score: {'the input' if len(files) == 1 else 'the inputs'} {shown} hold no text (empty "
            "files, or only empty documents); check the path, --format and --text-field")


def first_document(docs: Iterator[Document], files: list[str]) -> Iterator[Document]:
    """`docs` unchanged, once inputs that include standard input are known to hold some text: inputs without any
    are refused before a model loads. Only the documents up to the first with text are read ahead."""
    if "-" not in files:
        return docs
    held = []
    for d in docs:
        held.append(d)
        if d.text:
            return itertools.chain(held, docs)
    raise ScoreError(empty_input_message(files))


def _open_text(path: str, newline):
    if path == "-":
        return open(sys.stdin.fileno(), encoding="utf-8", newline=newline, closefd=False)
    return open(path, encoding="utf-8", newline=newline)


def iter_documents(path: str, fmt: str, text_field: str = "text", id_field: str = "id") -> Iterator[Document]:
    """Documents of one input file; `fmt` is one of text/lines/jsonl/auto (see build_parser)."""
    kind = _file_format(path, fmt)
    try:
        if kind == "text":
            # newline="" keeps the file's text exactly as it is (no \r\n translation).
            with _open_text(path, newline="") as f:
                yield Document(path, 0, NO_ID, f.read())
            return
        with _open_text(path, newline=None) as f:
            if kind == "lines":
                for i, line in enumerate(f):
                    yield Document(path, i, NO_ID, line[:-1] if line.endswith("\n") else line)
                return
            index = 0
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                yield _jsonl_document(path, lineno, index, line, text_field, id_field)
                index += 1
    except UnicodeDecodeError as e:
        raise ScoreError(f"{path}: not valid UTF-8 ({e.reason} at byte {e.start})") from None


def _jsonl_document(path, lineno, index, line, text_field, id_field) -> Document:
    where = f"{path}:{lineno}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ScoreError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(record, dict):
        raise ScoreError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if text_field not in record:
        raise ScoreError(f"{where}: the record has no {text_field!r} field (--text-field names another)")
    text = record[text_field]
    if not isinstance(text, str):
        raise ScoreError(f"{where}: field {text_field!r} must be a string, got {type(text).__name__}")
    return Document(path, index, record.get(id_field, NO_ID), text)


def say(message: str, prog: str = "logitless score") -> None:
    """One line on stderr, `prog: message`, that a progress bar, if one is drawn, is redrawn under."""
    try:
        from tqdm import tqdm
    except ImportError:
        print(f"{prog}: {message}", file=sys.stderr, flush=True)
    else:
        tqdm.write(f"{prog}: {message}", file=sys.stderr)


def buffers(docs: Iterator[Document], max_docs: int, max_chars: int) -> Iterator[list[Document]]:
    """Groups of documents, each as large as `max_docs` documents or `max_chars` characters allow."""
    buf, chars = [], 0
    for d in docs:
        buf.append(d)
        chars += len(d.text)
        if len(buf) == max_docs or chars >= max_chars:
            yield buf
            buf, chars = [], 0
    if buf:
        yield buf


def all_documents(args) -> Iterator[Document]:
    for path in args.files:
        yield from iter_documents(path, args.format, args.text_field, args.id_field)


def json_floats(t: torch.Tensor) -> list:
    # str() of a float32 is its shortest round-trip form: exact values, short lines.
    return [finite(float(s)) for s in map(str, t.numpy())]


def finite(x: float):
    return x if math.isfinite(x) else None


def exp_or_inf(x: float) -> float:
    return math.inf if x > 709.0 else math.exp(x)  # math.exp raises past float64's range; NaN stays NaN


def check_output(args) -> None:
    """--output (or standard output) is none of the input files: refused before anything loads."""
    try:
        if args.output != "-":
            files.check_output(args.output, args.files, what="--output",
                                no_clobber=getattr(args, "no_clobber", False))
        else:
            files.check_stdout(args.files)
    except files.OutputError as e:
        raise ScoreError(str(e)) from None


def output_sink(args):
    """Where the records go: standard output, or a temporary file beside --output renamed into place only when the
    run succeeds (a failed run leaves an existing output as it was)."""
    if args.output == "-":
        return contextlib.nullcontext(sys.stdout)
    try:
        return files.atomic_open(args.output, "w", no_clobber=getattr(args, "no_clobber", False), encoding="utf-8")
    except OSError as e:
        raise ScoreError(f"cannot write --output {args.output}: {e.strerror or e}") from None
