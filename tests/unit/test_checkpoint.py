"""Checkpoints: atomic writes, and a corrupt or mismatched checkpoint is refused with a
:class:`CheckpointError` naming the problem while nothing is loaded (issue 4, item 6)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dtrain import checkpoint as ckpt_mod
from dtrain.buckets import checksum
from dtrain.checkpoint import FORMAT, latest_checkpoint, load_checkpoint, save_checkpoint
from dtrain.errors import CheckpointError

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(60)


def _payload(site: str = "site-0", fingerprint: str = "fp-1", value: float = 1.0) -> dict:
    return {
        "site_id": site,
        "fingerprint": fingerprint,
        "model": {"w": torch.full((3, 2), value)},
        "inner_optimizer": {"state": {}, "param_groups": []},
        "diloco": {"round": 3},
        "batches": {"position": 17},
    }


def _files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


# --------------------------------------------------------------------------- save / load
def test_round_trip_names_the_file_by_round_and_keeps_the_newest(tmp_path: Path) -> None:
    for r in (1, 2, 3):
        save_checkpoint(tmp_path, r, _payload(value=float(r)), keep=2)
    assert _files(tmp_path) == ["ckpt-000002.pt", "ckpt-000003.pt"]
    assert latest_checkpoint(tmp_path) == tmp_path / "ckpt-000003.pt"
    data = load_checkpoint(tmp_path / "ckpt-000003.pt", site_id="site-0", fingerprint="fp-1")
    assert data["format"] == FORMAT and data["round"] == 3
    assert torch.equal(data["model"]["w"], torch.full((3, 2), 3.0))
    assert data["batches"] == {"position": 17}


def test_latest_checkpoint_ignores_temporary_and_foreign_files(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path / "missing") is None
    save_checkpoint(tmp_path, 4, _payload())
    (tmp_path / ".ckpt-000009.pt.tmp-1234").write_bytes(b"half a checkpoint")  # a writer killed mid-way
    (tmp_path / "ckpt-000010.pt.bak").write_bytes(b"x")
    (tmp_path / "notes.txt").write_text("x")
    assert latest_checkpoint(tmp_path) == tmp_path / "ckpt-000004.pt"


def test_a_failed_write_leaves_no_partial_file_and_the_previous_checkpoint_intact(tmp_path: Path, monkeypatch) -> None:
    save_checkpoint(tmp_path, 3, _payload(value=3.0))
    before = (tmp_path / "ckpt-000003.pt").read_bytes()
    real_save = torch.save

    def save_half_then_fail(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        with open(f, "r+b") as fh:  # the disk filled up half-way through
            fh.truncate(os.path.getsize(f) // 2)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt_mod.torch, "save", save_half_then_fail)
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint(tmp_path, 4, _payload(value=4.0))
    assert _files(tmp_path) == ["ckpt-000003.pt"]  # no ckpt-000004.pt, no temporary file either
    assert (tmp_path / "ckpt-000003.pt").read_bytes() == before
    assert latest_checkpoint(tmp_path) == tmp_path / "ckpt-000003.pt"


def test_a_failed_rename_leaves_no_file_under_the_final_name(tmp_path: Path, monkeypatch) -> None:
    def fail_replace(src, dst):
        raise OSError(5, "I/O error")

    monkeypatch.setattr(ckpt_mod.os, "replace", fail_replace)
    with pytest.raises(OSError):
        save_checkpoint(tmp_path, 1, _payload())
    assert _files(tmp_path) == []


# --------------------------------------------------------------------------- refusals
def _one_line_error(path: Path, **kw) -> str:
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path, **{"site_id": "site-0", "fingerprint": "fp-1", **kw})
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg, msg
    return msg


def test_garbage_bytes_are_refused_as_corrupt(tmp_path: Path) -> None:
    p = tmp_path / "ckpt-000001.pt"
    p.write_bytes(b"\x00not a checkpoint\xff" * 64)
    assert "corrupt" in _one_line_error(p)


def test_a_truncated_checkpoint_is_refused_as_corrupt(tmp_path: Path) -> None:
    p = save_checkpoint(tmp_path, 1, _payload())
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    assert "corrupt" in _one_line_error(p)


def test_a_pickle_with_foreign_objects_is_refused_without_running_it(tmp_path: Path) -> None:
    p = tmp_path / "ckpt-000001.pt"
    torch.save({"format": FORMAT, "obj": Path("/etc")}, p)  # not loadable with weights_only=True
    assert "corrupt or unreadable" in _one_line_error(p)


def test_another_format_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "ckpt-000001.pt"
    torch.save({"format": "someone-elses-v3", **_payload()}, p)
    msg = _one_line_error(p)
    assert FORMAT in msg and "someone-elses-v3" in msg


def test_another_sites_checkpoint_is_refused(tmp_path: Path) -> None:
    p = save_checkpoint(tmp_path, 2, _payload(site="site-2"))
    msg = _one_line_error(p, site_id="site-0")
    assert "site-2" in msg and "site-0" in msg


def test_another_models_checkpoint_is_refused(tmp_path: Path) -> None:
    p = save_checkpoint(tmp_path, 2, _payload(fingerprint="aaaa"))
    msg = _one_line_error(p, fingerprint="bbbb")
    assert "fingerprint" in msg and "aaaa" in msg and "bbbb" in msg


def test_a_checkpoint_without_the_data_position_is_refused(tmp_path: Path) -> None:
    payload = _payload()
    del payload["batches"]
    p = save_checkpoint(tmp_path, 2, payload)
    assert "'batches'" in _one_line_error(p)


# --------------------------------------------------------------------------- DiLoCo's state_dict
def _old_layout(sd: dict) -> dict:
    """``DiLoCo.state_dict()`` as written before its keys moved to the top level."""
    return {
        "global": {
            "fingerprint": sd["fingerprint"],
            "rounds_applied": sd["round"],
            "bucket_round": sd["bucket_round"],
            "theta": sd["theta"],
            "optimizers": sd["outer_optimizer"],
            "residuals": sd["residuals"],
        },
        "inner_steps": sd["inner_steps"],
        "sync_every": sd["sync_every"],
    }


def test_diloco_reads_a_checkpoint_written_with_the_old_state_dict_layout(tmp_path: Path) -> None:
    from dtrain import DiLoCo, DiLoCoConfig
    from dtrain.buckets import BucketConfig

    def wrapper(seed: int) -> DiLoCo:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        cfg = DiLoCoConfig(sync_every=2, buckets=BucketConfig(bucket_bytes=64, chunk_bytes=32))
        return DiLoCo(model, opt, config=cfg)

    src = wrapper(0)
    try:
        x = torch.randn(4, 5)
        for _ in range(6):  # 3 rounds: outer momentum is set
            src.model(x).pow(2).mean().backward()
            src.inner_optimizer.step()
            src.inner_optimizer.zero_grad()
        sd = src.state_dict()
    finally:
        src.close()
    assert sd["round"] == 3 and sd["inner_steps"] == 6 and len(sd["theta"]) > 1
    save_checkpoint(tmp_path, 3, _payload(fingerprint=sd["fingerprint"]) | {"diloco": _old_layout(sd)})
    data = load_checkpoint(tmp_path / "ckpt-000003.pt", site_id="site-0", fingerprint=sd["fingerprint"])
    dst = wrapper(1)
    try:
        assert dst.state.checksums() != [checksum(t) for t in sd["theta"]]
        dst.load_state_dict(data["diloco"])
        now = dst.state_dict()
    finally:
        dst.close()
    assert now["round"] == 3 and now["inner_steps"] == 6 and now["bucket_round"] == sd["bucket_round"]
    for a, b in zip(now["theta"], sd["theta"]):
        assert torch.equal(a, b)
    for a, b in zip(now["outer_optimizer"], sd["outer_optimizer"]):
        assert torch.equal(a["state"][0]["momentum_buffer"], b["state"][0]["momentum_buffer"])


# --------------------------------------------------------------------------- the worker
LOADS: list[str] = []


def recording_task(spec):
    """The built-in task, recording every ``load_state_dict`` on its parts (used as --task)."""
    from dtrain.tasks import load_task

    task = load_task("")(spec)
    for name, obj in (("model", task.model), ("optimizer", task.optimizer), ("batches", task.batches)):
        real = obj.load_state_dict

        def rec(state, *a, _name=name, _real=real, **kw):
            LOADS.append(_name)
            return _real(state, *a, **kw)

        obj.load_state_dict = rec
    return task


@pytest.mark.timeout(120)
@pytest.mark.parametrize("problem", ["corrupt", "other_site", "other_model", "unfit"])
def test_worker_refuses_a_bad_checkpoint_before_loading_anything(problem: str, tmp_path: Path) -> None:
    from dtrain.app.config import WORKER
    from dtrain.app.worker import run_worker

    cdir = tmp_path / "site-0" / "checkpoints"
    if problem == "corrupt":
        cdir.mkdir(parents=True)
        (cdir / "ckpt-000002.pt").write_bytes(b"garbage" * 100)
    elif problem == "other_site":  # this model's layout, another site's checkpoint
        save_checkpoint(cdir, 2, _payload(site="site-1", fingerprint=_fingerprint_of_tiny()))
    elif problem == "other_model":  # this site, another model
        save_checkpoint(cdir, 2, _payload(site="site-0", fingerprint="0123456789abcdef"))
    else:  # right site and layout, but a model state that does not fit: the recorder sees the attempt
        save_checkpoint(cdir, 2, _payload(site="site-0", fingerprint=_fingerprint_of_tiny()))
    cfg = WORKER.build(
        {
            "site_id": "site-0",
            "size": "tiny",
            "task": f"{__name__}:recording_task",
            "rendezvous": "127.0.0.1:9",
            "out_dir": str(tmp_path / "site-0"),
            "resume": True,
            "linger_s": 0.0,
        }
    )
    LOADS.clear()
    with pytest.raises(CheckpointError) as e:
        run_worker(cfg)
    words = {
        "corrupt": ["corrupt"],
        "other_site": ["site-1", "site-0"],
        "other_model": ["fingerprint", "0123456789abcdef"],
        "unfit": ["does not fit this task"],
    }
    for w in words[problem]:
        assert w in str(e.value)
    # Refused checkpoints are never applied; the unfit one fails on the model (strict load, nothing copied).
    assert LOADS == (["model"] if problem == "unfit" else []), f"loaded {LOADS} from a refused checkpoint"
    assert not (tmp_path / "site-0" / "metrics.jsonl").exists()  # training never started


def _fingerprint_of_tiny() -> str:
    from dtrain.app.config import WorkerConfig
    from dtrain.buckets import BucketLayout
    from dtrain.tasks import TaskSpec, load_task

    cfg = WorkerConfig()
    model = load_task("")(TaskSpec(site_index=0, num_sites=1, size="tiny")).model
    params = [p.numel() for p in model.parameters()]
    bufs = [b.numel() for b in model.buffers() if b.is_floating_point()]
    return BucketLayout(
        params + bufs, ["param"] * len(params) + ["buffer"] * len(bufs), cfg.diloco_config().buckets
    ).fingerprint()


@pytest.mark.timeout(120)
def test_worker_with_resume_and_a_corrupt_checkpoint_exits_2_with_one_line(tmp_path: Path) -> None:
    cdir = tmp_path / "site-0" / "checkpoints"
    cdir.mkdir(parents=True)
    (cdir / "ckpt-000005.pt").write_bytes(b"\x80\x02garbage" * 50)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "dtrain",
            "worker",
            "--resume",
            "--size",
            "tiny",
            "--rendezvous",
            "127.0.0.1:9",
            "--out-dir",
            str(tmp_path / "site-0"),
            "--log-level",
            "WARNING",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert p.returncode == 2, p.stderr
    lines = p.stderr.splitlines()
    assert len(lines) == 1, p.stderr
    assert (
        lines[0].startswith("dtrain worker: error: checkpoint ")
        and "ckpt-000005.pt" in lines[0]
        and "corrupt" in lines[0]
    )
    assert p.stdout == ""
