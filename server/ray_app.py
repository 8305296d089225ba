"""Ray Serve: gpt2-serve's app as the replicas of one deployment, built from the same settings.

    serve run server.ray_app:build model=gpt2 replicas=2          # or: serve deploy deploy/serve.yaml

This file alone imports Ray Serve (the `ray` extra). `build(args)` takes gpt2-serve's settings by their
names (`model`, `max_batch_size`, ...: over the `GPT2_<NAME>` variables, over the defaults, as
gpt2-serve takes them) and Ray's own: `replicas`, or `min_replicas`/`max_replicas`/
`target_ongoing_requests` for Serve's autoscaler, and `num_cpus`/`num_gpus` per replica. Each replica
loads the model once, before Serve routes anything to it, and runs the app unchanged, its lifespan
starting the replica's own engine; every route (OpenAI completions, native generation, activations,
the lab, `/health`, `/metrics`) answers as gpt2-serve's would, for that replica.

A replica takes as many requests at once as its engine can hold (`max_ongoing_requests` =
`max_batch_size` + `max_queue`): Serve's default of 5 would keep the continuous batch nearly empty.
Serve's proxy accepts the connections, so the connection bounds of gpt2-serve (`host`, `port`,
`header_timeout`, `write_timeout`, `keep_alive_timeout`, `max_connections`) are the proxy's `http_options`
here (`PROXY_SETTINGS`); the body's deadline (`body_timeout`) holds in each replica.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import ray
import torch
from fastapi import FastAPI
from ray import serve
from ray.exceptions import RayActorError, RayError, TaskCancelledError
from ray.serve import Application

from model.lab.steering import SteeringVector, StoredVectors
from model.loading import load_from

from .app import create_app, freeze_long_lived
from .settings import Settings, convert
from .threads import release_openmp_pool

log = logging.getLogger(__name__)

DEPLOYMENT = "gpt2"
# gpt2-serve's settings that belong to the accepting side, which Serve's proxy is here: where to set them.
PROXY_SETTINGS = {
    "host": "http_options.host",
    "port": "http_options.port",
    "keep_alive_timeout": "http_options.keep_alive_timeout_s",
    "header_timeout": "http_options.request_timeout_s (an end-to-end bound)",
    "write_timeout": "http_options.request_timeout_s (an end-to-end bound)",
    "max_connections": "a limit in front of the proxy (a load balancer, an ingress)",
}
RAY_ARGS = (
    "replicas",
    "min_replicas",
    "max_replicas",
    "target_ongoing_requests",
    "num_cpus",
    "num_gpus",
    "graceful_shutdown_timeout_s",
)


@dataclass(frozen=True)
class Plan:
    """What `build` deploys: each replica's settings and torch threads, and Serve's deployment options;
    `cwd`, the builder's working directory, which relative paths in the settings are read against."""

    settings: Settings
    threads: int
    options: dict[str, Any]
    cwd: str = field(default_factory=os.getcwd)


