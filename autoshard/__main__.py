import sys

from autoshard.tools.cli import main

sys.exit(main())
