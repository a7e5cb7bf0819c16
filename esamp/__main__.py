"""``python -m esamp``: the ``esamp`` command."""

import sys

from esamp.commands.cli import main

sys.exit(main())
