"""``python -m experiments run NAME [--mode smoke|quick|full]``: the lab's one runner (:mod:`experiments.lab`)."""

import sys

from experiments.lab import main

raise SystemExit(main(sys.argv[1:]))
