"""ROUGE against hand-computed values; instruction checks on hand-written answers."""

import json

import pytest

from astrai.errors import DataError
from astrai.eval.instructions import count_words, load_instructions, run_check, score_instructions
from astrai.eval.rouge import corpus_rouge, lcs_length, load_references, rouge_scores, rouge_tokens


def test_tokens_split_chinese_by_character_and_english_by_word():
    assert rouge_tokens("Hello, World! 你好世界") == ["hello", "world", "你", "好", "世", "界"]
    assert rouge_tokens("GPT4模型很小") == ["gpt4", "模", "型", "很", "小"]


def test_english_rouge_matches_hand_values():
    s = rouge_scores("the cat sat on the mat", "the cat is on the mat")
    # unigrams: the×2, cat, on, mat overlap = 5 of 6; bigrams: the-cat, on-the, the-mat = 3 of 5;
    # LCS: "the cat on the mat" = 5
    assert s["rouge1"]["f1"] == pytest.approx(5 / 6)
    assert s["rouge2"]["precision"] == pytest.approx(3 / 5) and s["rouge2"]["recall"] == pytest.approx(3 / 5)
    assert s["rougeL"]["f1"] == pytest.approx(5 / 6)


def test_chinese_rouge_matches_hand_values():
    s = rouge_scores("我喜欢猫", "我不喜欢狗")
    # characters: 我 喜 欢 shared → P 3/4, R 3/5; bigrams: 喜欢 shared → P 1/3, R 1/4; LCS 我喜欢 = 3
    assert s["rouge1"]["precision"] == pytest.approx(3 / 4) and s["rouge1"]["recall"] == pytest.approx(3 / 5)
    assert s["rouge1"]["f1"] == pytest.approx(2 / 3)
    assert s["rouge2"]["f1"] == pytest.approx(2 * (1 / 3) * (1 / 4) / (1 / 3 + 1 / 4))
    assert s["rougeL"]["f1"] == pytest.approx(2 / 3)


def test_best_reference_counts_and_corpus_mean():
    assert rouge_scores("paris is in france", ["london", "Paris is in France."])["rouge1"]["f1"] == 1.0
    assert lcs_length(list("abcbdab"), list("bdcaba")) == 4
    assert corpus_rouge(["a b", "x"], ["a b", "y"]) == {"rouge1": 0.5, "rouge2": 0.5, "rougeL": 0.5}


def test_instruction_checks_on_hand_written_answers():
    assert count_words("The sky is blue.") == 4 and count_words("天空是蓝色") == 5
    assert run_check("The sky is blue.", {"type": "word_count", "max": 5})
    assert not run_check("The sky is very very blue today.", {"type": "word_count", "max": 5})
    assert run_check("I am fine", {"type": "word_count", "min": 3, "max": 3})
    assert run_check("It is PARIS.", {"type": "include_keywords", "keywords": ["Paris"]})
    assert not run_check("It is Lyon.", {"type": "include_keywords", "keywords": ["Paris"]})
    assert not run_check("Maybe yes.", {"type": "exclude_keywords", "keywords": ["maybe"]})
    assert run_check("一年有十二个月。", {"type": "language", "language": "zh"})
    assert not run_check("Twelve months.", {"type": "language", "language": "zh"})
    assert run_check("Twelve months (十二).", {"type": "language", "language": "en"})
    assert not run_check("", {"type": "language", "language": "en"})
    assert run_check("  Yes, it is.", {"type": "starts_with", "prefix": "Yes"})
    assert run_check("Done. END ", {"type": "ends_with", "suffix": "END"})
    assert not run_check("x" * 11, {"type": "max_chars", "max": 10})


def test_bundled_instruction_sample_scores(bundled_eval):
    records = load_instructions(bundled_eval / "instructions_sample.jsonl")
    good = ["Blue.", "The capital is Paris.", "十二个月。", "Yes, water is wet.", "I am fine.", "我很好。"]
    result = score_instructions(records, good)
    assert result["prompt_accuracy"] == 1.0 and result["n"] == 6
    bad = ["The sky is a lovely shade of blue.", "Lyon.", "Twelve.", "maybe", "Fine.", "I am fine."]
    result = score_instructions(records, bad)
    assert result["prompt_accuracy"] == 0.0
    # of 8 checks only two pass: record 1 is English, and "I am fine." has at most 10 words
    assert result["check_accuracy"] == pytest.approx(2 / 8)
    assert result["by_type"]["word_count"] == pytest.approx(1 / 3)


def test_bad_eval_files_name_the_line(tmp_path):
    path = tmp_path / "checks.jsonl"
    path.write_text(json.dumps({"prompt": "x", "checks": [{"type": "word_count"}]}) + "\n"
                    + json.dumps({"prompt": "y", "checks": [{"type": "rhyme"}]}) + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"checks.jsonl:2: unknown check"):
        load_instructions(path)
    (tmp_path / "refs.jsonl").write_text('{"prompt": "x"}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"refs.jsonl:1: expected an object with a 'reference'"):
        load_references(tmp_path / "refs.jsonl")


@pytest.fixture
def bundled_eval():
    from pathlib import Path
    return Path(__file__).resolve().parents[2] / "data" / "eval"
