"""The BPE corpus: build_corpus's filters, split and token files on a small synthetic package
tree (built twice: the same bytes), the loader against a build and against the shipped CI
slice, and the errors for missing or damaged files."""

import json
import lzma
from pathlib import Path

import numpy as np
import pytest
import torch

from fp4_train.experiments import build_corpus, corpus

tokenizers = pytest.importorskip("tokenizers")

PROSE = (
    "The quick brown fox jumps over the lazy dog. A tensor holds numbers in a grid, and a "
    "collective moves them between the ranks of a group. "
)


def test_clean_drops_decoration_and_blank_runs():
    text = "Title\r\n=====\r\n\r\n\r\n\r\nBody text   \n-----\n~~~\n:: code\n"
    assert build_corpus.clean(text) == "Title\n\nBody text\n:: code\n"


def test_keep_needs_length_and_letters():
    assert build_corpus.keep(PROSE * 3)
    assert not build_corpus.keep(PROSE[:100])
    assert not build_corpus.keep("0x1234 5678 9abc, " * 40)


def test_html_text_is_the_content_element_only():
    page = (
        "<html><head><title>T</title><style>p {}</style></head><body>"
        "<div class='navheader'>Prev Next</div>"
        "<div class='sect1'><h2>Heading</h2><p>Some   words\n across lines.</p>"
        "<div class='inner'><pre>  indented\n    code</pre></div><script>x=1</script></div>"
        "<div class='navfooter'>Home</div></body></html>"
    )
    text = build_corpus.clean(build_corpus.html_text(page))
    assert text == "Heading\n\nSome words across lines.\n\n  indented\n    code\n"


def test_split_is_by_document_name_and_stable():
    names = [f"pkg/doc{i}.rst" for i in range(2000)]
    val = [n for n in names if build_corpus.is_validation(n)]
    assert 20 <= len(val) <= 80  # 2 %
    assert val == [n for n in names if build_corpus.is_validation(n)]


def _fake_tree(root: Path):
    """Two fake packages: reStructuredText (one .gz) and HTML pages."""
    rng = np.random.default_rng(0)
    words = PROSE.split()
    a = root / "a"
    (a / "sub").mkdir(parents=True)
    for i in range(30):
        body = " ".join(rng.choice(words, 120))
        (a / f"doc{i:02d}.rst").write_text(f"Doc {i}\n======\n\n{body}\n")
    import gzip

    (a / "sub" / "zipped.rst.gz").write_bytes(gzip.compress(("Zipped\n\n" + PROSE * 4).encode()))
    (a / "tiny.rst").write_text("too short\n")
    (a / "latin1.rst").write_bytes(("caf\xe9 " * 100).encode("latin-1"))
    b = root / "b"
    b.mkdir()
    for i in range(10):
        body = " ".join(rng.choice(words, 80))
        (b / f"page{i}.html").write_text(f"<div class='navheader'>x</div><div class='sect1'>"
                                         f"<p>{body}</p></div>")  # fmt: skip
    (b / "skipme.html").write_text("<div class='sect1'>" + PROSE * 5 + "</div>")
    return (
        build_corpus.Source("pkg-a", str(a), ("**/*.rst", "**/*.rst.gz"), "text", "MIT"),
        build_corpus.Source("pkg-b", str(b), ("*.html",), "html", "MIT", ("skipme",)),
    )


@pytest.fixture
def built(tmp_path, monkeypatch):
    sources = _fake_tree(tmp_path / "tree")
    monkeypatch.setattr(build_corpus, "package_version", lambda p: "1.0-test")
    monkeypatch.setattr(build_corpus, "SLICE_PACKAGE", "pkg-a")
    monkeypatch.setattr(build_corpus, "SOURCES", sources)
    out = tmp_path / "out"
    m = build_corpus.build(out, vocab_size=300, slice_dir=tmp_path / "slice", slice_tokens=2000,
                           sources=sources)  # fmt: skip
    return out, m, sources, tmp_path


def test_build_counts_filters_and_is_deterministic(built):
    out, m, sources, tmp_path = built
    a = m["sources"]["pkg-a"]
    assert (a["files"], a["not_utf8"], a["dropped"], a["documents"]) == (33, 1, 1, 31)
    assert m["sources"]["pkg-b"]["files"] == 10  # skipme.html excluded
    assert m["splits"]["train"]["documents"] + m["splits"]["val"]["documents"] == 41
    assert m["tokenizer"]["vocab_size"] == 300 and m["tokenizer"]["eot_id"] == 0
    again = build_corpus.build(tmp_path / "again", vocab_size=300, sources=sources)
    for split in ("train", "val"):
        assert again["splits"][split]["sha256"] == m["splits"][split]["sha256"]
        assert again["splits"][split]["xz"]["sha256"] == m["splits"][split]["xz"]["sha256"]
    assert again["tokenizer"]["sha256"] == m["tokenizer"]["sha256"]


