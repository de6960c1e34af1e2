"""The distribution: one import package ``tensorlane``, dependencies that flow one way, a wheel that installs the
agent without torch and the shim with it.

The import rules (docs in README.md, "Repository layout"):
- the agent never imports the shim, the shim never imports the agent; both import the shared modules
  (``tensorlane.client``, ``tensorlane.flows``, ``tensorlane.units``) and the policies;
- the shared modules and the policies import neither the agent nor the shim; the policies do no I/O;
- nothing shipped imports the repository tools (``bench``, ``testbed``), and no private name crosses a package;
- the agent and the CLI never load torch.
- the shim, and the shared modules it imports, make no privileged calls.
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import pytest
from test_ansible import fleet_testbed  # builds the wheel from a copy of the tree, as the fleet test does

from testbed import Testbed

pytestmark = pytest.mark.concurrent  # netns tests here run beside another file's (make test; pyproject markers)

REPO = Path(__file__).resolve().parents[1]
PARTS = {"tensorlane": REPO / "tensorlane", "tensorlane.agent": REPO / "agent", "tensorlane.shim": REPO / "shim",
         "tensorlane.policies": REPO / "policies"}

# module prefix -> prefixes it must never import
FORBIDDEN = {
    "tensorlane.agent": ("tensorlane.shim", "torch", "bench", "testbed"),
    "tensorlane.shim": ("tensorlane.agent", "bench", "testbed"),
    "tensorlane.policies": ("tensorlane.agent", "tensorlane.shim", "tensorlane.client", "tensorlane.flows", "torch",
                            "bench", "testbed", "os", "socket", "subprocess", "pyroute2", "threading"),
    "tensorlane.client": ("tensorlane.agent", "tensorlane.shim", "tensorlane.policies", "torch"),
    "tensorlane.flows": ("tensorlane.agent", "tensorlane.shim", "tensorlane.policies", "torch"),
    "tensorlane.units": ("tensorlane.agent", "tensorlane.shim", "tensorlane.policies", "torch"),
    "tensorlane.cli": ("tensorlane.shim", "torch", "bench", "testbed"),
}


def modules() -> dict[str, Path]:
    """Every shipped module by its dotted name (the package-dir mapping of pyproject.toml)."""
    out = {}
    for pkg, root in PARTS.items():
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root).with_suffix("").parts
            if pkg == "tensorlane" and len(rel) > 1:
                continue
            name = ".".join((pkg, *rel))
            out[name.removesuffix(".__init__")] = path
    return out


def imports(name: str, path: Path) -> list[tuple[str, tuple[str, ...]]]:
    """``(module, names)`` for each import statement of the module (relative imports resolved)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, ()) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = name.split(".")[: -node.level + (1 if path.name == "__init__.py" else 0) or None]
                base = ".".join([*parent, base]) if base else ".".join(parent)
            out.append((base, tuple(a.name for a in node.names)))
    return out


def package_of(module: str) -> str:
    for pkg in ("tensorlane.agent", "tensorlane.shim", "tensorlane.policies"):
        if module == pkg or module.startswith(pkg + "."):
            return pkg
    return module


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_imports_flow_one_way():
    """The agent and the shim meet only in the shared modules; policies and shared modules import neither."""
    bad = []
    for name, path in modules().items():
        rules = [bans for prefix, bans in FORBIDDEN.items() if _under(name, prefix)]
        for target, names in imports(name, path):
            targets = [target] + [f"{target}.{n}" for n in names]
            for bans in rules:
                bad += [f"{name} imports {t}" for t in targets for ban in bans if _under(t, ban)]
    assert not bad, "\n".join(sorted(set(bad)))


# what the shim, and the shared modules it imports, must never do: it runs in the training process, as its user
PRIVILEGED_MODULES = ("pyroute2", "subprocess", "ctypes", "fcntl", "nftables")
PRIVILEGED_CALLS = ("setsockopt", "ioctl", "system", "popen", "chmod", "chown", "mknod", "setns", "unshare")
PRIVILEGED_PATHS = ("/sys", "/run", "/dev", "/etc")


