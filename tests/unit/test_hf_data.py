"""Local data files (text, JSON lines, parquet; bytes or a tokenizer.json), the ``hf`` task
built from a config, and safetensors exports (issue 37, part A)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dtrain.app.config import WORKER, WorkerConfig, check_task
from dtrain.app.export import write_export
from dtrain.options import UsageError
from dtrain.tasks import build_task, load_task
from dtrain.tasks.data import FileTokenizer, load_corpus, load_tokenizer, read_document, shard_tokens
from dtrain.tasks.spec import HfSpec, TaskSpec

pytestmark = pytest.mark.timeout(60)

transformers = pytest.importorskip("transformers")
pq = pytest.importorskip("pyarrow.parquet")
pa = pytest.importorskip("pyarrow")

LINES = [f"record {i}: the quiet river falls over the old stone {i * 7 % 13}" for i in range(400)]


def _jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _parquet(path: Path, column: str = "text", values: list | None = None) -> Path:
    pq.write_table(pa.table({column: values if values is not None else LINES, "id": list(range(len(LINES)))}), path)
    return path


def _tokenizer(path: Path, vocab_size: int = 300) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["[UNK]"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(LINES, trainer)
    tok.save(str(path))
    return path


def test_each_format_reads_the_same_text(tmp_path: Path) -> None:
    text = "\n".join(LINES).encode()
    (tmp_path / "a.txt").write_bytes(text)
    _jsonl(tmp_path / "a.jsonl", [{"text": t, "n": 1} for t in LINES])
    _jsonl(tmp_path / "b.ndjson", [{"body": t} for t in LINES])
    _parquet(tmp_path / "a.parquet")
    assert read_document(tmp_path / "a.txt") == text
    assert read_document(tmp_path / "a.jsonl") == text
    assert read_document(tmp_path / "b.ndjson", "body") == text
    assert read_document(tmp_path / "a.parquet") == text
    corpus = load_corpus(str(tmp_path / "a.parquet"))
    assert corpus.single_file and corpus.train_docs[0][1] + corpus.val == text


def test_a_directory_mixes_formats_and_shards_by_file(tmp_path: Path) -> None:
    for i in range(4):
        _jsonl(tmp_path / f"part{i}.jsonl", [{"text": f"{i} {t}"} for t in LINES[:50]])
    _parquet(tmp_path / "more.parquet")
    (tmp_path / "notes.txt").write_text("plain text notes\n" * 50)
    corpus = load_corpus(str(tmp_path))
    names = sorted([rel for rel, _ in corpus.train_docs] + list(corpus.val_names))
    assert names == ["more.parquet", "notes.txt", "part0.jsonl", "part1.jsonl", "part2.jsonl", "part3.jsonl"]
    shards = [shard_tokens(corpus, site_index=s, num_sites=2, non_iid=True)[1] for s in range(2)]
    assert shards[0] and shards[1] and not set(shards[0]) & set(shards[1])


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda d: d / "gone.jsonl", ["gone.jsonl", "no such file"]),
        (lambda d: (d / "e.txt").write_text("") and None or d / "e.txt", ["e.txt", "is empty"]),
        (lambda d: (d / "e.jsonl").write_text("\n\n") and None or d / "e.jsonl", ["e.jsonl", "no JSON lines"]),
        (lambda d: (d / "e.parquet").write_bytes(b"") and None or d / "e.parquet", ["e.parquet", "is empty"]),
        (
            lambda d: (
                _jsonl(d / "x.jsonl", [{"text": "ok"}, {"text": "ok"}]).open("a").write("{oops\n") and d / "x.jsonl"
            ),
            ["x.jsonl", "line 3", "not valid JSON"],
        ),
        (
            lambda d: _jsonl(d / "x.jsonl", [{"text": "ok"}, {"body": "no"}]),
            ["x.jsonl", "line 2", "'text'", "text_field", "body"],
        ),
        (lambda d: _jsonl(d / "x.jsonl", [{"text": 5}]), ["x.jsonl", "line 1", "'text'", "must be a string", "int"]),
        (lambda d: _jsonl(d / "x.jsonl", [["text"]]), ["x.jsonl", "line 1", "JSON object", "list"]),
        (
            lambda d: (d / "x.parquet").write_text("not parquet at all") and None or d / "x.parquet",
            ["x.parquet", "not a readable parquet"],
        ),
        (
            lambda d: _parquet(d / "x.parquet", column="body"),
            ["x.parquet", "no column 'text'", "text_field", "body, id"],
        ),
        (
            lambda d: _parquet(d / "x.parquet", values=list(range(len(LINES)))),
            ["x.parquet", "'text'", "must hold strings", "int64"],
        ),
    ],
)
def test_a_missing_empty_or_malformed_file_names_the_file_and_field(tmp_path: Path, make, words) -> None:
    path = make(tmp_path)
    with pytest.raises(ValueError) as e:
        read_document(path)
    msg = str(e.value)
    assert msg.startswith("data: ")
    for w in words:
        assert w in msg
    if path.exists():  # the same error through the corpus loader
        with pytest.raises(ValueError, match=path.name):
            load_corpus(str(path))
    if path.exists() and path.stat().st_size:  # and in a directory (which skips empty files)
        with pytest.raises(ValueError, match=path.name):
            load_corpus(str(tmp_path))


def test_a_spec_names_a_missing_data_path_or_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="^data: .*no such path"):
        TaskSpec(data=str(tmp_path / "none.jsonl"))
    with pytest.raises(ValueError, match="^tokenizer: .*no such path"):
        TaskSpec(tokenizer=str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="^text_field: "):
        TaskSpec(text_field="")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="^tokenizer: .*bad.json is not a tokenizers tokenizer.json"):
        load_tokenizer(str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match="^tokenizer: .*no such file"):
        load_tokenizer(str(tmp_path))  # a directory without tokenizer.json


def test_a_tokenizer_encodes_the_shard_and_the_gpt_task_takes_its_vocabulary(tmp_path: Path) -> None:
    tok_path = _tokenizer(tmp_path / "tokenizer.json")
    data = _jsonl(tmp_path / "d.jsonl", [{"text": t} for t in LINES])
    tok = load_tokenizer(str(tmp_path))  # the directory holding tokenizer.json
    assert isinstance(tok, FileTokenizer) and tok.vocab_size == 300
    ids = tok.encode(b"the quiet river\nfalls")
    assert ids.dtype == torch.int32 and 0 < ids.numel() < 21 and int(ids.max()) < 300
    spec = TaskSpec(size="tiny", data=str(data), tokenizer=str(tok_path))
    task = build_task(spec)
    assert task.info["vocab_size"] == 300 and task.model.tok_emb.num_embeddings == 300
    assert task.batches.tokens.dtype == torch.int32
    assert task.info["shard_tokens"] < len(read_document(data)) * 0.95 / 2  # BPE merges: fewer tokens than bytes
    x, y = next(task.batches)
    assert x.shape == (8, 32) and torch.equal(x[:, 1:], y[:, :-1])
    first = task.evaluate(task.model)
    for _ in range(20):
        task.loss(task.model, next(task.batches)).backward()
        task.optimizer.step()
        task.optimizer.zero_grad(set_to_none=True)
    assert task.evaluate(task.model) < first - 0.5
    out = tmp_path / "export"
    task.export_files(out.mkdir() or out)
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 300
    assert (out / "tokenizer.json").read_bytes() == tok_path.read_bytes()


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory) -> Path:
    """A 28 KB text file: fast to load, and a tiny model learns it in a few steps."""
    path = tmp_path_factory.mktemp("corpus") / "lines.txt"
    path.write_text("\n".join(LINES))
    return path


def _hf(spec_kwargs: dict, config: str, data: Path):
    return load_task("hf")(TaskSpec(size="tiny", data=str(data), **spec_kwargs, hf=HfSpec(config=config)))


def test_hf_task_from_a_preset_is_identical_on_every_site_and_learns(small_corpus: Path) -> None:
    a = _hf({"site_index": 0, "num_sites": 2}, "tiny-llama", small_corpus)
    b = _hf({"site_index": 1, "num_sites": 2}, "tiny-llama", small_corpus)
    assert a.info["task"] == "hf:llama" and a.info["num_params"] == 34976
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(next(a.batches)[0], next(b.batches)[0])  # per-site data order
    first = a.evaluate(a.model)
    for _ in range(20):
        a.loss(a.model, next(a.batches)).backward()
        a.optimizer.step()
        a.optimizer.zero_grad(set_to_none=True)
    assert a.evaluate(a.model) < first - 1.0


def test_hf_task_from_a_config_file_or_a_directory_with_weights(tmp_path: Path, small_corpus: Path) -> None:
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
    )
    cfg.save_pretrained(tmp_path / "cfg")
    from_file = _hf({}, str(tmp_path / "cfg" / "config.json"), small_corpus)
    assert from_file.model.config.hidden_size == 32 and from_file.model.config.use_cache is False
    with torch.no_grad():
        for p in from_file.model.parameters():
            p.add_(0.5)
    from_file.model.save_pretrained(tmp_path / "weights")
    loaded = _hf({}, str(tmp_path / "weights"), small_corpus)  # config.json + model.safetensors
    want = from_file.model.state_dict()
    got = loaded.model.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    cfg.vocab_size = 100
    cfg.save_pretrained(tmp_path / "small")
    with pytest.raises(ValueError, match="^hf.config: .*vocab_size=100.*256"):
        _hf({}, str(tmp_path / "small"), small_corpus)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text('{"hidden_size": 3}')
    with pytest.raises(ValueError, match="^hf.config: .*not a transformers config.json"):
        _hf({}, str(tmp_path / "bad"), small_corpus)


def test_hf_options_are_flags_and_go_with_task_hf(tmp_path: Path) -> None:
    cfg = WORKER.build({"task": "hf", "hf.config": "tiny-llama", "tokenizer": None, "text_field": "body"})
    assert cfg.task_spec.hf.config == "tiny-llama" and cfg.task_spec.text_field == "body"
    assert WORKER.resolve("hf.config").key == "task_spec.hf.config"
    with pytest.raises(ValueError, match="task 'hf' and hf.config go together"):
        WorkerConfig(task="hf")
    with pytest.raises(ValueError, match="task 'hf' and hf.config go together"):
        WorkerConfig(task_spec=TaskSpec(hf=HfSpec(config="tiny-llama")))
    with pytest.raises(ValueError, match="^hf.config: must be one of tiny-llama, small-llama.*no such path"):
        HfSpec(config=str(tmp_path / "nope"))
    check_task("hf")  # transformers is installed here: no error, nothing imported
    with pytest.raises(UsageError, match="'module:function'"):
        check_task("hf:")


def test_export_round_trips_bit_for_bit_with_tied_weights_once(tmp_path: Path, small_corpus: Path) -> None:
    task = build_task(TaskSpec(size="tiny", data=str(small_corpus)))
    state = task.model.state_dict()
    assert state["head.weight"].data_ptr() == state["tok_emb.weight"].data_ptr()  # tied
    out = write_export(tmp_path / "e", state, metadata={"dtrain_round": "3"}, export_files=task.export_files)
    from safetensors import safe_open
    from safetensors.torch import load_file

    loaded = load_file(out / "model.safetensors")
    assert "head.weight" not in loaded and set(loaded) == set(state) - {"head.weight"}
    assert all(torch.equal(loaded[k], state[k]) for k in loaded)
    with safe_open(out / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt", "dtrain_round": "3"}
    assert json.loads((out / "config.json").read_text())["model_type"] == "dtrain-gpt"
    write_export(tmp_path / "e", {"w": torch.zeros(2)}, metadata={})  # replaces the older export whole
    assert set(load_file(out / "model.safetensors")) == {"w"} and not (out / "config.json").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["e"]  # no temporary left behind


def test_readme_hf_example_runs_as_written(tmp_path: Path, monkeypatch) -> None:
    """README's "A Hugging Face model on your own data": the corpus line, then the library block."""
    import re
    import subprocess
    import sys

    section = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = section.split("## A Hugging Face model on your own data", 1)[1].split("\n## ", 1)[0]
    (bash,) = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    make_corpus = bash.splitlines()[0]
    assert make_corpus.startswith(".venv/bin/python -c ") and "corpus.jsonl" in make_corpus
    subprocess.run([sys.executable, "-c", make_corpus.split(" -c ", 1)[1].strip('"')], cwd=tmp_path, check=True)
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert scope["diloco"].round == 3  # 60 steps, a round every 20
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "my-llama", local_files_only=True)
    got, want = model.state_dict(), scope["task"].model.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in got)  # blocking rounds leave the model at θ
    assert "--task hf --hf.config tiny-llama --data corpus.jsonl" in bash
