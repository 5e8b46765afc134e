"""``python -m dflash2_hf ...``: the ``dflash2`` command."""

import sys

from dflash2_cli import main

sys.exit(main())
