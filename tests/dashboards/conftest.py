"""Fixtures of the dashboards tests: the Debian binaries they run (a clear failure, never a skip, when missing)."""

from __future__ import annotations

import shutil

import pytest


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: .ci/run installs it from Debian (prometheus, prometheus-alertmanager)")
    return path


@pytest.fixture(scope="session")
def promtool() -> str:
    """Path of promtool."""
    return _binary("promtool")


@pytest.fixture(scope="session")
def amtool() -> str:
    """Path of amtool."""
    return _binary("amtool")
