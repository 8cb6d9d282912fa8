import sys

from netweave.cli import main

sys.exit(main())
