"""Commands that cannot go stale: every `ferry ...` line the README and docs/ quote still parses with ferry's own
parser, the repository config it names loads with its overrides (any other config's overrides name keys the run
config has), and the quick ones run for real, `ferry models` printing what its page quotes."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from doc_commands import PAGES, REPO, problems, quoted_commands, unprinted

from ferry.cli.main import main

QUOTED = quoted_commands()
# run for real in a checkout-like directory: quick on any machine, and needing nothing the suite has not made
_REAL = (
    ["data", "prepare", "--embedded", "stdlib", "--output", "data/stdlib"],
    ["data", "verify", "data/stdlib"],
    ["kernels", "list"],
)
# quoted commands run for real in that directory, in this order, their output held against the page's: the tour's
# stop and resume, the tiny run's export, import and generation (its run made first, shorter than the demo's), and
# a launch refused before anything is written
_TOURS = (
    ("README.md", "ferry train configs/tiny.yaml run.dir=/tmp/tour/run train.steps=60 train.stop_at=30"),
    ("README.md", "ferry train configs/tiny.yaml run.dir=/tmp/tour/run train.steps=60 resume=latest"),
    ("interop.md", "ferry export runs/tiny runs/tiny/hf"),
    ("interop.md", "ferry import runs/tiny/hf runs/tiny/imported"),
    ("interop.md", 'ferry generate runs/tiny --prompt "def read_file(path):" --prompt "class Parser:"'),
    ("interop.md", 'ferry generate runs/tiny --prompt "import os"'),
    ("cluster.md", "ferry launch configs/tiny.yaml --platform p5.48xlarge --nodes 2 --master-addr HOST"),
)
_TINY_RUN = ["train", "configs/tiny.yaml", "train.steps=2", "eval.sources=[]"]


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """A directory holding the checkout's configs/ (as the repository's root does) and the demo's dataset, prepared
    by the command the pages quote."""
    directory = tmp_path_factory.mktemp("checkout")
    (directory / "configs").symlink_to(REPO / "configs")
    here = Path.cwd()
    os.chdir(directory)
    try:
        assert main(_REAL[0]) == 0
    finally:
        os.chdir(here)
    return directory


def test_the_pages_quote_commands_of_every_kind():
    commands = {quoted.argv[0] for quoted in QUOTED}
    assert len(QUOTED) > 100 and {"train", "data", "release", "rehearse", "launch", "models", "export"} <= commands
    assert {quoted.page.name for quoted in QUOTED} >= {"README.md", "release.md", "models.md", "commands.md"}


def test_every_quoted_command_parses_and_loads_its_config_and_overrides():
    stale = [f"{quoted.where}\n    " + "\n    ".join(found) for quoted in QUOTED if (found := problems(quoted))]
    assert not stale, "commands the pages quote that ferry no longer takes:\n" + "\n".join(stale)


def test_the_quick_commands_run_as_quoted(checkout, monkeypatch, capsys):
    """`ferry data prepare` of the demo corpus (the fixture's), `ferry data verify` of it and `ferry kernels list`,
    as the pages quote them, in a directory holding the checkout's configs/ (as the repository's root does)."""
    texts = {" ".join(quoted.argv) for quoted in QUOTED}
    monkeypatch.chdir(checkout)
    for argv in _REAL:
        if argv is _REAL[0]:
            assert " ".join(argv) in texts, f"no page quotes ferry {' '.join(argv)} any more"
            continue
        assert " ".join(argv) in texts, f"no page quotes ferry {' '.join(argv)} any more"
        assert main(argv) == 0, (argv, capsys.readouterr().err)
    assert "ferry: dataset data/stdlib is valid" in capsys.readouterr().out


def test_the_tours_print_what_their_pages_quote(checkout, monkeypatch, capsys):
    """Each command of `_TOURS` run as quoted (its /tmp/ paths under this test's directory) prints ferry's lines its
    page quotes, in order and in their shape: the figures a machine or a shorter run changes masked, which steps
    print and every word kept (`doc_commands.shape`)."""
    monkeypatch.chdir(checkout)
    assert main(_TINY_RUN) == 0, capsys.readouterr().err
    capsys.readouterr()
    temporary = f"{checkout}/tmp/"
    drifted = []
    for page, start in _TOURS:
        [quoted] = [q for q in QUOTED if q.page.name == page and q.text.startswith(start)]
        argv = [word.replace("/tmp/", temporary) for word in quoted.argv]
        code = main(argv)
        said = capsys.readouterr()
        refused = any(line.startswith("ferry: error:") for line in quoted.output)  # a refusal, as the page shows
        assert code == (2 if refused else 0), (quoted.where, said.err[-2000:])
        expected = [line.replace("/tmp/", temporary) for line in quoted.output]
        missing = unprinted(expected, (said.out + said.err).splitlines())
        if missing:
            drifted.append(
                f"{quoted.where}\n  quoted but not printed:\n    "
                + "\n    ".join(missing)
                + "\n  printed:\n    "
                + "\n    ".join((said.out + said.err).splitlines())
            )
    assert not drifted, "\n".join(drifted)


def test_a_drifted_output_is_caught_in_its_shape_not_its_figures():
    printed = [
        "ferry: training tiny on cpu x 1 — 3.17M params",
        "step      1/60  loss 8.3585  lr 1.00e-04",
        "step     25/60  loss 7.0012  lr 2.50e-03",
        "ferry: stopped at step 30 — final loss 6.1111; run in r",
    ]
    assert (
        unprinted(
            ["...", "step     25/60  loss 6.9  ...", "ferry: stopped at step 31 — final loss 6.2; run in r"], printed
        )
        == []
    )
    assert unprinted(["step     30/60  loss 6.2854  lr 3.00e-03  ..."], printed) == [
        "step     30/60  loss 6.2854  lr 3.00e-03  ..."
    ], "a step the console does not print"
    assert unprinted(["ferry: stopped at step 30 — final loss 6.2; run in r; and more"], printed) != []
    assert unprinted(
        ["step     25/60  loss 7.0012  lr 2.50e-03", "step      1/60  loss 8.3585  lr 1.00e-04"], printed
    ) == ["step      1/60  loss 8.3585  lr 1.00e-04"], "in order"
    assert unprinted(["step     25/60  loss 7.0012"], printed) != [], "a whole line, unless cut with ..."
    assert unprinted(["a generated line, not ferry's own"], printed) == []


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
