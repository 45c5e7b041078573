"""Build the training corpus from Debian documentation packages: text, a validation split, a
byte-level BPE vocabulary and uint16 token files, deterministically and offline.

    apt-get update && apt-get install linux-doc-6.1 python3.11-doc python-django-doc perl-doc \\
        postgresql-doc-15 git-doc
    python -m fp4_train.experiments.build_corpus --out .data/corpus

The last lines it prints say whether the token files are those the study's runs trained on
(``STUDY_MANIFEST``; the same package versions give the same bytes) or which versions differ.

Sources (``SOURCES``): the documentation these packages install, as their authors wrote it
(reStructuredText, POD and AsciiDoc sources; HTML where the package ships nothing else), each
file one *document*.  Real English prose about software, with the markup and the code examples
of technical documentation; what each package holds and its licence: docs/tp_training.md
("Data").

Per document, in the order of the sorted file list (``.gz`` files read as gzip):

1. decode as UTF-8 (a file that is not UTF-8 is skipped and counted);
2. HTML: the text of the page's content element only (``HTML_CONTENT``: Sphinx's or DocBook's
   navigation bars, indexes and sidebars left out), ``script`` and ``style`` dropped, block
   elements ending lines;
3. line ends to ``\\n``, trailing blanks stripped, lines that are only a repeated punctuation
   character (reStructuredText's section underlines, table borders) dropped, runs of blank
   lines cut to one;
4. kept if at least ``MIN_DOC_BYTES`` bytes and at least ``MIN_LETTER_SHARE`` of its
   non-blank characters are letters (drops data tables, number lists, binary-ish files).

Split by document, never inside one: a document is validation when the first 8 bytes of the
sha256 of its path (package-relative), as an integer, modulo 10 000 fall below
``VAL_PER_10000``; the split of a file does not change when other files come or go.

The BPE (Hugging Face ``tokenizers``): byte-level (GPT-2's pre-tokenizer and its 256-byte
alphabet, so any text encodes without an unknown token), ``VOCAB_SIZE`` ids, trained on the
training documents only; id 0 is ``<|endoftext|>``, written after every document.  Token files:
little-endian uint16 (``train.bin``, ``val.bin``), and xz-compressed copies (``.bin.xz``) for
carrying to a machine without the packages.  ``manifest.json``: package versions, licences,
file and document counts, bytes and tokens per split, sha256 of every output.

``--slice DIR`` also writes the small slice that the tests read (``corpus.CI_SLICE``): the
tokens of the first documents of each split that come from ``SLICE_PACKAGE`` (permissively
licensed), up to ``--slice-tokens``, with the tokenizer.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import html.parser
import io
import json
import lzma
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

#: ids in the vocabulary: 2^14.  A corpus of ~60 MB has ~15 M tokens; 16 384 ids cover the
#: frequent words of technical English and keep a 100 M-parameter model's embedding and head
#: small (16 384 x 768 = 12.6 M each), and every id fits in uint16.
VOCAB_SIZE = 16384
EOT = "<|endoftext|>"  # id 0: the end of every document
MIN_FREQUENCY = 2  # a merge must occur twice in the training text
VAL_PER_10000 = 200  # 2 % of the documents are validation
MIN_DOC_BYTES = 256
MIN_LETTER_SHARE = 0.5
SLICE_PACKAGE = "python3.11-doc"  # PSF licence: the committed slice may carry its text
XZ_PRESET = 9

# A line that is one punctuation character repeated (at least 3 times), e.g. "=====", "-----".
_DECORATION = re.compile(r"^[ \t]*([=\-~^\"'*+#`:.<>_|])\1{2,}[ \t]*(?:\n|\Z)", re.MULTILINE)
_BLANK_RUNS = re.compile(r"\n{3,}")
_BLANKS = re.compile(r"\s+")
_TRAILING = re.compile(r"[ \t]+$", re.MULTILINE)


@dataclass(frozen=True)
class Source:
    package: str
    root: str  # files are named relative to this folder in the split hash and the manifest
    patterns: tuple[str, ...]  # globs under root
    kind: str  # "text" or "html"
    licence: str  # SPDX-style, from the package's copyright file
    exclude: tuple[str, ...] = ()  # path prefixes (relative to root) left out


SOURCES = (
    Source("linux-doc-6.1", "/usr/share/doc/linux-doc-6.1/Documentation",
           ("**/*.rst.gz", "**/*.txt.gz"), "text", "GPL-2.0-only"),
    Source("python3.11-doc", "/usr/share/doc/python3.11/html/_sources",
           ("**/*.rst.txt",), "text", "PSF-2.0"),
    Source("python-django-doc", "/usr/share/doc/python-django-doc/html", ("**/*.html",),
           "html", "BSD-3-Clause",
           ("_modules/", "_static/", "genindex", "py-modindex", "search.html")),
    Source("perl-doc", "/usr/share/perl/5.36.0/pod", ("*.pod",), "text",
           "GPL-1.0-or-later OR Artistic-1.0-Perl"),
    Source("postgresql-doc-15", "/usr/share/doc/postgresql-doc-15/html", ("*.html",), "html",
           "PostgreSQL", ("bookindex.html",)),
    Source("git-doc", "/usr/share/doc/git-doc", ("*.txt", "**/*.txt"), "text", "GPL-2.0-only"),
)  # fmt: skip

#: HTML: only the text inside the first element with one of these (attribute, value) pairs
#: (Sphinx's content column in Django's theme; DocBook's page body, whose navigation bars are
#: the divs ``navheader`` / ``navfooter`` outside it).
HTML_CONTENT = (("id", "yui-main"), ("class", "chapter"), ("class", "sect1"),
                ("class", "refentry"), ("class", "appendix"), ("class", "preface"),
                ("class", "part"), ("class", "book"), ("class", "reference"),
                ("class", "glossary"), ("class", "set"), ("class", "index"))  # fmt: skip
_HTML_SKIP = {"script", "style", "head"}
_HTML_BLOCK = {"p", "div", "br", "li", "tr", "pre", "h1", "h2", "h3", "h4", "h5", "h6",
               "dt", "dd", "table", "section", "blockquote", "hr"}  # fmt: skip


class _ContentText(html.parser.HTMLParser):
    """The text inside the first element that ``HTML_CONTENT`` names."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skip = 0
        self.pre = 0  # open <pre> elements: their whitespace is kept
        self.depth = 0  # open elements of the content element's tag, itself included
        self.tag: str | None = None
        self.done = False

    def handle_starttag(self, tag, attrs):
        if self.done:
            return
        if self.tag is None:
            attrs = dict(attrs)
            if any(attrs.get(a) == v for a, v in HTML_CONTENT):
                self.tag, self.depth = tag, 1
            return
        if tag == self.tag:
            self.depth += 1
        if tag in _HTML_SKIP:
            self.skip += 1
        if tag == "pre":
            self.pre += 1
        if tag in _HTML_BLOCK:
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if self.done or self.tag is None:
            return
        if tag in _HTML_SKIP:
            self.skip = max(0, self.skip - 1)
        if tag == "pre":
            self.pre = max(0, self.pre - 1)
        if tag in _HTML_BLOCK:
            self.parts.append("\n")
        if tag == self.tag:
            self.depth -= 1
            if self.depth == 0:
                self.done = True

    def handle_data(self, data):
        if self.tag is None or self.done or self.skip:
            return
        if not self.pre:
            # HTML collapses blanks and line breaks outside <pre>; a line starts unindented
            data = _BLANKS.sub(" ", data)
            if not self.parts or self.parts[-1].endswith("\n"):
                data = data.lstrip(" ")
        self.parts.append(data)


