"""``python -m ems.demo``: the same as ``ems demo`` (and how ``--instances`` starts workers)."""

import sys

from ems.demo import main

if __name__ == "__main__":
    sys.exit(main())
