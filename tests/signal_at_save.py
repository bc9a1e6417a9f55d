"""Run `fastformer ARGS...` and send this process SIGNAL at its n-th call of torch.save.

    python tests/signal_at_save.py SIGKILL 4 train --out runs/x ...

For tests/test_run_safety.py: a kill or Ctrl-C at a chosen point, with no hook in fastformer itself.
"""

import os
import signal
import sys

import torch

from fastformer.cli import main

signum, at_call = getattr(signal, sys.argv[1]), int(sys.argv[2])
# the signal as a terminal delivers it, even where the tests run as a background job (which ignores
# SIGINT) or under nohup (which ignores SIGHUP, and fastformer then leaves it ignored); SIGKILL has
# no disposition to set
if signum != signal.SIGKILL:
    signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
real_save = torch.save
calls = 0


def save_then_signal(obj, f, *args, **kwargs):
    global calls
    calls += 1
    if calls == at_call:
        os.kill(os.getpid(), signum)
    return real_save(obj, f, *args, **kwargs)


torch.save = save_then_signal
sys.exit(main(sys.argv[3:]))
