"""The lab: experiments on dtrain, run from the repository root.

``python -m experiments run SPEC [--mode smoke|quick|full]`` runs a declarative spec of
:mod:`experiments.specs` through the one runner (:mod:`experiments.lab`); the scripts that
are not specs yet run as ``python -m experiments.NAME`` (never as a file path: this is a
package, and nothing here edits ``sys.path``).
"""
