"""Build the bundled bilingual pre-training corpus in data/pretrain/ from Debian packages.

English: the World English Bible (public domain), Debian `sword-text-web`, read with
`diatheke`. Chinese: 300 Tang poems and 100 Song ci (public domain) plus a sample of
the `chinese` quotation collection (GPL-3.0+), Debian `fortunes-zh`.

Set-up (Debian/Ubuntu, as root):
    apt-get install -y diatheke sword-text-web fortunes-zh
    python scripts/build_corpus.py

Documents are one Bible chapter or one fortune entry each. A deterministic 5% of the
documents of each language are held out (valid_en.jsonl, valid_zh.jsonl). CI never
runs this: the output is committed.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
from pathlib import Path

FORTUNE_DIR = Path("/usr/share/games/fortunes")
VERSE = re.compile(r"^\s*(?P<book>[1-9A-Z][A-Za-z ]*?) (?P<chapter>\d+):\d+: ?(?P<text>.*)$")
MARKUP = re.compile(r"<[^>]*>")
SPACE_BEFORE_PUNCT = re.compile(r"\s+([,.;:!?’”)\]])")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def bible_chapters() -> list[str]:
    """One document per chapter, Strong's numbers and markup removed."""
    raw = subprocess.run(["diatheke", "-b", "engWEB2015eb", "-o", "n", "-f", "plain", "-k",
                          "Genesis 1:1-Revelation 22:21"], check=True, capture_output=True, text=True).stdout
    raw = raw.split("The following words used in the World English Bible")[0]
    chapters: dict[tuple[str, str], list[str]] = {}
    current = None
    for line in raw.splitlines():
        match = VERSE.match(line)
        if match:
            current = (match["book"], match["chapter"])
            line = match["text"]
        if current is not None:
            chapters.setdefault(current, []).append(line)
    docs = []
    for (book, chapter), lines in chapters.items():
        text = MARKUP.sub("", " ".join(lines))
        text = SPACE_BEFORE_PUNCT.sub(r"\1", re.sub(r"\s+", " ", text)).strip()
        docs.append(f"{book} {chapter}\n{text}")
    return docs


def fortune_entries(name: str) -> list[str]:
    """Entries of a fortune file (separated by lines holding '%'), colour codes removed."""
    text = ANSI.sub("", (FORTUNE_DIR / name).read_text(encoding="utf-8", errors="strict"))
    entries = [e.strip() for e in re.split(r"^%\s*$", text, flags=re.M)]
    return [e for e in entries if e]


def split(docs: list[str], rng: random.Random, valid_fraction: float) -> tuple[list[str], list[str]]:
    order = list(range(len(docs)))
    rng.shuffle(order)
    n_valid = max(1, round(len(docs) * valid_fraction))
    valid = set(order[:n_valid])
    return [d for i, d in enumerate(docs) if i not in valid], [d for i, d in enumerate(docs) if i in valid]


def take_budget(docs: list[str], budget_bytes: int) -> list[str]:
    """Every k-th document, k chosen so the sample fits the byte budget and spans the source."""
    total = sum(len(d.encode()) for d in docs)
    step = max(1, -(-total // budget_bytes))
    return docs[::step]


def write_jsonl(path: Path, records: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="data/pretrain")
    parser.add_argument("--en_bytes", type=int, default=1_200_000)
    parser.add_argument("--zh_bytes", type=int, default=900_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    english = [("web", d) for d in take_budget(bible_chapters(), args.en_bytes)]
    poems = [("tang300", d) for d in fortune_entries("tang300")] + [("song100", d) for d in fortune_entries("song100")]
    poem_bytes = sum(len(d.encode()) for _, d in poems)
    quotes = [("fortunes-zh", d) for d in take_budget(fortune_entries("chinese"), args.zh_bytes - poem_bytes)]
    chinese = poems + quotes

    train, valid = [], {}
    for lang, docs in (("en", english), ("zh", chinese)):
        doc_train, doc_valid = split([f"{s}\t{d}" for s, d in docs], rng, 0.05)
        as_record = lambda item: {"text": item.split("\t", 1)[1], "lang": lang, "source": item.split("\t", 1)[0]}
        train += [as_record(d) for d in doc_train]
        valid[lang] = [as_record(d) for d in doc_valid]
    rng.shuffle(train)
    write_jsonl(out / "train.jsonl", train)
    for lang, records in valid.items():
        write_jsonl(out / f"valid_{lang}.jsonl", records)
    for name in ("train.jsonl", "valid_en.jsonl", "valid_zh.jsonl"):
        path = out / name
        print(f"{path}: {sum(1 for _ in open(path, encoding='utf-8'))} documents, {path.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
