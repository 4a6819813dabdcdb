"""The lab: experiments on dtrain, run from the repository root.

``python -m experiments run NAME [--mode smoke|quick|full]`` runs the declarative spec
``experiments.NAME.SPEC`` through the one runner (:mod:`experiments.lab`, whose ``SPECS``
lists them); the experiments not yet written as specs, and the micro-benchmarks, run as
``python -m experiments.NAME`` (never as a file path: this is a package, and nothing here
edits ``sys.path``).
"""
