"""``python -m gateway.batch``: see :mod:`gateway.batch.cli`."""

import sys

from gateway.batch.cli import main

if __name__ == "__main__":
    sys.exit(main())
