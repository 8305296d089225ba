"""The API on Ray Serve (server/ray_app.py): a local Ray instance started here (one for the session, loopback
only, no dashboard, no usage reports), two CPU replicas of a tiny random checkpoint behind Serve's proxy.
Sixteen concurrent clients get exactly what a single server gives; streams arrive token by token; a
client that hangs up frees its sequence in its replica; a replica killed mid-run fails its own streams
(not a hang), the other serves meanwhile, and Ray restarts it. Skipped where Ray is not installed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import safetensors.torch
import torch
from conftest import make_checkpoint
from contract import CMPL, GEN
from fastapi.testclient import TestClient
from inprocess import wait_until
from serving import free_port

pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install -e '.[ray]')")

import ray
from ray import serve

from model.loading import LoadedModel, load
from server.app import create_app
from server.ray_app import DEPLOYMENT, application, plan, vector_store_name
from server.settings import Settings

APP = "gpt2"
GUARD = 120.0  # seconds before a wait fails as hung (a guard, not a measured bound)
LONG = 1000  # tokens of a stream that is cut short: far more than are generated while a disconnect travels


@pytest.fixture(scope="session")
def ray_url() -> Iterator[str]:
    """One local Ray instance and Serve's proxy for the session (starting one costs about ten seconds);
    every Ray process is gone at the end."""
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # no usage report leaves the machine
    temp = tempfile.mkdtemp(prefix="ray-")  # short: Ray's socket paths live under it
    ray.init(
        num_cpus=2,
        object_store_memory=80 * 2**20,
        include_dashboard=False,
        _temp_dir=temp,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
        configure_logging=False,
    )
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        wait_until(lambda: not _processes_under(temp), timeout=GUARD)
        shutil.rmtree(temp, ignore_errors=True)


def _processes_under(temp: str) -> list[int]:
    """Processes whose command line names Ray's temp directory (the raylet, the GCS, workers)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and temp.encode() in (proc / "cmdline").read_bytes():
                found.append(int(proc.name))
        except OSError:
            continue
    return found


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The smallest shape that serves: 2 layers, 2 heads, d_model 32, a context of 1024 for long streams."""
    directory = tmp_path_factory.mktemp("ray-tiny")
    make_checkpoint(directory, n_layer=2, n_head=2, n_embd=32, n_positions=1024, seed=7)
    return directory


@pytest.fixture(scope="module")
def args(checkpoint: Path, tokenizer_dir: Path) -> dict[str, Any]:
    return {
        "model": str(checkpoint),
        "tokenizer": str(tokenizer_dir),
        "device": "cpu",
        "dtype": "float32",
        "max_batch_size": "8",
        "max_queue": "64",
        "replicas": "2",
    }


@pytest.fixture(scope="module")
def ray_app(ray_url: str, args: dict[str, Any], checkpoint: Path) -> Iterator[str]:
    """The deployment, two replicas: `serve run server.ray_app:build` with these args, run in the checkpoint's
    parent directory and naming it relative to there, as `serve run ... model=./gpt2` does (the replicas'
    processes started elsewhere: they read it where the builder did)."""
    here = os.getcwd()
    os.chdir(checkpoint.parent)
    try:
        planned = plan({**args, "model": f"./{checkpoint.name}"}, environ={})
    finally:
        os.chdir(here)
    serve.run(application(planned), name=APP, route_prefix="/")
    try:
        yield ray_url
    finally:
        serve.delete(APP)


@pytest.fixture(scope="module")
def single(checkpoint: Path, tokenizer_dir: Path) -> Iterator[TestClient]:
    """The same model behind one server in this process, named as the deployment names it: what each answer
    must equal."""
    here = os.getcwd()
    os.chdir(checkpoint.parent)
    try:
        relative = f"./{checkpoint.name}"
        loaded: LoadedModel = load(relative, tokenizer_dir=tokenizer_dir, device="cpu", dtype="float32")
    finally:
        os.chdir(here)
    app = create_app(Settings(model="tiny", max_batch_size=8, max_queue=64), loaded=loaded)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


def stats(replicas: int = 2) -> list[dict[str, Any]]:
    """Every replica's process id, sequences in flight and tokens generated so far, once the handle knows
    `replicas` of them (a handle learns of the replicas from Serve's controller as it goes)."""
    handle = serve.get_deployment_handle(DEPLOYMENT, app_name=APP)
    found: list[dict[str, Any]] = []

    def complete() -> bool:
        found[:] = handle.broadcast("stats").results(timeout_s=GUARD)
        return len(found) == replicas

    wait_until(complete, timeout=GUARD)
    return found


def in_flight() -> int:
    return sum(s["sequences"] for s in stats())


def generated() -> int:
    return sum(s["tokens_generated"] for s in stats())


def sse_events(lines: Iterator[str]) -> list[Any]:
    """The JSON events of a stream, and "[DONE]" at its end when the stream got there."""
    events: list[Any] = []
    for line in lines:
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_still_serving(url: str) -> None:
    body = {"input_ids": [464, 3290], "max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + GEN, json=body, timeout=GUARD)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["token_ids"]) == 3


def requests_of_sixteen_clients() -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    for i in range(16):
        if i % 2:
            body = {"prompt": f"Client {i} says", "max_tokens": 6 + i, "temperature": 0, "n": 1 + i % 3}
            out.append((CMPL, body))
        else:
            body = {"input_ids": [[464 + i, 3290], [11]], "max_new_tokens": 5 + i, "temperature": 0, "logprobs": 2}
            out.append((GEN, body))
    return out


def comparable(path: str, answer: dict[str, Any]) -> Any:
    """What must be equal between servers: each choice's tokens, text and finish, and the usage."""
    if path == CMPL:
        choices = [(c["index"], c["text"], c["finish_reason"]) for c in answer["choices"]]
    else:
        choices = [
            (c["index"], c["token_ids"], c["text"], c["finish_reason"], [t["id"] for t in c["logprobs"]])
            for c in answer["choices"]
        ]
    return choices, answer["usage"]


def test_ray_sixteen_concurrent_clients_get_what_a_single_server_gives(ray_app: str, single: TestClient) -> None:
    work = requests_of_sixteen_clients()
    with httpx.Client(base_url=ray_app, timeout=GUARD) as client, ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda job: client.post(job[0], json=job[1]), work))
    for (path, body), answer in zip(work, answers, strict=True):
        assert answer.status_code == 200, answer.text
        alone = single.post(path, json=body)
        assert alone.status_code == 200, alone.text
        assert comparable(path, answer.json()) == comparable(path, alone.json()), f"{path} {body}"
    assert len({s["pid"] for s in stats()}) == 2
    # every route answers through the proxy as it does on one server: a few of the others
    for path in ("/health", "/v1/models", "/v1/model", "/tokenizer_info"):
        through_ray, direct = httpx.get(ray_app + path, timeout=GUARD), single.get(path)
        assert (through_ray.status_code, through_ray.json()) == (direct.status_code, direct.json()), path
    assert "gpt2_tokens_generated_total" in httpx.get(ray_app + "/metrics", timeout=GUARD).text
    acts = {"prompt": "Hello there", "activations": {"hooks": ["blocks.0.hook_resid_post"]}}
    through_ray = httpx.post(ray_app + "/v1/activations", json=acts, timeout=GUARD)
    assert through_ray.status_code == 200, through_ray.text
    dump, alone = (
        safetensors.torch.load(through_ray.content),
        safetensors.torch.load(single.post("/v1/activations", json=acts).content),
    )
    assert dump.keys() == alone.keys() and all(torch.equal(dump[k], alone[k]) for k in dump)
    lab = {"prompt": "The cat sat on the mat", "top_k": 3}
    assert (
        httpx.post(ray_app + "/v1/analyze", json=lab, timeout=GUARD).json()
        == single.post("/v1/analyze", json=lab).json()
    )
    assert httpx.get(ray_app + "/", timeout=GUARD).text == single.get("/").text


