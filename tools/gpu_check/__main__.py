"""`python -m tools.gpu_check`: see the package's docstring."""

import os
import sys

from tools.gpu_check.command import main

status = main()
# Every file is written and closed and the summary printed: end without the interpreter's
# teardown, whose unwinding of torch's and Triton's state after an interrupt crashed once (CI,
# 2026-12-03: SIGSEGV after the summary of a run interrupted in its bench stage, exit 139 where 130
# was due; not seen again in 40 interrupted reruns here, idle or loaded), so that the exit status
# is the run's.
sys.stdout.flush()
sys.stderr.flush()
os._exit(status)
