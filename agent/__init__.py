"""tensorlane agent: the per-host privileged daemon. Never imports torch."""
