"""`astrai VERB --help` and a mistyped flag answer before anything heavy loads.

The precise guard is the import check: building any verb's parser leaves torch, FastAPI,
transformers and tokenizers out of ``sys.modules``. The timings are a regression guard
with a generous bound (each answers in about 0.05 s on a quiet 2-core machine, against
2.4-2.8 s when the flags imported torch), not a benchmark.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from astrai.cli import VERBS, main

HEAVY = ("torch", "fastapi", "transformers", "tokenizers", "uvicorn")


def test_no_verb_parser_imports_anything_heavy():
    code = ("import json, sys\n"
            "from astrai.cli import VERBS, build_parser\n"
            "for verb in VERBS:\n"
            "    build_parser(verb)\n"
            f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []


@pytest.mark.parametrize("verb", [None, *VERBS])
def test_help_answers_quickly(verb):
    argv = [sys.executable, "-m", "astrai", *([verb] if verb else []), "--help"]
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    elapsed = time.perf_counter() - start
    assert done.returncode == 0 and "usage: astrai" in done.stdout, done.stderr
    assert elapsed < 1.5, f"astrai {verb or ''} --help took {elapsed:.2f} s"


def test_the_flags_spell_out_the_choices_the_code_defines():
    from astrai.commands import engine, serve, tokenizer
    from astrai.inference import speculative
    from astrai.inference.placement import DTYPE_CHOICES
    from astrai.serving.application import DEFAULT_MAX_BODY_BYTES
    from astrai.serving.launch import API_KEY_ENV
    from astrai.model.quantized import FORMATS
    from astrai.tokenize.training import SPECIAL_TOKENS

    assert sorted(engine.DTYPE_CHOICES) == sorted(DTYPE_CHOICES)
    assert engine.QUANTIZATION_FORMATS == tuple(FORMATS)
    assert tokenizer.SPECIAL_TOKENS == SPECIAL_TOKENS
    assert (serve.API_KEY_ENV, serve.DEFAULT_MAX_BODY_BYTES) == (API_KEY_ENV, DEFAULT_MAX_BODY_BYTES)
    assert (engine.SPECULATIVE_METHODS, engine.DEFAULT_DRAFT_TOKENS, engine.MAX_DRAFT_TOKENS) == (
        speculative.SPECULATIVE_METHODS, speculative.DEFAULT_DRAFT_TOKENS, speculative.MAX_DRAFT_TOKENS)


@pytest.mark.parametrize("argv,usage,word,hint", [
    (["generate", "--model", "m", "--max-tokns", "3"], "usage: astrai generate", "--max-tokns", "--max-tokens"),
    (["generate", "--model", "m", "--max_tokns=3"], "usage: astrai generate", "--max_tokns=3", "--max-tokens"),
    (["model", "create", "--out", "m", "--vocab-sise", "300"], "usage: astrai model create", "--vocab-sise",
     "--vocab_size"),
    (["train", "--max_stesp", "3"], "usage: astrai train", "--max_stesp", "--max_steps"),
])
def test_a_mistyped_flag_gets_the_verbs_usage_and_the_closest_flag(argv, usage, word, hint, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith(usage)
    assert f"unrecognized arguments: {word}" in err and f"did you mean {hint}?" in err


def test_a_word_far_from_every_flag_gets_no_guess(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--model", "m", "--zzzzzz"])
    err = capsys.readouterr().err
    assert err.startswith("usage: astrai serve") and "unrecognized arguments: --zzzzzz" in err and "did you mean" not in err


def test_a_mistyped_verb_gets_the_closest_verb(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generat", "--model", "m"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("usage: astrai")
    assert "unknown verb 'generat' (did you mean generate?)" in err