def _shim_side() -> dict[str, Path]:
    """The shim's modules and every shared module it imports (client, flows, units, the top package)."""
    mods = modules()
    return {n: p for n, p in mods.items() if _under(n, "tensorlane.shim") or package_of(n) == n
            and not _under(n, "tensorlane.cli") and n != "tensorlane.__main__"}


def privileged_uses(path: Path) -> list[str]:
    """``LINE: what`` for each privileged thing the module does: imports of netlink, nftables, subprocess, ctypes
    or fcntl; a ``setsockopt`` (SO_PRIORITY, IP_TOS: the agent classifies, no socket option of the shim's may),
    ``ioctl``, ``os.system`` and the like; a file opened for writing, or a path under /sys, /run, /dev or /etc named
    outside a docstring."""
    tree = ast.parse(path.read_text(), str(path))
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    out = []
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        out += [f"{node.lineno}: import {n}" for n in names if n.split(".")[0] in PRIVILEGED_MODULES]
        if isinstance(node, ast.Call):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if func in PRIVILEGED_CALLS:
                out.append(f"{node.lineno}: {func}()")
            mode = node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "mode"),
                                                                 None)
            reads = mode is None or isinstance(mode, ast.Constant) and set(str(mode.value)) <= set("rbt")
            if func == "open" and not reads:
                out.append(f"{node.lineno}: open() to write")
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs \
                and node.value.startswith(tuple(p + "/" for p in PRIVILEGED_PATHS)):
            out.append(f"{node.lineno}: the path {node.value!r}")
    return out


def test_the_shim_makes_no_privileged_calls():
    """The shim runs inside training processes, as the training user: no netlink, nftables or tc, no socket option
    (the agent classifies the flows; ``SO_PRIORITY`` above 6 needs CAP_NET_ADMIN and ``IP_TOS`` resets it), no
    ``ioctl``, no subprocess, no file written and no path under /sys, /run, /dev or /etc of its own: the agent's
    socket path comes from ``tensorlane.client.DEFAULT_SOCKET`` (a constant the shim connects to, never writes).
    The shared modules it imports are held to the same rule."""
    side = _shim_side()
    assert "tensorlane.shim.ddp" in side and "tensorlane.flows" in side and "tensorlane.client" in side
    bad = [f"{name}:{use}" for name, path in side.items() for use in privileged_uses(path)
           if not (name == "tensorlane.client" and use.endswith("'/run/tensorlane/agent.sock'"))]
    assert not bad, "\n".join(bad)


def test_the_privileged_check_sees_what_it_looks_for(tmp_path):
    """``privileged_uses`` finds each kind of privileged call (a check that finds nothing proves nothing)."""
    f = tmp_path / "m.py"
    f.write_text('"""/run/x in a docstring is fine."""\nimport pyroute2\nfrom subprocess import run\n'
                 "s.setsockopt(1, 2, 3)\nopen('/x', 'w')\nopen(p, mode='ab')\nopen('/proc/1/stat')\n"
                 "P = '/sys/class/net'\n")
    got = [u.split(": ", 1)[1] for u in privileged_uses(f)]
    assert got == ["import pyroute2", "import subprocess", "setsockopt()", "open() to write", "open() to write",
                   "the path '/sys/class/net'"], got


def test_no_private_name_crosses_a_package():
    """``from X import _name`` only inside X's own package."""
    mods = modules()
    bad = [f"{name}: from {target} import {n}" for name, path in mods.items()
           for target, names in imports(name, path) if target.startswith("tensorlane")
           for n in names if n.startswith("_") and n != "__version__"
           and package_of(target) != package_of(name)]
    assert not bad, "\n".join(bad)


def test_agent_and_cli_never_load_torch():
    """Importing every agent module and the CLI leaves torch unloaded (a fleet host has no torch)."""
    agent = [n for n in modules() if _under(n, "tensorlane.agent")] + ["tensorlane.cli", "tensorlane.client"]
    code = f"import importlib, sys\nfor m in {agent!r}: importlib.import_module(m)\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


