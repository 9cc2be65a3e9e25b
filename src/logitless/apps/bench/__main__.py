"""`python -m logitless.apps.bench`: the same as `logitless bench`."""

import sys

from .cli import main

sys.exit(main())
