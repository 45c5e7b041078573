"""The training text: a file's bytes as tokens, a validation split, and batches drawn from the
seed and the step alone (the same for every codec and parallel layout)."""

from __future__ import annotations

import gzip
from pathlib import Path

import torch

VOCAB = 256  # byte-level tokens
# Debian package jargon-text (apt-get install jargon-text): the Jargon File 4.4.7, 1.7 MB text.
DEFAULT_CORPUS = Path("/usr/share/doc/jargon-text/jargon.txt.gz")


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