def html_text(page: str) -> str:
    """The content text of one HTML page ('' where it has no ``HTML_CONTENT`` element)."""
    p = _ContentText()
    p.feed(page)
    p.close()
    return "".join(p.parts)


def clean(text: str) -> str:
    """Steps 3 of the module docstring: line ends, trailing blanks, decoration, blank runs."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _TRAILING.sub("", text)
    text = _DECORATION.sub("", text)
    text = _BLANK_RUNS.sub("\n\n", text)
    return text.strip("\n") + "\n"


def keep(text: str) -> bool:
    """Step 4: long enough, and mostly letters."""
    if len(text.encode()) < MIN_DOC_BYTES:
        return False
    visible = [c for c in text if not c.isspace()]
    letters = sum(c.isalpha() for c in visible)
    return letters >= MIN_LETTER_SHARE * len(visible)


def is_validation(name: str) -> bool:
    """The document named ``name`` (package/relative path) belongs to the validation split."""
    h = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    return h % 10000 < VAL_PER_10000


def source_files(source: Source) -> list[Path]:
    root = Path(source.root)
    files = {p for pat in source.patterns for p in root.glob(pat) if p.is_file()}
    rel = sorted((p.relative_to(root).as_posix(), p) for p in files)
    return [p for r, p in rel if not any(r.startswith(x) for x in source.exclude)]


def read_document(path: Path, kind: str) -> str | None:
    raw = path.read_bytes()
    if path.suffix == ".gz":
        raw = gzip.decompress(raw)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if kind == "html":
        text = html_text(text)
    return clean(text)


def package_version(package: str) -> str | None:
    try:
        out = subprocess.run(["dpkg-query", "-W", "-f=${Version}", package],
                             capture_output=True, text=True, check=False)  # fmt: skip
    except FileNotFoundError:  # not a Debian system
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def collect(sources=SOURCES):
    """(train documents, validation documents, per-package statistics); documents are
    (name, text) in the order of the sorted file lists, packages in ``sources`` order."""
    train, val, stats = [], [], {}
    missing = [s.package for s in sources if package_version(s.package) is None
               or not Path(s.root).is_dir()]  # fmt: skip
    if missing:
        raise SystemExit(
            f"build_corpus: not installed: {' '.join(missing)}; run\n"
            f"    apt-get install {' '.join(missing)}"
        )
    for s in sources:
        st = {"version": package_version(s.package), "licence": s.licence, "root": s.root,
              "copyright": f"/usr/share/doc/{s.package}/copyright", "files": 0,
              "not_utf8": 0, "dropped": 0, "documents": 0, "bytes": 0}  # fmt: skip
        for path in source_files(s):
            st["files"] += 1
            text = read_document(path, s.kind)
            if text is None:
                st["not_utf8"] += 1
                continue
            if not keep(text):
                st["dropped"] += 1
                continue
            name = f"{s.package}/{path.relative_to(s.root).as_posix()}"
            (val if is_validation(name) else train).append((name, text))
            st["documents"] += 1
            st["bytes"] += len(text.encode())
        stats[s.package] = st
    return train, val, stats


def train_tokenizer(texts, vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE of ``vocab_size`` ids trained on ``texts`` (in order)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=MIN_FREQUENCY,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def encode_documents(tok, texts) -> np.ndarray:
    """The documents' ids, each followed by ``<|endoftext|>``, as uint16."""
    eot = tok.token_to_id(EOT)
    out = []
    for enc in tok.encode_batch(texts):
        out.append(np.asarray(enc.ids, dtype=np.uint16))
        out.append(np.asarray([eot], dtype=np.uint16))
    return np.concatenate(out) if out else np.zeros(0, np.uint16)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_tokens(path: Path, ids: np.ndarray, xz: bool = True) -> dict:
    path.write_bytes(ids.astype("<u2").tobytes())
    rec = {"file": path.name, "tokens": int(ids.size), "bytes": path.stat().st_size,
           "sha256": sha256_file(path)}  # fmt: skip
    if xz:
        packed = path.with_name(path.name + ".xz")
        packed.write_bytes(lzma.compress(path.read_bytes(), preset=XZ_PRESET))
        rec["xz"] = {"file": packed.name, "bytes": packed.stat().st_size,
                     "sha256": sha256_file(packed)}  # fmt: skip
    return rec


