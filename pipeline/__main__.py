"""`python -m pipeline ...`: the same entrypoint locally and under `ray job submit`."""

import sys

from pipeline.run.cli import main

if __name__ == "__main__":
    sys.exit(main())
