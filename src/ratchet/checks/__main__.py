"""`python -m ratchet.checks run|recover|explain|list ...`: the same as `ratchet checks ...`."""

from __future__ import annotations

from ratchet._exit import exit_process
from ratchet.checks._cli import main

exit_process(main())
