"""bench/chat_workload.py: the conversations it builds, the figures it reports, and one run of its
client against astrai's real server (the tiny random model of this folder's fixtures)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from server_helpers import MODEL_NAME

from astrai.errors import ConfigError

sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))  # the benchmarks import each other by name

from chat_workload import build_conversations, bundled_exchanges, run_conversations, summarize  # noqa: E402
from llamacpp_tools import resident_memory  # noqa: E402

SLOT, NEW = 512, 8


@pytest.fixture(scope="module")
def conversations(tokenizer):
    return build_conversations(tokenizer, users=3, turns=4, slot_tokens=SLOT, new_tokens=NEW, seed=5)


def test_the_same_seed_builds_the_same_conversations_and_another_seed_others(tokenizer, conversations):
    assert build_conversations(tokenizer, users=3, turns=4, slot_tokens=SLOT, new_tokens=NEW, seed=5) == conversations
    assert build_conversations(tokenizer, users=3, turns=4, slot_tokens=SLOT, new_tokens=NEW, seed=6) != conversations
    assert len(conversations) == 3 and all(len(prompts) == 4 for prompts in conversations)


def test_each_turn_extends_the_last_one_and_the_last_fits_its_slot_with_the_reply(conversations):
    for prompts in conversations:
        for earlier, later in zip(prompts, prompts[1:]):
            assert len(later) > len(earlier) and later[:len(earlier)] == earlier
        # the last turn lands between half the slot (less what one question can leave unused) and all of it
        assert SLOT // 2 * 0.8 <= len(prompts[-1]) <= SLOT - NEW, [len(p) for p in prompts]


def test_a_turn_asks_several_bundled_questions_and_the_history_keeps_their_bundled_answers(tokenizer):
    exchanges = [(f"question {i}", f"answer {i}") for i in range(50)]
    prompts = build_conversations(tokenizer, users=1, turns=2, slot_tokens=SLOT, new_tokens=NEW, seed=0,
                                  exchanges=exchanges)[0]
    second = tokenizer.decode(prompts[1], skip_special_tokens=False)
    # the last three messages before the assistant's opening (after a system prompt, if the template writes one)
    first_question, first_reply, second_question = (
        part.split("\n", 1)[1].split("<|im_end|>")[0] for part in second.split("<|im_start|>")[-4:-1])
    asked = [int(line.removeprefix("question ")) for line in first_question.split("\n")]
    assert len(asked) > 1 and first_reply.split("\n") == [f"answer {i}" for i in asked]
    assert all(line.startswith("question ") for line in second_question.split("\n"))
    assert bundled_exchanges()[0] == ("3+1=", "4")  # by default they come from data/sft/train.jsonl


class LongNewlines:
    """A character-level tokenizer whose newline is ten tokens: joined questions take more tokens than
    the builder's estimate (a question's tokens and one for its newline) counts."""

    def encode(self, text):
        return [self.encode(t) for t in text] if isinstance(text, list) else [ord(c) for c in text.replace("\n", "\n" * 10)]

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        return self.encode("".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>")


def test_prompts_fit_the_slot_where_the_tokenizer_outgrows_the_estimate():
    exchanges = [("q" * 20, "a" * 20)] * 10
    for user in build_conversations(LongNewlines(), users=2, turns=3, slot_tokens=SLOT, new_tokens=NEW,
                                    last_turn_tokens=(SLOT - NEW, SLOT - NEW), exchanges=exchanges):
        assert SLOT - NEW - 40 <= len(user[-1]) <= SLOT - NEW, [len(p) for p in user]


def test_a_slot_too_small_for_the_history_is_refused_clearly(tokenizer):
    with pytest.raises(ConfigError, match="history alone needs"):
        build_conversations(tokenizer, users=1, turns=2, slot_tokens=64, new_tokens=NEW,
                            exchanges=[("a question", "a long answer " * 30)])
    with pytest.raises(ConfigError, match="slot less the reply"):
        build_conversations(tokenizer, users=1, turns=2, slot_tokens=64, new_tokens=NEW, last_turn_tokens=(64, 64))


def test_summary_counts_generated_tokens_over_the_wall_time_and_takes_percentiles():
    turns = [{"turn": i % 2, "prompt_tokens": 100, "ttft_s": float(i + 1), "done_s": 10.0 + i, "events": 9,
              "completion_tokens": 8 if i % 4 else None} for i in range(20)]
    got = summarize(turns)
    generated = 15 * 8 + 5 * 9  # the server's usage count where given, else the streamed events
    assert got["output_tokens"] == generated and got["fewest_tokens_in_a_reply"] == 8
    assert got["seconds"] == 29.0 and got["output_tok_s"] == pytest.approx(generated / 29.0)
    assert got["ttft_p50_s"] == pytest.approx(10.5) and got["ttft_p95_s"] == pytest.approx(19.05)
    assert got["ttft_p50_by_turn_s"] == [10.0, 11.0] and got["prompt_tokens"] == 2000
    assert got["turns_without_a_token"] == 0


def test_resident_memory_counts_the_process_and_its_children():
    alone = resident_memory(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        with_child = resident_memory(os.getpid())
    finally:
        child.communicate(b"")
    assert alone["processes"] == 1 and with_child["processes"] == 2
    assert 0 < alone["vm_rss_bytes"] <= alone["vm_hwm_bytes"]
    assert with_child["vm_rss_bytes"] > alone["vm_rss_bytes"] + 1_000_000  # a Python interpreter's few MB


def test_the_chat_client_runs_every_turn_against_the_server(server_url, tokenizer):
    conversations = build_conversations(tokenizer, users=2, turns=2, slot_tokens=SLOT, new_tokens=NEW, seed=1)
    got = run_conversations(server_url, MODEL_NAME, conversations, new_tokens=NEW)
    assert got["requests"] == 4 and got["output_tokens"] == 4 * NEW
    assert [r["completion_tokens"] for r in got["turn_records"]] == [NEW] * 4
    assert got["turns_without_a_token"] == 0 and len(got["ttft_p50_by_turn_s"]) == 2
    assert all(0 < r["ttft_s"] <= r["done_s"] - r["sent_s"] for r in got["turn_records"])
    assert got["prompt_tokens"] == sum(len(p) for prompts in conversations for p in prompts)
    # a user's second turn is sent only after its first reply has finished
    for user in range(2):
        first, second = sorted((r for r in got["turn_records"] if r["user"] == user), key=lambda r: r["turn"])
        assert second["sent_s"] >= first["done_s"]
