"""The large-corpus builder on a tiny fake package directory: each format is cleaned,
licences are recorded, held-out and excluded documents stay out of training, and a
second build is a no-op. Nothing is downloaded."""

import gzip
import json

import pytest

import astrai.dataset.corpus as corpus
from astrai.dataset.corpus import build_corpus, corpus_ready, troff_text

POEM = "\x1b[1;32m静夜思\x1b[0m\n床前明月光，疑是地上霜。举头望明月，低头思故乡。这是一首很有名的唐诗，人人都会背。"
MANPAGE = """.de Sh \\" Subsection
.PP
\\fB\\\\$1\\fR
..
.TH "LS" 1
.SH NAME
ls \\- 列出目录内容
.SH "描述 DESCRIPTION"
.PP
\\fBls\\fR 列出目录中的文件。默认情况下按字母顺序排列，并且只显示当前目录中的文件和子目录的名字。
"""
PAGE = """<html><head><title>帮助</title><script>var x = "脚本内容不应出现";</script></head><body>
<header>导航栏</header><p>这是帮助页面的第一段，说明如何插入表格以及如何设置表格的边框和颜色。</p>
<p>第二段介绍了筛选功能 &amp; 排序功能的用法，并给出了一些例子。</p></body></html>"""


def unpack(root, package, files):
    for relative, content in files.items():
        path = root / package / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        if relative.endswith(".gz"):
            path.write_bytes(gzip.compress(content.encode("utf-8")))
        else:
            path.write_text(content, encoding="utf-8")
    (root / package / ".astrai-version").write_text("1.0-test\n")


@pytest.fixture
def packages(tmp_path):
    root = tmp_path / "packages"
    jargon = "\n\n".join(f"hacker {i}: a person who enjoys exploring the details of programmable systems "
                         f"and stretching their capabilities, entry number {i}." for i in range(60))
    unpack(root, "jargon-text", {"usr/share/doc/jargon-text/jargon.txt.gz": jargon})
    unpack(root, "fortunes-zh", {"usr/share/games/fortunes/tang300": f"{POEM}\n%\n{POEM.replace('静夜思', '另一首')}\n%\n",
                                 "usr/share/games/fortunes/tang300.dat": "binary index, not text"})
    unpack(root, "manpages-zh", {"usr/share/man/zh_CN/man1/ls.1.gz": MANPAGE})
    unpack(root, "libreoffice-help-zh-cn", {"usr/share/libreoffice/help/zh-CN/text/shared/a.html": PAGE})
    unpack(root, "wordnet-base", {"usr/share/wordnet/data.noun":
                                  "  1 This software and database is being provided\n" + "".join(
                                      f"0000{i:04d} 03 n 01 word_{i} 0 000 | a gloss for word {i} that explains "
                                      f"its meaning in a few words\n" for i in range(80))})
    return root


def test_build_cleans_each_format_and_records_licences(tmp_path, packages, monkeypatch):
    monkeypatch.setattr(corpus, "HELDOUT_SHARE", 0.3)
    excluded = POEM.replace("静夜思", "另一首")
    messages = []
    out = build_corpus(tmp_path / "corpus", packages, download=False,
                       exclude={corpus._key(corpus.clean(corpus.fortune_entries(excluded)[0]))}, log=messages.append)
    assert corpus_ready(out)
    manifest = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    assert {s["name"] for s in manifest["sources"]} == {"jargon", "fortunes-zh", "manpages-zh", "libreoffice-help",
                                                        "wordnet"}
    assert all(s["licence"] and s["version"] == "1.0-test" for s in manifest["sources"])
    sources_md = (out / "SOURCES.md").read_text(encoding="utf-8")
    assert "MPL-2.0" in sources_md and "public domain" in sources_md and "WordNet" in sources_md
    assert any("python3.11-doc is not unpacked" in m for m in messages)  # a missing package is skipped, said so

    rows = {name: [json.loads(line) for line in (out / name).read_text(encoding="utf-8").splitlines()]
            for name in ("train.jsonl", "valid_en.jsonl", "valid_zh.jsonl")}
    everything = [r for records in rows.values() for r in records]
    texts = [r["text"] for r in everything]
    assert all(set(r) == {"text", "lang", "source"} for r in everything)
    held = {r["text"] for r in rows["valid_en.jsonl"] + rows["valid_zh.jsonl"]}
    assert held and not held & {r["text"] for r in rows["train.jsonl"]}  # held-out never trained on
    assert len(texts) == len(set(texts))
    poem = next(t for t in texts if "床前明月光" in t)
    assert "\x1b" not in poem and poem.startswith("静夜思")
    assert not any("另一首" in t for t in texts)  # the excluded document
    page = next(r["text"] for r in everything if r["source"] == "libreoffice-help")
    assert "第一段" in page and "筛选功能 & 排序功能" in page and "脚本" not in page and "导航栏" not in page
    man = next(r["text"] for r in everything if r["source"] == "manpages-zh")
    assert "ls 列出目录中的文件" in man and ".PP" not in man and "\\f" not in man and "Subsection" not in man
    gloss = next(r["text"] for r in everything if r["source"] == "wordnet")
    assert gloss.startswith("word ") and ": a gloss for word" in gloss and "software" not in gloss
    assert all(len(t) <= corpus.DOC_CHARS + 500 for t in texts)

    before = (out / "train.jsonl").stat().st_mtime_ns
    assert build_corpus(tmp_path / "corpus", packages, download=False, log=messages.append) == out
    assert (out / "train.jsonl").stat().st_mtime_ns == before and "built already" in messages[-1]


def test_nothing_readable_is_an_error_and_leaves_no_corpus(tmp_path):
    from astrai.errors import DataError

    with pytest.raises(DataError, match="no source could be read"):
        build_corpus(tmp_path / "corpus", tmp_path / "empty", download=False, log=lambda _: None)
    assert not corpus_ready(tmp_path / "corpus")


def test_troff_keeps_section_titles_and_font_requests_text_and_drops_the_rest():
    text = troff_text('.TH X 1\n.SH "名称 NAME"\nfoo \\- 做某事\n.B bold\n')
    assert "名称 NAME" in text and "foo - 做某事" in text and ".B" not in text and "bold" in text
