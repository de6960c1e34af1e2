"""``python -m bench NAME [ARGS]`` from a checkout (see bench.main); Ctrl-C and SIGTERM clean up (bench.workers.cli)."""
from bench import main
from bench.workers import cli

cli(main, sigterm=True)
