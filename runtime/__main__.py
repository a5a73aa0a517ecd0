"""`python -m sits.runtime ...` is the `sits` command."""

import sys

from sits.runtime.cli import main

sys.exit(main())
