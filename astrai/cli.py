"""The ``astrai`` command: one verb per stage of a model's life.

Each verb lives beside the code it drives, in a module exposing
``add_arguments(parser)`` and ``run(args) -> int``; this file only maps verbs to
those modules (imported lazily, so ``astrai serve`` never imports the trainer) and
turns user mistakes (``AstraiError``) into a one-line message and exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from astrai.errors import AstraiError

# the verbs that run a model: they tune the process for it first (astrai/backends/cpu/tuning.py)
COMPUTE_VERBS = frozenset({"quickstart", "train", "generate", "chat", "serve", "eval"})

VERBS: dict[str, tuple[str, str]] = {
    "quickstart": ("astrai.quickstart", "train a bilingual tiny model end to end (tokenizer → PT → SFT → DPO → GRPO) with a report"),
    "tokenizer": ("astrai.tokenize.cli", "train or inspect a byte-level BPE tokenizer"),
    "preprocess": ("astrai.dataset.cli", "turn raw JSONL into memory-mapped / HDF5 / JSON storage"),
    "train": ("astrai.trainer.cli", "pre-train, fine-tune or align a model (seq, sft, dpo, rm, grpo, kl)"),
    "generate": ("astrai.inference.cli", "generate completions for prompts (command line or JSONL)"),
    "chat": ("astrai.inference.chat_cli", "chat with a model in the terminal"),
    "serve": ("astrai.inference.server.cli", "serve a model over OpenAI- and Anthropic-compatible HTTP"),
    "eval": ("astrai.eval.cli", "evaluate a model: perplexity, task accuracy, samples"),
    "model": ("astrai.model.cli", "create, inspect or convert model directories"),
}


def build_parser(verb: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="astrai", description="Build, train and serve small language models.")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    for name, (module_name, help_text) in VERBS.items():
        verb_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == verb:
            importlib.import_module(module_name).add_arguments(verb_parser)
    return parser


def known_options(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of ``parser`` and of its sub-commands, however deep."""
    found: set[str] = set()
    for action in parser._actions:
        found.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= known_options(sub)
    return found


def either_spelling(argv: list[str], known: set[str]) -> list[str]:
    """Accept ``--max_tokens`` for ``--max-tokens`` and ``--batch-per-device`` for
    ``--batch_per_device``: the training verbs spell their flags with underscores, as the
    spec's training CLI does, the serving verbs with dashes, and nobody should have to
    remember which is which. Only a spelling that is not itself an option is rewritten,
    and only to an option that exists; anything after ``--`` is left alone."""
    out = []
    for i, arg in enumerate(argv):
        if arg == "--":
            return out + argv[i:]
        name, eq, value = arg.partition("=")
        if name.startswith("--") and name not in known:
            body = name[2:]
            for other in ("--" + body.replace("_", "-"), "--" + body.replace("-", "_")):
                if other in known:
                    arg = other + eq + value
                    break
        out.append(arg)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    verb = next((a for a in argv if not a.startswith("-")), None)
    if verb is not None and verb not in VERBS:
        verb = None
    parser = build_parser(verb)
    args = parser.parse_args(either_spelling(argv, known_options(parser)))
    if args.verb is None:
        parser.print_help()
        return 0 if not argv else 2
    try:
        if args.verb in COMPUTE_VERBS:
            from astrai.backends.cpu import tune_process

            tune_process()
        return int(importlib.import_module(VERBS[args.verb][0]).run(args) or 0)
    except AstraiError as exc:
        print(f"astrai {args.verb}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"astrai {args.verb}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
