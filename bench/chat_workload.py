"""A chat workload for OpenAI-compatible servers: simulated users holding multi-turn conversations.

The conversations come from the bundled chat data (data/sft/train.jsonl). A user's turn
asks several bundled questions in one message, and the reply that joins the history is
their bundled answers, not what the server generated: so every server gets the very same
prompts whatever it writes. Each turn's prompt is the whole history, rendered with the
model's chat template and sent as token ids, and it extends the previous turn's prompt,
so a server that keeps a conversation's cache prefills only the newest message. The
histories grow evenly to a last-turn length drawn per user from ``last_turn_tokens``
(by default from half a slot to a full one less the reply: 2,048 to 4,032 of 4,096).

Users run concurrently, each sending its next turn as soon as its previous reply has
streamed. Output tokens/s counts every generated token over the wall time from the first
turn sent to the last reply finished; the time to first token is taken per turn, from
its sending to its first streamed token.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from pathlib import Path
from typing import Optional

import httpx

from astrai.errors import ConfigError
from serving_load import stream_completion, ttft_percentiles

BUNDLED_CHATS = Path(__file__).resolve().parent.parent / "data" / "sft" / "train.jsonl"
# sent to every server: llama-server keeps a slot's cache only when asked; astrai ignores the field
CACHE_FIELDS = {"cache_prompt": True, "stream_options": {"include_usage": True}}


def bundled_exchanges(path: Path = BUNDLED_CHATS) -> list[tuple[str, str]]:
    """Every (user message, assistant reply) pair of the bundled conversations, in file order."""
    pairs = []
    for line in path.read_text(encoding="utf-8").splitlines():
        messages = json.loads(line)["messages"]
        pairs += [(ask["content"], answer["content"]) for ask, answer in zip(messages, messages[1:])
                  if ask["role"] == "user" and answer["role"] == "assistant"]
    return pairs


def build_conversations(tokenizer, users: int, turns: int, slot_tokens: int = 4096, new_tokens: int = 64,
                        last_turn_tokens: Optional[tuple[int, int]] = None, seed: int = 0,
                        exchanges: Optional[list[tuple[str, str]]] = None) -> list[list[list[int]]]:
    """``users`` conversations of ``turns`` prompts each, as token ids: conversation[u][k] is user
    u's whole history up to its turn k, ending where the assistant's reply begins.

    The history after turn k's reply aims at k/turns of the user's last-turn length (drawn from
    ``last_turn_tokens``), the last prompt at all of it; every prompt leaves room for
    ``new_tokens`` in a ``slot_tokens`` slot. The same arguments give the same ids."""
    exchanges = exchanges or bundled_exchanges()
    limit = slot_tokens - new_tokens
    low, high = last_turn_tokens or (slot_tokens // 2, limit)
    if not 0 < low <= high <= limit:
        raise ConfigError(f"last_turn_tokens ({low}, {high}) must lie within 1..{limit} (slot less the reply)")
    # tokens an exchange adds: its question and its answer, each with the newline that joins it to
    # the next; an estimate (the template's text around them is counted by rendering)
    asked = [len(ids) + 1 for ids in tokenizer.encode([ask for ask, _ in exchanges])]
    answered = [len(ids) + 1 for ids in tokenizer.encode([answer for _, answer in exchanges])]

    def render(messages: list[dict]) -> list[int]:
        return tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)

    rng = random.Random(seed)
    conversations = []
    for user in range(users):
        last = rng.randint(low, high)
        messages: list[dict] = []
        prompts = []
        for turn in range(1, turns + 1):
            # an earlier turn aims its history with the reply at its share of the last length,
            # the last turn its prompt alone; a question that would overshoot ends the turn
            cost = asked if turn == turns else [q + a for q, a in zip(asked, answered)]
            room = last * turn // turns - len(render(messages + [{"role": "user", "content": ""}]))
            picked = [rng.randrange(len(exchanges))]
            room -= cost[picked[0]]
            while True:
                drawn = rng.randrange(len(exchanges))
                if cost[drawn] > room:
                    break
                picked.append(drawn)
                room -= cost[drawn]
            while True:
                message = {"role": "user", "content": "\n".join(exchanges[i][0] for i in picked)}
                prompt = render(messages + [message])
                if len(prompt) <= limit:
                    break
                if len(picked) == 1:
                    raise ConfigError(f"user {user}, turn {turn}: the history alone needs {len(prompt)} tokens, "
                                      f"more than the {limit} a {slot_tokens}-token slot leaves for {new_tokens} new ones")
                picked.pop()
            prompts.append(prompt)
            messages += [message, {"role": "assistant", "content": "\n".join(exchanges[i][1] for i in picked)}]
        conversations.append(prompts)
    return conversations


async def _converse(client: httpx.AsyncClient, url: str, model: str, user: int, prompts: list[list[int]],
                    new_tokens: int, start: float, fields: dict) -> list[dict]:
    """One user's turns in order, each sent when the previous reply has finished streaming."""
    results = []
    for turn, prompt in enumerate(prompts):
        done = await stream_completion(client, url, model, prompt, new_tokens, start, **fields)
        results.append({"user": user, "turn": turn, "prompt_tokens": len(prompt), **done})
    return results


async def _chat(base_url: str, model: str, conversations: list[list[list[int]]], new_tokens: int,
                fields: dict) -> list[dict]:
    # a fresh connection per turn: llama-server (cpp-httplib) closes one idle for 5 s, and a turn
    # that picks such a pooled connection fails with 'Server disconnected without sending a response'
    limits = httpx.Limits(max_connections=len(conversations), max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        start = time.perf_counter()
        users = await asyncio.gather(*(_converse(client, base_url + "/v1/completions", model, user, prompts,
                                                 new_tokens, start, fields) for user, prompts in enumerate(conversations)))
    return [turn for user in users for turn in user]


def summarize(turns: list[dict]) -> dict:
    """Output tokens/s over the wall time, TTFT p50/p95 over all turns and p50 per turn index.

    A turn's generated tokens are the server's own count (streamed usage) where it sends one,
    else its streamed events."""
    wall = max(t["done_s"] for t in turns)
    generated = [t["completion_tokens"] if t.get("completion_tokens") is not None else t["events"] for t in turns]
    by_turn: dict[int, list[float]] = {}
    for t in turns:
        if t["ttft_s"] is not None:
            by_turn.setdefault(t["turn"], []).append(t["ttft_s"])
    return {"requests": len(turns), "output_tokens": sum(generated), "fewest_tokens_in_a_reply": min(generated),
            "prompt_tokens": sum(t["prompt_tokens"] for t in turns), "seconds": wall,
            "output_tok_s": sum(generated) / wall,
            **ttft_percentiles([ttft for ttfts in by_turn.values() for ttft in ttfts]),
            "ttft_p50_by_turn_s": [statistics.median(by_turn[k]) for k in sorted(by_turn)],
            "turns_without_a_token": sum(t["ttft_s"] is None for t in turns), "turn_records": turns}


def run_conversations(base_url: str, model: str, conversations: list[list[list[int]]], new_tokens: int = 64) -> dict:
    """All users' conversations against the server at ``base_url``, greedy, ``new_tokens`` a reply."""
    return summarize(asyncio.run(_chat(base_url, model, conversations, new_tokens, CACHE_FIELDS)))
