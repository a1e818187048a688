"""``python -m attnum``: the command line (``attnum.cli``)."""
import sys

from attnum.cli import main

if __name__ == "__main__":
    sys.exit(main())
