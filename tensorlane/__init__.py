"""tensorlane: network-level priority for data-parallel training traffic. See README.md.

``tensorlane.agent`` (the per-host daemon), ``tensorlane.shim`` (imported by training code) and
``tensorlane.policies`` (pure scheduling functions) live in the repository's agent/, shim/ and policies/ folders.
"""
import importlib.util
import os
import sys
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("tensorlane")
except PackageNotFoundError:  # a source tree on sys.path without an install
    __version__ = "0+unknown"

_SUBPACKAGES = ("agent", "shim", "policies")
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _checkout_error(name: str) -> ImportError | None:
    """The error for ``tensorlane.NAME`` (agent, shim, policies) where this is a checkout's ``tensorlane/`` folder,
    first on ``sys.path`` (a script run from the checkout's root) in front of a ``pip install .``: its subpackages
    live in the checkout's agent/, shim/ and policies/, which only an install maps. None elsewhere.
    Usage: ``err = _checkout_error("shim")``"""
    if name in _SUBPACKAGES and os.path.isdir(os.path.join(_CHECKOUT, name)) \
            and os.path.isfile(os.path.join(_CHECKOUT, "pyproject.toml")):
        return ImportError(
            f"tensorlane.{name} cannot be imported: this `tensorlane` is the folder {os.path.dirname(__file__)} "
            f"of a checkout, found on sys.path before any installed tensorlane (a script run from the "
            f"checkout's root). Run it from another folder, or install the checkout with `pip install -e .`",
            name=f"tensorlane.{name}")
    return None


class _CheckoutFinder:
    """Last on ``sys.meta_path``: ``import tensorlane.shim`` (or ``tensorlane.shim.lightning``, ``from
    tensorlane.policies.planner import ...``) that no other finder resolved gets ``_checkout_error``'s message,
    where it was Python's bare "No module named 'tensorlane.shim'". An editable install's finder comes first.
    Usage: ``sys.meta_path.append(_CheckoutFinder())``"""

    def find_spec(self, fullname, path=None, target=None):
        """Raise the checkout's error for ``tensorlane.SUBPACKAGE[...]``; None for every other name."""
        parts = fullname.split(".")
        err = _checkout_error(parts[1]) if len(parts) == 2 and parts[0] == "tensorlane" else None
        if err is not None:
            raise err
        return None


if _checkout_error("shim") is not None and not any(isinstance(f, _CheckoutFinder) for f in sys.meta_path):
    sys.meta_path.append(_CheckoutFinder())


def __getattr__(name: str):
    """``from tensorlane import shim`` in a checkout's folder (``_checkout_error``): say so, instead of Python's
    "cannot import name"."""
    if name in _SUBPACKAGES and importlib.util.find_spec(f"tensorlane.{name}") is None:
        raise _checkout_error(name) or AttributeError(f"module 'tensorlane' has no attribute {name!r}")
    raise AttributeError(f"module 'tensorlane' has no attribute {name!r}")
