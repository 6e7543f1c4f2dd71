import sys

from pagedflash.cli import main

sys.exit(main())
