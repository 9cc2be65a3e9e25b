"""The `logitless` command: `logitless bench ...` and `logitless score ...`."""

from __future__ import annotations

import importlib
import sys

# subcommand -> module with a `main(argv) -> int`; imported only when used, so each stays independent.
_COMMANDS = {
    "bench": ("logitless.apps.bench.cli", "speed and memory of every provider, side by side"),
    "score": ("logitless.apps.score", "per-token log-probs, NLL and perplexity of text under a local HF causal LM"),
    "detect": ("logitless.apps.detect", "Binoculars score (observer NLL / cross-entropy to a performer) of text"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-V", "--version"):
        from .. import __version__

        print(f"logitless {__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: logitless [--version] {" + ",".join(_COMMANDS) + "} [options]\n")
        for name, (_, text) in _COMMANDS.items():
            print(f"  {name:8s} {text}")
        print("\n`logitless COMMAND --help` explains each command's options.")
        return 0
    if argv[0] not in _COMMANDS:
        print(f"logitless: unknown command {argv[0]!r}; expected one of {', '.join(_COMMANDS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(_COMMANDS[argv[0]][0])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
