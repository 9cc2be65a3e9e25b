"""The `logitless` command and its subcommands, the top of the package: nothing below imports them.

Layout: cli.py (the `logitless` command), score.py (`logitless score`), detect.py (`logitless detect`), bench/
(`logitless bench`), files.py (output files written whole or not at all).
"""
