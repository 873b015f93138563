"""What a long command shows while it works: a progress bar on stderr, drawn only when stderr is a terminal,
and, around a library that prints a lot (gptqmodel), its output kept in a log while one line of ours moves.

Knows terminals, file descriptors and the one text of gptqmodel's it reads ("Quantizing layer I of N").
Does not know what the command does: the caller says what to count and what to call it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

import typer

# NOTE: gptqmodel 7.6's layer bar reads "Quantizing layer {index} of {count - 1}" (looper/stage_layer.py).
LAYER = re.compile(rb"Quantizing layer (\d+) of (\d+)")
TICK_S = 1.0


class _NoBar:
    def update(self, n: int) -> None:
        pass


@contextlib.contextmanager
def progress_bar(*, length: int, label: str) -> Iterator:
    """A bar on stderr with .update(n); nothing at all when stderr is not a terminal (a CI log, a pipe)."""
    if not sys.stderr.isatty():
        yield _NoBar()
        return
    with typer.progressbar(length=length, label=label, file=sys.stderr) as bar:
        yield bar


@contextlib.contextmanager
def output_to_log(log_path: Path) -> Iterator[TextIO]:
    """Everything the process prints while the block runs goes to log_path: sys.stdout and sys.stderr, file
    descriptors 1 and 2 (C code, streams a library kept) and every logging handler bound to the terminal.
    Yields a stream to the terminal's stderr for the command's own lines."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    # NOTE: where sys.stderr is file descriptor 2, our lines go to a copy of it (2 itself goes to the log);
    # where it is something else (a test runner's buffer), to that.
    is_fd2 = _fileno(sys.stderr) == 2
    terminal = os.fdopen(os.dup(2), "w", buffering=1) if is_fd2 else sys.stderr
    saved_fds = (os.dup(1), os.dup(2))
    with open(log_path, "a", buffering=1) as log:
        handlers = _terminal_handlers()
        try:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            for handler in handlers:
                handler.setStream(log)
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                yield terminal
        finally:
            log.flush()
            for handler, stream in handlers.items():
                handler.setStream(stream)
            os.dup2(saved_fds[0], 1)
            os.dup2(saved_fds[1], 2)
            for fd in saved_fds:
                os.close(fd)
            if is_fd2:
                terminal.close()


def _fileno(stream: TextIO) -> int | None:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):  # NOTE: io.UnsupportedOperation is an OSError
        return None


def _terminal_handlers() -> dict[logging.StreamHandler, TextIO]:
    """Every logging handler that writes to this process's stdout or stderr -> its stream."""
    loggers = [logging.getLogger(), *(v for v in logging.Logger.manager.loggerDict.values()
                                      if isinstance(v, logging.Logger))]
    streams = (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)
    return {h: h.stream for lg in loggers for h in lg.handlers
            if type(h) is logging.StreamHandler and any(h.stream is s for s in streams)}


class LayerTicker:
    """One line on a terminal, redrawn every second: what runs, the layer gptqmodel's log last named, the time.

    say() prints a line of the command's own above it. At the end the line's last state stays. On a stream
    that is not a terminal it draws nothing and say() prints plain lines.
    """

    def __init__(self, terminal: TextIO, *, label: str, log_path: Path) -> None:
        self.terminal, self.label, self.log_path = terminal, label, log_path
        self.is_drawn = terminal.isatty()
        self.started = time.monotonic()
        self.layer: tuple[int, int] | None = None
        self._offset = log_path.stat().st_size if log_path.exists() else 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="layer-ticker", daemon=True)

    def __enter__(self) -> LayerTicker:
        if self.is_drawn:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if not self.is_drawn:
            return
        self._read_layer()  # NOTE: the last layers may have passed between two ticks
        self._clear()
        if self.layer is not None:
            self.terminal.write(self.line() + "\n")  # the line's last state stays, as a summary
            self.terminal.flush()

    def say(self, message: str) -> None:
        with self._lock:
            self._clear()
            self.terminal.write(message + "\n")
            self.terminal.flush()

    def line(self) -> str:
        elapsed = int(time.monotonic() - self.started)
        where = f"layer {self.layer[0]} of {self.layer[1]}" if self.layer else "starting"
        return f"{self.label}: {where} ({elapsed // 60} min {elapsed % 60:02d} s)"

    def _run(self) -> None:
        while not self._stop.wait(TICK_S):
            self._read_layer()
            with self._lock:
                self.terminal.write("\r\033[K" + self.line())
                self.terminal.flush()

    def _read_layer(self) -> None:
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self._offset)
                chunk = log.read()
        except OSError:
            return
        # NOTE: keep a tail, so a match split across two reads is still found
        self._offset += max(0, len(chunk) - 64)
        matches = LAYER.findall(chunk)
        if matches:
            index, last = matches[-1]
            self.layer = (int(index) + 1, int(last) + 1)

    def _clear(self) -> None:
        if self.is_drawn:
            self.terminal.write("\r\033[K")
            self.terminal.flush()
