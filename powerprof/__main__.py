"""`python -m powerprof`: the `powerprof` command, for a venv whose scripts folder is not on PATH.

It failed with "No module named powerprof.__main__". Through `entry`, as the console script, so that
`python -m powerprof tune` records its kill switch as early."""

import sys

from powerprof.entry import main

if __name__ == "__main__":
    sys.exit(main())
