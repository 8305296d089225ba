"""Prometheus metrics, in a registry of the app's own (so several apps in one process do not collide)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# The key under which the app's lifespan hands its Metrics to the server (ASGI lifespan state), so that the
# connection layer (`server.connections`) counts the answers it gives to requests no route sees.
LIFESPAN_KEY = "gpt2_metrics"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("gpt2_requests", "HTTP requests by route and status", ["route", "status"], registry=r)
        self.answers_cut = Counter(
            "gpt2_answers_cut",
            "Answers cut short after they began (gpt2_requests counts them under the status they were sent with), "
            "by route and reason: client_left, write_timeout (the client took none of it in --write-timeout and was "
            "dropped) or drain (the shutdown's --drain-timeout ran out)",
            ["route", "reason"],
            registry=r,
        )
        self.tokens_generated = Counter("gpt2_tokens_generated", "Tokens generated", registry=r)
        self.prompt_tokens_shared = Counter(
            "gpt2_prompt_tokens_shared",
            "Prompt tokens whose keys and values were copied from another sequence's row in the batch (a prompt "
            "prefix they share, as the n samples of one prompt do) instead of computed",
            registry=r,
        )
        self.queue_depth = Gauge("gpt2_queue_depth", "Sequences waiting for a batch slot", registry=r)
        self.running = Gauge(
            "gpt2_running_sequences", "Sequences in the batch (generating, or a prompt-only pass)", registry=r
        )
        self.dump_bytes_in_flight = Gauge(
            "gpt2_dump_bytes_in_flight",
            "Bytes of activation dumps, SAE readings, gradients and analyses being captured, built or sent "
            "(as estimated; --max-dump-bytes-in-flight)",
            registry=r,
        )
        self.dumps_waiting = Gauge(
            "gpt2_dumps_waiting",
            "Requests (dumps, SAE readings, gradients, analyses) waiting for room under --max-dump-bytes-in-flight",
            registry=r,
        )
        self.batch_size = Histogram(
            "gpt2_batch_size", "Sequences per decode step", buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r
        )
        self.time_to_first_token = Histogram(
            "gpt2_time_to_first_token_seconds",
            "From submission to the first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "gpt2_inter_token_latency_seconds",
            "Between consecutive tokens of a sequence",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
