import sys

from tensorlane.cli import main

sys.exit(main())