def plan(args: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> Plan:
    """The deployment for `args` (a Serve config's `args`, or `serve run`'s `key=value` pairs, as text).
    An unknown name or a bad value is a ValueError that names it."""
    env = os.environ if environ is None else environ
    names = {f.name for f in fields(Settings)}
    values: dict[str, Any] = {}
    for f in fields(Settings):  # the environment first: args override it
        raw = env.get("GPT2_" + f.name.upper())
        if raw is not None and f.name not in PROXY_SETTINGS:
            values[f.name] = _setting(f.name, raw, f"GPT2_{f.name.upper()}")
    ray_args: dict[str, Any] = {}
    for key, raw in args.items():
        name = key.replace("-", "_")
        if name in PROXY_SETTINGS:
            raise ValueError(f"{key!r} is set on Serve's proxy under Ray: use {PROXY_SETTINGS[name]}")
        if name in RAY_ARGS:
            ray_args[name] = raw
        elif name in names:
            values[name] = _setting(name, raw, key)
        else:
            valid = ", ".join(sorted((names - PROXY_SETTINGS.keys()) | set(RAY_ARGS)))
            raise ValueError(f"unknown argument {key!r}: the arguments are {valid}")
    if "graceful_shutdown_timeout_s" in ray_args:  # the same setting: the argument wins over the environment's
        if any(key.replace("-", "_") == "drain_timeout" for key in args):
            raise ValueError("drain_timeout is Serve's graceful_shutdown_timeout_s under Ray: give one of them")
        values.pop("drain_timeout", None)
    settings = Settings(**values)
    if settings.device.startswith("cuda:"):
        raise ValueError(
            f"device={settings.device!r}: Ray gives each replica its own GPU (num_gpus), seen as cuda: use device=cuda"
        )
    uses_gpu = settings.device == "cuda"
    num_cpus = _number(ray_args, "num_cpus", 1.0, low=0.0, open_low=True)
    num_gpus = _number(ray_args, "num_gpus", 1.0 if uses_gpu else 0.0, low=0.0)
    if uses_gpu and num_gpus == 0:
        raise ValueError("device=cuda needs a GPU per replica: num_gpus must be above 0")
    options: dict[str, Any] = {
        "name": DEPLOYMENT,
        "max_ongoing_requests": settings.max_batch_size + settings.max_queue,
        "ray_actor_options": {"num_cpus": num_cpus, "num_gpus": num_gpus},
        # how long a replica Serve stops (a redeploy, a scale-down) finishes its requests: Serve's default 20 s
        # cut streams of a few hundred tokens on a CPU; gpt2-serve's --drain-timeout, unless given here
        "graceful_shutdown_timeout_s": _number(
            ray_args, "graceful_shutdown_timeout_s", settings.drain_timeout, low=0.0
        ),
    }
    autoscaled = [name for name in ("min_replicas", "max_replicas", "target_ongoing_requests") if name in ray_args]
    if autoscaled:
        options["autoscaling_config"] = _autoscaling(ray_args, settings)
    else:
        options["num_replicas"] = int(_number(ray_args, "replicas", 1, low=1, integer=True))
    return Plan(settings, threads=max(1, math.floor(num_cpus)), options=options)


def build(args: dict[str, Any]) -> Application:
    """Serve's application builder: `serve run server.ray_app:build model=gpt2 replicas=2`."""
    return application(plan(args))


def replica_threads(planned: int) -> int:
    """Torch threads for this replica: the CPUs Ray gave it (a config file's `ray_actor_options` may
    override the builder's `num_cpus`), else `planned`."""
    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU") if ray.is_initialized() else None
    return max(1, math.floor(cpus)) if cpus else planned


VectorStore = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)(StoredVectors)
STORE_TIMEOUT_S = 5.0  # a store call slower than this is given up (its error said, the replica's copy kept)


def vector_store_name(app_name: str, model: str) -> str:
    """The name of the `VectorStore` actor of an application serving `model` (its `model` setting), in the
    namespace `serve`: a redeploy with another model has a store of its own."""
    return f"gpt2-steering-vectors-{app_name}-{hashlib.sha256(model.encode()).hexdigest()[:12]}"


class ReplicaVectors:
    """`SharedVectors` on the application's `VectorStore` actor (`StoredVectors` in a named actor, so that a
    `{"vector": name}` finds the vector whichever replica stored it): made by the first replica to start,
    detached so that it outlives any one replica, and restarted (empty, a new epoch) if its process dies.
    A handle to a store that is gone is looked up again (made again) once; a call that still fails or takes
    longer than STORE_TIMEOUT_S leaves the replica's copy as it was (`since`) or refuses the store."""

    def __init__(self, app_name: str, model: str) -> None:
        self.name = vector_store_name(app_name, model)
        self.actor = self._lookup()

    def _lookup(self) -> Any:
        return VectorStore.options(name=self.name, namespace="serve", get_if_exists=True, lifetime="detached").remote()

    async def _call(self, method: str, *args: Any) -> Any:
        try:
            return await asyncio.wait_for(getattr(self.actor, method).remote(*args), STORE_TIMEOUT_S)
        except RayActorError:  # the store is gone for good (killed): look it up again, made again if need be
            self.actor = self._lookup()
            return await asyncio.wait_for(getattr(self.actor, method).remote(*args), STORE_TIMEOUT_S)

    async def store(self, name: str, vector: SteeringVector, max_vectors: int) -> str | None:
        try:
            refusal: str | None = await self._call("store", name, vector, max_vectors)
        except asyncio.TimeoutError:  # the call stays queued in the store's actor: it may land once that answers
            return (
                f"the store of steering vectors the replicas share did not answer within {STORE_TIMEOUT_S:g} s: "
                f"{name!r} may still be stored once it does (GET /v1/model lists the stored vectors)"
            )
        except RayError as e:
            return f"the store of steering vectors the replicas share cannot be reached ({type(e).__name__})"
        return refusal

    async def since(self, version: str) -> tuple[str, dict[str, SteeringVector] | None]:
        try:
            got: tuple[str, dict[str, SteeringVector] | None] = await self._call("since", version)
        except (RayError, asyncio.TimeoutError) as e:
            log.warning("the shared steering vectors cannot be read (%s): this replica's copy is used", e)
            return version, None
        return got


