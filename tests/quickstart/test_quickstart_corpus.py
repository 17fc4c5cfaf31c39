"""Which pre-training text a run reads: the large corpus's budget-sized prefix beside the
bundled sample when one is built, the bundled sample otherwise (no training here)."""

import json

import pytest

from astrai.dataset.corpus import BUILD_VERSION
from astrai.errors import ConfigError
from astrai.quickstart.from_scratch import CORPUS_BYTES_PER_MINUTE, DATA_DIR, Quickstart, Settings


def fake_corpus(root, documents=400):
    root.mkdir()
    lines = [json.dumps({"text": f"document {i} " + "word " * 200, "lang": "en", "source": "test"}) + "\n"
             for i in range(documents)]
    (root / "train.jsonl").write_text("".join(lines))
    for lang in ("en", "zh"):
        (root / f"valid_{lang}.jsonl").write_text(json.dumps({"text": "held out " * 20, "lang": lang}) + "\n")
    (root / "manifest.json").write_text(json.dumps({"version": BUILD_VERSION}))
    return root


def test_a_built_corpus_is_read_up_to_the_budget_beside_the_bundled_sample(tmp_path):
    corpus = fake_corpus(tmp_path / "corpus")
    minutes = 0.1  # 150 kB of a 400 kB corpus
    qs = Quickstart(Settings(out=str(tmp_path / "run"), minutes=minutes, corpus=str(corpus), pretrain_arithmetic=0))
    qs.stage_corpus()
    record = qs.corpus
    prefix = tmp_path / "run" / "data" / "corpus_train.jsonl"
    assert record["kind"] == "large" and record["train"] == [str(prefix), str(DATA_DIR / "pretrain" / "train.jsonl")]
    taken = prefix.read_text().splitlines()
    assert record["bytes"] == prefix.stat().st_size <= minutes * CORPUS_BYTES_PER_MINUTE
    assert taken == (corpus / "train.jsonl").read_text().splitlines()[:len(taken)] and 0 < len(taken) < 400
    assert set(qs.heldout()) == {"en", "zh", "corpus-en", "corpus-zh"}
    # a resumed run reads the same choice back
    again = Quickstart(Settings(out=str(tmp_path / "run"), corpus="bundled"))
    again.stage_corpus()
    assert again.corpus == record


def test_bundled_or_unbuilt(tmp_path):
    qs = Quickstart(Settings(out=str(tmp_path / "a"), corpus="bundled", pretrain_arithmetic=0))
    qs.stage_corpus()
    assert qs.corpus["kind"] == "bundled" and set(qs.heldout()) == {"en", "zh"}
    with pytest.raises(ConfigError, match="not a built corpus"):
        Quickstart(Settings(out=str(tmp_path / "b"), corpus=str(tmp_path / "nothing"))).stage_corpus()
