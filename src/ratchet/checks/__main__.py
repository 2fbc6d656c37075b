"""`python -m ratchet.checks run|recover|explain|list ...`: the same as `ratchet checks ...`."""

from __future__ import annotations

import sys

from ratchet.checks._cli import main

sys.exit(main())
