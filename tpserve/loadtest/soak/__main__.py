"""``python -m tpserve.loadtest.soak``: the same as ``tpserve soak``."""

import sys

from tpserve.loadtest.soak.run import main

sys.exit(main())