def application(p: Plan) -> Application:
    settings, threads = p.settings, p.threads

    def replica_app() -> FastAPI:
        """Runs on each replica as it starts, before Serve routes requests to it."""
        logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        torch.set_num_threads(replica_threads(threads))
        # a replica's process starts where `ray start` ran: relative paths (model, tokenizer, SAEs) are read
        # where `serve run` read them, on a node that has that directory
        here = os.getcwd()
        if os.path.isdir(p.cwd):
            os.chdir(p.cwd)
        else:
            log.warning("the builder's directory %s is not on this node: relative paths are read in %s", p.cwd, here)
        loaded = load_from(settings)
        release_openmp_pool()  # this thread's, from loading: the engine's thread should keep the only one
        # a replica serves this model for its whole life; its sends to the proxy are queued, never waited on
        return create_app(
            settings,
            loaded=loaded,
            on_loaded=freeze_long_lived,
            sliced=False,
            client_gone=(TaskCancelledError,),  # raised into a handler whose client left: a 499, not a 500
            shared_vectors=ReplicaVectors(serve.get_replica_context().app_name, settings.model),
        )

    @serve.ingress(replica_app)
    class GPT2Replica:
        """One replica: the app around its own engine. `stats` and `check_health` are reached by Serve
        (a DeploymentHandle, the controller), not over HTTP."""

        def stats(self) -> dict[str, Any]:
            """This replica's process, and its engine's load and output so far."""
            app: FastAPI = self.app  # type: ignore[attr-defined]  # ASGIAppReplicaWrapper's
            engine = app.state.engine
            tokens = app.state.metrics.registry.get_sample_value("gpt2_tokens_generated_total") or 0
            return {"pid": os.getpid(), "sequences": engine.sequences, "tokens_generated": int(tokens)}

        def check_health(self) -> None:
            """Serve restarts a replica whose engine thread has ended (it would never answer again)."""
            app: FastAPI = self.app  # type: ignore[attr-defined]
            if not app.state.engine.running:
                raise RuntimeError("the engine's thread has ended")

    return serve.deployment(**p.options)(GPT2Replica).bind()


def _setting(name: str, raw: Any, given_as: str) -> Any:
    try:
        return convert(name, raw)
    except ValueError as e:
        raise ValueError(f"{given_as} {e}") from None


def _number(
    args: Mapping[str, Any],
    name: str,
    default: float,
    *,
    low: float,
    open_low: bool = False,
    integer: bool = False,
) -> float:
    raw = args.get(name, default)
    kind = "an integer" if integer else "a number"
    try:
        if isinstance(raw, bool) or (integer and isinstance(raw, float) and not raw.is_integer()):
            raise ValueError
        value = int(raw) if integer else float(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be {kind}, got {raw!r}") from None
    if not math.isfinite(value) or value < low or (open_low and value == low):
        bound = f"above {low:g}" if open_low else f"at least {low:g}"
        raise ValueError(f"{name} must be {kind} {bound}, got {raw!r}")
    return value


def _autoscaling(args: Mapping[str, Any], settings: Settings) -> dict[str, Any]:
    """Serve's autoscaler: between min_replicas (1) and max_replicas (min_replicas, at least 1), aiming at
    target_ongoing_requests per replica (max_batch_size: a full batch, no queue); `replicas` is the
    initial count."""
    low = int(_number(args, "min_replicas", 1, low=0, integer=True))
    high = int(_number(args, "max_replicas", max(low, 1), low=1, integer=True))
    if high < low:
        raise ValueError(f"max_replicas ({high}) must be at least min_replicas ({low})")
    target = _number(args, "target_ongoing_requests", settings.max_batch_size, low=0, open_low=True)
    most = settings.max_batch_size + settings.max_queue  # what a replica takes at once (max_ongoing_requests)
    if target > most:
        raise ValueError(
            f"target_ongoing_requests ({target:g}) is more than a replica takes at once (max_batch_size + "
            f"max_queue = {most}): the autoscaler would never add a replica"
        )
    config: dict[str, Any] = {"min_replicas": low, "max_replicas": high, "target_ongoing_requests": target}
    if "replicas" in args:
        initial = int(_number(args, "replicas", 1, low=0, integer=True))
        if not low <= initial <= high:
            raise ValueError(f"replicas ({initial}) must be between min_replicas ({low}) and max_replicas ({high})")
        config["initial_replicas"] = initial
    return config
