"""`python -m tools.gpu_check`: see the package's docstring."""

import sys

from tools.gpu_check.command import main

sys.exit(main())
