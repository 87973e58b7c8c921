"""`python -m bench.harness`: see runner.py."""

import sys

from .runner import main

sys.exit(main())
