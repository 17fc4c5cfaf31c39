"""Sample answers to fixed English and Chinese prompts: what a reader looks at first.

The prompts never change between runs, so answers from different stages (pre-trained,
SFT, DPO, GRPO) and different runs sit side by side in reports.
"""

from __future__ import annotations

from astrai.eval.generation import Generator, chat_prompt

SAMPLE_PROMPTS: list[dict[str, str]] = [
    {"language": "en", "prompt": "What is the capital of France?"},
    {"language": "en", "prompt": "Write one sentence about the sea."},
    {"language": "en", "prompt": "What is 12 + 7?"},
    {"language": "zh", "prompt": "中国的首都是哪里？"},
    {"language": "zh", "prompt": "请用一句话介绍春天。"},
    {"language": "zh", "prompt": "3 加 5 等于多少？"},
]


def sample_answers(generator: Generator, tokenizer, prompts: list[dict[str, str]] | None = None,
                   chat: bool = True) -> list[dict[str, str]]:
    """Answer each prompt; with ``chat`` the prompt goes through the chat template,
    without it (a pre-trained model that never saw the template) it is continued as text."""
    prompts = prompts or SAMPLE_PROMPTS
    texts = [chat_prompt(tokenizer, p["prompt"]) if chat else p["prompt"] for p in prompts]
    return [{**p, "answer": answer} for p, answer in zip(prompts, generator(texts))]
