"""pytest plugin (``-p fake_nonroot_plugin``) that makes the process look unprivileged.

Used by test_netem_lifecycle.py to check that the netem tests skip (or fail when
DTRAIN_NETEM_REQUIRED=1) with a reason naming what is missing.
"""

import os

os.geteuid = lambda: 1000
