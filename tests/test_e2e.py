"""End to end: `gpt2-serve` as a real subprocess (`python -m server`) on a free loopback port, serving the
`tiny` checkpoint with the real tokenizer; answers are compared with the same model run in this process.

Two servers run for the module: `main` (the limits of `contract.LIMITS`, 8 rows) and `keyed` (an API key
from GPT2_API_KEY). Both are killed at the end, whatever happens.
"""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import safetensors.torch
import torch
from contract import (
    CASES,
    CMPL,
    GEN,
    LIMITS,
    NEXT,
    Bad,
    assert_error,
    assert_same,
    full_capture,
    full_logprobs,
    greedy,
    safetensors_metadata,
    sse_events,
)
from serving import STARTUP_TIMEOUT, free_port, launch, shut_down, wait_ready

from model.loading import LoadedModel

API_KEY = "e2e-secret"


@dataclass
class Server:
    process: subprocess.Popen[bytes]
    port: int
    log: Path  # the process's stderr
    api_key: str | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, **kwargs: Any) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.Client(base_url=self.url, timeout=60, headers=headers, **kwargs)

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")

    def metric(self, name: str) -> float:
        """A sample without labels from /metrics."""
        with self.client() as c:
            for line in c.get("/metrics").text.splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
        raise AssertionError(f"no {name} in /metrics")


