"""`python -m sits.runtime.router ...`: the same as `sits router ...`, without importing the other commands."""

from __future__ import annotations

import sys

from sits.runtime.router.command import main

if __name__ == "__main__":
    sys.exit(main())