def test_the_shim_without_torch_says_to_install_the_shim_extra():
    """``pip install .`` (no ``[shim]``) then ``shim.attach(...)``: until 2026-11-28 a bare "No module named 'torch'"
    from inside shim/ddp.py; it now names the extra to install. (torch is hidden: ``sys.modules['torch'] = None``.)"""
    code = ("import sys\nsys.modules['torch'] = None\nfrom tensorlane import shim\n"
            "try:\n    shim.attach\nexcept ModuleNotFoundError as e:\n    print(e.name, '|', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.startswith("torch | tensorlane.shim.attach needs torch"), out.stdout + out.stderr
    assert "pip install '.[shim]'" in out.stdout, out.stdout


def test_the_checkouts_folder_in_front_of_an_install_says_so(tmp_path):
    """A script run from a checkout's root finds its ``tensorlane/`` folder before the installed package, and
    ``from tensorlane import shim`` failed "cannot import name 'shim'" (``import tensorlane.shim.lightning``: "No
    module named 'tensorlane.shim'"): it now says why and what to do. (``-S``: no
    site-packages, so no editable install maps the subpackages.)"""
    import shutil

    shutil.copytree(REPO / "tensorlane", tmp_path / "tensorlane", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    (tmp_path / "shim").mkdir()
    r = subprocess.run([sys.executable, "-S", "-c", "from tensorlane import shim"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "tensorlane.shim cannot be imported: this `tensorlane` is the folder" in r.stderr, r.stderr
    assert "Run it from another folder, or install the checkout with `pip install -e .`" in r.stderr
    for code, name in (("import tensorlane.shim.lightning", "shim"),
                       ("from tensorlane.policies.planner import plan_shim", "policies")):
        # (the forms docs/frameworks.md and the README use: until 2026-11-28 a bare "No module named ...")
        (tmp_path / name).mkdir(exist_ok=True)
        r = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, capture_output=True, text=True,
                           timeout=60)
        assert f"tensorlane.{name} cannot be imported: this `tensorlane` is the folder" in r.stderr, (code, r.stderr)
    r = subprocess.run([sys.executable, "-S", "-c", "import tensorlane; tensorlane.nothing"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert "AttributeError: module 'tensorlane' has no attribute 'nothing'" in r.stderr, r.stderr


def test_version_is_stated_once():
    """``tensorlane --version`` and the API report the package metadata's version; the Ansible role's default
    version to install is the same."""
    version = metadata.version("tensorlane")
    out = subprocess.run([sys.executable, "-m", "tensorlane", "--version"], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == f"tensorlane {version}"
    from tensorlane.agent import api

    assert version == api.VERSION
    role = REPO / "ansible" / "roles" / "tensorlane"
    assert f'tensorlane_version: "{version}"' in (role / "defaults" / "main.yml").read_text()
    spec = (role / "meta" / "argument_specs.yml").read_text()
    assert f'default: "{version}"' in spec.split("tensorlane_version:", 1)[1].split("\n\n", 1)[0]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> tuple[Path, Path]:
    """The project's wheel, and a wheelhouse with its dependencies (downloaded once)."""
    out = tmp_path_factory.mktemp("wheel")
    return Path(fleet_testbed.build_wheel(str(out))), Path(fleet_testbed.fill_wheelhouse(str(out)))


def test_wheel_holds_one_package(wheel):
    """Every file of the wheel is under ``tensorlane/`` or its dist-info: no bench, testbed or generic names."""
    import zipfile

    names = zipfile.ZipFile(wheel[0]).namelist()
    tops = {n.split("/", 1)[0] for n in names}
    assert tops == {"tensorlane", f"tensorlane-{metadata.version('tensorlane')}.dist-info"}, tops
    shipped = {name.replace(".", "/") + ("/__init__.py" if path.name == "__init__.py" else ".py")
               for name, path in modules().items()}
    missing = sorted(n for n in shipped if n not in names)
    assert not missing, f"modules left out of the wheel (pyproject.toml's packages): {missing}"
    assert "tensorlane/policies/profiles/resnet50.json" in names
    assert any(n.endswith("licenses/LICENSE") for n in names)


def test_shim_imports_from_the_wheel_with_torch(wheel, tmp_path):
    """``from tensorlane import shim`` from the installed wheel (with the project's torch)."""
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                    str(target), str(wheel[0])], check=True, capture_output=True, timeout=300)
    code = "from tensorlane import shim; import torch; print(shim.__file__); print(callable(shim.attach))"
    env = dict(os.environ, PYTHONPATH=str(target))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                         cwd=tmp_path, check=True)
    path, ok = out.stdout.split()
    assert path.startswith(str(target)) and ok == "True"


@pytest.mark.netns
def test_agent_runs_from_the_wheel_without_torch(wheel, tmp_path):
    """In an empty virtualenv the wheel installs only ``tensorlane`` and its three dependencies; its agent
    starts on a namespace's interface, answers ``tensorlane status`` and stops cleanly; torch is absent."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py, cli = venv / "bin" / "python", venv / "bin" / "tensorlane"
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(wheel[1]), str(wheel[0])],
                   check=True, capture_output=True, timeout=300)
    probe = subprocess.run([py, "-c", "import importlib.util as u; print(u.find_spec('torch') is None)"],
                           capture_output=True, text=True, check=True, timeout=60)
    assert probe.stdout.strip() == "True"
    version = subprocess.run([cli, "--version"], capture_output=True, text=True, check=True, timeout=60)
    assert version.stdout.strip() == f"tensorlane {metadata.version('tensorlane')}"
    sock = f"/run/tensorlane/twh-{os.getpid()}.sock"
    with Testbed(hosts=1, rate="100mbit", name="twh", shape_hosts=False) as tb:
        host = tb.host(1)
        conf = tmp_path / "agent.toml"  # a veth's driver speed is a placeholder: the rate is the config's
        conf.write_text(f'interface = "{host.ifname}"\nlink_rate = "100mbit"\n'  # (a state_dir of its own: an agent
                        f'state_dir = "{tmp_path / "state"}"\n')  # of the host's /run/tensorlane refused this one)
        agent = host.popen([str(cli), "agent", "--config", str(conf), "--socket", sock, "--metrics-address", ""],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 20
            status = None
            while time.monotonic() < deadline and agent.poll() is None:
                status = host.run([str(cli), "status", "--socket", sock, "--json"], check=False, timeout=10)
                if status.returncode == 0:
                    break
                time.sleep(0.2)
            assert status is not None and status.returncode == 0, (status and status.stderr, agent.poll())
            assert '"name": "eth0"' in status.stdout
        finally:
            agent.terminate()
            try:
                err = agent.communicate(timeout=20)[1]
            except subprocess.TimeoutExpired:
                agent.kill()
                err = agent.communicate()[1]
        assert agent.returncode == 0, err


def test_concurrent_netns_files_use_testbed_names_of_their_own():
    """make test runs the netns tests of files marked ``concurrent`` two files at a time: a testbed (or namespace)
    name used by two such files would have one file's ``up`` meet the other's testbed, now and then."""
    names: dict[str, str] = {}
    pattern = re.compile(r'Testbed\([^)]*name="([a-z0-9-]+)"|"TENSORLANE_TESTBED_NAME", "([a-z0-9-]+)"'
                         r'|"netns", "add", "([a-z0-9-]+)"')
    files = sorted(p for p in (REPO / "tests").glob("test_*.py") if "pytest.mark.concurrent" in p.read_text())
    assert len(files) >= 9, files  # (the files marked 2026-11-28)
    clashes = []
    for path in files:
        for found in {n for m in pattern.finditer(path.read_text()) for n in m.groups() if n}:
            if names.setdefault(found, path.name) != path.name:
                clashes.append((found, names[found], path.name))
    assert not clashes, f"testbed names used by two concurrent files: {clashes}"
