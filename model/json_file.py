"""JSON files from outside (a config.json, a safetensors index or header, an SAE's cfg.json): read with a
one-line error, and their values shown in messages without letting a hostile file flood or break them."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeGuard

CLIP = 100  # characters of a value a message shows


def read_json(path: Path, error: Callable[[str], Exception], what: str) -> Any:
    """The JSON value in the file `path`, or `error(message)` with a one-line message: unreadable, not JSON,
    or nested too deeply to parse (`what` says what the file should have been)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise error(f"cannot read {path}: {e.strerror or e}") from None
    except ValueError as e:  # not UTF-8, not JSON, or a number of more than 4300 digits
        raise error(f"{path} is not valid JSON: {e}") from None
    except RecursionError:
        raise error(f"{path} is not {what}: its JSON is nested too deeply") from None


def is_int(value: object) -> TypeGuard[int]:
    """An integer, not a bool (Python's bool is an int, but JSON's true is not a count, a size or an id)."""
    return isinstance(value, int) and not isinstance(value, bool)


def clip(value: object, show: Callable[[object], str] = repr) -> str:
    """`value` for a one-line message, cut to CLIP characters; never raises. A hostile file can hold
    megabyte-long names, and values that cannot be shown at all: nested deeper than Python's recursion
    allows here (json parsed them higher up the stack), or integers of more than 4300 digits (computed
    from smaller ones). `show`: repr, or json.dumps for a value in the file's own spelling; both escape
    line breaks."""
    try:
        text = show(value)
    except (RecursionError, ValueError):
        return "(a value too large or nested too deeply to show)"
    return text if len(text) <= CLIP else text[:CLIP] + "..."
