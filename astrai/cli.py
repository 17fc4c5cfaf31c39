"""The ``astrai`` command: one verb per stage of a model's life.

Each verb has two halves: its flags, in a module of astrai/commands that imports nothing
heavy (so ``--help`` and a mistyped flag are answered at once), and the code it runs, beside
what it drives, exposing ``run(args) -> int`` and imported only once the command line has
parsed (so ``astrai serve`` never imports the trainer). This file maps verbs to both, points
a mistyped flag at the closest real one, and turns user mistakes (``AstraiError``) into a
one-line message and exit status 2.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys
from typing import NamedTuple

from astrai.backends import backend_for
from astrai.errors import AstraiError

# the verbs that run a model: the backend of their device prepares the process first (prepare_process)
COMPUTE_VERBS = frozenset({"quickstart", "train", "generate", "chat", "serve", "eval"})

class Verb(NamedTuple):
    flags: str  # module with add_arguments(parser): imports nothing heavy
    runner: str  # module with run(args) -> int
    help: str


VERBS: dict[str, Verb] = {
    "quickstart": Verb("astrai.commands.quickstart", "astrai.quickstart.cli",
                       "train a bilingual tiny model end to end (tokenizer → PT → SFT → DPO → GRPO) with a report"),
    "tokenizer": Verb("astrai.commands.tokenizer", "astrai.tokenize.cli", "train or inspect a byte-level BPE tokenizer"),
    "preprocess": Verb("astrai.commands.preprocess", "astrai.dataset.cli",
                       "turn raw JSONL into memory-mapped / HDF5 / JSON storage"),
    "train": Verb("astrai.commands.train", "astrai.commands.train_run",
                  "pre-train, fine-tune or align a model (seq, sft, dpo, rm, grpo, kl)"),
    "generate": Verb("astrai.commands.generate", "astrai.inference.cli",
                     "generate completions for prompts (command line or JSONL)"),
    "chat": Verb("astrai.commands.chat", "astrai.inference.chat_cli", "chat with a model in the terminal"),
    "serve": Verb("astrai.commands.serve", "astrai.serving.cli",
                  "serve a model over OpenAI- and Anthropic-compatible HTTP"),
    "eval": Verb("astrai.commands.eval", "astrai.eval.cli", "evaluate a model: perplexity, task accuracy, samples"),
    "model": Verb("astrai.commands.model", "astrai.model.cli", "create, inspect or convert model directories"),
}


def build_parser(verb: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="astrai", description="Build, train and serve small language models.")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    for name, spec in VERBS.items():
        verb_parser = sub.add_parser(name, help=spec.help, description=spec.help)
        if name == verb:
            importlib.import_module(spec.flags).add_arguments(verb_parser)
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


def innermost_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the deepest sub-command ``args`` chose (``astrai model create``'s, not ``astrai``'s)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and getattr(args, action.dest, None) in action.choices:
            return innermost_parser(action.choices[getattr(args, action.dest)], args)
    return parser


def closest_option(word: str, parser: argparse.ArgumentParser) -> str | None:
    """The long option of ``parser`` nearest to the mistyped ``word``, dashes and underscores alike."""
    if not word.startswith("--"):
        return None
    options = {o.replace("_", "-"): o for a in parser._actions for o in a.option_strings if o.startswith("--")}
    match = difflib.get_close_matches(word.partition("=")[0].replace("_", "-"), list(options), n=1, cutoff=0.6)
    return options[match[0]] if match else None


def parse_command_line(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``parser.parse_args``, except that an unknown flag is reported with the verb's own usage
    and the name of the flag that was probably meant, as git and cargo do."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        where = innermost_parser(parser, args)
        guesses = {word: closest_option(word, where) for word in unknown}
        hints = [f"did you mean {guess}?" for guess in guesses.values() if guess]
        where.error(f"unrecognized arguments: {' '.join(unknown)}" + (f" ({'; '.join(hints)})" if hints else ""))
    return args


def prepare_process(device: str) -> None:
    """The process-wide preparation the backend of ``device``'s kind asks for (astrai/backends;
    the CPU's: the allocator tuning of astrai/backends/cpu/tuning.py), which a compute verb
    makes explicitly for its user. ``auto``, also a verb without --device (train's may come
    from its --config), means a visible GPU, else the CPU."""
    if device == "auto":
        from astrai.parallel.setup import default_device_type  # torch: loaded once a compute verb runs, not for --help

        device = default_device_type()
    backend_for(device).prepare_process()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    verb = next((a for a in argv if not a.startswith("-")), None)
    if verb is not None and verb not in VERBS:
        guess = difflib.get_close_matches(verb, list(VERBS), n=1)
        if guess:
            build_parser().error(f"unknown verb {verb!r} (did you mean {guess[0]}?)")
        verb = None
    parser = build_parser(verb)
    args = parse_command_line(parser, either_spelling(argv, known_options(parser)))
    if args.verb is None:
        parser.print_help()
        return 0 if not argv else 2
    try:
        if args.verb in COMPUTE_VERBS:
            prepare_process(getattr(args, "device", None) or "auto")
        return int(importlib.import_module(VERBS[args.verb].runner).run(args) or 0)
    except AstraiError as exc:
        print(f"astrai {args.verb}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"astrai {args.verb}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
