"""Fixtures of the end-to-end tests: the Debian binaries they run (a failure, never a skip, when missing)."""

from __future__ import annotations

import shutil

import pytest


@pytest.fixture(scope="session")
def prometheus_binary() -> str:
    """Path of the prometheus server binary."""
    path = shutil.which("prometheus")
    if path is None:
        pytest.fail("prometheus is not installed: .ci/run installs the Debian package prometheus")
    return path