def write_slice(out: Path, tok, train, val, n_tokens: int) -> dict:
    """The CI slice: tokens of the first ``SLICE_PACKAGE`` documents of each split (train up to
    ``n_tokens``, validation up to a quarter of that); the split records."""
    out.mkdir(parents=True, exist_ok=True)
    splits = {}
    for split, docs, limit in (("train", train, n_tokens), ("val", val, n_tokens // 4)):
        picked = []
        total = 0
        for name, text in docs:
            if not name.startswith(SLICE_PACKAGE + "/"):
                continue
            ids = encode_documents(tok, [text])
            if total + ids.size > limit:
                break
            picked.append(ids)
            total += ids.size
        ids = np.concatenate(picked) if picked else np.zeros(0, np.uint16)
        splits[split] = write_tokens(out / f"{split}.bin", ids, xz=False)
        splits[split]["documents"] = len(picked)
    return splits


def write_slice_notice(out: Path) -> None:
    """``NOTICE`` of the slice: what it is, the changes made (PSF licence, clause 3), the
    documentation's copyright notice and the PSF licence agreement, from the package."""
    licence = Path("/usr/share/doc/python3.11-doc/copyright").read_text()
    start = licence.index("PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2")
    agreement = licence[start : licence.index("BEOPEN.COM LICENSE AGREEMENT", start)]
    notices = Path(_source(SLICE_PACKAGE).root, "copyright.rst.txt").read_text()
    paragraphs = (" ".join(p.split()) for p in notices.split("\n\n"))
    lines = [p for p in paragraphs if p.startswith("Copyright ©")]
    text = (
        "The token files here (train.bin, val.bin) encode text of the Python 3.11\n"
        "documentation as Debian's python3.11-doc package ships it (its reStructuredText\n"
        "sources), with the changes fp4_train.experiments.build_corpus makes: lines of one\n"
        "repeated punctuation character and runs of blank lines removed, documents\n"
        "concatenated and tokenized with the BPE vocabulary of tokenizer.json.\n\n"
        + "\n".join(lines)
        + "\n\n"
        + agreement.rstrip()
        + "\n"
    )
    (out / "NOTICE").write_text(text)


def _source(package):
    return next(s for s in SOURCES if s.package == package)


def build(out: Path, vocab_size: int = VOCAB_SIZE, slice_dir: Path | None = None,
          slice_tokens: int = 96 * 1024, sources=SOURCES) -> dict:  # fmt: skip
    import tokenizers

    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    train, val, stats = collect(sources)
    print(f"documents: {len(train)} train, {len(val)} validation "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
    tok = train_tokenizer([t for _, t in train], vocab_size)
    tok_path = out / "tokenizer.json"
    tok.save(str(tok_path))
    print(f"BPE trained ({time.perf_counter() - t0:.0f} s)", flush=True)
    splits = {}
    for name, docs in (("train", train), ("val", val)):
        ids = encode_documents(tok, [t for _, t in docs])
        splits[name] = write_tokens(out / f"{name}.bin", ids)
        splits[name]["documents"] = len(docs)
        splits[name]["text_bytes"] = sum(len(t.encode()) for _, t in docs)
    print(f"tokenized ({time.perf_counter() - t0:.0f} s)", flush=True)
    manifest = {
        "what": "fp4_train.experiments.build_corpus",
        "sources": stats,
        "filters": {"min_doc_bytes": MIN_DOC_BYTES, "min_letter_share": MIN_LETTER_SHARE,
                    "val_per_10000": VAL_PER_10000,
                    "html_content": [list(c) for c in HTML_CONTENT]},
        "tokenizer": {"file": tok_path.name, "sha256": sha256_file(tok_path),
                      "bytes": tok_path.stat().st_size, "kind": "byte-level BPE",
                      "vocab_size": tok.get_vocab_size(), "eot": EOT,
                      "eot_id": tok.token_to_id(EOT), "min_frequency": MIN_FREQUENCY,
                      "tokenizers_version": tokenizers.__version__},
        "dtype": "uint16 little-endian",
        "splits": splits,
    }  # fmt: skip
    (out / "manifest.json").write_text(_dumps(manifest))
    if slice_dir is not None:
        # the same manifest, its splits those of the slice; the corpus's under "slice_of"
        sliced = dict(manifest, splits=write_slice(slice_dir, tok, train, val, slice_tokens))
        sliced["slice_of"] = {"package": SLICE_PACKAGE, "licence": _source(SLICE_PACKAGE).licence,
                              "splits": splits}  # fmt: skip
        tok.save(str(slice_dir / "tokenizer.json"))
        (slice_dir / "manifest.json").write_text(_dumps(sliced))
        if SLICE_PACKAGE == "python3.11-doc":
            write_slice_notice(slice_dir)
    return manifest


#: the manifest of the corpus the study's runs trained on (docs/tp_training.md, Results)
STUDY_MANIFEST = Path(__file__).parent / "data" / "corpus_manifest.json"


def compare_with_study(manifest: dict, study: dict) -> list[str]:
    """Lines saying whether ``manifest`` describes the same token files as the study's corpus
    (``STUDY_MANIFEST``) and, where not, which package versions differ: a runs' losses compare
    only on the same tokens."""
    ours, theirs = manifest["splits"], study["splits"]
    if all(ours[s]["sha256"] == theirs[s]["sha256"] for s in theirs) and (
            manifest["tokenizer"]["sha256"] == study["tokenizer"]["sha256"]):  # fmt: skip
        return ["the same token files and vocabulary as the study's corpus"]
    lines = ["NOT the study's corpus: its losses do not compare with the study's runs"]
    for name, src in study["sources"].items():
        got = manifest["sources"].get(name, {}).get("version")
        if got != src["version"]:
            lines.append(f"  {name}: {got} installed, the study's corpus used {src['version']} "
                         "(apt-get update, then install that version)")  # fmt: skip
    return lines


def _dumps(obj):
    s = io.StringIO()
    json.dump(obj, s, indent=1, sort_keys=True)
    return s.getvalue() + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(".data/corpus"))
    ap.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    ap.add_argument("--slice", type=Path, default=None, help="also write the CI slice here")
    ap.add_argument("--slice-tokens", type=int, default=96 * 1024)
    args = ap.parse_args(argv)
    if not 257 <= args.vocab_size <= 65536:
        ap.error(f"--vocab-size {args.vocab_size}: 257..65536 (byte alphabet + 1, uint16 ids)")
    if args.slice_tokens < 1:
        ap.error(f"--slice-tokens {args.slice_tokens}: at least 1")
    if args.slice is not None and args.slice.resolve() == args.out.resolve():
        ap.error(f"--slice {args.slice}: a folder other than --out (the slice's files would "
                 "replace the corpus's)")  # fmt: skip
    for option, folder in (("--out", args.out), ("--slice", args.slice)):
        if folder is not None and folder.exists() and not folder.is_dir():
            ap.error(f"{option} {folder}: exists and is not a folder")
    m = build(args.out, args.vocab_size, args.slice, args.slice_tokens)
    for name, s in m["splits"].items():
        print(f"{name}: {s['documents']} documents, {s['text_bytes'] / 1e6:.1f} MB text, "
              f"{s['tokens']} tokens, {s['xz']['bytes'] / 2**20:.2f} MiB xz")  # fmt: skip
    if args.vocab_size == VOCAB_SIZE:
        print("\n".join(compare_with_study(m, json.loads(STUDY_MANIFEST.read_text()))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
