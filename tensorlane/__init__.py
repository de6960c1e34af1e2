"""tensorlane: network-level priority for data-parallel training traffic. See README.md."""
__version__ = "0.1.0"
