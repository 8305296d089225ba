"""deploy/: the Kubernetes manifests against Kubernetes' own schemas (kubernetes-validate, offline, strict:
an unknown or misspelt field fails), their references to each other and to the image, and the Ray Serve
config against Serve's schema and this project's builder. And what a pod's life asks of the server: a drain
on SIGTERM that ends within the pod's grace period, and /health answered past the connection cap (the
liveness probe's)."""

from __future__ import annotations

import importlib
import json
import re
import signal
import socket
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
import yaml
from inprocess import wait_until
from serving import free_port, launch, shut_down, wait_ready
from test_connections import GUARD, http_exchange, running

from model.loading import LoadedModel
from server.connections import uvicorn_config
from server.settings import parse_settings

ROOT = Path(__file__).resolve().parents[1]
KUBE = ROOT / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.30"  # the oldest version still supported upstream when these were written


def manifests() -> dict[str, dict[str, Any]]:
    """Every resource the kustomization applies, by kind."""
    listed = yaml.safe_load((KUBE / "kustomization.yaml").read_text())["resources"]
    out = {}
    for name in listed:
        for doc in yaml.safe_load_all((KUBE / name).read_text()):
            out[doc["kind"]] = doc
    return out


KINDS = ["Deployment", "Service", "HorizontalPodAutoscaler", "PersistentVolumeClaim", "PodDisruptionBudget"]


@pytest.fixture
def kubernetes_validate() -> ModuleType:
    return pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")


