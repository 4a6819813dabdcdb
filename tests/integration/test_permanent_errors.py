"""A permanent refusal ends a worker at once, with what to fix: a worker whose token is not
the rendezvous's exits with code 2 and a message naming ``--net.token-file``, without
retrying the join (before, it retried for the whole join budget, logging
"rendezvous unreachable (... UNAUTHENTICATED: wrong token); retrying")."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(180)


def _env() -> dict[str, str]:
    return dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        GRPC_VERBOSITY="NONE",
    )


def _dtrain(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "dtrain", *args], cwd=REPO, env=_env(), text=True, stdout=subprocess.PIPE, **kw
    )


def test_a_worker_with_a_wrong_token_exits_at_once_naming_the_token_option(tmp_path: Path) -> None:
    right, wrong = tmp_path / "right.token", tmp_path / "wrong.token"
    right.write_text("the-run-token\n")
    wrong.write_text("another-token\n")
    address_file = tmp_path / "rendezvous.addr"
    rdv = _dtrain(
        "rendezvous",
        "--bind",
        "127.0.0.1:0",
        "--address-file",
        str(address_file),
        "--token-file",
        str(right),
        "--http-bind",
        "off",
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while not address_file.exists():
            assert rdv.poll() is None, "the rendezvous exited"
            assert time.monotonic() < deadline, "the rendezvous did not start within 60 s"
            time.sleep(0.1)
        argv = ["worker", "--rendezvous", address_file.read_text().strip(), "--token-file", str(wrong)]
        argv += ["--size", "tiny", "--rounds", "1", "--out-dir", str(tmp_path / "site-0"), "--log-level", "INFO"]
        t0 = time.monotonic()
        worker = _dtrain(*argv, stderr=subprocess.PIPE)
        try:
            out, err = worker.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            worker.kill()
            out, err = worker.communicate()
            pytest.fail(f"the worker with a wrong token still ran after 120 s:\n{err[-3000:]}")
        elapsed_s = time.monotonic() - t0
    finally:
        rdv.terminate()
        rdv.wait(timeout=30)
    last = err.strip().splitlines()[-1]
    assert worker.returncode == 2, err[-3000:]
    assert last.startswith("dtrain worker: error: "), last
    for words in ("UNAUTHENTICATED", "token", "--net.token-file", "--token-file"):
        assert words in last, f"{words!r} not in {last!r}"
    assert "retrying" not in err and "unreachable" not in err, err[-3000:]  # refused once, not retried
    assert out == ""
    # the join comes right after torch's import and the model's build; the old retry budget alone was 60 s
    assert elapsed_s < 30, f"{elapsed_s:.1f} s"  # ~3 s on an idle 2-core machine
