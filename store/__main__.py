import sys

from rollshard.store.commands import main

sys.exit(main())
