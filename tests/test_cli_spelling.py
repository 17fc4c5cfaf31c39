"""Every long flag of the `astrai` command works with dashes and with underscores."""

from __future__ import annotations

import json

import pytest

from astrai.cli import build_parser, either_spelling, known_options, main


def _parse(verb: str, argv: list[str]):
    parser = build_parser(verb)
    return parser.parse_args(either_spelling([verb, *argv], known_options(parser)))


def test_training_flags_take_dashes_and_serving_flags_take_underscores():
    args = _parse("train", ["--batch-per-device", "3", "--grad-accum-steps=2", "--max_lr", "0.01"])
    assert (args.batch_per_device, args.grad_accum_steps, args.max_lr) == (3, 2, 0.01)
    args = _parse("generate", ["--model", "m", "--max_tokens", "5", "--top_p=0.5", "--prompt", "hi"])
    assert (args.max_tokens, args.top_p, args.prompt) == (5, 0.5, ["hi"])
    args = _parse("serve", ["--model", "m", "--max_batch_size", "8"])
    assert args.max_batch_size == 8


def test_only_unknown_spellings_are_rewritten_and_nothing_after_a_double_dash():
    known = {"--max-tokens", "--max_lr", "--x_y", "--x-y"}
    assert either_spelling(["--max_tokens", "1", "--max-lr=2", "--x_y", "--x-y", "--nope_no", "--", "--max_tokens"],
                           known) == ["--max-tokens", "1", "--max_lr=2", "--x_y", "--x-y", "--nope_no", "--", "--max_tokens"]


def test_main_accepts_the_other_spelling_end_to_end(tmp_path, capsys):
    out = tmp_path / "model"
    assert main(["model", "create", "--preset", "tiny", "--vocab-size", "300", "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 300
    with pytest.raises(SystemExit) as exit_info:  # a misspelled flag still gets argparse's own message
        main(["model", "create", "--preset", "tiny", "--vocab-sise", "300", "--out", str(out)])
    assert exit_info.value.code == 2 and "unrecognized arguments: --vocab-sise" in capsys.readouterr().err
