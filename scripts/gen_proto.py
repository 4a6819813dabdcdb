#!/usr/bin/env python3
"""Regenerate the committed protobuf/gRPC modules under ``dtrain/_proto/``.

Usage (from the repository root)::

    .venv/bin/python scripts/gen_proto.py            # rewrite dtrain/_proto
    .venv/bin/python scripts/gen_proto.py --out DIR  # generate into DIR instead

Runs ``python -m grpc_tools.protoc -Iproto --python_out --grpc_python_out
--pyi_out`` on every ``proto/dtrain/v1/*.proto``. protoc writes modules that
import each other as ``dtrain.v1.<name>_pb2``; this script rewrites those imports
to ``dtrain._proto.dtrain.v1.<name>_pb2`` so the modules work from an installed
``dtrain`` package, and writes the ``__init__.py`` files of the package tree.
``tests/unit/test_proto_current.py`` runs it into a temporary directory and fails
when the committed modules differ.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["REPO_ROOT", "generate"]

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "proto"
DEFAULT_OUT = REPO_ROOT / "dtrain" / "_proto"
_PACKAGE = "dtrain._proto"  # import path of the output directory
_IMPORT_RE = re.compile(r"^from dtrain\.v1 import ", re.MULTILINE)
_INIT_TEXT = '"""Generated protobuf/gRPC modules (scripts/gen_proto.py); do not edit."""\n'


def _fix_imports(path: Path) -> None:
    text = path.read_text()
    fixed = _IMPORT_RE.sub(f"from {_PACKAGE}.dtrain.v1 import ", text)
    if re.search(r"^(from|import) dtrain\.v1\b", fixed, re.MULTILINE):
        raise RuntimeError(f"{path}: an import of dtrain.v1 was left unrewritten")
    path.write_text(fixed)


def generate(out_dir: Path) -> list[Path]:
    """Generate the modules into ``out_dir`` (replacing its ``dtrain/`` subtree).

    Returns the paths written, relative to ``out_dir``, sorted.
    """
    protos = sorted(p.relative_to(PROTO_ROOT).as_posix() for p in (PROTO_ROOT / "dtrain" / "v1").glob("*.proto"))
    if not protos:
        raise RuntimeError(f"no .proto files under {PROTO_ROOT / 'dtrain' / 'v1'}")
    out_dir.mkdir(parents=True, exist_ok=True)
    # Generate into a scratch directory first so a failing protoc leaves out_dir intact.
    with tempfile.TemporaryDirectory() as scratch:
        cmd = [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={scratch}",
            f"--grpc_python_out={scratch}",
            f"--pyi_out={scratch}",
            *protos,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT)
        if proc.returncode != 0:
            raise RuntimeError(f"protoc failed (rc {proc.returncode}):\n{proc.stderr}")
        gen_root = Path(scratch)
        for path in sorted(gen_root.rglob("*.py*")):
            _fix_imports(path)
        for pkg in (gen_root, gen_root / "dtrain", gen_root / "dtrain" / "v1"):
            (pkg / "__init__.py").write_text(_INIT_TEXT)
        target = out_dir / "dtrain"
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(gen_root / "dtrain", target)
        shutil.copy2(gen_root / "__init__.py", out_dir / "__init__.py")
    return sorted(p.relative_to(out_dir) for p in out_dir.rglob("*") if p.is_file() and "__pycache__" not in p.parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory (default: dtrain/_proto)")
    args = parser.parse_args(argv)
    for rel in generate(args.out):
        print(args.out / rel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
