"""``dtrain launch --task hf``: a tiny Llama built from a config trains 2 sites x 1 rank
(JSON lines tokenized by a tokenizer.json) and 2 sites x 2 FSDP2 ranks (parquet, bytes)
with falling loss and equal θ checksums; the exported safetensors load with
``from_pretrained`` and hold the agreed θ bit for bit (issue 37, part A)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers")
pq = pytest.importorskip("pyarrow.parquet")
pa = pytest.importorskip("pyarrow")

REPO = Path(__file__).resolve().parents[2]
SITES = ["site-0", "site-1"]
BASE = ["--task", "hf", "--hf.config", "tiny-llama", "--sites", "2", "--size", "tiny", "--sync-every", "10"]
BASE += ["--linger-s", "1", "--rounds", "3"]


def _texts() -> list[str]:
    """~300 KB of real text: some standard-library modules, one record per paragraph."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out: list[str] = []
    for name in ("argparse.py", "dataclasses.py", "typing.py"):
        out += [p for p in (root / name).read_text().split("\n\n") if p.strip()]
    return out


def _launch(args: list[str], run_dir: Path) -> dict[str, dict]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    env.pop("DTRAIN_TEST_FAULT", None)
    cmd = [sys.executable, "-m", "dtrain", "launch", *BASE, *args, "--out", str(run_dir), "--no-progress"]
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=100)
    assert p.returncode == 0, f"stdout:\n{p.stdout}\nstderr:\n{p.stderr[-3000:]}"
    return {s: json.loads((run_dir / s / "summary.json").read_text()) for s in SITES}


def _checked_run(summaries: dict[str, dict], run_dir: Path) -> list[dict]:
    """Falling validation loss and one θ checksum per round over the sites; site-0's round lines."""
    lines = {s: [json.loads(x) for x in (run_dir / s / "metrics.jsonl").read_text().splitlines()] for s in SITES}
    rounds = {s: [d for d in lines[s] if d["event"] == "round"] for s in SITES}
    assert [d["round"] for d in rounds["site-0"]] == [0, 1, 2]  # numbered from 0
    for r in range(3):
        assert len({rounds[s][r]["checksum"] for s in SITES}) == 1
    for s in SITES:
        assert summaries[s]["final_val_loss"] < summaries[s]["first_val_loss"] - 1.0
    assert len({summaries[s]["checksum"] for s in SITES}) == 1
    return rounds["site-0"]


def _export(directory: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(directory / "model.safetensors", "pt") as f:
        meta = f.metadata()
    return load_file(directory / "model.safetensors"), meta


def _loads_back(directory: Path, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)
    got = model.state_dict()
    assert set(got) == set(tensors)
    assert all(torch.equal(got[k], tensors[k]) for k in tensors)
    return model


def _theta_checksum(model: torch.nn.Module, num_sites: int) -> str:
    """The site θ checksum (K = 1) a worker computes, over ``model``'s tensors."""
    from dtrain.app.config import WorkerConfig
    from dtrain.buckets import BucketLayout, checksum
    from dtrain.diloco import sync_tensors
    from dtrain.tasks.spec import HfSpec, TaskSpec

    cfg = WorkerConfig(task="hf", task_spec=TaskSpec(num_sites=num_sites, hf=HfSpec(config="tiny-llama")))
    dcfg = cfg.diloco_config()
    tensors, kinds = sync_tensors(model, dcfg.buffers)
    layout = BucketLayout([t.numel() for t in tensors], kinds, dcfg.buckets)
    h = hashlib.blake2b(digest_size=8)
    for b in range(len(layout)):
        h.update(checksum(layout.gather(b, tensors)).encode())
    return h.hexdigest()


@pytest.mark.timeout(150)
def test_hf_two_sites_jsonl_with_a_tokenizer_export_the_agreed_theta(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    texts = _texts()
    data = tmp_path / "corpus.jsonl"
    data.write_text("".join(json.dumps({"content": t}) + "\n" for t in texts))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=512, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    run = tmp_path / "run"
    args = ["--data", str(data), "--text-field", "content", "--tokenizer", str(tmp_path / "tokenizer.json")]
    summaries = _launch(args, run)
    _checked_run(summaries, run)
    exports = [_export(run / s / "export" / "final") for s in SITES]
    (a, meta), (b, _) = exports
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)  # the agreed θ
    assert meta["dtrain_round"] == "3" and meta["dtrain_checksum"] == summaries["site-0"]["checksum"]
    final = run / "site-0" / "export" / "final"
    assert (final / "tokenizer.json").read_bytes() == (tmp_path / "tokenizer.json").read_bytes()
    model = _loads_back(final, a)
    assert model.config.vocab_size == 512
    assert _theta_checksum(model, 2) == summaries["site-0"]["checksum"]  # the export is θ, bit for bit


@pytest.mark.timeout(150)
def test_hf_two_sites_of_two_fsdp_ranks_parquet_export_every_two_rounds(tmp_path: Path) -> None:
    data = tmp_path / "corpus.parquet"
    pq.write_table(pa.table({"text": _texts()}), data)
    run = tmp_path / "run"
    summaries = _launch(
        ["--ranks-per-site", "2", "--parallel", "fsdp", "--data", str(data), "--export.every", "2"], run
    )
    rounds = _checked_run(summaries, run)
    assert rounds[0]["ranks"] == 2
    for name, want in (("round-000002", rounds[1]["checksum"]), ("final", summaries["site-0"]["checksum"])):
        (a, meta), (b, _) = (_export(run / s / "export" / name) for s in SITES)
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
        assert meta["dtrain_checksum"] == want
        _loads_back(run / "site-0" / "export" / name, a)
    assert sorted(p.name for p in (run / "site-0" / "export").iterdir()) == ["final", "round-000002"]
