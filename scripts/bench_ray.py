"""The server benchmark's Ray Serve side (`bench_server.py --ray REPLICAS`): the same app as REPLICAS
replicas of `server.ray_app` on a local Ray instance (loopback, no dashboard, no usage reports), each
with `--ray-threads` torch threads, behind Serve's HTTP proxy. Needs the `ray` extra."""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import tempfile
from collections.abc import Callable
from typing import Any


def start(args: argparse.Namespace, model: str) -> tuple[str, Callable[[], None]]:
    """Start Ray, Serve's proxy and the deployment; return the proxy's URL and the function that stops
    them all."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray import serve

    from server.ray_app import application, plan

    temp = tempfile.mkdtemp(prefix="ray-")
    ray.init(
        num_cpus=args.ray * args.ray_threads,
        include_dashboard=False,
        _temp_dir=temp,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    settings: dict[str, Any] = {
        "model": model,
        "tokenizer": args.tokenizer,
        "device": args.device,
        "dtype": args.dtype,
        "max_batch_size": args.max_batch_size,
        "max_queue": 4096,
        "log_level": "warning",
        "replicas": args.ray,
        "num_cpus": args.ray_threads,
    }
    if args.prefill_chunk is not None:
        settings["prefill_chunk"] = args.prefill_chunk
    serve.run(application(plan(settings, environ={})), name="gpt2", route_prefix="/")

    def stop() -> None:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)

    return f"http://127.0.0.1:{port}", stop
