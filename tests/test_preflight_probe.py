"""The Ansible role's preflight probe (ansible/roles/tensorlane/files/preflight-probe.sh) on this machine, with
interpreters that cannot run the agent: each gets a ``python_error`` line that says why (no root needed)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

PROBE = Path(__file__).resolve().parents[1] / "ansible" / "roles" / "tensorlane" / "files" / "preflight-probe.sh"


def probe(python: str) -> dict[str, str]:
    """Run the probe as the role does (``sh -c "$(cat probe)" probe IFACE PYTHON``); ``{key: rest of line}``."""
    out = subprocess.run(["sh", "-c", PROBE.read_text(), "probe", "lo", python], capture_output=True, text=True,
                         timeout=60, check=True)
    return dict((line.split(" ", 1) + [""])[:2] for line in out.stdout.splitlines() if line)


def fake(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


def test_a_good_interpreter_passes():
    found = probe(sys.executable)
    assert found.get("python") == sys.version.split()[0] and "python_error" not in found


def test_an_old_interpreter_is_named(tmp_path):
    """A Python 3.10 is refused with its version and the reason (tomllib)."""
    old = fake(tmp_path, "python3.10", 'case "$2" in *version_info*) exit 1;; *) echo 3.10.12;; esac')
    assert probe(old)["python_error"] == "it is Python 3.10.12, older than 3.11 (the agent needs tomllib)"


def test_an_interpreter_without_venv_is_named(tmp_path):
    """A Python without venv/ensurepip (Debian without python3-venv) is refused, saying so."""
    real = sys.executable
    body = (f'case "$2" in *ensurepip*) echo "ModuleNotFoundError: No module named \'ensurepip\'" >&2; exit 1;; '
            f'*) exec "{real}" "$@";; esac')
    err = probe(fake(tmp_path, "python3", body))["python_error"]
    assert "lacks venv or ensurepip" in err and "ensurepip" in err.split(":", 1)[1]


def test_a_missing_interpreter_is_named(tmp_path):
    err = probe(os.path.join(tmp_path, "no-such-python"))["python_error"]
    assert err.startswith("cannot run it:")
