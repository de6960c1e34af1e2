"""Shared test set-up. Tests marked ``netns`` need root and the kernel's qdiscs: they fail, never skip, when
they cannot run (CI runs them as root)."""
import os
import shutil

import pytest


@pytest.fixture(autouse=True)
def _netns_prerequisites(request):
    if request.node.get_closest_marker("netns") is None:
        return
    if os.geteuid() != 0:
        pytest.fail("this test needs root for network namespaces (run `make test` as root)")
    missing = [tool for tool in ("ip", "tc", "nft", "iperf3") if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"this test needs {', '.join(missing)}: run scripts/bootstrap as root")
