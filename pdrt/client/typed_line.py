"""Reading one line from a terminal key by key, so that a chat can send the draft as it is typed.

The terminal goes into cbreak mode (keys arrive at once, Ctrl-C still
interrupts) for the duration of one line; this module echoes what is typed,
handles backspace, and calls `on_change` with the whole line after every
key. Enter ends the line; Ctrl-D on an empty line is end of input.
"""

import codecs
import os
import sys
import termios
import tty
from collections.abc import Callable

BACKSPACES = ("\x7f", "\b")
END_OF_INPUT = "\x04"


def read_typed_line(prompt: str, on_change: Callable[[str], None]) -> str | None:
    """The line typed on the terminal (None at end of input), reporting every change as it happens."""
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    line = ""
    try:
        tty.setcbreak(fd, termios.TCSANOW)  # keep keys typed ahead of the prompt (TCSAFLUSH would drop them)
        # The prompt only once keys arrive one by one: a Ctrl-D typed on seeing it must not meet canonical mode.
        sys.stdout.write(prompt)
        sys.stdout.flush()
        while True:
            data = os.read(fd, 64)
            if not data:
                return None
            for char in decoder.decode(data):
                if char in ("\r", "\n"):
                    sys.stdout.write("\n")
                    sys.stdout.flush()
                    return line
                if char == END_OF_INPUT and not line:
                    sys.stdout.write("\n")
                    return None
                if char in BACKSPACES:
                    if line:
                        line = line[:-1]
                        sys.stdout.write("\b \b")
                elif char.isprintable():
                    line += char
                    sys.stdout.write(char)
                else:
                    continue
                sys.stdout.flush()
                on_change(line)
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)
