"""``astrai chat``: talk to a model in the terminal.

The conversation is kept as chat messages and re-rendered with the tokenizer's chat
template every turn; the prefix cache makes the shared history cheap to re-read.
Replies stream as they are generated. Commands: ``/reset`` clears the history,
``/exit`` (or Ctrl-D) quits. Sampling defaults as ``astrai generate``'s: the model's
generation_config.json, else greedy. Flags: astrai/commands/chat.py.
"""

from __future__ import annotations

import argparse
import sys

from astrai.inference.cli import build_engine, sampling_from_args


def run(args: argparse.Namespace, stdin=None, stdout=None) -> int:
    stdin = stdin or sys.stdin
    stdout = stdout or sys.stdout
    interactive = stdin.isatty()
    sampling = sampling_from_args(args)
    base = [{"role": "system", "content": args.system}] if args.system else []
    history = list(base)
    with build_engine(args) as engine:
        if interactive:
            stdout.write("astrai chat - /reset clears the history, /exit quits\n")
        while True:
            if interactive:
                stdout.write("you> ")
                stdout.flush()
            line = stdin.readline()
            if not line:
                break
            text = line.strip()
            if not text:
                continue
            if text == "/exit":
                break
            if text == "/reset":
                history = list(base)
                stdout.write("(history cleared)\n")
                continue
            history.append({"role": "user", "content": text})
            stdout.write("assistant> ")
            reply = []
            for piece in engine.generate(history, stream=True, **sampling):
                reply.append(piece)
                stdout.write(piece)
                stdout.flush()
            stdout.write("\n")
            history.append({"role": "assistant", "content": "".join(reply)})
    return 0