def test_load_tokens_reads_a_build_and_its_xz_copies(built):
    out, m, _, _ = built
    c = corpus.load_tokens(out)
    assert c.train.dtype == torch.int64 and c.train.numel() == m["splits"]["train"]["tokens"]
    assert int(c.train.max()) < c.vocab_size == 300
    # every document ends with <|endoftext|>: as many as documents
    assert int((c.train == c.eot_id).sum()) == m["splits"]["train"]["documents"]
    tok = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    first = c.train[: int((c.train == 0).nonzero()[0])].tolist()
    assert tok.decode(first).startswith("Doc ")
    for split in ("train", "val"):
        (out / f"{split}.bin").unlink()
    again = corpus.load_tokens(out)
    assert torch.equal(again.train, c.train) and torch.equal(again.val, c.val)


def test_load_tokens_rejects_damaged_files(built):
    out, _, _, _ = built
    raw = bytearray((out / "train.bin").read_bytes())
    raw[0] ^= 1
    (out / "train.bin").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="sha256"):
        corpus.load_tokens(out)
    assert int(corpus.load_tokens(out, verify=False).train[0]) == raw[0] | raw[1] << 8
    (out / "train.bin").write_bytes(bytes(raw[:-2]))
    with pytest.raises(ValueError, match="cut"):
        corpus.load_tokens(out, verify=False)
    with pytest.raises(FileNotFoundError, match="build_corpus"):
        corpus.load_tokens(out / "nowhere")


def test_the_slice_of_a_build(built):
    _, m, _, tmp_path = built
    s = corpus.load_tokens(tmp_path / "slice")
    assert 0 < s.train.numel() <= 2000 and s.val.numel() <= 500
    sliced = json.loads((tmp_path / "slice" / "manifest.json").read_text())
    assert sliced["slice_of"]["splits"]["train"]["sha256"] == m["splits"]["train"]["sha256"]


def test_the_shipped_ci_slice():
    c = corpus.load_tokens(corpus.CI_SLICE)
    m = c.manifest
    assert c.vocab_size == m["tokenizer"]["vocab_size"] == build_corpus.VOCAB_SIZE
    assert c.train.numel() > 50_000 and c.val.numel() > 10_000
    assert int(c.train.max()) < c.vocab_size
    tok = tokenizers.Tokenizer.from_file(str(corpus.CI_SLICE / "tokenizer.json"))
    assert tok.get_vocab_size() == c.vocab_size
    text = tok.decode(c.val[:400].tolist())
    assert sum(ch.isalpha() for ch in text) > 0.5 * len(text)  # English words
    x, y = corpus.train_batch(c.train, step=3, batch=4, seq_len=128, seed=1)
    assert x.shape == y.shape == (128, 4) and torch.equal(x[1:], y[:-1])
    notice = (corpus.CI_SLICE / "NOTICE").read_text()
    assert "Python Software Foundation" in notice and "LICENSE VERSION 2" in notice
    # the tokenizer file is the corpus's own (the manifest's sha256)
    assert build_corpus.sha256_file(corpus.CI_SLICE / "tokenizer.json") == m["tokenizer"]["sha256"]


def test_xz_copy_is_the_same_bytes(built):
    out, _, _, _ = built
    assert lzma.decompress((out / "train.bin.xz").read_bytes()) == (out / "train.bin").read_bytes()


def test_compare_with_study_names_the_versions_that_differ():
    study = json.loads(build_corpus.STUDY_MANIFEST.read_text())
    same = json.loads(json.dumps(study))
    assert build_corpus.compare_with_study(same, study) == [
        "the same token files and vocabulary as the study's corpus"
    ]
    other = json.loads(json.dumps(study))
    other["splits"]["val"]["sha256"] = "0" * 64
    other["sources"]["perl-doc"]["version"] = "5.36.0-7+deb12u3"
    lines = build_corpus.compare_with_study(other, study)
    assert lines[0].startswith("NOT the study's corpus")
    assert len(lines) == 2 and "perl-doc: 5.36.0-7+deb12u3 installed" in lines[1]
    assert study["sources"]["perl-doc"]["version"] in lines[1]
