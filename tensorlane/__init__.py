"""tensorlane: network-level priority for data-parallel training traffic. See README.md.

``tensorlane.agent`` (the per-host daemon), ``tensorlane.shim`` (imported by training code) and
``tensorlane.policies`` (pure scheduling functions) live in the repository's agent/, shim/ and policies/ folders.
"""
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("tensorlane")
except PackageNotFoundError:  # a source tree on sys.path without an install
    __version__ = "0+unknown"