def test_ray_a_bad_request_is_the_same_error_and_the_replica_serves_on(ray_app: str, single: TestClient) -> None:
    bad = {"prompt": "Hi", "temperature": -1}
    through_ray = httpx.post(ray_app + GEN, json=bad, timeout=GUARD)
    assert (through_ray.status_code, through_ray.json()) == (400, single.post(GEN, json=bad).json())
    assert_still_serving(ray_app)


def test_ray_streams_arrive_token_by_token(ray_app: str, single: TestClient) -> None:
    body = {"prompt": "Once upon a time", "max_new_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=GUARD) as client, client.stream("POST", ray_app + GEN, json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    with single.stream("POST", GEN, json=body) as alone:
        expected = sse_events(alone.iter_lines())
    assert events[-1] == "[DONE]"
    tokens = [e for e in events if isinstance(e, dict) and "token_id" in e]
    assert len(tokens) == 24  # one event per token
    assert [(e["token_id"], e["text"]) for e in tokens] == [
        (e["token_id"], e["text"]) for e in expected if isinstance(e, dict) and "token_id" in e
    ]


def test_ray_a_client_that_hangs_up_frees_its_sequence_in_the_replica(ray_app: str) -> None:
    """A long stream's first token arrives while its sequence is still generating (so the proxy does not
    hold the stream back); the client hangs up; the sequence leaves its replica long before its end."""
    wait_until(lambda: in_flight() == 0, timeout=GUARD)
    before = generated()
    body = {"input_ids": [464], "max_new_tokens": LONG, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=GUARD) as client, client.stream("POST", ray_app + GEN, json=body) as r:
        lines = r.iter_lines()  # held: a dropped iterator would close the connection as it is collected
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first.removeprefix("data: "))["token_id"] >= 0
        assert in_flight() == 1  # still generating: the first token came as it was made
    wait_until(lambda: in_flight() == 0, timeout=GUARD)
    assert generated() - before < LONG, "the abandoned stream ran to its end"
    assert_still_serving(ray_app)


