"""A command-line flag whose value is JSON (`gpt2-generate --steer`, `gpt2-analyze --metric`), read as the
HTTP API reads that field of a request: each object naming a key once, the API's own schema, and an error
in the server's words, on one line and cut short (a value can be megabytes long)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from model.json_file import clip

T = TypeVar("T")
LONGEST = 1000  # characters of a problem shown


def read_json_flag(flag: str, text: str, validate: Callable[[Any], T], error: Callable[[str], Exception]) -> T:
    """`validate` (a pydantic model's or TypeAdapter's `validate_python`) of the JSON `text`; for text that is
    not JSON, names a key twice, or that `validate` refuses, `error(message)` is raised, the message naming
    `flag` and the text."""
    from pydantic import ValidationError

    from server.errors import validation_message
    from server.json_body import DuplicateKeyError, loads

    value: Any = None
    try:
        value = loads(text.encode())
        return validate(value)
    except DuplicateKeyError as e:
        problem = f"names the key {e.param!r} more than once"
    except ValidationError as e:
        problem = validation_message(e.errors(), value)[0]
    except (ValueError, RecursionError) as e:  # not JSON (or not UTF-8), nested too deeply, 4300+ digits
        problem = f"not valid JSON: {e}"
    problem = problem.replace("\r", "\\r").replace("\n", "\\n")
    shown = problem if len(problem) <= LONGEST else problem[:LONGEST] + "..."
    raise error(f"{flag} ({clip(text)}): {shown}") from None
