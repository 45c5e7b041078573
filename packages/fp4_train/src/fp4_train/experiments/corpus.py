"""The training text and batches drawn from the seed and the step alone (the same for every
codec and parallel layout).

Two kinds of corpus:

- bytes: ``load_corpus`` of text files (each byte a token, ``VOCAB`` = 256), split by position
  (``split``);
- BPE tokens: ``load_tokens`` of a folder that ``build_corpus`` wrote (``train.bin`` and
  ``val.bin``, uint16, or their ``.xz`` copies, checked against ``manifest.json``), split by
  document; ``CI_SLICE`` is a small one shipped with the package for tests.

``train_batch`` and ``val_batches`` take either kind's 1-D token tensor.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import lzma
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

VOCAB = 256  # byte-level tokens
# Debian package jargon-text (apt-get install jargon-text): the Jargon File 4.4.7, 1.7 MB text.
DEFAULT_CORPUS = Path("/usr/share/doc/jargon-text/jargon.txt.gz")
#: where ``python -m fp4_train.experiments.build_corpus`` writes the BPE corpus by default
DEFAULT_TOKENS = Path(".data/corpus")
#: a slice of that corpus (Python's documentation, PSF licence) with its tokenizer, for tests
CI_SLICE = Path(__file__).with_name("data") / "corpus_slice"
SPLITS = ("train", "val")


@dataclass(frozen=True)
class TokenCorpus:
    """A BPE corpus: int64 token ids of each split, documents ended by ``eot_id``."""

    train: torch.Tensor
    val: torch.Tensor
    vocab_size: int
    eot_id: int
    manifest: dict = field(repr=False)


def load_tokens(path: str | Path = DEFAULT_TOKENS, verify: bool = True) -> TokenCorpus:
    """The token files of a ``build_corpus`` output folder (``<split>.bin``, else
    ``<split>.bin.xz``), checked against its manifest: token count always, sha256 of the
    uint16 bytes when ``verify`` (~0.1 s per 10 M tokens)."""
    path = Path(path)
    manifest_path = path / "manifest.json"
    if not manifest_path.is_file():
        raise FileNotFoundError(
            f"{manifest_path}: no token corpus here; build it with `python -m "
            f"fp4_train.experiments.build_corpus --out {path}` (docs/tp_training.md, Data), or "
            "copy that folder's manifest.json and *.bin.xz here"
        )
    manifest = json.loads(manifest_path.read_text())
    tok = manifest["tokenizer"]
    splits = manifest["splits"]
    tokens = {}
    for name in SPLITS:
        rec = splits[name]
        raw = _read_split(path, rec["file"])
        if len(raw) != 2 * rec["tokens"]:
            raise ValueError(
                f"{path / rec['file']}: {len(raw)} bytes, the manifest says {rec['tokens']} "
                "uint16 tokens; the file is cut or from another build: copy it again"
            )
        if verify and hashlib.sha256(raw).hexdigest() != rec["sha256"]:
            raise ValueError(
                f"{path / rec['file']}: sha256 differs from the manifest's; the file is "
                "damaged or from another build: copy it again or rebuild"
            )
        ids = np.frombuffer(raw, dtype="<u2")
        tokens[name] = torch.from_numpy(ids.astype(np.int64))
    return TokenCorpus(tokens["train"], tokens["val"], tok["vocab_size"], tok["eot_id"],
                       manifest)  # fmt: skip


def _read_split(folder, name):
    plain, packed = folder / name, folder / (name + ".xz")
    if plain.is_file():
        return plain.read_bytes()
    if packed.is_file():
        return lzma.decompress(packed.read_bytes())
    raise FileNotFoundError(f"{plain}: neither it nor {packed.name} is there")


def load_corpus(paths, max_bytes=None):
    """The bytes of one or more text files (``.gz`` read as gzip), concatenated, as int64 token
    ids 0..255."""
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    chunks = []
    for path in map(Path, paths):
        if not path.exists():
            raise FileNotFoundError(
                f"{path}: no corpus; `apt-get install jargon-text` installs the default one, or "
                "pass --data PATH (any text file; .gz is read as gzip)"
            )
        raw = path.read_bytes()
        chunks.append(gzip.decompress(raw) if path.suffix == ".gz" else raw)
    raw = b"\n".join(chunks)
    if max_bytes:
        raw = raw[:max_bytes]
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()


def split(tokens, val_fraction):
    n_val = int(len(tokens) * val_fraction)
    return tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :]


def train_batch(tokens, step, batch, seq_len, seed):
    """Sequences at random offsets, drawn from (seed, step) alone: the same batches for every
    codec and layout.  Returns inputs and targets, [seq_len, batch] each."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(tokens) - seq_len - 1, (batch,), generator=g)
    idx = starts[None, :] + torch.arange(seq_len + 1)[:, None]
    window = tokens[idx]
    return window[:-1], window[1:]


def val_batches(tokens, n_batches, batch, seq_len):
    """Evenly spaced windows of the validation split (the same ones at every evaluation)."""
    n = n_batches * batch
    starts = torch.linspace(0, len(tokens) - seq_len - 2, n).long()
    idx = starts[None, :] + torch.arange(seq_len + 1)[:, None]
    window = tokens[idx]
    return [
        (window[:-1, i * batch : (i + 1) * batch], window[1:, i * batch : (i + 1) * batch])
        for i in range(n_batches)
    ]
