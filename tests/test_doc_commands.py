"""Commands that cannot go stale: every `ferry ...` line the README and docs/ quote still parses with ferry's own
parser, the repository config it names loads with its overrides (any other config's overrides name keys the run
config has), and the quick ones run for real, `ferry models` printing what its page quotes."""

from __future__ import annotations

import os
import re

from doc_commands import PAGES, REPO, problems, quoted_commands
from ferry.cli.main import main

QUOTED = quoted_commands()
# run for real in a checkout-like directory: quick on any machine, and needing nothing the suite has not made
_REAL = (["data", "prepare", "--embedded", "stdlib", "--output", "data/stdlib"], ["data", "verify", "data/stdlib"],
         ["kernels", "list"])


def test_the_pages_quote_commands_of_every_kind():
    commands = {quoted.argv[0] for quoted in QUOTED}
    assert len(QUOTED) > 100 and {"train", "data", "release", "rehearse", "launch", "models", "export"} <= commands
    assert {quoted.page.name for quoted in QUOTED} >= {"README.md", "release.md", "models.md", "commands.md"}


def test_every_quoted_command_parses_and_loads_its_config_and_overrides():
    stale = [f"{quoted.where}\n    " + "\n    ".join(found) for quoted in QUOTED if (found := problems(quoted))]
    assert not stale, "commands the pages quote that ferry no longer takes:\n" + "\n".join(stale)


def test_the_quick_commands_run_as_quoted(tmp_path, monkeypatch, capsys):
    """`ferry data prepare` of the demo corpus, `ferry data verify` of it and `ferry kernels list`, as the pages
    quote them, in a directory holding the checkout's configs/ (as the repository's root does)."""
    texts = {" ".join(quoted.argv) for quoted in QUOTED}
    (tmp_path / "configs").symlink_to(REPO / "configs")
    monkeypatch.chdir(tmp_path)
    for argv in _REAL:
        assert " ".join(argv) in texts, f"no page quotes ferry {' '.join(argv)} any more"
        assert main(argv) == 0, (argv, capsys.readouterr().err)
    assert "ferry: dataset data/stdlib is valid" in capsys.readouterr().out


def test_a_stale_command_is_caught_naming_its_page_and_line(tmp_path):
    page = tmp_path / "stale.md"
    page.write_text(
        "Text.\n\n```sh\n"
        "ferry train configs/tiny.yaml train.stepz=3          # a key that is no more\n"
        "ferry trian configs/tiny.yaml                        # a command that never was\n"
        "ferry train configs/renamed.yaml                     # a config that moved\n"
        "ferry release replay rel --stage x --bogus 1         # an option that went\n"
        "ferry bench moe-tiny --out b.json model.widht=3      # an override of another config\n"
        "ferry train configs/tiny.yaml train.steps=3          # still good\n"
        "```\n\n```\n$ ferry models olmoe-1b-7b\nan old table\n```\n"
    )
    quoted = quoted_commands([page])
    assert [q.line for q in quoted] == [4, 5, 6, 7, 8, 9, 13]
    found = {q.line: problems(q) for q in quoted}
    assert "train.stepz" in found[4][0] and "cannot parse it" in found[5][0]
    assert "configs/renamed.yaml" in found[6][0] and "--bogus" in found[7][0]
    assert "override 'model.widht=3' names no key of the run config" in found[8][0]
    assert found[9] == [] and "prints otherwise now" in found[13][0]
    assert quoted[0].where.endswith("stale.md:4: ferry train configs/tiny.yaml train.stepz=3 # a key that is no more")


def test_every_page_is_in_the_map_and_every_link_of_the_docs_resolves():
    index = (REPO / "docs" / "index.md").read_text()
    for page in PAGES[1:]:
        assert page.name == "index.md" or f"]({page.name})" in index, f"docs/index.md does not list {page.name}"
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target:
                assert os.path.exists(page.parent / target), f"{page.name}: a link to {target} leads nowhere"
