"""``python -m ems.bench`` = ``ems bench``."""

import sys

from ems.bench.runner import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
