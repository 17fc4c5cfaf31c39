"""`astrai generate` prints what a terminal user expects: streamed text by default, JSON lines
on request, timings with --verbose, and the same text on every run of a model that carries no
sampling settings of its own."""

from __future__ import annotations

import io
import json

import pytest
import torch

from astrai.cli import main
from astrai.config import preset
from astrai.dataset.records import RecordEncoder
from astrai.inference import InferenceEngine
from astrai.model import AutoModel

PROMPT = "The cat sat on"


@pytest.fixture(scope="module")
def model_dir(tokenizer, tmp_path_factory):
    torch.manual_seed(3)
    model = AutoModel.from_config(preset("tiny", vocab_size=tokenizer.vocab_size, n_layers=2, dim=64, n_heads=4,
                                         n_kv_heads=2, dim_ffn=128, max_len=256))
    path = tmp_path_factory.mktemp("generate_cli") / "final"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def engine_text(model_dir, **sampling) -> str:
    with InferenceEngine.from_pretrained(model_dir, max_batch_size=1, num_pages=32) as engine:
        return engine.generate(PROMPT, **sampling)


class Writes(io.StringIO):
    """stdout that remembers each write, to tell streamed text from text written at the end."""

    def __init__(self):
        super().__init__()
        self.pieces: list[str] = []

    def write(self, text: str) -> int:
        self.pieces.append(text)
        return super().write(text)


def run_cli(argv, monkeypatch, verb: str = "generate") -> Writes:
    out = Writes()
    monkeypatch.setattr("sys.stdout", out)
    assert main([verb, *argv]) == 0
    return out


@pytest.mark.timeout(120)
def test_text_streams_by_default_and_json_gives_the_json_line(model_dir, monkeypatch, capsys):
    streamed = run_cli(["--model", str(model_dir), "--prompt", PROMPT, "--max-tokens", "12"], monkeypatch)
    row = json.loads(run_cli(["--model", str(model_dir), "--prompt", PROMPT, "--max-tokens", "12", "--json"],
                              monkeypatch).getvalue())
    assert set(row) == {"index", "prompt", "text", "finish_reason", "prompt_tokens", "completion_tokens"}
    assert row["text"] and streamed.getvalue() == row["text"] + "\n"
    assert len([p for p in streamed.pieces if p.strip()]) > 1  # written piece by piece as tokens arrived
    assert capsys.readouterr().err == ""


@pytest.mark.timeout(120)
def test_greedy_without_generation_config(model_dir, monkeypatch):
    first = run_cli(["--model", str(model_dir), "--prompt", PROMPT, "--max-tokens", "16"], monkeypatch).getvalue()
    again = run_cli(["--model", str(model_dir), "--prompt", PROMPT, "--max-tokens", "16"], monkeypatch).getvalue()
    assert first == again == engine_text(model_dir, max_tokens=16, temperature=0.0) + "\n"


@pytest.mark.timeout(120)
def test_generation_config_sets_the_sampling(model_dir, tmp_path, monkeypatch):
    sampled = tmp_path / "sampled"
    sampled.mkdir()
    for item in model_dir.iterdir():
        (sampled / item.name).write_bytes(item.read_bytes())
    (sampled / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 1.5, "top_k": 50, "max_new_tokens": 20}))
    out = run_cli(["--model", str(sampled), "--prompt", PROMPT, "--seed", "7", "--json"], monkeypatch)
    row = json.loads(out.getvalue())
    reference = engine_text(sampled, seed=7)  # the engine's own defaults: read from generation_config.json
    assert row["text"] == reference and row["completion_tokens"] <= 20
    assert reference != engine_text(model_dir, max_tokens=20, temperature=0.0)


@pytest.mark.timeout(120)
def test_verbose_times_each_completion_on_stderr(model_dir, monkeypatch, capsys):
    out = run_cli(["--model", str(model_dir), "--prompt", PROMPT, "--prompt", "hello", "--max-tokens", "8",
                    "--verbose"], monkeypatch)
    err = capsys.readouterr().err
    assert out.getvalue().startswith("--- 1/2 ---\n") and "--- 2/2 ---\n" in out.getvalue()
    assert err.count("time to first token") == 2 and "tokens/s" in err


