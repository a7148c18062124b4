"""``python -m ems`` is the ``ems`` command."""

import sys

from ems.cli import main

sys.exit(main())
