import sys

from rollshard.store.cli import main

sys.exit(main())