@pytest.fixture(scope="module")
def servers(tiny: Any, tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    logs = tmp_path_factory.mktemp("gpt2-serve")
    common = ["--model", str(tiny.path), "--tokenizer", str(tokenizer_dir), "--log-level", "warning"]
    limits = [f"--{name.replace('_', '-')}={value}" for name, value in LIMITS.items()]
    started: dict[str, Server] = {}
    try:
        for name, extra, env, key in (
            ("main", ["--max-batch-size", "8", *limits], {}, None),
            ("keyed", ["--max-batch-size", "2"], {"GPT2_API_KEY": API_KEY}, API_KEY),
        ):
            port = free_port()
            log = logs / f"{name}.log"
            process = launch([*common, "--port", str(port), *extra], log, env)
            started[name] = Server(process, port, log, key)
        for server in started.values():  # started together, waited for in turn
            wait_ready(server.process, server.url, server.log)
        yield started
    finally:
        for server in started.values():
            shut_down(server.process)


@pytest.fixture(scope="module")
def main(servers: dict[str, Server]) -> Server:
    return servers["main"]


@pytest.fixture(scope="module")
def keyed(servers: dict[str, Server]) -> Server:
    return servers["keyed"]


@pytest.fixture(scope="module")
def http(main: Server) -> Iterator[httpx.Client]:
    with main.client() as c:
        yield c


@pytest.fixture(scope="module")
def model_name(http: httpx.Client) -> str:
    return str(http.get("/v1/models").json()["data"][0]["id"])


def ids_of(loaded: LoadedModel, text: str) -> list[int]:
    return loaded.tokenizer.encode(text)


def post_ok(client: httpx.Client, path: str, body: dict[str, Any]) -> Any:
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def assert_still_serving(client: httpx.Client) -> None:
    body = post_ok(client, GEN, {"prompt": "Hello", "max_new_tokens": 2, "temperature": 0, "ignore_eos": True})
    assert len(body["choices"][0]["token_ids"]) == 2


PROMPTS = ["Hello world", "The quick brown fox jumps over", "In 1905, Einstein"]


# --- native API ---------------------------------------------------------------------------------


def test_health_and_model(http: httpx.Client, loaded: LoadedModel) -> None:
    assert http.get("/health").json() == {"status": "ok"}
    info = http.get("/v1/model").json()
    assert (info["n_layer"], info["d_model"], info["n_ctx"], info["vocab_size"]) == (2, 64, 128, 50257)
    assert info["hook_names"] == loaded.model.hook_names


def test_generate(http: httpx.Client, loaded: LoadedModel) -> None:
    body = post_ok(http, GEN, {"prompt": PROMPTS, "max_new_tokens": 10, "temperature": 0, "logprobs": 2})
    for prompt, choice in zip(PROMPTS, body["choices"], strict=True):
        ids = ids_of(loaded, prompt)
        ref = greedy(loaded, ids, 10)
        assert (choice["text"], choice["token_ids"]) == (ref.text, ref.token_ids)
        full = full_logprobs(loaded, ids + ref.token_ids)
        got = [lp["logprob"] for lp in choice["logprobs"]]
        want = [float(full[len(ids) - 1 + i, t]) for i, t in enumerate(ref.token_ids)]
        assert got == pytest.approx(want, abs=1e-4)


def test_stream(main: Server, http: httpx.Client, loaded: LoadedModel) -> None:
    request = {"prompt": PROMPTS[1], "max_new_tokens": 12, "temperature": 0}
    whole = post_ok(http, GEN, request)["choices"][0]
    with main.client() as c, c.stream("POST", GEN, json={**request, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = list(r.iter_lines())
    events = sse_events("\n".join(lines) + "\n")
    *tokens, final = events
    assert [e["token_id"] for e in tokens] == whole["token_ids"]
    assert "".join(e["text"] for e in tokens) == whole["text"]
    assert final["finish_reason"] == whole["finish_reason"] == "length"
    assert final["usage"]["completion_tokens"] == 12


def test_next_token(http: httpx.Client, loaded: LoadedModel) -> None:
    body = post_ok(http, NEXT, {"prompt": PROMPTS[0], "top_k": 5})
    logprobs = full_logprobs(loaded, ids_of(loaded, PROMPTS[0]))[-1]
    top = torch.topk(logprobs, 5)
    assert [t["id"] for t in body["top"]] == top.indices.tolist()
    assert [t["prob"] for t in body["top"]] == pytest.approx(top.values.exp().tolist(), rel=1e-4)
    assert body["entropy"] == pytest.approx(float(-(logprobs.exp() * logprobs).sum()), rel=1e-4)


def test_activations(http: httpx.Client, loaded: LoadedModel) -> None:
    hooks = ["blocks.*.hook_resid_post", "blocks.1.attn.hook_pattern", "ln_final.hook_normalized"]
    request = {"prompt": PROMPTS[2], "max_new_tokens": 3, "temperature": 0, "activations": {"hooks": hooks}}
    r = http.post("/v1/activations", json=request)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/octet-stream"
    tensors = safetensors.torch.load(r.content)
    token_ids = json.loads(safetensors_metadata(r.content)["token_ids"])
    ids = ids_of(loaded, PROMPTS[2])
    assert token_ids == ids + greedy(loaded, ids, 3).token_ids
    names = ["blocks.0.hook_resid_post", "blocks.1.hook_resid_post", "blocks.1.attn.hook_pattern"]
    expected = full_capture(loaded, token_ids, [*names, "ln_final.hook_normalized"])
    assert sorted(tensors) == sorted(expected)
    for name, want in expected.items():
        torch.testing.assert_close(tensors[name], want, atol=1e-4, rtol=1e-4)


# --- the official OpenAI client -------------------------------------------------------------------


@pytest.fixture(scope="module")
def oai(main: Server) -> Iterator[openai.OpenAI]:
    client = openai.OpenAI(base_url=main.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield client
    client.close()


def test_openai_completions(oai: openai.OpenAI, loaded: LoadedModel, model_name: str) -> None:
    out = oai.completions.create(model=model_name, prompt=PROMPTS[0], max_tokens=6, temperature=0)
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert out.choices[0].text == greedy(loaded, ids_of(loaded, PROMPTS[0]), 6).text
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 6
    many = oai.completions.create(model=model_name, prompt=PROMPTS, max_tokens=4, temperature=0, n=2)
    assert [c.index for c in many.choices] == [0, 1, 2, 3, 4, 5]
    refs = [greedy(loaded, ids_of(loaded, p), 4).text for p in PROMPTS]
    assert [c.text for c in many.choices] == [r for r in refs for _ in range(2)]


def test_openai_streaming(oai: openai.OpenAI, loaded: LoadedModel, model_name: str) -> None:
    chunks = list(
        oai.completions.create(
            model=model_name,
            prompt=PROMPTS[1],
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == greedy(loaded, ids_of(loaded, PROMPTS[1]), 8).text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_openai_echo_logprobs(oai: openai.OpenAI, loaded: LoadedModel, model_name: str, max_tokens: int) -> None:
    """What lm-evaluation-harness sends to score a continuation: the prompt's own log-probabilities."""
    prompt = "The capital of France is Paris, of course"
    out = oai.completions.create(
        model=model_name, prompt=prompt, max_tokens=max_tokens, temperature=0, echo=True, logprobs=1
    )
    ids = ids_of(loaded, prompt)
    all_ids = ids + greedy(loaded, ids, max_tokens).token_ids
    ref = full_logprobs(loaded, all_ids)
    lp = out.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert out.choices[0].text == loaded.tokenizer.decode(all_ids)
    assert lp.tokens == [loaded.tokenizer.token_text(t) for t in all_ids]
    assert lp.token_logprobs[0] is None
    want = [float(ref[i - 1, all_ids[i]]) for i in range(1, len(all_ids))]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-5)
    for i, top in enumerate(lp.top_logprobs[1:], start=1):
        assert isinstance(top, dict)
        best = int(ref[i - 1].argmax())
        assert top[loaded.tokenizer.token_text(best)] == pytest.approx(float(ref[i - 1, best]), abs=1e-5)


# --- many clients at once ----------------------------------------------------------------------------


def _request(i: int) -> tuple[str, dict[str, Any]]:
    prompt = f"{PROMPTS[i % 3]} {i}" + " and" * (i % 5)
    n = 4 + (i * 7) % 13
    if i % 4 == 0:
        return CMPL, {"prompt": prompt, "max_tokens": n, "temperature": 0, "logprobs": 1}
    return GEN, {"prompt": prompt, "max_new_tokens": n, "temperature": 0, "stream": i % 4 == 1}


def _answer(client: httpx.Client, path: str, body: dict[str, Any]) -> Any:
    """The request's result, streamed or not, in one comparable form."""
    if not body.get("stream"):
        return post_ok(client, path, body)["choices"]
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        text = "".join(line + "\n" for line in r.iter_lines())
    events = sse_events(text)
    return [e["token_id"] for e in events[:-1]], events[-1]["finish_reason"], events[-1]["usage"]


def test_32_concurrent_clients(main: Server, http: httpx.Client, loaded: LoadedModel) -> None:
    requests = [_request(i) for i in range(32)]
    alone = [_answer(http, path, body) for path, body in requests]
    barrier = threading.Barrier(len(requests))

    def client(i: int) -> Any:
        with main.client() as c:  # a connection of its own
            barrier.wait(30)
            return _answer(c, *requests[i])

    steps, rows = main.metric("gpt2_batch_size_count"), main.metric("gpt2_batch_size_sum")
    with ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(client, range(len(requests)), timeout=120))
    mean_batch = (main.metric("gpt2_batch_size_sum") - rows) / (main.metric("gpt2_batch_size_count") - steps)
    assert mean_batch > 2, "the clients were not served together"
    for (path, body), one, many in zip(requests, alone, together, strict=True):
        assert_same(many, one, where=f"{path} {body}")
    # and one at a time equals the model in this process
    for (path, body), one in zip(requests[2:4], alone[2:4], strict=True):
        assert path == GEN and not body["stream"]
        ref = greedy(loaded, ids_of(loaded, body["prompt"]), body["max_new_tokens"])
        assert one[0]["token_ids"] == ref.token_ids


# --- bad input, disconnects, keys ----------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(http: httpx.Client, case: Bad) -> None:
    assert_error(case.send(http), case.status, case.param, case.code)
    assert_still_serving(http)


def test_client_disconnects_mid_stream(main: Server, http: httpx.Client) -> None:
    """A client reads one event of a long stream (8 sequences x 64 tokens, every row of the server) and
    hangs up: its sequences are cancelled, so the rows are free for the next request at once."""
    before = main.metric("gpt2_tokens_generated_total")
    long = {"input_ids": [[464]] * 8, "max_new_tokens": 64, "ignore_eos": True, "temperature": 0, "stream": True}
    with main.client() as c, c.stream("POST", GEN, json=long) as r:
        assert r.status_code == 200
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
        assert json.loads(first.removeprefix("data: "))["token_id"] >= 0
    # the connection is closed: the next request needs all 8 rows
    body = post_ok(http, GEN, {"input_ids": [[464]] * 8, "max_new_tokens": 2, "temperature": 0})
    assert [len(c["token_ids"]) for c in body["choices"]] == [2] * 8
    time.sleep(0.2)
    cut_short = main.metric("gpt2_tokens_generated_total") - before - 16
    assert cut_short < 8 * 64 / 2, f"the abandoned stream went on: {cut_short} tokens"
    assert_still_serving(http)
    assert "Traceback" not in main.stderr()


def test_api_key(keyed: Server, loaded: LoadedModel, model_name: str) -> None:
    assert httpx.get(keyed.url + "/health").status_code == 200
    for headers, code in (({}, None), ({"Authorization": "Bearer wrong"}, "invalid_api_key")):
        r = httpx.get(keyed.url + "/v1/models", headers=headers)
        assert_error(r, 401, None, code)
        assert_error(httpx.post(keyed.url + GEN, json={"prompt": "Hi"}, headers=headers), 401)
    with keyed.client() as c:
        assert c.get("/v1/models").status_code == 200
    good = openai.OpenAI(base_url=keyed.url + "/v1", api_key=API_KEY, max_retries=0)
    out = good.completions.create(model=model_name, prompt=PROMPTS[0], max_tokens=3, temperature=0)
    assert out.choices[0].text == greedy(loaded, ids_of(loaded, PROMPTS[0]), 3).text
    bad = openai.OpenAI(base_url=keyed.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as refused:
        bad.completions.create(model=model_name, prompt="Hi", max_tokens=1)
    assert refused.value.code == "invalid_api_key"
    # the key in X-API-Key beside the client's own Bearer token (an OpenAI client always sends one)
    beside = openai.OpenAI(
        base_url=keyed.url + "/v1", api_key="unused", default_headers={"X-API-Key": API_KEY}, max_retries=0
    )
    assert beside.completions.create(model=model_name, prompt="Hi", max_tokens=1).choices[0].text is not None


def test_model_that_cannot_load_exits(tmp_path: Path, tokenizer_dir: Path) -> None:
    missing = tmp_path / "no-such-checkpoint"
    log = tmp_path / "stderr.log"
    process = launch(["--model", str(missing), "--tokenizer", str(tokenizer_dir), "--port", str(free_port())], log)
    try:
        returncode = process.wait(timeout=STARTUP_TIMEOUT)
    finally:
        shut_down(process)
    stderr = log.read_text()
    assert returncode != 0, stderr
    reason = stderr.strip().splitlines()[-1]
    assert reason.startswith("gpt2-serve: error: cannot load the model:"), stderr
    assert str(missing) in reason and stderr.count("cannot load the model") == 1, stderr  # said once
    assert "Traceback" not in stderr


@pytest.mark.parametrize("host", ["127.0.0.1", "999.1.1.1"], ids=["port in use", "bad host"])
def test_address_that_cannot_be_bound_exits(host: str, tmp_path: Path, tokenizer_dir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        taken.listen()
        log = tmp_path / "stderr.log"
        process = launch(["--model", "./no-such-checkpoint", "--host", host, "--port", str(port)], log)
        try:
            returncode = process.wait(timeout=STARTUP_TIMEOUT)
        finally:
            shut_down(process)
    stderr = log.read_text()
    assert returncode == 1, stderr
    # refused before the model loads: one line, no uvicorn log and no crash of the loading thread
    assert stderr.startswith(f"gpt2-serve: error: cannot listen on {host}:{port}: ") and stderr.count("\n") == 1, stderr


def test_unknown_log_level_is_a_usage_error(tmp_path: Path) -> None:
    log = tmp_path / "stderr.log"
    process = launch(["--log-level", "verbose"], log, env={"GPT2_MODEL": "./no-such-checkpoint"})
    assert process.wait(timeout=STARTUP_TIMEOUT) == 2
    stderr = log.read_text()
    assert stderr.splitlines()[-1] == (
        "gpt2-serve: error: --log-level must be one of debug, info, warning, error, critical, got 'verbose'"
    )
    assert "Traceback" not in stderr
