"""``python -m meta_dist.checkpoint info|consolidate ...``: runs ``cli.main``.

Imports cli.py; run by ``python -m``, imported by nobody.
"""

import sys

from meta_dist.checkpoint.cli import main

if __name__ == "__main__":
    sys.exit(main())
