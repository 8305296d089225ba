"""Server settings from flags and `GPT2_<NAME>` variables: flags win, values are checked, and an error
names what the user wrote (the flag, or the variable)."""

from __future__ import annotations

import pytest

from server.settings import parse_settings


def test_flags_override_the_environment_which_overrides_defaults() -> None:
    env = {"GPT2_MAX_BATCH_SIZE": "4", "GPT2_PORT": "9000", "GPT2_CORS_ORIGINS": "http://a, http://b"}
    s = parse_settings(["--port", "9100"], environ=env)
    assert (s.max_batch_size, s.port, s.cors_origins, s.max_queue) == (4, 9100, ("http://a", "http://b"), 256)


def test_served_model_names() -> None:
    """--served-model-name repeats; its variable holds several, comma-separated; the flag wins."""
    assert parse_settings([], environ={}).served_model_name == ()
    env = {"GPT2_SERVED_MODEL_NAME": "gpt2, my-gpt2,"}
    assert parse_settings([], environ=env).served_model_name == ("gpt2", "my-gpt2")
    flags = ["--served-model-name", "a", "--served-model-name", "b"]
    assert parse_settings(flags, environ=env).served_model_name == ("a", "b")


@pytest.mark.parametrize(
    ("argv", "env", "says"),
    [
        ([], {"GPT2_MAX_BATCH_SIZE": "abc"}, "GPT2_MAX_BATCH_SIZE must be an integer, got 'abc'"),
        (["--max-batch-size", "abc"], {}, "argument --max-batch-size: invalid int value: 'abc'"),
        ([], {"GPT2_MAX_QUEUE": "0"}, "GPT2_MAX_QUEUE must be at least 1, got 0"),
        ([], {"GPT2_LOG_LEVEL": "trace"}, "GPT2_LOG_LEVEL must be one of"),
        ([], {"GPT2_MAX_DUMP_BYTES_IN_FLIGHT": "0"}, "GPT2_MAX_DUMP_BYTES_IN_FLIGHT must be at least 1, got 0"),
        ([], {"GPT2_MAX_DUMP_BYTES_IN_FLIGHT": "1GB"}, "GPT2_MAX_DUMP_BYTES_IN_FLIGHT must be an integer, got '1GB'"),
        (["--max-dump-bytes-in-flight", "-5"], {}, "--max-dump-bytes-in-flight must be at least 1, got -5"),
        # a flag's bad value names the flag, not the variable
        (["--sae", "res8"], {}, "--sae must be ID=PATH"),
        (["--cors-origins", "x"], {"GPT2_MAX_QUEUE": "q"}, "GPT2_MAX_QUEUE must be an integer"),
        # names torch knows but nothing here runs on: refused at once, not served (or crashed on) after binding
        ([], {"GPT2_DEVICE": "meta"}, "GPT2_DEVICE: unknown device 'meta'; use auto, cpu, cuda, cuda:N or mps"),
        (["--device", "xpu"], {}, "--device: unknown device 'xpu'"),
        (["--preset", "gpt3"], {}, "--preset: unknown preset 'gpt3'; choose one of gpt2, "),
        ([], {"GPT2_DTYPE": "fp8"}, "GPT2_DTYPE: unknown dtype 'fp8'; use auto, float32, float16, bfloat16 or int8"),
        # empty: a host that would bind every interface, a key that no request can give
        ([], {"GPT2_HOST": ""}, "GPT2_HOST must not be empty"),
        ([], {"GPT2_API_KEY": ""}, "GPT2_API_KEY must not be empty"),
        # a key with outer whitespace (a Secret's trailing newline): a header never carries it, so none matches
        ([], {"GPT2_API_KEY": "secret\n"}, "GPT2_API_KEY must not begin or end with a space or tab"),
        (["--api-key", " secret"], {}, "--api-key must not begin or end with a space or tab"),
        (["--api-key", "sec\x01ret"], {}, "--api-key must not begin or end with a space or tab, nor hold a control"),
        ([], {"GPT2_REVISION": ""}, "GPT2_REVISION must not be empty"),
        (["--tokenizer", ""], {}, "--tokenizer must not be empty"),
        # an origin no browser sends: it would silently allow nothing
        (["--cors-origins", "http://a.example/"], {}, "--cors-origins: 'http://a.example/' is not an origin"),
        ([], {"GPT2_CORS_ORIGINS": "a.example"}, "GPT2_CORS_ORIGINS: 'a.example' is not an origin (scheme://"),
        (["--cors-origins", "HTTP://A.example"], {}, "--cors-origins: 'HTTP://A.example' is not an origin"),
        (["--host", "[]"], {}, "--host must not be empty"),  # not every interface
    ],
)
def test_a_bad_value_is_a_usage_error_naming_it(
    argv: list[str], env: dict[str, str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_settings(argv, environ=env)
    assert exit_info.value.code == 2
    assert says in capsys.readouterr().err


def test_a_key_a_header_can_carry_is_taken() -> None:
    """Inner spaces and tabs, non-ASCII characters (sent as UTF-8), and a non-breaking space at the end, which
    HTTP does not strip (Python's str.strip() would)."""
    for key in ("two words", "tab\there", "s3cret-ключ", "ends-in-nbsp\u00a0"):
        assert parse_settings(["--api-key", key], environ={}).api_key == key


def test_an_ipv6_host_in_brackets_and_origins_as_browsers_send_them() -> None:
    """`[::1]`, as a URL spells an IPv6 address, binds ::1 (the brackets failed as a host name); origins with a
    port, or `*`, are taken as given."""
    assert parse_settings(["--host", "[::1]"], environ={}).host == "::1"
    origins = ("http://a.example:8080", "https://b.example", "http://[::1]:8080", "null", "*")  # null: file://
    assert parse_settings(["--cors-origins", ",".join(origins)], environ={}).cors_origins == origins


def test_a_valid_flag_overrides_a_bad_variable() -> None:
    assert parse_settings(["--max-batch-size", "8"], environ={"GPT2_MAX_BATCH_SIZE": "abc"}).max_batch_size == 8


def test_the_devices_this_project_runs_on_are_accepted() -> None:
    for device in ("auto", "cpu", "cuda", "cuda:1", "mps"):
        assert parse_settings(["--device", device], environ={}).device == device


def test_the_dump_budget_defaults_to_four_of_the_largest_dump() -> None:
    """Four dumps of --max-activation-bytes at once, unless --max-dump-bytes-in-flight says otherwise."""
    env = {"GPT2_MAX_ACTIVATION_BYTES": "1000"}
    assert parse_settings([], environ=env).dump_bytes_in_flight == 4000
    assert parse_settings(["--max-dump-bytes-in-flight", "1500"], environ=env).dump_bytes_in_flight == 1500
    assert parse_settings([], environ={}).dump_bytes_in_flight == 4 * 256 * 2**20


def test_the_help_gives_each_default(capsys: pytest.CaptureFixture[str]) -> None:
    """`gpt2-serve --help` shows a setting's default where its own help does not already say it."""
    with pytest.raises(SystemExit) as exit:
        parse_settings(["--help"], environ={})
    assert exit.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for shown in (
        "port to listen on (default: 8000)",
        "(default: 16) [env GPT2_MAX_BATCH_SIZE]",
        "(default: 120.0) [env GPT2_DRAIN_TIMEOUT]",
        "(default: 512 CUDA, 64 otherwise) [env",
    ):
        assert shown in text
    assert "(default: None)" not in text and "(default: ())" not in text
    assert text.count("default") == text.count("(default: ") + text.count("by default")
