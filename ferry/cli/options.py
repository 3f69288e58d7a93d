"""Option types shared by the commands: a value is checked where it is parsed, and the message names the flag;
an option no command knows is answered with the config key it most likely meant."""

from __future__ import annotations

import argparse
import shlex
import types
import typing
from collections.abc import Callable, Iterable, Iterator

from pydantic import BaseModel

from ferry.config import UserError


def device_option(name: str) -> str:
    """`--device NAME`: `auto`, `cpu` or an accelerator present here (the error would otherwise speak of
    `run.device`, a setting the command has not got)."""
    from ferry.config.errors import ConfigError
    from ferry.platform import resolve_device

    try:
        resolve_device(name)
    except ConfigError:
        raise argparse.ArgumentTypeError(
            f"{name!r} is not available on this machine (auto, cpu, or an accelerator present here)"
        ) from None
    return name


def refuse_unknown_options(extra: list[str], argv: list[str]) -> None:
    """Refuse an option the command does not know before it reaches the config as a malformed override. Who
    writes `--steps 10` most likely means a config key, so the refusal names the dotted override that sets it
    (`train.steps=10`); `argv` is the command line the option came from, where its value follows it."""
    option = next((item for item in extra if item.startswith("-")), None)
    if option is None:
        return
    name, has_value, value = option.lstrip("-").partition("=")
    if not has_value:
        following = argv[argv.index(option) + 1 :][:1]
        taken = following and not following[0].startswith("-") and "=" not in following[0]
        value = following[0] if taken else "VALUE"
    spellings = {name.replace("-", "_"), name.replace("-", ".")}  # --micro-batch, --run-dir
    matches = [key for key in run_config_keys() if any(key == end or key.endswith(f".{end}") for end in spellings)]
    if not matches:
        raise UserError(
            f"unrecognized argument {option}: neither an option of this command nor a config key "
            "(overrides are dotted keys without dashes: KEY=VALUE)"
        )
    overrides = " or ".join(shlex.quote(f"{key}={value}") for key in matches)
    raise UserError(
        f"unrecognized argument {option}: overrides are dotted keys without dashes; did you mean {overrides}?"
    )


def run_config_keys() -> list[str]:
    """Every dotted key of the run config that holds a value."""
    from ferry.train.config import RunConfig

    return _value_keys(RunConfig)


def _value_keys(section: type[BaseModel]) -> list[str]:
    """Sections are followed (an optional one too); lists and mappings are values, their keys are the user's."""
    keys = []
    for name, field in section.model_fields.items():
        inner = _section_of(field.annotation)
        keys += [f"{name}.{key}" for key in _value_keys(inner)] if inner else [name]
    return keys


def _section_of(annotation: object) -> type[BaseModel] | None:
    """The section a field holds, directly or as `Section | None`; None for a value."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    for candidate in typing.get_args(annotation) if union else (annotation,):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


class DefaultShown(argparse.HelpFormatter):
    """An option's help ends with its default, unless the help already speaks of it or there is none to show:
    a user reading `--help` should not have to run the command to learn what it does by default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        shown = not (default is None or default is False or default is argparse.SUPPRESS or default == [])
        if not action.option_strings or "default" in text or not shown:
            return text
        return f"{text} (default: %(default)s)"


def complete_help(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Give every sub-command's `--help` the description its parent lists it with, and every parser with the
    standard layout the formatter that shows defaults; returns `parser`."""
    if parser.formatter_class is argparse.HelpFormatter:
        parser.formatter_class = DefaultShown
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        for listed in action._choices_actions:
            command = action.choices[listed.dest]
            if command.description is None:
                command.description = listed.help
            complete_help(command)
    return parser


def parse_forms(
    argv: list[str], parsers: Callable[[str], argparse.ArgumentParser], named: tuple[str, ...], default: str
) -> tuple[str, argparse.Namespace | None]:
    """A command of several forms (`ferry release verify DIR`, `ferry rehearse start ...`): the form its first word
    names (`default` when it names none; `help` when asked or given nothing) and its options. Words after an
    option join the form's `KEY=VALUE` overrides, where it takes them; anything else is refused here, before
    anything runs."""
    if not argv or argv[0] in ("-h", "--help"):
        return "help", None
    form = argv[0] if argv[0] in named else default
    parser = parsers(form)
    options, extra = parser.parse_known_args(argv[1:] if form != default else argv)
    refuse_unknown_options(extra, argv)
    if extra and not hasattr(options, "overrides"):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if hasattr(options, "overrides"):
        options.overrides = [*options.overrides, *extra]
        unknown = [item for item in options.overrides if "=" not in item]
        if unknown:
            raise UserError(f"{parser.prog}: unrecognized arguments: {' '.join(unknown)}")
    return form, options


class RegistryChoices:
    """An option's choices read from a registry of kinds when first asked (a value given, or the help printed), so
    that parsing a command imports no more than it runs."""

    def __init__(self, names: Callable[[], Iterable[str]]):
        self._names = names

    def _all(self) -> tuple[str, ...]:
        return tuple(self._names())

    def __contains__(self, value: object) -> bool:
        return value in self._all()

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())


def architecture_names() -> tuple[str, ...]:
    from ferry.interop.architectures import ARCHITECTURES

    return ARCHITECTURES
