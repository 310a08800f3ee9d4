"""Training data for a sweep: text in, token ids on disk, the same batches at every batch size.

``--data`` is a text file, a folder of .txt / .jsonl / .parquet files, or a Hugging Face
``datasets`` name or path (read from the local cache when there is no network). The text is
split once into train and validation (the last ``val_fraction`` of the characters, cut at a
line break), tokenized with a byte-level BPE trained on the train split at the model's
vocabulary size (or ``bytes``, or a tokenizer from the local cache), and the ids are saved as
``.npy`` files memory-mapped on reading, under a key that hashes the data, the tokenizer and
the split: a second sweep on the same data tokenizes nothing.

Samples are windows of ``seq_len + 1`` tokens (inputs and shifted targets). Their order is a
permutation fixed by the seed, and a run consumes them in that order, ``batch_size`` at a
time: at the same budget every batch size sees the same samples, and the data position of
a run is one integer (samples consumed), which a checkpoint saves.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from batchfit.errors import OptionError, UsageError, read_text
from batchfit.trace.cache import cache_root
from batchfit.workload import Workload

EOT = "<|endoftext|>"
TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")


def default_cache_dir() -> Path:
    return cache_root() / "tokens"


# --- reading text ----------------------------------------------------------------------------
def _files(path: Path) -> list[Path]:
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
    if not files:
        raise UsageError(f"`data` {path}: the folder has no .txt, .jsonl or .parquet files")
    return files


def _jsonl_rows(path: Path) -> list[tuple[int, object]]:
    """(line number, parsed value) of each non-blank line of a .jsonl file."""
    rows = []
    for number, line in enumerate(read_text(path, f"`data` {path}", UsageError).splitlines(), 1):
        if line.strip():
            try:
                rows.append((number, json.loads(line)))
            except json.JSONDecodeError:
                raise UsageError(f"{path}:{number}: not JSON; each .jsonl line must be an object, "
                                 "e.g. {\"text\": \"Once upon a time\"}") from None
    return rows


def _parquet_table(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UsageError(f"{path}: reading .parquet needs pyarrow: pip install 'batchfit[data]'") from None
    return pq.read_table(path)


def _read_file(path: Path) -> list[str]:
    if path.suffix == ".jsonl":
        docs = []
        for number, row in _jsonl_rows(path):
            if not isinstance(row, dict) or "text" not in row:
                raise UsageError(f"{path}:{number}: each .jsonl line must be an object with a "
                                 "'text' field, e.g. {\"text\": \"Once upon a time\"}")
            docs.append(row["text"])
        return docs
    if path.suffix == ".parquet":
        table = _parquet_table(path)
        if "text" not in table.column_names:
            raise UsageError(f"{path} has no 'text' column (columns: {', '.join(table.column_names)})")
        return [t for t in table.column("text").to_pylist() if t]
    raw = path.read_bytes()
    _check_is_text(path, raw)
    return [raw.decode("utf-8", errors="replace")]


def _check_is_text(path: Path, raw: bytes) -> None:
    """Refuse a file that is clearly not UTF-8 text (random bytes, an archive, a model file,
    UTF-16): it would tokenize into noise, silently. A few stray bytes are replaced."""
    sample = raw[: 1 << 20]
    if b"\x00" in sample:
        raise UsageError(f"`data` {path} is not text (it holds NUL bytes: binary, or UTF-16): give a UTF-8 "
                         "text file, e.g. `data` stories.txt")
    text = sample.decode("utf-8", errors="replace")
    bad = text.count("\ufffd") - sample.decode("utf-8", errors="ignore").count("\ufffd")  # not counting real U+FFFD
    if sample and bad > max(8, len(sample) // 100):
        raise UsageError(f"`data` {path} is not UTF-8 text ({bad:,} invalid UTF-8 sequences in its first "
                         f"{len(sample):,} bytes): give a UTF-8 text file, e.g. `data` stories.txt")


def _fingerprint(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for p in paths:
        digest.update(str(p.name).encode())
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def _dataset_texts(name: str) -> tuple[list[str], str]:
    try:
        import datasets
    except ImportError:
        raise UsageError(f"`data` {name} is no file or folder here; reading a datasets name needs "
                         "pip install 'batchfit[data]'") from None
    try:
        if Path(name).is_dir():
            loaded = datasets.load_from_disk(name)
        else:
            loaded = datasets.load_dataset(name)
    except Exception as error:  # network, unknown name, no cache: one line
        first = (str(error).strip().splitlines() or [""])[0]
        raise UsageError(f"`data` {name}: no such file or folder, and datasets cannot load it "
                         f"({type(error).__name__}: {first}); give a text file, a folder, or a "
                         "cached dataset") from None
    split = loaded["train"] if isinstance(loaded, dict) or hasattr(loaded, "keys") else loaded
    if "text" not in split.column_names:
        raise UsageError(f"`data` {name}: the train split has no 'text' column ({', '.join(split.column_names)})")
    return [t for t in split["text"] if t], getattr(split, "_fingerprint", name)


def _local_files(data: str) -> list[Path] | None:
    """The files ``--data`` names here (a file, or a folder's text files); None for a datasets
    name or a dataset saved with ``save_to_disk``."""
    path = Path(data).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir() and not (path / "dataset_info.json").exists() and not (path / "state.json").exists():
        return _files(path)
    return None


def read_texts(data: str) -> tuple[list[str], str]:
    """The documents of ``--data`` and a fingerprint of their content."""
    files = _local_files(data)
    if files is not None:
        return [d for f in files for d in _read_file(f)], _fingerprint(files)
    path = Path(data).expanduser()
    if not path.exists() and (path.suffix in (*TEXT_SUFFIXES, ".json", ".csv") or data.startswith(("/", ".", "~"))):
        # a file's path, not a dataset's name: a Hub lookup would only add a network error
        parent = path.parent if path.parent.is_dir() else None
        where = f"'{parent}' has no {path.name}" if parent else f"the folder '{path.parent}' does not exist"
        raise UsageError(f"`data` {data}: no such file ({where}); give a text file, a folder of "
                         f"{'/'.join(TEXT_SUFFIXES)} files, or a datasets name (e.g. roneneldan/TinyStories)")
    return _dataset_texts(data)


def split_text(docs: list[str], val_fraction: float) -> tuple[str, str]:
    """The last ``val_fraction`` of the characters (cut at a line break when there is one
    near) is validation: fixed, whatever the seed."""
    if not 0 < val_fraction < 1:
        raise OptionError(f"`val_fraction` must be between 0 and 1, e.g. 0.01; got {val_fraction}")
    text = f"\n{EOT}\n".join(docs)
    cut = int(len(text) * (1 - val_fraction))
    newline = text.find("\n", cut)
    if newline != -1 and newline - cut < max(1, len(text) // 100):
        cut = newline + 1
    return text[:cut], text[cut:]


# --- tokenizers ------------------------------------------------------------------------------
@dataclass
class Tokenizer:
    name: str
    """'bytes', 'bpe-<vocab>' or a cached tokenizer's name."""
    vocab_size: int
    encode: Callable[[str], list[int]]
    identity: str
    """What the cache key hashes: the kind, its vocab, how it was trained."""


def bytes_tokenizer() -> Tokenizer:
    return Tokenizer("bytes", 256, lambda text: list(text.encode("utf-8")), "bytes")


def train_bpe(text: str, vocab_size: int) -> tuple[Tokenizer, str]:
    """A byte-level BPE (HF ``tokenizers``) trained on ``text``; returns it and its JSON."""
    try:
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise UsageError("the default BPE tokenizer needs pip install 'batchfit[data]', or give "
                         "`tokenizer` bytes") from None
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    chunk = 1 << 16  # an iterator of pieces, so a large corpus is not one Python string twice
    tok.train_from_iterator((text[i:i + chunk] for i in range(0, len(text), chunk)), trainer=trainer)
    return _wrap_hf(tok, f"bpe-{vocab_size}"), tok.to_str()


def _wrap_hf(tok, name: str) -> Tokenizer:
    def encode(text: str) -> list[int]:
        chunk = 1 << 16
        ids: list[int] = []
        pieces = [text[i:i + chunk] for i in range(0, len(text), chunk)]
        for encoding in tok.encode_batch(pieces):
            ids.extend(encoding.ids)
        return ids

    return Tokenizer(name, tok.get_vocab_size(), encode, name)


def cached_tokenizer(name: str) -> Tokenizer:
    """A tokenizer.json path, or a name in the local Hugging Face cache (no network)."""
    path = Path(name).expanduser()
    try:
        if path.is_file():
            from tokenizers import Tokenizer as HFTokenizer

            return _wrap_hf(HFTokenizer.from_file(str(path)), str(path))
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(name, local_files_only=True)
    except ImportError as error:  # what to install, not "not found"
        extra = "hf" if error.name == "transformers" else "data"
        raise UsageError(f"`tokenizer` {name} needs {error.name}: pip install 'batchfit[{extra}]'") from None
    except Exception as error:
        first = (str(error).strip().splitlines() or [""])[0]
        raise UsageError(f"`tokenizer` {name}: not found in the local cache ({type(error).__name__}: {first}); "
                         "use `tokenizer` bpe (trained on your data) or bytes") from None
    return Tokenizer(name, len(hf), lambda text: hf(text, add_special_tokens=False)["input_ids"], name)


# --- sample lengths (estimate --data: the shapes of a run's batches) ---------------------------
def tokenizer_named(name: str) -> Tokenizer:
    """``bytes``, a tokenizer.json path, or a tokenizer in the local Hugging Face cache or a model folder."""
    if name == "bytes":
        return bytes_tokenizer()
    try:
        return cached_tokenizer(name)
    except UsageError as error:  # its hint names `tokenizer` bpe, which trains on a sweep's text only
        raise UsageError(str(error).split("; use `tokenizer` bpe")[0] + "; give a tokenizer.json, a tokenizer in "
                         "the local Hugging Face cache, or bytes") from None


def _row_length(row: object, where: str, length_column: str | None,
                tokenizer: Callable[[], Tokenizer]) -> int:
    """One sample's tokens: its length column, its ``input_ids``, or its text tokenized."""
    if isinstance(row, str):
        return len(tokenizer().encode(row))
    if not isinstance(row, dict):
        raise UsageError(f"{where}: each row must be an object, e.g. {{\"text\": \"Once upon a time\"}}")
    if length_column is not None:
        if length_column not in row:
            raise UsageError(f"{where}: no column '{length_column}' (columns: {', '.join(map(str, row))}): "
                             "give `length_column` one of them, or drop it")
        value = row[length_column]
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise UsageError(f"{where}: '{length_column}' is {value!r}, not a count of tokens (an integer >= 0)")
        return value
    if "input_ids" in row:
        return len(row["input_ids"])
    if "text" in row:
        return len(tokenizer().encode(row["text"] or ""))
    raise UsageError(f"{where}: a row has no 'input_ids' and no 'text' (columns: {', '.join(map(str, row))}): "
                     "give `length_column` NAME for a column of lengths")


def _file_rows(path: Path) -> list[tuple[str, object]]:
    """(where, row) of each sample of a file: .jsonl lines, .parquet rows, a .txt file's non-blank lines."""
    if path.suffix == ".jsonl":
        return [(f"{path}:{number}", row) for number, row in _jsonl_rows(path)]
    if path.suffix == ".parquet":
        return [(f"{path} row {i}", row) for i, row in enumerate(_parquet_table(path).to_pylist())]
    return [(f"{path}:{number}", line) for number, line in enumerate(_read_file(path)[0].splitlines(), 1)
            if line.strip()]


def sample_lengths(data: str, *, length_column: str | None = None,
                   tokenizer: Callable[[], Tokenizer] | None = None) -> list[int]:
    """The token count of each sample of ``--data``, in the data's order: a .txt file's lines, a
    .jsonl / .parquet file's rows (a ``length_column``, else ``input_ids``, else ``text``
    tokenized), a folder's files in name order, or a datasets name's texts. ``tokenizer`` is
    called only where a row holds text; None there is a one-line error."""
    def need_tokenizer() -> Tokenizer:
        if tokenizer is None:
            raise UsageError(f"`data` {data} holds text and no tokenizer was given or found with the model: "
                             "give `tokenizer` (a tokenizer.json, a cached name, or bytes), rows with "
                             "input_ids, or `length_column` NAME")
        return tokenizer()

    files = _local_files(data)
    rows = ([row for f in files for row in _file_rows(f)] if files is not None
            else [(f"`data` {data}", text) for text in _dataset_texts(data)[0]])
    if not rows:
        raise UsageError(f"`data` {data} holds no samples: give a file with one sample per line (.txt, .jsonl) "
                         "or per row (.parquet)")
    memo: list[Tokenizer] = []

    def once() -> Tokenizer:  # loaded on the first text, and only once
        if not memo:
            memo.append(need_tokenizer())
        return memo[0]

    return [_row_length(row, where, length_column, once) for where, row in rows]


# --- the token cache -------------------------------------------------------------------------
@dataclass
class TokenData:
    """Token ids of the train and validation splits (memory-mapped) and how they were made."""

    train: np.ndarray
    val: np.ndarray
    tokenizer: str
    vocab_size: int
    key: str
    source: str
    folder: Path
    """Where the cache lives: worker processes open it with :func:`open_tokens`."""

    def to_json(self) -> dict:
        return {"source": self.source, "tokenizer": self.tokenizer, "vocab_size": self.vocab_size,
                "train_tokens": int(len(self.train)), "val_tokens": int(len(self.val)), "cache_key": self.key}


def tokenize(data: str, *, tokenizer: str = "bpe", vocab_size: int, val_fraction: float = 0.01,
             cache_dir: Path | None = None, progress: Callable[[str], None] | None = None) -> TokenData:
    """Token ids of ``data``, from the cache when this data and tokenizer were seen before."""
    say = progress or (lambda message: None)
    docs, fingerprint = read_texts(data)
    if not docs or not any(d.strip() for d in docs):
        raise UsageError(f"`data` {data} holds no text")
    kind = "bpe" if tokenizer == "bpe" else tokenizer
    key = hashlib.sha256(json.dumps([fingerprint, kind, vocab_size if kind == "bpe" else None,
                                     val_fraction]).encode()).hexdigest()[:20]
    folder = Path(cache_dir or default_cache_dir()) / key
    meta_file = folder / "meta.json"
    if meta_file.exists():
        say(f"tokens from the cache {folder}")
        return open_tokens(folder)
    train_text, val_text = split_text(docs, val_fraction)
    if tokenizer == "bytes":
        tok = bytes_tokenizer()
        saved = None
    elif tokenizer == "bpe":
        say(f"training a byte-level BPE with {vocab_size:,} tokens on the train split")
        tok, saved = train_bpe(train_text, vocab_size)
    else:
        tok, saved = cached_tokenizer(tokenizer), None
    if tok.vocab_size > vocab_size:
        raise OptionError(f"`tokenizer` {tok.name} has {tok.vocab_size:,} tokens but the model's vocabulary has "
                          f"{vocab_size:,}: use `tokenizer` bpe (trained at the model's size) or a smaller tokenizer")
    say(f"tokenizing {len(train_text):,} + {len(val_text):,} characters ({tok.name})")
    dtype = np.uint16 if vocab_size <= 1 << 16 else np.uint32
    train, val = (np.asarray(tok.encode(t), dtype=dtype) for t in (train_text, val_text))
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # a file where a folder goes, a read-only place
        raise OptionError(f"cannot create the token cache {folder} ({error.strerror or error}): give `cache_dir` "
                          "a folder you can write, e.g. `cache_dir` ~/.cache/batchfit/tokens") from None
    tmp = folder / f".tmp-{os.getpid()}"
    tmp.mkdir(exist_ok=True)
    np.save(tmp / "train.npy", train)
    np.save(tmp / "val.npy", val)
    if saved:
        (tmp / "tokenizer.json").write_text(saved)
    for name in ("train.npy", "val.npy", "tokenizer.json"):
        if (tmp / name).exists():
            os.replace(tmp / name, folder / name)
    tmp.rmdir()
    # meta.json last: its presence says the folder is complete (a killed tokenization is redone)
    meta_file.write_text(json.dumps({"tokenizer": tok.name, "vocab_size": tok.vocab_size, "data": data}))
    return open_tokens(folder)


def open_tokens(folder: Path) -> TokenData:
    """A finished cache folder, memory-mapped."""
    meta = json.loads((folder / "meta.json").read_text())
    return TokenData(np.load(folder / "train.npy", mmap_mode="r"), np.load(folder / "val.npy", mmap_mode="r"),
                     meta["tokenizer"], meta["vocab_size"], folder.name, meta["data"], folder)


# --- what a language-model workload's batch looks like -----------------------------------------
@dataclass
class LMFormat:
    """How token windows become the batch a workload's loss_fn takes."""

    vocab_size: int
    seq_len: int
    to_batch: Callable[[torch.Tensor], Any]
    """(windows [b, seq_len + 1] int64) -> batch."""


def _vocab_size(workload: Workload) -> int | None:
    """The input embedding's rows, from the model built on the meta device (no memory)."""
    with torch.device("meta"):
        model = workload.build_model()
    get = getattr(model, "get_input_embeddings", None)
    embedding = get() if callable(get) else None
    if not isinstance(embedding, nn.Embedding):
        embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return embedding.num_embeddings if embedding is not None else None


def lm_format(workload: Workload) -> LMFormat | None:
    """The batch format of a token language model (zoo ``(x, y)`` pairs, or transformers
    ``{input_ids, labels}``), read from one ``make_batch``; None for any other workload."""
    with torch.random.fork_rng(devices=[]):
        sample = workload.make_batch(1, torch.device("cpu"))
    if (isinstance(sample, tuple) and len(sample) == 2
            and all(isinstance(t, torch.Tensor) and t.dtype == torch.long and t.dim() == 2 for t in sample)
            and sample[0].shape == sample[1].shape):
        seq = sample[0].shape[1]
        to_batch = lambda w: (w[:, :-1].contiguous(), w[:, 1:].contiguous())  # noqa: E731
    elif (isinstance(sample, dict) and set(sample) == {"input_ids", "labels"}
          and sample["input_ids"].dim() == 2 and torch.equal(sample["input_ids"], sample["labels"])):
        seq = sample["input_ids"].shape[1]

        def to_batch(w: torch.Tensor) -> dict:  # transformers shifts the labels itself
            ids = w[:, :-1].contiguous()
            return {"input_ids": ids, "labels": ids}
    else:
        return None
    vocab = _vocab_size(workload)
    return LMFormat(vocab, seq, to_batch) if vocab else None


# --- where batches come from -----------------------------------------------------------------
class TokenSamples:
    """Windows of ``seq_len + 1`` tokens in a seeded order; sample ``i`` is always the same."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int) -> None:
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed
        self.count = (len(tokens) - 1) // seq_len
        if self.count < 1:
            raise UsageError(f"the data holds {len(tokens):,} tokens, fewer than one sample of {seq_len + 1}: "
                             "give more text or a shorter `seq_len`")
        self._epoch, self._order = -1, np.empty(0, dtype=np.int64)

    def windows(self, start: int, n: int) -> torch.Tensor:
        """Samples start .. start+n-1 of the run's stream (epochs reshuffle with seed + epoch)."""
        rows = []
        for i in range(start, start + n):
            epoch, within = divmod(i, self.count)
            if epoch != self._epoch:
                self._epoch = epoch
                self._order = np.random.default_rng([self.seed, epoch]).permutation(self.count)
            offset = int(self._order[within]) * self.seq_len
            rows.append(np.asarray(self.tokens[offset:offset + self.seq_len + 1], dtype=np.int64))
        return torch.from_numpy(np.stack(rows))

    def fixed(self, n: int) -> torch.Tensor:
        """The first ``n`` windows in file order (validation: the same for every run)."""
        n = min(n, self.count)
        return torch.from_numpy(np.stack([np.asarray(self.tokens[i * self.seq_len:(i + 1) * self.seq_len + 1],
                                                     dtype=np.int64) for i in range(n)]))


class BatchSource:
    """Batches for a run: micro-batches of the training stream, and the validation set."""

    def __init__(self, workload: Workload, *, seed: int, tokens: TokenData | None = None,
                 eval_samples: int = 64) -> None:
        self.workload, self.seed, self.eval_samples = workload, seed, eval_samples
        self.kind = "synthetic"
        self._train = self._val = self._format = None
        if tokens is not None:
            self._format = lm_format(workload)
            if self._format is None:
                raise UsageError(f"`data` gives text, but {workload.name} is not a token language model "
                                 "(its make_batch returns no token ids): drop `data`, or give the workload "
                                 "train_batches")
            if tokens.vocab_size > self._format.vocab_size:
                raise OptionError(f"the tokenizer has {tokens.vocab_size:,} tokens, the model's embedding "
                                  f"{self._format.vocab_size:,}: use `tokenizer` bpe or a model with a "
                                  "larger vocabulary")
            self._train = TokenSamples(tokens.train, self._format.seq_len, seed)
            self._val = TokenSamples(tokens.val, self._format.seq_len, seed)
            self.kind = "text"
        elif workload.train_batches is not None:
            self.kind = "workload"

    def train(self, sample_index: int, batch_size: int, device: torch.device) -> Any:
        """The micro-batch of ``batch_size`` samples starting at sample ``sample_index``."""
        if self.kind == "text":
            return _to(self._format.to_batch(self._train.windows(sample_index, batch_size)), device)
        if self.kind == "workload":
            return self._from_workload(sample_index, batch_size, "train", device)
        # Synthetic: the batch is a function of (seed, position), whatever the model's RNG did.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed * 1_000_003 + sample_index)
            return self.workload.make_batch(batch_size, device)

    def _from_workload(self, sample_index: int, batch_size: int, split: str, device: torch.device) -> Any:
        # train_batches(batch_size, split, seed) is an iterator: resume skips what was consumed.
        if sample_index % batch_size:
            raise UsageError("train_batches cannot start mid-batch; use the same micro-batch to resume")
        key = (batch_size, split)
        position = sample_index // batch_size
        it, at = getattr(self, "_iters", {}).get(key, (None, -1))
        if it is None or at > position:
            it, at = iter(self.workload.train_batches(batch_size, split, self.seed)), 0
        while at < position:
            next(it)
            at += 1
        batch = next(it)
        self._iters = {**getattr(self, "_iters", {}), key: (it, at + 1)}
        return _to(batch, device)

    def validation(self, micro_batch: int, device: torch.device) -> Iterator[tuple[int, Any]]:
        """(samples, batch) pieces of the fixed validation set, ``micro_batch`` at a time."""
        n = self.eval_samples
        if self.kind == "text":
            windows = self._val.fixed(n)
            for i in range(0, len(windows), micro_batch):
                piece = windows[i:i + micro_batch]
                yield len(piece), _to(self._format.to_batch(piece), device)
            return
        if self.kind == "workload":
            it = iter(self.workload.train_batches(micro_batch, "val", self.seed))
            for done in range(0, n, micro_batch):
                yield micro_batch, _to(next(it), device)
            return
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(-1 - self.seed & 0xFFFF_FFFF)  # a stream no training batch uses
            for done in range(0, n, micro_batch):
                size = min(micro_batch, n - done)
                yield size, self.workload.make_batch(size, device)


def _to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: _to(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to(v, device) for v in batch)
    return batch
