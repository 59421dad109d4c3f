"""`ServeMetrics`: what GET /metrics shows, in Prometheus text (prometheus_client, a private registry per ingress).

    hsx_serve_requests_total{endpoint, status}   HTTP requests answered, by endpoint and status code
    hsx_serve_prompt_tokens_total                prompt tokens of successful requests
    hsx_serve_generation_tokens_total            generated tokens of successful requests
    hsx_serve_queue_depth                        prompts sent to the engine replicas and not yet answered
    hsx_serve_batch_size                         prompts per engine batch (histogram, one observation per batch)
    hsx_serve_batches_total{replica}             engine batches by replica (Serve's replica id)
    hsx_serve_batch_seconds                      one engine call: compute plus durable writes (histogram)
    hsx_serve_request_seconds                    request arrival to response, the file durable (histogram)
    hsx_serve_write_seconds                      one file: its request's end to durable on storage (histogram)
    hsx_serve_bytes_written_total                bytes of the files answered
    hsx_serve_requests_aborted_total             requests stopped mid-batch (LLM.abort_request) because their client went
                                                 away: nothing written
    hsx_serve_files_discarded_total{reason}      files removed: client_gone (the engine replicas report theirs with
                                                 each reply), request_failed (other prompts of a failed request)

A speculative server (--speculative-config) adds vLLM's own spec-decode counters, summed over the replicas, labelled
model_name as vLLM labels them (acceptance rate = accepted / draft tokens, mean acceptance length = 1 + accepted /
drafts, per-position rate = per_pos{position} / drafts):

    vllm:spec_decode_num_drafts_total{model_name}                       verified proposals
    vllm:spec_decode_num_draft_tokens_total{model_name}                 drafted tokens
    vllm:spec_decode_num_accepted_tokens_total{model_name}              accepted drafted tokens
    vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name, position}
                                                                        accepted at draft position 0..k-1
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServeMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, num_speculative_tokens: int = 0, model_name: str = "") -> None:
        disable_created_metrics()  # no *_created series (process-wide; the ingress process is ours)
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("hsx_serve_requests", "HTTP requests answered", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("hsx_serve_prompt_tokens", "prompt tokens of successful requests", registry=r)
        self.generation_tokens = Counter("hsx_serve_generation_tokens", "generated tokens of successful requests",
                                         registry=r)
        self.queue_depth = Gauge("hsx_serve_queue_depth", "prompts at the engine replicas, not yet answered",
                                 registry=r)
        self.batch_size = Histogram("hsx_serve_batch_size", "prompts per engine batch", buckets=_SIZE_BUCKETS,
                                    registry=r)
        self.batches = Counter("hsx_serve_batches", "engine batches by replica", ["replica"], registry=r)
        self.batch_seconds = Histogram("hsx_serve_batch_seconds", "engine call seconds (compute + durable writes)",
                                       buckets=_SECONDS_BUCKETS, registry=r)
        self.request_seconds = Histogram("hsx_serve_request_seconds", "request seconds, arrival to durable response",
                                         buckets=_SECONDS_BUCKETS, registry=r)
        self.write_seconds = Histogram("hsx_serve_write_seconds", "file write seconds, request end to durable",
                                       buckets=_SECONDS_BUCKETS, registry=r)
        self.bytes_written = Counter("hsx_serve_bytes_written", "bytes of files answered", registry=r)
        self.files_discarded = Counter("hsx_serve_files_discarded", "files removed (client gone, request failed)",
                                       ["reason"], registry=r)
        self._discarded_by_replica: dict[str, int] = {}
        self.aborted = Counter("hsx_serve_requests_aborted", "requests stopped mid-batch, their client gone",
                               registry=r)
        self._aborted_by_replica: dict[str, int] = {}
        self.spec_decode = None
        if num_speculative_tokens:
            names = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
            docs = ("Number of spec decoding drafts.", "Number of draft tokens.", "Number of accepted tokens.")
            totals = [Counter(f"vllm:spec_decode_{n}", d, ["model_name"], registry=r).labels(model_name)
                      for n, d in zip(names, docs)]
            per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
                              ["model_name", "position"], registry=r)
            self.spec_decode = (*totals, [per_pos.labels(model_name, str(i)) for i in range(num_speculative_tokens)])
            self._spec_by_replica: dict[str, tuple] = {}

    def observe_reply(self, reply, answered: bool = True) -> None:
        """One engine reply (serve.engine.EngineReply): tokens and bytes when it succeeded and its request was
        answered with it (not a list request that failed as a whole), its batch when it is the batch's first."""
        if reply.ok and answered:
            self.prompt_tokens.inc(len(reply.prompt_token_ids))
            self.generation_tokens.inc(len(reply.token_ids))
            self.bytes_written.inc(reply.bytes_written)
            if reply.write_seconds is not None:
                self.write_seconds.observe(reply.write_seconds)
        seen = self._discarded_by_replica.get(reply.replica, 0)
        if reply.discarded > seen:
            self.files_discarded.labels("client_gone").inc(reply.discarded - seen)
            self._discarded_by_replica[reply.replica] = reply.discarded
        seen = self._aborted_by_replica.get(reply.replica, 0)
        if reply.aborted > seen:
            self.aborted.inc(reply.aborted - seen)
            self._aborted_by_replica[reply.replica] = reply.aborted
        if self.spec_decode is not None and reply.spec_decode is not None:
            self._observe_spec(reply.replica, reply.spec_decode)
        if reply.first_in_batch:
            self.batch_size.observe(reply.batch_size)
            self.batches.labels(reply.replica).inc()
            self.batch_seconds.observe(reply.batch_seconds)

    def _observe_spec(self, replica: str, counts: tuple) -> None:
        """A replica's running counts: what grew since it last reported goes onto the counters (the replies of
        concurrent batches may arrive out of order: a smaller count than the last is old news)."""
        *totals, per_pos = counts
        seen = self._spec_by_replica.get(replica)
        if seen is not None and totals[0] <= seen[0]:
            return
        *before, before_pos = seen or (0, 0, 0, (0,) * len(per_pos))
        for counter, now, was in zip(self.spec_decode[:3], totals, before):
            counter.inc(now - was)
        for counter, now, was in zip(self.spec_decode[3], per_pos, before_pos):
            counter.inc(now - was)
        self._spec_by_replica[replica] = counts

    def text(self) -> bytes:
        return generate_latest(self.registry)
