import sys

from rollshard.generate.cli import main

sys.exit(main())
