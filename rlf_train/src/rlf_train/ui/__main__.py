"""`python -m rlf_train.ui`."""

import sys

from rlf_train.ui.app import main

sys.exit(main())
