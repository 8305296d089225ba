"""deploy/: the Kubernetes manifests against Kubernetes' own schemas (kubernetes-validate, offline, strict:
an unknown or misspelt field fails), their references to each other and to the image, and the Ray Serve
config against Serve's schema and this project's builder."""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from server.settings import parse_settings

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")

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


def test_the_kustomization_applies_every_manifest() -> None:
    listed = set(yaml.safe_load((KUBE / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in KUBE.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(manifests()) == {"Deployment", "Service", "HorizontalPodAutoscaler", "PersistentVolumeClaim"}


@pytest.mark.parametrize("kind", ["Deployment", "Service", "HorizontalPodAutoscaler", "PersistentVolumeClaim"])
def test_each_manifest_is_valid_kubernetes(kind: str) -> None:
    kubernetes_validate.validate(manifests()[kind], KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("spec", "replica"), 2),  # a misspelt field
        (("spec", "replicas"), "two"),  # a wrong type
        (("spec", "template", "spec", "containers", 0, "readinessProbe", "httpGet", "port"), {"name": "http"}),
    ],
)
def test_a_broken_manifest_fails_validation(path: tuple[Any, ...], value: Any) -> None:
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
    (container,) = pod["spec"]["containers"]
    (port,) = container["ports"]
    env = {e["name"]: e["value"] for e in container["env"]}
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
