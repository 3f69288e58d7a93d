"""The `ferry ...` commands the README and docs/ quote, read out of their code blocks, and the check that they
still work: each parsed by ferry's own parser (`ferry.cli.main.parse_command`), the repository config it names
loaded with its overrides, the overrides of any other config checked against the run config's keys, and
`ferry models` run for real with its quoted output compared line by line (its figures are arithmetic: they do not
vary with the CPU)."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
_ENVIRONMENT_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")
# commands whose first positional is a run config and whose `overrides` are laid over it
_CONFIG_COMMANDS = ("train", "drill", "launch", "rehearse")
# commands run for real, with the output their page quotes compared: quick, and the same on any machine
_RUN_FOR_REAL = ("models",)


@dataclass
class Quoted:
    """A command as a page quotes it, and the output lines that follow it on the page (its `$ ` form)."""

    page: Path
    line: int
    text: str
    output: list[str]

    @property
    def where(self) -> str:
        page = self.page.relative_to(REPO) if self.page.is_relative_to(REPO) else self.page
        return f"{page}:{self.line}: {self.text}"

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.text, comments=True)[1:]


def quoted_commands(pages: list[Path] = PAGES) -> list[Quoted]:
    """Every `ferry` command in the pages' code blocks (continuation lines joined; leading `VAR=value` assignments
    and a `cd DIR &&` left out). In a block with `$ ` prompts only the prompted lines are commands, the rest is
    their output; usage synopses (`[optional]` parts) and lines with shell expansions are not commands."""
    found: list[Quoted] = []
    for page in pages:
        for start, block in _code_blocks(page):
            prompted = any(line.startswith("$ ") for line in block)
            current = None
            for offset, line in enumerate(block):
                command = _command(line) if line.startswith("$ ") or not prompted else None
                if command is not None:
                    current = None if _is_template(command) else Quoted(page, start + offset, command, [])
                    if current is not None:
                        found.append(current)
                elif line.startswith("$ "):
                    current = None
                elif current is not None and line.strip():
                    current.output.append(line)
    return found


def _code_blocks(page: Path) -> list[tuple[int, list[str]]]:
    """(first line number, lines) of each fenced code block, continuation lines joined onto the first."""
    blocks, block, start, joined = [], None, 0, ""
    for number, line in enumerate(page.read_text(encoding="utf-8").split("\n"), start=1):
        if line.startswith("```"):
            if block is not None:
                blocks.append((start, block))
                block = None
            else:
                block, start = [], number + 1
            continue
        if block is None:
            continue
        if joined:
            line = joined + " " + line.strip()
            joined = ""
        if line.endswith("\\"):
            joined = line[:-1]
            block.append("")  # the continued line keeps its place (and the numbering)
            continue
        block.append(line)
    return blocks


def _command(line: str) -> str | None:
    text = line.strip().removeprefix("$ ").split("&&")[-1].strip()
    words = text.split()
    while words and _ENVIRONMENT_ASSIGNMENT.match(words[0]):
        words = words[1:]
    return " ".join(words) if words[:1] == ["ferry"] and len(words) > 1 else None


def _is_template(command: str) -> bool:
    """A usage synopsis (`[--steps N]`) or a line of a script (`"$SLURM_ARRAY_TASK_ID"`), not a command."""
    return any(word.startswith("[") for word in command.split()) or re.search(r"\$[{A-Za-z]", command) is not None


def problems(quoted: Quoted) -> list[str]:
    """What no longer holds of a quoted command: empty when it parses, its config and overrides load, and (for a
    command run for real) it prints what the page quotes."""
    from ferry.cli.main import main, parse_command
    from ferry.config import UserError

    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args = parse_command(quoted.argv)
    except SystemExit:
        return [f"ferry cannot parse it: {stderr.getvalue().strip().splitlines()[-1:]}"]
    except UserError as exc:
        return [f"ferry refuses it: {exc}"]
    found = _config_problems(args)
    if args.command in _RUN_FOR_REAL and quoted.output:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(stderr):
            code = main(quoted.argv)
        if code != 0:
            found.append(f"exit {code}: {stderr.getvalue().strip()[-300:]}")
        printed = out.getvalue().rstrip("\n").split("\n")
        if [line for line in quoted.output if line != "..."] != printed:
            found.append(f"prints otherwise now:\n{out.getvalue()}")
    return found


# The figures of a line: they vary with the machine (timings, MFU, the last digits of a loss) and with how long a run
# trained (digests, checkpoint steps, token counts), so the shape of a quoted line is compared, not its figures. A
# step line's counter ("step     30/60") is no figure: which steps print is the console's rule.
_FIGURE = re.compile(r"(?<!\w)[0-9a-f]*\d[0-9a-f]*(?:[.,]\d+)*(?:e[+-]?\d+)?")
_STEP_COUNTER = re.compile(r"^(step\s+\d+/\d+)(.*)$")
# ferry's own lines among a command's output, and the indented lines that continue them; the rest (generated text,
# tables) is content a shorter run changes
_OWN_LINE = re.compile(r"^(ferry: |step\s+\d|  \S)")


def shape(line: str) -> str:
    """`line` with every figure replaced by `#`, a step line's counter kept."""
    counter = _STEP_COUNTER.match(line)
    head, rest = (counter.group(1), counter.group(2)) if counter else ("", line)
    return head + _FIGURE.sub("#", rest)


def unprinted(quoted: list[str], printed: list[str]) -> list[str]:
    """The quoted lines of ferry's own (a trailing `...` quoting a line's start) that the printed lines do not hold,
    in order, in their shape."""
    missing, position = [], 0
    for line in quoted:
        if not _OWN_LINE.match(line):
            continue
        cut = line.endswith("...")
        wanted = shape(line.removesuffix("...").rstrip() if cut else line)
        for offset, candidate in enumerate(printed[position:]):
            if shape(candidate).startswith(wanted) if cut else shape(candidate) == wanted:
                position += offset + 1
                break
        else:
            missing.append(line)
    return missing


def _config_problems(args) -> list[str]:
    from ferry.config import ConfigError, UserError

    config, overrides = _config_and_overrides(args)
    if config is not None and config.startswith("configs/"):
        preset = []
        model = getattr(args, "model", None)
        written_earlier = model is not None and model.endswith(".yaml") and not (REPO / model).exists()
        if model and not written_earlier:  # a model.yaml an earlier command of the page writes (`ferry import`)
            from ferry.model.presets import preset_overrides

            preset = preset_overrides(model)
        try:
            from ferry.train import load_run_config

            load_run_config(REPO / config, [*preset, *overrides])
        except (ConfigError, UserError) as exc:
            return [f"{config} with its overrides does not load: {exc}"]
        return []
    return [f"override {item!r} names no key of the run config" for item in overrides if not _known(item)]


def _config_and_overrides(args) -> tuple[str | None, list[str]]:
    options = getattr(args, "options", None)
    if isinstance(options, tuple):  # a command with forms (`release`, `rehearse`)
        form, parsed = options
        if parsed is None:
            return None, []
        config = getattr(parsed, "config", None) if args.command in _CONFIG_COMMANDS else None
        return config, list(getattr(parsed, "overrides", []))
    config = getattr(args, "config", None) if args.command in _CONFIG_COMMANDS else None
    return config, list(getattr(args, "overrides", []))


def _known(override: str) -> bool:
    from ferry.cli.options import run_config_keys
    from ferry.config.loader import parse_override

    keys, _ = parse_override(override)
    dotted = ".".join(keys)
    return any(
        dotted == key or dotted.startswith(f"{key}.") or key.startswith(f"{dotted}.") for key in run_config_keys()
    )
