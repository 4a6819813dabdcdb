"""``dtrain launch --tensorboard DIR`` (issue 37): each site's TensorBoard event files hold
the scalars of its status-page reports, equal to its metrics.jsonl lines, read back with
tensorboard's own event reader. 2 sites, 3 rounds of the tiny GPT (~6 s on 2 cores)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dtrain.app.tensorboard_sink import round_scalars
from dtrain.metrics import read_metrics

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
ROUNDS = 3


def _scalars(run_path: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} of one TensorBoard run directory (tensorboard's EventAccumulator)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_path), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


@pytest.mark.timeout(90)
def test_launch_writes_the_round_scalars_of_metrics_jsonl_to_tensorboard(tmp_path: Path) -> None:
    run_dir, tb = tmp_path / "run", tmp_path / "tb"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    env.pop("DTRAIN_TEST_FAULT", None)
    args = ["--sites", "2", "--size", "tiny", "--sync-every", "10", "--linger-s", "1", "--rounds", str(ROUNDS)]
    p = subprocess.run(
        [sys.executable, "-m", "dtrain", "launch", *args, "--out", str(run_dir), "--tensorboard", str(tb)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=80,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    for site in ("site-0", "site-1"):
        lines = [ln.as_dict() for ln in read_metrics(run_dir / site / "metrics.jsonl")]
        rounds = [d for d in lines if d["event"] == "round"]
        assert [d["round"] for d in rounds] == list(range(ROUNDS))
        want: dict[str, dict[int, float]] = {}
        for d in rounds:
            for tag, v in round_scalars(d).items():
                want.setdefault(tag, {})[d["round"]] = v
        got = _scalars(tb / site)
        # the status page's figures, each in every round
        for key in ("val_loss", "train_loss", "sync_s", "bytes_sent", "bytes_received", "reduce_arrived_fraction"):
            assert set(got[f"round/{key}"]) == set(range(ROUNDS)), (site, key, got.get(f"round/{key}"))
        assert got.keys() == want.keys(), (site, sorted(got), sorted(want))
        for tag, by_step in want.items():  # event files store float32
            assert got[tag] == pytest.approx(by_step, rel=1e-6, abs=1e-6), (site, tag)
        assert got["round/val_loss"][ROUNDS - 1] == pytest.approx(rounds[-1]["val_loss"], rel=1e-6)
        assert got["round/num_members"] == {r: 2.0 for r in range(ROUNDS)}
