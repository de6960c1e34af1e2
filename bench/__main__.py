"""``python -m bench NAME [ARGS]`` from a checkout (see bench.main)."""
import sys

from bench import main

sys.exit(main())
