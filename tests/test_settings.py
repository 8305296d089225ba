"""Server settings from flags and `GPT2_<NAME>` variables: flags win, values are checked, and an error
names what the user wrote (the flag, or the variable)."""

from __future__ import annotations

import pytest

from server.settings import parse_settings


def test_flags_override_the_environment_which_overrides_defaults() -> None:
    env = {"GPT2_MAX_BATCH_SIZE": "4", "GPT2_PORT": "9000", "GPT2_CORS_ORIGINS": "http://a, http://b"}
    s = parse_settings(["--port", "9100"], environ=env)
    assert (s.max_batch_size, s.port, s.cors_origins, s.max_queue) == (4, 9100, ("http://a", "http://b"), 256)


@pytest.mark.parametrize(
    ("argv", "env", "says"),
    [
        ([], {"GPT2_MAX_BATCH_SIZE": "abc"}, "GPT2_MAX_BATCH_SIZE must be an integer, got 'abc'"),
        (["--max-batch-size", "abc"], {}, "argument --max-batch-size: invalid int value: 'abc'"),
        ([], {"GPT2_MAX_QUEUE": "0"}, "max_queue must be at least 1, got 0"),
        ([], {"GPT2_LOG_LEVEL": "trace"}, "log_level must be one of"),
    ],
)
def test_a_bad_value_is_a_usage_error_naming_it(
    argv: list[str], env: dict[str, str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_settings(argv, environ=env)
    assert exit_info.value.code == 2
    assert says in capsys.readouterr().err


def test_a_valid_flag_overrides_a_bad_variable() -> None:
    assert parse_settings(["--max-batch-size", "8"], environ={"GPT2_MAX_BATCH_SIZE": "abc"}).max_batch_size == 8
