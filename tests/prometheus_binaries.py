"""Debian's `prometheus` and `promtool`, which `.ci/run` installs: a test that needs one skips, saying so, where it
is absent, except in CI (`CI=true`), where its absence fails the test instead of hiding it."""

from __future__ import annotations

import os
import shutil

import pytest


def binary(name: str) -> str:
    """The path of `name` on PATH; a skip (a failure under CI=true) naming the package where it is absent."""
    path = shutil.which(name)
    if path is None:
        message = f"{name} is not installed (Debian's prometheus package; .ci/run installs it as root)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return path