def test_ray_a_killed_replica_fails_its_streams_and_the_other_serves(ray_app: str) -> None:
    """Four long streams across both replicas; one replica's process is killed mid-run. Its streams end
    with an error (no hang, no [DONE]), the others finish; new requests are served meanwhile by the
    survivor; Ray starts a new replica in its place."""
    wait_until(lambda: in_flight() == 0, timeout=GUARD)
    body = {"input_ids": [464], "max_new_tokens": LONG, "temperature": 0, "ignore_eos": True, "stream": True}
    outcomes: list[str] = []
    started = threading.Barrier(5, timeout=GUARD)

    def stream() -> None:
        try:
            with httpx.Client(timeout=GUARD) as client, client.stream("POST", ray_app + GEN, json=body) as r:
                lines = r.iter_lines()
                next(line for line in lines if line.startswith("data: "))
                started.wait()
                outcomes.append("done" if sse_events(lines)[-1:] == ["[DONE]"] else "cut")
        except httpx.TransportError as e:  # the connection closed mid-body
            outcomes.append(f"error: {type(e).__name__}")

    threads = [threading.Thread(target=stream) for _ in range(4)]
    for t in threads:
        t.start()
    started.wait()  # every stream has its first token
    replicas = stats()
    victim = max(replicas, key=lambda s: s["sequences"])
    assert victim["sequences"] >= 1
    os.kill(victim["pid"], signal.SIGKILL)
    for _ in range(4):  # served by the survivor while the victim is gone
        assert_still_serving(ray_app)
    for t in threads:
        t.join(GUARD)
    assert not any(t.is_alive() for t in threads), "a stream hung"
    failed = [o for o in outcomes if o != "done"]
    assert len(failed) == victim["sequences"], outcomes
    assert len(outcomes) - len(failed) == 4 - victim["sequences"], outcomes
    # Ray replaces the replica
    wait_until(lambda: _replica_pids() - {victim["pid"]} and len(_replica_pids()) == 2, timeout=GUARD)
    assert_still_serving(ray_app)


def _replica_pids() -> set[int]:
    """The process ids of the replicas that answer now."""
    handle = serve.get_deployment_handle(DEPLOYMENT, app_name=APP)
    try:
        return {s["pid"] for s in handle.broadcast("stats").results(timeout_s=GUARD)}
    except Exception:  # a replica that died, not yet known as such by the handle
        return set()


# --- the deployment's options, from the settings (no cluster needed) -------------------------------------