@pytest.mark.timeout(120)
def test_chat_is_greedy_without_generation_config(model_dir, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
    out = run_cli(["--model", str(model_dir), "--max-tokens", "10"], monkeypatch, verb="chat")
    with InferenceEngine.from_pretrained(model_dir, max_batch_size=1, num_pages=32) as engine:
        reply = engine.generate([{"role": "user", "content": "hi"}], max_tokens=10, temperature=0.0)
    assert out.getvalue() == f"assistant> {reply}\n"



@pytest.mark.timeout(120)
def test_output_writes_the_json_lines_and_says_where(model_dir, tmp_path, monkeypatch, capsys):
    path = tmp_path / "out.jsonl"
    out = run_cli(["--model", str(model_dir), "--prompt", PROMPT, "--prompt", "hello", "--max-tokens", "4",
                   "--output", str(path)], monkeypatch)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert out.getvalue() == "" and [r["index"] for r in rows] == [0, 1]
    assert capsys.readouterr().err.splitlines()[-1] == f"wrote {path}: 2 completion(s) as JSON lines"


@pytest.mark.timeout(120)
def test_speculative_flags_keep_the_text_and_refuse_what_cannot_run(model_dir, monkeypatch, capsys):
    """--speculative ngram and --draft-model (the model drafting for itself) give the plain greedy
    text; --speculative draft without a drafter, or a draft length past the limit, is one error line."""
    repeat = "the cat sat on the mat, the cat sat on the mat, the cat sat on the"
    plain = run_cli(["--model", str(model_dir), "--prompt", repeat, "--max-tokens", "24"], monkeypatch).getvalue()
    for flags in (["--speculative", "ngram"], ["--draft-model", str(model_dir), "--draft-tokens", "3"]):
        got = run_cli(["--model", str(model_dir), "--prompt", repeat, "--max-tokens", "24", *flags], monkeypatch)
        assert got.getvalue() == plain
    capsys.readouterr()
    for flags, message in ((["--speculative", "draft"], "needs a drafter"),
                           (["--speculative", "ngram", "--draft-tokens", "9"], "draft_tokens must be an integer from 1 to 7")):
        assert main(["generate", "--model", str(model_dir), "--prompt", "hi", *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith("astrai generate: error:") and message in err and "Traceback" not in err


@pytest.mark.timeout(120)
def test_a_quantized_target_drafts_with_its_own_weights_saved_in_another_format(model_dir, tmp_path, monkeypatch):
    """An int8 target with --draft-model on its int4 copy (`astrai model quantize`): the draft opens
    in its own format, and the text is the int8 target's."""
    assert main(["model", "quantize", str(model_dir), "--to", "int4", "--out", str(tmp_path / "int4"),
                 "--calibration", "none"]) == 0
    repeat = "the cat sat on the mat, the cat sat on the mat, the cat sat on the"
    args = ["--model", str(model_dir), "--prompt", repeat, "--max-tokens", "24", "--quantize", "int8"]
    plain = run_cli(args, monkeypatch).getvalue()
    assert run_cli(args + ["--draft-model", str(tmp_path / "int4")], monkeypatch).getvalue() == plain
    with InferenceEngine.from_pretrained(model_dir, quantize="int8", draft_model=str(tmp_path / "int4"),
                                         max_batch_size=1, num_pages=32) as engine:
        engine.generate(repeat, max_tokens=24, temperature=0.0)
        assert engine.scheduler._drafter.runner.model.quantization["format"] == "int4"
        assert engine.get_stats()["speculative"]["drafted_tokens"] > 0


@pytest.mark.timeout(120)
def test_sft_records_answer_each_chats_last_user_turn(model_dir, tokenizer, tmp_path, monkeypatch, capsys):
    """--sft-records writes what `astrai preprocess --train_type sft` reads: each chat up to its
    last user turn with the model's reply as the assistant's; a plain prompt is asked as a user turn."""
    chat = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"},
            {"role": "user", "content": PROMPT}, {"role": "assistant", "content": "a human's answer"}]
    source = tmp_path / "chats.jsonl"
    source.write_text(json.dumps({"messages": chat}) + "\n" + json.dumps({"prompt": PROMPT}) + "\n")
    path = tmp_path / "replies.jsonl"
    run_cli(["--model", str(model_dir), "--input", str(source), "--max-tokens", "6", "--sft-records", "--output",
             str(path)], monkeypatch)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    with InferenceEngine.from_pretrained(model_dir, max_batch_size=1, num_pages=32) as engine:
        reply = engine.generate(chat[:3], max_tokens=6, temperature=0.0)
        response = engine.generate([{"role": "user", "content": PROMPT}], max_tokens=6, temperature=0.0)
    assert rows == [{"messages": chat[:3] + [{"role": "assistant", "content": reply}]},
                    {"messages": [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": response}]}]
    encoder = RecordEncoder(tokenizer, "sft")
    for row in rows:  # SFT records as the preprocessor reads them
        pieces, build = encoder.prepare(row)
        ids, mask = build(encoder.encode_pieces(pieces))
        assert len(ids) == len(mask) and mask.sum() > 0  # the reply is what is learned
    assert capsys.readouterr().err.splitlines()[-1] == f"wrote {path}: 2 completion(s) as SFT records"
    source.write_text(json.dumps({"messages": [{"role": "system", "content": "be brief"}]}) + "\n")
    assert main(["generate", "--model", str(model_dir), "--input", str(source), "--sft-records"]) == 2
    assert "these messages have none" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_an_input_longer_than_the_engines_queue_waits_for_room(model_dir, tmp_path, monkeypatch):
    """Every line of a long file is answered: when the engine's queue is full, generate waits for
    the oldest request instead of failing with the queue's 'retry later'."""
    import astrai.inference.cli as cli

    build = cli.build_engine
    monkeypatch.setattr(cli, "build_engine", lambda args: _with_queue(build(args), 2))
    source = tmp_path / "many.jsonl"
    source.write_text("".join(json.dumps({"prompt": f"{PROMPT} {i}"}) + "\n" for i in range(7)))
    out = run_cli(["--model", str(model_dir), "--input", str(source), "--max-tokens", "3", "--json"], monkeypatch)
    assert [json.loads(line)["index"] for line in out.getvalue().splitlines()] == list(range(7))


def _with_queue(engine, size: int):
    engine.scheduler.max_queue = size
    return engine
