import sys

from rollshard.train.cli import main

sys.exit(main())
