"""Every `astrai` command shown in README.md and docs/ parses with the real command line.

A newcomer pastes these; a flag renamed in the code but not in the docs would fail for
them with argparse's "unrecognized arguments". Lines that elide flags with ``...`` or
quote an error message are skipped - they are not meant to be pasted.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from astrai.cli import VERBS, build_parser, either_spelling, known_options

ROOT = Path(__file__).resolve().parents[1]
SHELL_FENCES = {"bash", "sh", "console", ""}
COMMAND = re.compile(r"(?:^|\s|/)(?:astrai|\$A)\s+(\S.*)$")


def shell_blocks(text: str) -> list[str]:
    """The bodies of fenced code blocks marked as shell (or unmarked), continuation lines joined."""
    blocks, body, fence = [], [], None
    for line in text.splitlines():
        if line.startswith("```"):
            if fence is None:
                fence, body = line[3:].strip(), []
            else:
                if fence in SHELL_FENCES:
                    blocks.append("\n".join(body).replace("\\\n", " "))
                fence = None
        elif fence is not None:
            body.append(line)
    return blocks


def documented_commands() -> list[tuple[str, str]]:
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in shell_blocks(path.read_text(encoding="utf-8")):
            for line in block.splitlines():
                line = line.split("  #")[0].strip()
                match = COMMAND.search(line)
                if match is None or "..." in line or "error:" in line:
                    continue
                found.append((path.name, match.group(1)))
    return found


COMMANDS = documented_commands()


def test_the_docs_show_commands_of_every_verb():
    """Guards the extraction itself: if it found nothing, the test below would pass vacuously."""
    verbs = {shlex.split(rest)[0] for _, rest in COMMANDS}
    assert len(COMMANDS) >= 30
    assert verbs == set(VERBS), f"verbs without a documented command: {set(VERBS) - verbs}"


@pytest.mark.parametrize("source,command", COMMANDS, ids=[f"{s}:{c[:60]}" for s, c in COMMANDS])
def test_documented_command_parses(source, command):
    argv = shlex.split(command)
    parser = build_parser(argv[0])
    try:
        parser.parse_args(either_spelling(argv, known_options(parser)))
    except SystemExit as exit_info:
        pytest.fail(f"{source}: `astrai {command}` is rejected by the command line (exit {exit_info.code})")


def test_a_renamed_flag_would_be_caught():
    argv = shlex.split("train --train_type seq --max_stepz 3")
    parser = build_parser("train")
    with pytest.raises(SystemExit):
        parser.parse_args(either_spelling(argv, known_options(parser)))
