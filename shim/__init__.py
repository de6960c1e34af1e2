"""Training-side shim of tensorlane: finds the TCP flows that a training process opened and reports them to the
per-host agent. ``shim.flows`` reads /proc only (no torch, no privileges).
"""
