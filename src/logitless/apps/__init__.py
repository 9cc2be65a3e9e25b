"""The `logitless` command and its subcommands, the top of the package: nothing below imports them.

Layout: cli.py (the `logitless` command), score.py (`logitless score`), detect.py (`logitless detect`),
documents.py and model.py (the input documents, output lines and local model both of those share), bench/
(`logitless bench`), files.py (output files written whole or not at all).
"""
