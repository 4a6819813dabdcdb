"""The lab: experiments on dtrain, run from the repository root.

``python -m experiments run NAME [--mode smoke|quick|full]`` runs the declarative spec
``experiments.NAME.SPEC`` through the one runner (:mod:`experiments.lab`, whose ``SPECS``
lists every experiment); the micro-benchmarks (``bench_*``, ``cli_startup``) run as
``python -m experiments.NAME`` (never as a file path: this is a package, and nothing here
edits ``sys.path``).
"""
