"""`python -m rlf_train`."""

import sys

from rlf_train.cli import main

sys.exit(main())
