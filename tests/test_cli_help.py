"""Every `ferry ... --help` says what the command is for and what each option does by default."""

from __future__ import annotations

import argparse

import pytest

from ferry.cli.main import _build_parser, main


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("ferry",)):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, command in action.choices.items():
                yield from _commands(command, (*path, name))


COMMANDS = list(_commands(_build_parser()))


@pytest.mark.parametrize("path, parser", COMMANDS, ids=[" ".join(path) for path, _ in COMMANDS])
def test_every_command_has_a_description_and_every_argument_a_help(path, parser):
    assert parser.description, f"{' '.join(path)} --help has no description"
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) or action.nargs == argparse.REMAINDER:
            continue
        assert action.help, f"{' '.join(path)}: {action.option_strings or action.dest} has no help"


def test_help_shows_the_defaults_of_options(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "tokens generated after each prompt at most (default: 64)" in text
    assert "(default: fp32)" in text
    with pytest.raises(SystemExit):
        main(["plot", "--help"])
    assert "draw loss, throughput, time split and expert load as PNGs" in capsys.readouterr().out
