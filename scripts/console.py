"""How the command-line tools end: `main()`'s return value is the exit status, and Ctrl-C prints one line
instead of a traceback, then ends the process by SIGINT, as Python's own handling does. A shell waiting
on the tool sees it killed by the signal and stops too (bash carries on with a loop after a child that
merely exits 130)."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from typing import NoReturn


def run_console(main: Callable[[], int], interrupted: str) -> NoReturn:
    try:
        status = main()
    except KeyboardInterrupt:
        print(f"\n{interrupted}", file=sys.stderr, flush=True)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        status = 130  # not reached where SIGINT ends the process, as it does on POSIX
    sys.exit(status)