def test_ray_options_follow_from_the_settings() -> None:
    p = plan({"model": "gpt2", "max_batch_size": "8", "max_queue": 100, "replicas": "3", "num_cpus": "2"}, environ={})
    assert p.settings.max_batch_size == 8 and p.threads == 2
    assert p.options == {
        "name": DEPLOYMENT,
        "max_ongoing_requests": 108,  # one replica's batch and queue: not Serve's default of 5
        "ray_actor_options": {"num_cpus": 2.0, "num_gpus": 0.0},
        "graceful_shutdown_timeout_s": 120.0,  # a stopped replica finishes its streams (Serve's 20 s cut them)
        "num_replicas": 3,
    }
    assert plan({"graceful_shutdown_timeout_s": "600"}, environ={}).options["graceful_shutdown_timeout_s"] == 600.0
    # gpt2-serve's --drain-timeout is the same setting: taken from the args or the environment, not both ways
    assert plan({"drain_timeout": "45"}, environ={}).options["graceful_shutdown_timeout_s"] == 45.0
    assert plan({}, environ={"GPT2_DRAIN_TIMEOUT": "30"}).options["graceful_shutdown_timeout_s"] == 30.0
    with pytest.raises(ValueError, match="is Serve's graceful_shutdown_timeout_s under Ray: give one of them"):
        plan({"drain_timeout": "45", "graceful_shutdown_timeout_s": "60"}, environ={})
    given = plan({"graceful_shutdown_timeout_s": "60"}, environ={"GPT2_DRAIN_TIMEOUT": "30"})  # args win, as always
    assert given.options["graceful_shutdown_timeout_s"] == 60.0
    gpu = plan({"device": "cuda"}, environ={"GPT2_MAX_BATCH_SIZE": "32"})
    assert gpu.options["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 1.0}
    assert gpu.options["max_ongoing_requests"] == 32 + 256  # the variable, as gpt2-serve reads it
    # a list setting: YAML's list, `serve run`'s comma-separated text, or the variable's
    assert plan({"served_model_name": ["gpt2", "b"]}, environ={}).settings.served_model_name == ("gpt2", "b")
    assert plan({"served_model_name": "gpt2,b"}, environ={}).settings.served_model_name == ("gpt2", "b")
    named = plan({}, environ={"GPT2_SERVED_MODEL_NAME": "gpt2"})
    assert named.settings.served_model_name == ("gpt2",)


def test_ray_autoscaling_is_exposed() -> None:
    p = plan({"min_replicas": 1, "max_replicas": 4, "replicas": 2, "max_batch_size": 16}, environ={})
    assert "num_replicas" not in p.options
    assert p.options["autoscaling_config"] == {
        "min_replicas": 1,
        "max_replicas": 4,
        "target_ongoing_requests": 16.0,  # a full batch per replica, by default
        "initial_replicas": 2,
    }
    assert plan({"max_replicas": 3, "target_ongoing_requests": 4}, environ={}).options["autoscaling_config"] == {
        "min_replicas": 1,
        "max_replicas": 3,
        "target_ongoing_requests": 4.0,
    }


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ({"port": 9000}, "'port' is set on Serve's proxy under Ray: use http_options.port"),
        ({"header_timeout": 3}, "'header_timeout' is set on Serve's proxy under Ray"),
        ({"write_timeout": 3}, "'write_timeout' is set on Serve's proxy under Ray"),
        ({"modle": "gpt2"}, "unknown argument 'modle': the arguments are api_key, body_timeout"),
        ({"max_batch_size": "lots"}, "max_batch_size must be an integer, got 'lots'"),
        ({"replicas": "0"}, "replicas must be an integer at least 1, got '0'"),
        ({"replicas": 1.5}, "replicas must be an integer, got 1.5"),
        ({"num_cpus": "0"}, "num_cpus must be a number above 0, got '0'"),
        ({"graceful_shutdown_timeout_s": -1}, "graceful_shutdown_timeout_s must be a number at least 0, got -1"),
        ({"device": "cuda:1"}, "device='cuda:1': Ray gives each replica its own GPU (num_gpus), seen as cuda"),
        ({"device": "cuda", "num_gpus": 0}, "device=cuda needs a GPU per replica: num_gpus must be above 0"),
        ({"min_replicas": 3, "max_replicas": 2}, "max_replicas (2) must be at least min_replicas (3)"),
        (
            {"max_replicas": 2, "target_ongoing_requests": 1000},
            "target_ongoing_requests (1000) is more than a replica takes at once (max_batch_size + max_queue = 272)",
        ),
        ({"max_replicas": 2, "replicas": 5}, "replicas (5) must be between min_replicas (1) and max_replicas (2)"),
        ({"served_model_name": 2}, "served_model_name must be text or a list of texts, got 2"),
        ({"served_model_name": ["a", None]}, "served_model_name must be text or a list of texts, got ['a', None]"),
        ({"sae": None}, "sae must be text or a list of texts, got None"),
        ({"cors_origins": {"a": 1}}, "cors_origins must be text or a list of texts"),
    ],
)
def test_ray_a_bad_argument_names_itself(args: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError) as error:
        plan(args, environ={})
    assert says in str(error.value)


