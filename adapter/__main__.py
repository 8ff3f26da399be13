import sys

from adapter.ops.cli import main

sys.exit(main())
