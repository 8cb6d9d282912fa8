"""Shared fixtures and the emulation-test policy.

Emulation tests (marker ``emulation``) need root and Mininet. When either is
missing they skip with the reason, except under ``CI=true``, where they must
run: there a missing prerequisite is a failure, not a skip.
"""

from __future__ import annotations

import os
import shutil

import pytest

from topology import default_cluster

IN_CI = os.environ.get("CI", "").lower() == "true"


def emulation_unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "emulation needs root (Mininet creates network namespaces)"
    if shutil.which("mnexec") is None:
        return "Mininet is not installed (Debian package 'mininet'; `make test` installs it as root)"
    return None


@pytest.fixture(autouse=True)
def _emulation_prerequisites(request):
    """Skip an emulation test with the reason, or, under CI=true, fail it: CI must run them."""
    if "emulation" not in request.keywords:
        return
    reason = emulation_unavailable_reason()
    if reason is None:
        return
    if IN_CI:
        pytest.fail(f"CI=true but {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def cluster():
    """The embedded default: 4 DGX H100 on a rail-optimized fabric (do not mutate)."""
    return default_cluster()
