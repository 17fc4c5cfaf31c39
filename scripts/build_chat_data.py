"""Build the bundled SFT, DPO and GRPO files in data/ (sft/, dpo/, grpo/).

Sources:
- chatterbot-corpus 1.3.3 (PyPI, BSD licence, Gunther Cox): English and Simplified
  Chinese YAML conversations. Fetch and unpack it with
      pip download --no-deps chatterbot-corpus==1.3.3 -d /tmp/cb && unzip /tmp/cb/*.whl -d /tmp/cb
  then run  python scripts/build_chat_data.py --chatterbot /tmp/cb/chatterbot_corpus/data
- Generated here: arithmetic conversations (astrai.dataset.arithmetic) and bilingual
  templated arithmetic questions.

Preference pairs are built honestly, never invented as "human preferences": the
chosen answer is the corpus's (or the correct) answer, the rejected one is an answer
to a different question from the same corpus, or a wrong sum.
Needs PyYAML (build time only). The output is committed; CI never runs this.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import yaml

from astrai.dataset.arithmetic import make_problems, problem_messages, sft_conversation

MULTI_TURN_CATEGORIES = {"conversations", "greetings"}


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def chatterbot_conversations(root: Path, language: str) -> list[dict]:
    """Dialogue files become alternating multi-turn chats; Q&A files (where later
    items are alternative answers) become one question and its first answer."""
    records = []
    for path in sorted((root / language).glob("*.yml")):
        category = path.stem
        for turns in yaml.safe_load(path.read_text(encoding="utf-8"))["conversations"]:
            turns = [str(t).strip() for t in turns if str(t).strip()]
            if len(turns) < 2:
                continue
            if category not in MULTI_TURN_CATEGORIES:
                turns = turns[:2]
            turns = turns[: len(turns) // 2 * 2]
            messages = [user(t) if i % 2 == 0 else assistant(t) for i, t in enumerate(turns)]
            records.append({"messages": messages, "source": f"chatterbot-corpus/{language}/{category}"})
    return records


def templated_arithmetic(rng: random.Random, n: int) -> list[dict]:
    """The same sums asked in words, in English and Chinese."""
    records = []
    for problem in make_problems(n, seed=rng.randrange(1 << 30)):
        a, b, c = problem["a"], problem["b"], problem["answer"]
        if rng.random() < 0.5:
            question, answer = f"What is {a} plus {b}?", f"{a} plus {b} is {c}."
        else:
            question, answer = f"{a}加{b}等于几？", f"{a}加{b}等于{c}。"
        records.append({"messages": [user(question), assistant(answer)], "source": "generated/arithmetic-words"})
    return records


def preference_pairs(conversations: list[dict], rng: random.Random) -> list[dict]:
    """Chosen: the corpus's answer. Rejected: the answer to another question in the same language."""
    single = [c["messages"][:2] for c in conversations]
    pairs = []
    for i, (question, answer) in enumerate(single):
        other = single[rng.randrange(len(single))][1]
        if other["content"] == answer["content"]:
            continue
        pairs.append({"prompt": [question], "chosen": answer["content"], "rejected": other["content"],
                      "source": "chatterbot-corpus (rejected = answer to another question)"})
    return pairs


def arithmetic_pairs(rng: random.Random, n: int) -> list[dict]:
    """Chosen: the right sum. Rejected: a sum off by 1-3."""
    pairs = []
    for problem in make_problems(n, seed=rng.randrange(1 << 30)):
        right = int(problem["answer"])
        wrong = right + rng.choice([d for d in (-3, -2, -1, 1, 2, 3) if right + d >= 0])
        pairs.append({"prompt": problem_messages(problem), "chosen": str(right), "rejected": str(wrong),
                      "source": "generated/arithmetic (rejected = wrong sum)"})
    return pairs


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    print(f"{path}: {len(records)} records, {path.stat().st_size:,} bytes")


def main() -> None:
    parser = argparse.ArgumentParser(description="Build data/sft, data/dpo and data/grpo.")
    parser.add_argument("--chatterbot", required=True, type=Path, help="the unpacked chatterbot_corpus/data directory")
    parser.add_argument("--out", default="data", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)

    english = chatterbot_conversations(args.chatterbot, "english")
    chinese = chatterbot_conversations(args.chatterbot, "chinese")
    arithmetic = [{**sft_conversation(p), "source": "generated/arithmetic"} for p in make_problems(600, seed=1)]
    sft = english + chinese + arithmetic + templated_arithmetic(rng, 300)
    rng.shuffle(sft)
    n_valid = len(sft) // 20
    write_jsonl(args.out / "sft" / "train.jsonl", sft[n_valid:])
    write_jsonl(args.out / "sft" / "valid.jsonl", sft[:n_valid])

    dpo = preference_pairs(english, rng) + preference_pairs(chinese, rng) + arithmetic_pairs(rng, 400)
    rng.shuffle(dpo)
    write_jsonl(args.out / "dpo" / "train.jsonl", dpo)

    problems = make_problems(500, seed=2)
    write_jsonl(args.out / "grpo" / "arithmetic.jsonl",
                [{"prompt": problem_messages(p), "problem": p["prompt"], "answer": p["answer"]} for p in problems])


if __name__ == "__main__":
    main()
