"""What reaches the terminal: every string a command prints (paths, prompts, names from a plan, a profile or a
checkpoint's files, library warnings) is shown with its control characters escaped, so that a file cannot clear
the screen, restyle it, move the cursor, ring the bell, overwrite a line with a carriage return or reorder the text
with a bidi override.

`shown` escapes a string; `SafeConsole` is a rich Console that passes every string it renders through it (rich's
markup escape only covers `[`, and markup=False does not stop an ESC); `escaped_output` does the same, for the
length of a command, to Python warnings and log records, which libraries print on their own.
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from typing import Any, Iterator

from rich.console import Console

__all__ = ["SafeConsole", "escaped_output", "json_shown", "shown"]

# C0 but tab and newline, DEL, C1; the Unicode line and paragraph separators; the bidi marks, embeddings, overrides
# and isolates (U+061C, U+200E/F, U+202A-E, U+2066-9)
_CONTROL = "\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069"
_UNSAFE = re.compile(f"[{_CONTROL}]")
_UNSAFE_OR_NEWLINE = re.compile(f"[{_CONTROL}\t\n]")
_UNSAFE_IN_JSON = re.compile("[\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]")  # JSON escapes C0 itself


_NAMED = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}


def _escape(match: re.Match) -> str:
    char = match.group()
    code = ord(char)
    return _NAMED.get(char) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def shown(text: str, one_line: bool = False) -> str:
    """`text` with every control character written out as Python's repr writes it (ESC as `\\x1b`, CR as `\\r`,
    a bidi override as `\\u202e`); newlines and tabs kept, unless `one_line`."""
    return (_UNSAFE_OR_NEWLINE if one_line else _UNSAFE).sub(_escape, text)


def json_shown(text: str) -> str:
    """JSON text (a serialiser's: C0 already escaped) with the other control characters escaped as JSON escapes
    them (`\\u009b`): the same document, safe on a terminal. They can only be inside its strings."""
    return _UNSAFE_IN_JSON.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


class SafeConsole(Console):
    """A rich Console whose every string (printed, or a table's cell) has its control characters escaped before
    rich reads its markup."""

    def render_str(self, text: str, **kwargs: Any):  # type: ignore[override]
        """rich's render_str of the escaped `text`."""
        return super().render_str(shown(text), **kwargs)


class _EscapedRecord(logging.LogRecord):
    """A log record whose message comes out escaped, whichever handler prints it."""

    def getMessage(self) -> str:  # noqa: N802 (logging's name)
        return shown(super().getMessage())


@contextlib.contextmanager
def escaped_output() -> Iterator[None]:
    """Within: warnings and log records are shown escaped (`shown`), whoever raises them."""
    show, factory = warnings.showwarning, logging.getLogRecordFactory()

    def show_escaped(message, category, filename, lineno, file=None, line=None):
        show(shown(str(message)), category, filename, lineno, file, line)

    warnings.showwarning = show_escaped
    if factory is logging.LogRecord:  # a factory of someone else's is left alone
        logging.setLogRecordFactory(_EscapedRecord)
    try:
        yield
    finally:
        warnings.showwarning = show
        logging.setLogRecordFactory(factory)
