"""Each family of kinds keeps its names to itself: no code outside a kind's files compares a layout mode, an
optimizer, a model variant or a transformers architecture by name (or an alias: the optimizer's checkpoint name),
or asks whether a tensor or an optimizer is of a layout's type. A new layout, optimizer or architecture is then a
file of its own, and nothing else branches on it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

FERRY = Path(__file__).resolve().parent.parent / "ferry"

_LITERAL = r"""["'](?:{names})["']"""
_COMPARED = r"""(?:(?:==|!=|\bis\b|\bis not\b)\s*{literal}|{literal}\s*(?:==|!=)|\bin\s*[\(\[\{{][^)\]}}]*{literal})"""

# family -> (names, the files where they may be compared: the kinds')
FAMILIES = {
    "layout mode": (("ep", "fsdp", "single"), ("train/layouts/", "parallel/strategies.py")),
    "optimizer": (("adamw", "muon", "AdamW", "Muon"), ("parallel/optimizers/",)),
    "model variant": (("gqa", "mla", "standard", "farskip"), ("model/variants/",)),
    "architecture": (
        ("olmoe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "gpt_oss"),
        ("interop/architectures/",),
    ),
}
LAYOUT_TYPE_NAMES = (
    "DTensor",
    "ShardedOptimizer",
    "MuonWithAdamW",
    "FSDPModule",
    "ExpertResident",
    "FullySharded",
    "PipelineStages",
    "WholeModel",
)
LAYOUT_TYPES = r"isinstance\([^)]*\b(?:" + "|".join(LAYOUT_TYPE_NAMES) + r")\b"
# the files that own those types: FSDP's placement (its DTensors), ZeRO-1 (its sharded optimizer), Muon (FSDP's
# sharded matrices, orthogonalised by owners)
LAYOUT_TYPE_OWNERS = (
    "parallel/strategies.py",
    "parallel/zero.py",
    "parallel/optimizers/muon.py",
    "parallel/muon_fsdp.py",
)


def _code_lines(path: Path) -> list[tuple[int, str]]:
    """The lines of `path` with their comments cut (a docstring or a message may name a kind; code may not compare
    it)."""
    return [(number, line.split("#")[0]) for number, line in enumerate(path.read_text().splitlines(), start=1)]


def _found(pattern: re.Pattern, allowed: tuple[str, ...]) -> list[str]:
    found = []
    for path in sorted(FERRY.rglob("*.py")):
        relative = path.relative_to(FERRY).as_posix()
        if relative.startswith(allowed):
            continue
        found += [
            f"ferry/{relative}:{number}: {line.strip()}" for number, line in _code_lines(path) if pattern.search(line)
        ]
    return found


def _compared(names: tuple[str, ...]) -> re.Pattern:
    literal = _LITERAL.format(names="|".join(re.escape(name) for name in names))
    return re.compile(_COMPARED.format(literal=literal))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_no_name_of_a_kind_is_compared_outside_its_kinds(family):
    names, allowed = FAMILIES[family]
    found = _found(_compared(names), allowed)
    assert not found, f"{family} names compared outside their kinds:\n" + "\n".join(found)


def test_no_layout_type_is_checked_outside_the_code_that_owns_it():
    found = _found(re.compile(LAYOUT_TYPES), LAYOUT_TYPE_OWNERS)
    assert not found, "layout types checked outside their owners:\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("line", "family"),
    [
        ('    if config.parallel.mode == "fsdp":', "layout mode"),
        ('    expert_parallel = "ep" == mode', "layout mode"),
        ('    if config.optim.name != "muon":', "optimizer"),
        ('    return "Muon" if isinstance(local, X) else "AdamW"', None),
        ("    if kind in ('AdamW', 'other'):", "optimizer"),
        ('    if arch in DEEPSEEK or arch == "gpt_oss":', "architecture"),
        ('    if config.attention is not "gqa":', "model variant"),
    ],
)
def test_the_patterns_find_what_they_are_for(line, family):
    """The patterns catch a compare written either way round, `in` a literal tuple and `is`; a name in a string
    that is no compare is not caught."""
    hits = {name for name, (names, _) in FAMILIES.items() if _compared(names).search(line)}
    assert hits == ({family} if family else set())
    assert re.search(LAYOUT_TYPES, "    sharded = isinstance(optimizer, ShardedOptimizer)")
