"""tensorlane: network-level priority for data-parallel training traffic. See README.md.

``tensorlane.agent`` (the per-host daemon), ``tensorlane.shim`` (imported by training code) and
``tensorlane.policies`` (pure scheduling functions) live in the repository's agent/, shim/ and policies/ folders.
"""
import importlib.util
import os
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("tensorlane")
except PackageNotFoundError:  # a source tree on sys.path without an install
    __version__ = "0+unknown"


def __getattr__(name: str):
    """``from tensorlane import shim`` where this is a checkout's ``tensorlane/`` folder, first on ``sys.path``
    (a script run from the checkout's root) in front of a ``pip install .``: its subpackages live in the checkout's
    agent/, shim/ and policies/, which only an install maps. Say so, instead of Python's "cannot import name"."""
    if name in ("agent", "shim", "policies"):
        checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        if (os.path.isdir(os.path.join(checkout, name)) and os.path.isfile(os.path.join(checkout, "pyproject.toml"))
                and importlib.util.find_spec(f"tensorlane.{name}") is None):
            raise ImportError(
                f"tensorlane.{name} cannot be imported: this `tensorlane` is the folder {os.path.dirname(__file__)} "
                f"of a checkout, found on sys.path before any installed tensorlane (a script run from the "
                f"checkout's root). Run it from another folder, or install the checkout with `pip install -e .`",
                name=f"tensorlane.{name}")
    raise AttributeError(f"module 'tensorlane' has no attribute {name!r}")