def test_ray_a_bad_variable_names_itself() -> None:
    with pytest.raises(ValueError, match="GPT2_MAX_QUEUE must be an integer, got 'many'"):
        plan({}, environ={"GPT2_MAX_QUEUE": "many"})


def test_a_replica_takes_as_many_torch_threads_as_ray_gave_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A config file's `ray_actor_options: {num_cpus: 2}` overrides the builder's num_cpus: the replica then
    runs 2 torch threads, as the CPUs Ray assigned it say (it kept the builder's 1)."""
    import ray

    from server.ray_app import replica_threads

    class Context:
        def __init__(self, cpus: float | None) -> None:
            self.cpus = cpus

        def get_assigned_resources(self) -> dict[str, float]:
            return {} if self.cpus is None else {"CPU": self.cpus}

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    for cpus, want in ((2.0, 2), (3.5, 3), (0.5, 1), (None, 1)):
        monkeypatch.setattr(ray, "get_runtime_context", lambda cpus=cpus: Context(cpus))
        assert replica_threads(1) == want, cpus
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    assert replica_threads(4) == 4  # not in a Ray worker: the plan's


def test_ray_a_vector_stored_by_name_is_known_to_every_replica(
    ray_app: str, single: TestClient, checkpoint: Path
) -> None:
    """A steering vector stored by name through one replica is found whichever replica serves a later request
    (they share one store, `VectorStore`), and /v1/model lists it on each. Last of the tests on `ray_app`:
    the others compare /v1/model with a server that stores none."""
    body = {"positive": ["I love it"], "negative": ["I hate it"], "hook": "blocks.0.hook_resid_pre", "name": "joy"}
    steer = {
        "prompt": "The weather today",
        "max_new_tokens": 4,
        "temperature": 0,
        "logprobs": 1,
        "interventions": [
            {"hook": "blocks.0.hook_resid_pre", "op": "steer", "scale": 4, "direction": {"vector": "joy"}}
        ],
    }
    try:
        stored = httpx.post(ray_app + "/v1/steering-vectors", json=body, timeout=GUARD)
        assert stored.status_code == 200 and stored.json()["stored"] == ["joy"], stored.text
        assert single.post("/v1/steering-vectors", json=body).json()["vector"] == stored.json()["vector"]
        want = single.post(GEN, json=steer).json()
        with httpx.Client(base_url=ray_app, timeout=GUARD) as client, ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda _: client.post(GEN, json=steer), range(16)))
            listed = [client.get("/v1/model").json()["steering_vectors"] for _ in range(10)]
        for answer in answers:  # were 400s ("no stored steering vector 'joy'") wherever another replica served
            assert answer.status_code == 200, answer.text
            assert comparable(GEN, answer.json()) == comparable(GEN, want)
        assert listed == [["joy"]] * 10
        assert len({s["pid"] for s in stats()}) == 2
        # the store's actor killed: the replicas make it again (empty) and go on; a 400, never a 500
        ray.kill(ray.get_actor(vector_store_name(APP, f"./{checkpoint.name}"), namespace="serve"))
        gone = [httpx.post(ray_app + GEN, json=steer, timeout=GUARD) for _ in range(6)]
        assert {(g.status_code, "no stored steering vector 'joy'" in g.text) for g in gone} == {(400, True)}
        again = httpx.post(ray_app + "/v1/steering-vectors", json=body, timeout=GUARD)
        assert again.status_code == 200 and again.json()["stored"] == ["joy"], again.text
    finally:
        ray.kill(ray.get_actor(vector_store_name(APP, f"./{checkpoint.name}"), namespace="serve"))


def test_a_store_the_shared_store_is_slow_to_take_says_it_may_still_land(monkeypatch: pytest.MonkeyPatch) -> None:
    """A store call given up after STORE_TIMEOUT_S stays queued in the store's actor: the refusal says it may
    still land, rather than that it failed (it did land, once the actor answered)."""
    import asyncio

    import server.ray_app as ray_app

    class Slow:
        class store:
            @staticmethod
            def remote(*args: object) -> asyncio.Future[None]:
                return asyncio.get_running_loop().create_future()  # never answers

    monkeypatch.setattr(ray_app, "STORE_TIMEOUT_S", 0.05)
    vectors = object.__new__(ray_app.ReplicaVectors)
    vectors.actor = Slow()
    said = asyncio.run(vectors.store("joy", None, 8))  # type: ignore[arg-type]
    assert said is not None and "did not answer within 0.05 s: 'joy' may still be stored once it does" in said
