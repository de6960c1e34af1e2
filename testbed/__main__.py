"""``python -m testbed up|down|list`` (see testbed.topology.main)."""
import sys

from testbed.topology import main

sys.exit(main())
