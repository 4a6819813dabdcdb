"""The committed modules under dtrain/_proto must match what scripts/gen_proto.py
generates from proto/dtrain/v1/*.proto with the installed grpcio-tools."""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import importlib.util
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
COMMITTED = REPO_ROOT / "dtrain" / "_proto"


def _load_gen_proto():
    spec = importlib.util.spec_from_file_location("gen_proto", REPO_ROOT / "scripts" / "gen_proto.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _files(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): p.read_text()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


@pytest.mark.timeout(60)
def test_committed_proto_modules_are_current(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools is needed to regenerate the proto modules")
    _load_gen_proto().generate(tmp_path)
    fresh, committed = _files(tmp_path), _files(COMMITTED)
    assert fresh, "gen_proto.py generated nothing"
    problems = []
    for name in sorted(set(fresh) | set(committed)):
        if name not in committed:
            problems.append(f"missing from dtrain/_proto: {name}")
        elif name not in fresh:
            problems.append(f"stale file in dtrain/_proto (no longer generated): {name}")
        elif fresh[name] != committed[name]:
            diff = difflib.unified_diff(
                committed[name].splitlines(),
                fresh[name].splitlines(),
                f"committed/{name}",
                f"fresh/{name}",
                lineterm="",
                n=1,
            )
            problems.append("\n".join(list(diff)[:20]))
    tools = importlib.metadata.version("grpcio-tools")
    assert not problems, (
        "dtrain/_proto is out of date with proto/dtrain/v1/*.proto (or was generated with another "
        f"grpcio-tools; installed: {tools}). Run `.venv/bin/python scripts/gen_proto.py` and commit "
        "dtrain/_proto.\n" + "\n".join(problems)
    )


def test_generated_modules_import_from_the_package() -> None:
    peer = importlib.import_module("dtrain._proto.dtrain.v1.peer_pb2_grpc")
    rdv = importlib.import_module("dtrain._proto.dtrain.v1.rendezvous_pb2_grpc")
    assert hasattr(peer, "PeerStub") and hasattr(peer, "add_PeerServicer_to_server")
    assert hasattr(rdv, "RendezvousStub") and hasattr(rdv, "add_RendezvousServicer_to_server")
    pb = importlib.import_module("dtrain._proto.dtrain.v1.peer_pb2")
    msg = pb.ContributionChunk(round=3, bucket=1, payload=b"xy")
    assert pb.ContributionChunk.FromString(msg.SerializeToString()).payload == b"xy"
