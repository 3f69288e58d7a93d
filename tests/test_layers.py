"""Imports point down the layers docs/architecture.md declares: between ferry's packages (its table, top to
bottom), and inside ferry/train between its base modules and its sub-packages (its `ferry/train, top to bottom`
block). An import only a type checker reads counts too: it is an arrow all the same."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ARCHITECTURE = (REPO / "docs" / "architecture.md").read_text()


def _imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ferry."):
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.startswith("ferry.")]
    return found


def test_packages_import_only_the_layers_below_them():
    layers = re.findall(r"^\| [a-z]+ \| `ferry/([a-z_]+)/`", ARCHITECTURE, flags=re.MULTILINE)
    assert layers[:2] == ["cli", "launch"] and layers[-1] == "config" and len(layers) == len(set(layers))
    rank = {package: index for index, package in enumerate(layers)}
    upward = []
    for path in sorted((REPO / "ferry").rglob("*.py")):
        parts = path.relative_to(REPO / "ferry").parts
        if len(parts) < 2 or parts[0] not in rank:
            continue
        for module in _imports(path):
            target = module.split(".")[1]
            if target in rank and rank[target] < rank[parts[0]]:
                upward.append(f"{path.relative_to(REPO)} imports {module}")
    assert not upward, "\n".join(upward)


def test_inside_ferry_train_the_base_and_its_sub_packages_import_downwards_only():
    block = ARCHITECTURE.split("ferry/train, top to bottom:\n", 1)[1].split("```", 1)[0]
    tiers = [line.split(":", 1)[1].split() for line in block.strip().splitlines()]
    tier_of = {unit: index for index, units in enumerate(tiers) for unit in units}
    train = REPO / "ferry" / "train"
    units = {
        path.name if path.is_dir() else path.stem
        for path in train.iterdir()
        if path.suffix == ".py" or (path.is_dir() and (path / "__init__.py").exists())
    }
    assert units == set(tier_of), f"placed in no tier, or gone: {sorted(units ^ set(tier_of))}"
    upward = []
    for path in sorted(train.rglob("*.py")):
        relative = path.relative_to(train).parts
        source = relative[0] if len(relative) > 1 else path.stem
        for module in _imports(path):
            if not module.startswith("ferry.train"):
                continue
            target = (module.split(".")[2:] or ["__init__"])[0]
            if target != source and tier_of[target] < tier_of[source]:
                upward.append(f"ferry/train/{'/'.join(relative)} imports {module}")
    assert not upward, "\n".join(upward)