def container_of(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def plain_env(container: dict[str, Any]) -> dict[str, str]:
    """The container's variables given as values (not those from a Secret, `valueFrom`)."""
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def test_the_kustomization_applies_every_manifest() -> None:
    listed = set(yaml.safe_load((KUBE / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in KUBE.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(manifests()) == set(KINDS)


@pytest.mark.parametrize("kind", KINDS)
def test_each_manifest_is_valid_kubernetes(kubernetes_validate: ModuleType, kind: str) -> None:
    kubernetes_validate.validate(manifests()[kind], KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("spec", "replica"), 2),  # a misspelt field
        (("spec", "replicas"), "two"),  # a wrong type
        (("spec", "template", "spec", "containers", 0, "readinessProbe", "httpGet", "port"), {"name": "http"}),
    ],
)
def test_a_broken_manifest_fails_validation(kubernetes_validate: ModuleType, path: tuple[Any, ...], value: Any) -> None:
    broken = manifests()["Deployment"]
    *parents, last = path
    node = broken
    for key in parents:
        node = node[key]
    node[last] = value
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_the_manifests_fit_together_and_fit_the_image() -> None:
    m = manifests()
    deployment, service, hpa, pvc = (
        m["Deployment"],
        m["Service"],
        m["HorizontalPodAutoscaler"],
        m["PersistentVolumeClaim"],
    )
    pod = deployment["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"] == labels
    assert service["spec"]["selector"] == labels
    container = container_of(deployment)
    (port,) = container["ports"]
    env = plain_env(container)
    assert port["containerPort"] == int(env["GPT2_PORT"])  # the port gpt2-serve listens on
    assert service["spec"]["ports"][0]["targetPort"] == port["name"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):  # 503 while loading, 200 when serving
        assert container[probe]["httpGet"] == {"path": "/health", "port": port["name"]}, probe
    assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"]
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": deployment["apiVersion"],
        "kind": "Deployment",
        "name": deployment["metadata"]["name"],
    }
    assert "replicas" not in deployment["spec"]  # the autoscaler's to set: a count here resets it at every apply
    (volume,) = pod["spec"]["volumes"]
    assert volume["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    (mount,) = container["volumeMounts"]
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert mount["name"] == volume["name"] and mount["mountPath"] == env["HF_HOME"]
    assert f"HF_HOME={env['HF_HOME']}" in dockerfile  # the image's hub cache
    user = re.search(r"^USER (\d+):(\d+)$", dockerfile, re.M)
    assert user is not None
    assert pod["spec"]["securityContext"]["runAsUser"] == int(user[1])
    settings = parse_settings(container["args"], environ=env)  # the args are gpt2-serve flags it accepts
    assert settings.port == port["containerPort"]


def test_a_stopping_pod_drains_within_its_grace_period() -> None:
    """Kubernetes kills a pod `terminationGracePeriodSeconds` after it starts stopping: the preStop wait and then
    gpt2-serve's drain (its settings, as the manifest gives them) must both fit, or a long stream is cut."""
    deployment = manifests()["Deployment"]
    container = container_of(deployment)
    settings = parse_settings(container["args"], environ=plain_env(container))
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert pre_stop >= 5  # long enough for the Service's endpoints to drop the pod before its listener closes
    assert grace >= pre_stop + settings.drain_timeout + 10, (grace, pre_stop, settings.drain_timeout)


def test_the_pod_meets_the_restricted_standard_and_reads_its_key_from_a_secret() -> None:
    deployment = manifests()["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    container = container_of(deployment)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    (key,) = [e for e in container["env"] if "valueFrom" in e]
    assert key["name"] == "GPT2_API_KEY"
    assert parse_settings([], environ={key["name"]: "k"}).api_key == "k"  # the variable gpt2-serve reads
    assert key["valueFrom"]["secretKeyRef"] == {"name": "gpt2-api-key", "key": "api-key", "optional": True}
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "kubectl create secret generic gpt2-api-key --from-literal=api-key=" in readme


def test_a_node_drain_leaves_a_pod_serving() -> None:
    m = manifests()
    labels = m["Deployment"]["spec"]["template"]["metadata"]["labels"]
    pdb = m["PodDisruptionBudget"]["spec"]
    assert pdb["selector"]["matchLabels"] == labels and pdb["maxUnavailable"] == 1
    assert m["HorizontalPodAutoscaler"]["spec"]["minReplicas"] >= 2


def test_the_uvicorn_config_bounds_the_drain() -> None:
    settings = parse_settings([], environ={"GPT2_DRAIN_TIMEOUT": "7.5"})
    assert uvicorn_config(lambda *_: None, settings).timeout_graceful_shutdown == 7.5  # type: ignore[arg-type]
    assert parse_settings([], environ={}).drain_timeout == 120.0  # Ray Serve's graceful_shutdown_timeout_s too


def test_sigterm_ends_a_request_in_flight_at_the_drain_timeout(tiny: Any, tokenizer_dir: Path, tmp_path: Path) -> None:
    """A real gpt2-serve with a 1 s drain, a request in flight (its body arriving slowly, within the body's 60 s
    deadline), then SIGTERM: the process exits at the drain's bound, not when the request would have ended, and
    the request cut there is answered a 503 in the API's shape (logged as one, without a traceback), not
    uvicorn's bare 500."""
    port, log = free_port(), tmp_path / "gpt2-serve.log"
    args = ["--model", str(tiny.path), "--tokenizer", str(tokenizer_dir), "--port", str(port)]
    process = launch([*args, "--drain-timeout", "1", "--body-timeout", "60"], log)
    try:
        wait_ready(process, f"http://127.0.0.1:{port}", log)
        with socket.create_connection(("127.0.0.1", port), timeout=GUARD) as slow:
            slow.sendall(b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            time.sleep(0.5)  # the request reaches the app, which waits for the rest of its body
            stopping = time.monotonic()
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=45)  # under the body's 60 s: at it, the drain was not bounded
            took = time.monotonic() - stopping
            answer = b""
            while chunk := slow.recv(65536):
                answer += chunk
        # uvicorn raises the signal again once it has shut down: the exit status a SIGTERM'd process has
        text = log.read_text(errors="replace")
        assert process.returncode == -signal.SIGTERM, text
        assert 1.0 <= took < 30.0, took  # the 1 s drain and the shutdown, far from the 60 s an unbounded one takes
        assert "timeout graceful shutdown exceeded" in text
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503 "), (answer, text)
        assert "did not finish within its drain timeout" in json.loads(body)["error"]["message"], answer
        assert "Traceback" not in text and '"path": "/v1/generate", "status": 503' in text, text
    finally:
        shut_down(process)


HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
MODELS = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"


def test_health_is_answered_past_the_connection_cap(loaded: LoadedModel) -> None:
    """A flood of connections fills the cap: other requests on a newer connection are refused, but the liveness
    probe's /health (a new connection each time) is answered, so Kubernetes does not restart a serving pod."""
    with running(loaded, max_connections=2, header_timeout=120.0) as r:
        flood = [r.connect() for _ in range(3)]
        try:
            wait_until(lambda: r.open_connections() == 3, timeout=GUARD)
            with r.connect() as probe:
                status, headers, _ = http_exchange(probe, HEALTH)
                assert status == 200 and headers["connection"] == "close"  # the cap still bounds what is held open
                assert probe.recv(1) == b""  # closed by the server
            with r.connect() as other:
                status, _, body = http_exchange(other, MODELS)
            assert status == 503 and "--max-connections" in body["error"]["message"]
            assert httpx.head(r.url + "/health", timeout=GUARD).status_code == 200  # HEAD, as a load balancer may
        finally:
            for sock in flood:
                sock.close()


def test_the_serve_config_is_valid_for_serve_and_for_the_builder() -> None:
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install -e '.[ray]')")
    from ray.serve.schema import ServeDeploySchema

    from server.ray_app import plan

    config = yaml.safe_load((ROOT / "deploy" / "serve.yaml").read_text())
    ServeDeploySchema.model_validate(config)
    (app,) = config["applications"]
    module, _, name = app["import_path"].partition(":")
    assert callable(getattr(importlib.import_module(module), name))
    p = plan(app["args"], environ={})
    assert p.options["autoscaling_config"]["max_replicas"] == app["args"]["max_replicas"]
    assert p.options["max_ongoing_requests"] == app["args"]["max_batch_size"] + app["args"]["max_queue"]
