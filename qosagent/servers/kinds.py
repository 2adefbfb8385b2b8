"""What each kind of inference server exports, in one table, and how a process or an exposition tells its kind.

Names from each project's metrics reference (checked 2026-12):
- vLLM, docs.vllm.ai/en/stable/usage/metrics/: `vllm:kv_cache_usage_perc` (0-1; `vllm:gpu_cache_usage_perc` before
  V1), `vllm:num_requests_waiting`, `vllm:num_requests_running`, counter `vllm:num_preemptions`.
- SGLang, docs.sglang.io/references/production_metrics: `sglang:token_usage` (share of the KV token pool in use),
  `sglang:num_queue_reqs`, `sglang:num_running_reqs`, counter `sglang:num_retracted_requests` (its preemptions).
- TGI, huggingface.co/docs/text-generation-inference/reference/metrics: `tgi_queue_size`, `tgi_batch_current_size`.
  TGI exports no KV-cache occupancy; the nearest is `tgi_batch_current_max_tokens` (the tokens the running batch
  has reserved) over `max_batch_total_tokens` from its `/info` (the KV pool it sized at start, in tokens).
- Triton (TensorRT-LLM backend), github.com/triton-inference-server/tensorrtllm_backend docs/guides/metrics.md:
  `nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction"}`, `nv_trt_llm_request_metrics` with
  request_type `waiting` / `scheduled`; other backends only `nv_inference_pending_request_count`
  (github.com/triton-inference-server/server docs/user_guide/metrics.md). Metrics on port 8002 by default.
- llama.cpp's llama-server, its tools/server/README.md "GET /metrics" (served only with `--metrics`; checked against
  the source of llama-cpp-python 0.3.36's vendored llama.cpp): `llamacpp:requests_deferred` (requests queued for a
  slot), `llamacpp:requests_processing` (slots busy), counter `llamacpp:tokens_predicted_total`. It exports no
  KV-cache usage: each of its `total_slots` (`/props`, the `-np` it started with) owns its share of the context, and a
  request finding every slot busy is deferred, so busy slots over total slots is its pressure reading in the KV
  field. Its `predicted_tokens_seconds` gauge is not used: it is averaged between two scrapes and reset by each, so
  any other scraper moves it; the counter's rate is not. The counter grows when a request ends, by all its tokens
  (server-context.cpp: metrics_on_prediction, called from the slot's reset), so its rate is taken over 10 s of
  reads, not one interval. It prints every number with the C++ stream's default precision, 6 significant digits
  (server-task.cpp: to_metrics): past 999,999 the counter moves in steps of 10, then 100, ...
- Generated tokens, counters: vLLM `vllm:generation_tokens_total`, SGLang `sglang:generation_tokens_total` (same
  pages as above); the agent shows their rate between two reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

# The readings, by field: KV-cache usage (0-1), requests waiting, requests running (admission uses these), and the
# server's own counters of preemptions and of generated tokens.
KV, WAITING, RUNNING, PREEMPTIONS = "kv_cache_usage", "requests_waiting", "requests_running", "preemptions"
GENERATED = "generated_tokens"
FIELDS = (KV, WAITING, RUNNING, PREEMPTIONS, GENERATED)
COUNTERS = (PREEMPTIONS, GENERATED)


@dataclass(frozen=True)
class Source:
    """One way to read a field: a sample name, optionally one label's value; the first source present wins."""

    sample: str
    label: tuple[str, str] | None = None


@dataclass(frozen=True)
class Kind:
    name: str
    fields: Mapping[str, tuple[Source, ...]]
    # Whether the server takes most of its GPUs' memory at start (vLLM gpu_memory_utilization, SGLang
    # mem_fraction_static, TGI's KV pool, TensorRT-LLM kv_cache_free_gpu_mem_fraction): memory used on its GPUs then
    # says nothing about load.
    preallocates: bool
    metrics_port: int | None = None  # where its metrics are when not on the serving port
    prefix: str = ""  # how its metric names start: tells the kind of an unknown server from its exposition
    # KV usage as a count over a capacity read from a JSON document of the server's (path, key): TGI's /info
    # (tokens), llama-server's /props (slots).
    kv_capacity: tuple[str, str] | None = None
    # What an HTTP status from its metrics endpoint means for this kind, said with the reason (llama-server answers
    # 501 when it was started without --metrics).
    http_hints: Mapping[int, str] = field(default_factory=dict)
    # The generated-tokens counter's rate is taken over at least this long (s); 0: between the last two reads. A
    # counter that grows only when a request ends needs a window over several requests, or its rate comes in lumps.
    rate_window: float = 0.0
    # Significant digits the server prints its numbers with; None: exact. A counter printed to d digits is known to
    # half a step of its last digit, so its rate is known only over a span where that is small (scraper.RATE_ERROR).
    digits: int | None = None


KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind("vllm", {
        KV: (Source("vllm:kv_cache_usage_perc"), Source("vllm:gpu_cache_usage_perc")),
        WAITING: (Source("vllm:num_requests_waiting"),),
        RUNNING: (Source("vllm:num_requests_running"),),
        PREEMPTIONS: (Source("vllm:num_preemptions_total"),),
        GENERATED: (Source("vllm:generation_tokens_total"),),
    }, preallocates=True, prefix="vllm:"),
    Kind("sglang", {
        KV: (Source("sglang:token_usage"),),
        WAITING: (Source("sglang:num_queue_reqs"),),
        RUNNING: (Source("sglang:num_running_reqs"),),
        PREEMPTIONS: (Source("sglang:num_retracted_requests_total"),),
        GENERATED: (Source("sglang:generation_tokens_total"),),
    }, preallocates=True, prefix="sglang:"),
    Kind("tgi", {
        KV: (Source("tgi_batch_current_max_tokens"),),  # tokens, over kv_capacity
        WAITING: (Source("tgi_queue_size"),),
        RUNNING: (Source("tgi_batch_current_size"),),
    }, preallocates=True, prefix="tgi_", kv_capacity=("/info", "max_batch_total_tokens")),
    Kind("triton", {
        KV: (Source("nv_trt_llm_kv_cache_block_metrics", ("kv_cache_block_type", "fraction")),),
        WAITING: (Source("nv_trt_llm_request_metrics", ("request_type", "waiting")),
                  Source("nv_inference_pending_request_count")),
        RUNNING: (Source("nv_trt_llm_request_metrics", ("request_type", "scheduled")),),
    }, preallocates=True, metrics_port=8002, prefix="nv_"),
    # It allocates the KV cache of its whole context (-c) at start, on the GPU when it offloads layers there.
    Kind("llamacpp", {
        KV: (Source("llamacpp:requests_processing"),),  # slots, over kv_capacity
        WAITING: (Source("llamacpp:requests_deferred"),),
        RUNNING: (Source("llamacpp:requests_processing"),),
        GENERATED: (Source("llamacpp:tokens_predicted_total"),),
    }, preallocates=True, prefix="llamacpp:", kv_capacity=("/props", "total_slots"),
        http_hints={501: "llama-server serves /metrics only when started with --metrics"}, rate_window=10.0,
        digits=6),
)}
# A server of no known kind: nothing is read but whether it answers, and its memory use is load.
GENERIC = Kind("generic", {}, preallocates=False)


def kind(name: str) -> Kind:
    return KINDS.get(name, GENERIC)


def from_cmdline(argv: list[str]) -> str | None:
    """The kind a process's command line names, or None."""
    words = " ".join(argv).lower()
    # Order matters: `python -m sglang.launch_server` may carry a vllm package path in its arguments, never the
    # other way round.
    if "sglang" in words:
        return "sglang"
    if "vllm" in words:
        return "vllm"
    if "tritonserver" in words:
        return "triton"
    if "text-generation-" in words or "text_generation_server" in words:
        return "tgi"
    # The executable itself: llama-cpp-python's own server (`python -m llama_cpp.server`) is another server, with
    # no llamacpp: metrics.
    if any(a.rsplit("/", 1)[-1] == "llama-server" for a in argv[:1]):
        return "llamacpp"
    return None


def from_exposition(names: set[str]) -> str | None:
    """The kind whose metric names appear in an exposition, or None."""
    for k in KINDS.values():
        if any(n.startswith(k.prefix) for n in names):
            return k.name
    return None


def metrics_url(port: int, kind_name: str, host: str = "127.0.0.1") -> str:
    k = kind(kind_name)
    return f"http://{f'[{host}]' if ':' in host else host}:{k.metrics_port or port}/metrics"
