"""How the command-line tools end: `main()`'s return value is the exit status, and Ctrl-C prints one line
instead of a traceback, then ends the process by SIGINT, as Python's own handling does. A shell waiting
on the tool sees it killed by the signal and stops too (bash carries on with a loop after a child that
merely exits 130). A reader of the output that goes away (`| head -1`) ends it silently by SIGPIPE, as it
ends `cat` (Python ignores the signal and raises `BrokenPipeError` instead).

A second Ctrl-C, during the first one's clean-up, ends the process at once (`_interrupt_once`). SIGTERM
(`kill`, `timeout`, `docker stop`) is taken as Ctrl-C is (`Terminated`): the same clean-up and line, then
the process ends by SIGTERM (a shell sees 143). Once the work is over (`main` has returned, its output whole),
either ends the tool at once, by its signal, without a line.

The installed commands start here (`generate`, `analyze`, `harvest`), importing their module inside
`run_console`, with a Ctrl-C held until the import is over (`held_interrupt`: one inside torch's C++
aborted the process, or left numpy half imported), then the same one line. `empty_flag` is the check the
three share before any work, `takes_negative_values` how their parsers read a value such as -1e-3."""

from __future__ import annotations

import argparse
import importlib
import os
import re
import signal
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn, TextIO


def run_console(main: Callable[[], int], interrupted: str) -> NoReturn:
    sys.stderr = _Stderr(sys.stderr)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where it is ignored (nohup)
        signal.signal(signal.SIGINT, _interrupt_once)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _terminate_once)
    try:
        status = main()
        _default_signals()  # the work is over: a Ctrl-C or SIGTERM now ends the tool at once, without a line
    except KeyboardInterrupt:
        # which signal, as `_terminate_once` noted it (a library may raise a KeyboardInterrupt of its own for it)
        stop = signal.SIGTERM if _signals.terminated else signal.SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # another signal, while this one is said, ends it at once
        _default_signals()
        print(f"\n{interrupted}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), stop)
        status = 128 + stop  # not reached where the signal ends the process, as it does on POSIX
    except BrokenPipeError:
        # what is left in stdout's buffer goes nowhere (flushed at exit, it would raise again)
        if sys.stdout is not None:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        if hasattr(signal, "SIGPIPE"):
            signal.signal(signal.SIGPIPE, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGPIPE)
        status = 1  # not reached where SIGPIPE ends the process
    sys.exit(status)


class _Stderr:
    """Standard error that cannot fail the tool. Closed (`2>&-`), Python makes it None and `print(file=None)`
    writes to standard output, into the text; full or broken (`2>/dev/full`), a status line would raise
    after the work was done (and an unflushed line at exit makes the status 120). Its lines then go nowhere."""

    def __init__(self, stream: TextIO | None) -> None:
        self._stream = stream if stream is not None else self._nowhere()

    @staticmethod
    def _nowhere() -> TextIO:
        return open(os.devnull, "w", encoding="utf-8")

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError:
            self._stream = self._nowhere()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError:
            self._stream = self._nowhere()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised as Ctrl-C's KeyboardInterrupt is (every clean-up that takes Ctrl-C takes it too)."""


class _Signals:
    terminated = False  # a SIGTERM came: the process ends by it, whatever became of its `Terminated`


_signals = _Signals()


def _default_signals() -> None:
    """SIGINT's and SIGTERM's default actions back, where `run_console` took them (not where they are ignored):
    once the work is over, one ends the tool at once, by its signal (a KeyboardInterrupt raised as the
    interpreter exits was a traceback, "Exception ignored in atexit callback")."""
    for signum, handler in ((signal.SIGINT, _interrupt_once), (signal.SIGTERM, _terminate_once)):
        if signal.getsignal(signum) is handler:
            signal.signal(signum, signal.SIG_DFL)


def _terminate_once(signum: int, frame: object) -> None:
    """SIGTERM as `Terminated`, once: a second one, during the first one's clean-up, ends the process at once."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _signals.terminated = True
    raise Terminated


def _interrupt_once(signum: int, frame: object) -> None:
    """Python's Ctrl-C, a KeyboardInterrupt, once: a second one, while the first one's clean-up runs (a
    generator closed as its frame goes, a harvest letting go of its files), ends the process by SIGINT at
    once, where it broke into that clean-up (Python printed "Exception ignored in ..." and a traceback)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    raise KeyboardInterrupt


# A flag's value that begins with '-' and a digit (-1e-3, -5=1, -.5) or is a number's word (-inf, -nan), as
# Python 3.13's argparse reads the first: 3.10-3.12's took only -1 and -0.5 for values, and any other such
# word for an unknown flag ("--presence-penalty: expected one argument")
NEGATIVE_VALUE = re.compile(r"-\.?\d|-(inf|infinity|nan)$", re.IGNORECASE)


def takes_negative_values(parser: argparse.ArgumentParser) -> None:
    """Make `parser` read a word that begins with '-' and a digit, or that is -inf or -nan, as a value (the
    tools have no flag that looks like a number, nor a one-letter one, -i or -n, that argparse would find in
    -inf or -nan first)."""
    parser._negative_number_matcher = NEGATIVE_VALUE  # argparse's own test, widened


def empty_flag(flags: Iterable[tuple[str, str | None]]) -> str | None:
    """The error for the first (flag, value) given as an empty string, which a path would read as the
    current directory and a name as nothing; None when there is none."""
    for flag, value in flags:
        if value == "":
            return f"{flag} is empty: give a name or a path"
    return None


HARVEST_INTERRUPTED = "interrupted; run it again with the same arguments to resume"


@contextmanager
def held_interrupt() -> Iterator[None]:
    """Hold a Ctrl-C (SIGINT) or a SIGTERM that comes during the block, and raise it (KeyboardInterrupt,
    `Terminated`) once the block is over: an import of torch or numpy interrupted midway can abort the process
    (a C++ terminate) or leave a module that cannot be imported again. A signal ignored (nohup, `&` in a
    script) stays so; a second one during the block is held too."""
    came: list[int] = []
    held = [s for s in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(s) is not signal.SIG_IGN]
    previous = {s: signal.signal(s, lambda signum, frame: came.append(signum)) for s in held}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if signal.SIGTERM in came:
        _signals.terminated = True
        raise Terminated
    if came:
        raise KeyboardInterrupt


def _command(module: str, name: str, interrupted: str = "interrupted") -> NoReturn:
    def main() -> int:
        with held_interrupt():
            tool = importlib.import_module(f"gpt2_scripts.{module}")
        status: int = tool.main()
        return status

    run_console(main, f"{name}: {interrupted}")


def generate() -> NoReturn:
    """The `gpt2-generate` command."""
    _command("generate", "gpt2-generate")


def analyze() -> NoReturn:
    """The `gpt2-analyze` command."""
    _command("analyze", "gpt2-analyze")


def harvest() -> NoReturn:
    """The `gpt2-harvest` command."""
    _command("harvest", "gpt2-harvest", HARVEST_INTERRUPTED)
