"""A stand-in for an inference server's /metrics: text shaped like each kind's real exposition (the names, labels,
HELP/TYPE lines and counter suffixes of vLLM, SGLang, TGI, Triton+TensorRT-LLM and llama.cpp's llama-server as their
docs show them; the real llama-server is in test_llamacpp_*.py), driven
by a JSON control file that is re-read on every request, so a test can change the load, break the answer (HTML,
garbage, NaN, HTTP 500, slow, a restart) or stop the process.

    python inference_metrics.py KIND PORT CONTROL_JSON [NAME]

The kind is in the command line, as it is in `vllm serve ...` or `python -m sglang.launch_server ...`; NAME
(ignored) stands for what names TGI's and Triton's processes (`text-generation-router`, `tritonserver`).
"""

from __future__ import annotations

import json
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


TGI_KV_TOKENS = 16000  # TGI's max_batch_total_tokens, as its /info reports it
LLAMACPP_SLOTS = 4  # llama-server's total_slots (-np), as its /props reports it


def exposition(kind: str, s: dict[str, Any]) -> str:
    kv, waiting, running = s.get("kv", 0.0), s.get("waiting", 0), s.get("running", 0)
    pre, start, generated = s.get("preemptions", 0), s.get("start_time", 1.7e9), s.get("generated", 0)
    proc = ("# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.\n"
            "# TYPE process_start_time_seconds gauge\n"
            f"process_start_time_seconds {start}\n")
    if kind == "vllm":
        lab = 'engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"'
        return proc + (
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{{{lab}}} {running}\n"
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{{{lab}}} {waiting}\n"
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f"vllm:kv_cache_usage_perc{{{lab}}} {kv}\n"
            "# HELP vllm:num_preemptions Cumulative number of preemption from the engine.\n"
            "# TYPE vllm:num_preemptions counter\n"
            f"vllm:num_preemptions_total{{{lab}}} {pre}\n"
            "# HELP vllm:generation_tokens Number of generation tokens processed.\n"
            "# TYPE vllm:generation_tokens counter\n"
            f"vllm:generation_tokens_total{{{lab}}} {generated}\n"
            "# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.\n"
            "# TYPE vllm:time_to_first_token_seconds histogram\n"
            f'vllm:time_to_first_token_seconds_bucket{{{lab},le="0.1"}} 3.0\n'
            f'vllm:time_to_first_token_seconds_bucket{{{lab},le="+Inf"}} 4.0\n'
            f"vllm:time_to_first_token_seconds_count{{{lab}}} 4.0\n"
            f"vllm:time_to_first_token_seconds_sum{{{lab}}} 0.61\n")
    if kind == "sglang":
        lab = 'model_name="meta-llama/Llama-3.1-8B-Instruct"'
        return proc + (
            "# HELP sglang:token_usage The token usage\n# TYPE sglang:token_usage gauge\n"
            f"sglang:token_usage{{{lab}}} {kv}\n"
            "# HELP sglang:num_queue_reqs The number of requests in the waiting queue\n"
            "# TYPE sglang:num_queue_reqs gauge\n"
            f"sglang:num_queue_reqs{{{lab}}} {waiting}\n"
            "# HELP sglang:num_running_reqs The number of running requests\n# TYPE sglang:num_running_reqs gauge\n"
            f"sglang:num_running_reqs{{{lab}}} {running}\n"
            "# HELP sglang:num_retracted_requests Number of retracted requests\n"
            "# TYPE sglang:num_retracted_requests counter\n"
            f"sglang:num_retracted_requests_total{{{lab}}} {pre}\n"
            "# HELP sglang:generation_tokens_total Number of generation tokens processed.\n"
            "# TYPE sglang:generation_tokens_total counter\n"
            f"sglang:generation_tokens_total{{{lab}}} {generated}\n")
    if kind == "tgi":
        return ("# TYPE tgi_queue_size gauge\n"
                f"tgi_queue_size {waiting}\n"
                "# TYPE tgi_batch_current_size gauge\n"
                f"tgi_batch_current_size {running}\n"
                "# TYPE tgi_batch_current_max_tokens gauge\n"
                f"tgi_batch_current_max_tokens {int(TGI_KV_TOKENS * kv)}\n"
                "# TYPE tgi_request_count counter\n"
                "tgi_request_count 42\n")
    if kind == "triton":
        lab = 'model="tensorrt_llm",version="1"'
        return (
            "# HELP nv_inference_pending_request_count Instantaneous number of pending requests awaiting execution "
            "per-model.\n# TYPE nv_inference_pending_request_count gauge\n"
            f'nv_inference_pending_request_count{{model="ensemble",version="1"}} {waiting}\n'
            "# HELP nv_trt_llm_request_metrics TRT LLM request metrics\n# TYPE nv_trt_llm_request_metrics gauge\n"
            f'nv_trt_llm_request_metrics{{{lab},request_type="waiting"}} {waiting}\n'
            f'nv_trt_llm_request_metrics{{{lab},request_type="scheduled"}} {running}\n'
            f'nv_trt_llm_request_metrics{{{lab},request_type="max"}} 512\n'
            f'nv_trt_llm_request_metrics{{{lab},request_type="active"}} {running}\n'
            "# HELP nv_trt_llm_kv_cache_block_metrics TRT LLM KV cache block metrics\n"
            "# TYPE nv_trt_llm_kv_cache_block_metrics gauge\n"
            f'nv_trt_llm_kv_cache_block_metrics{{{lab},kv_cache_block_type="max"}} 6240\n'
            f'nv_trt_llm_kv_cache_block_metrics{{{lab},kv_cache_block_type="used"}} {int(6240 * kv)}\n'
            f'nv_trt_llm_kv_cache_block_metrics{{{lab},kv_cache_block_type="fraction"}} {kv}\n'
            f'nv_trt_llm_kv_cache_block_metrics{{{lab},kv_cache_block_type="tokens_per"}} 64\n')
    if kind == "llamacpp":
        # One unlabelled sample per name; the slots busy are requests_processing (its KV field is them over
        # total_slots). n_tokens_max is typed counter without the _total suffix, as the real server writes it.
        rows = (("prompt_tokens_total", "counter", 1337), ("prompt_seconds_total", "counter", 0.43),
                ("tokens_predicted_total", "counter", generated), ("tokens_predicted_seconds_total", "counter", 1.2),
                ("n_decode_total", "counter", 420), ("n_tokens_max", "counter", 1537),
                ("prompt_tokens_seconds", "gauge", 3109.3), ("predicted_tokens_seconds", "gauge", 812.5),
                ("requests_processing", "gauge", round(kv * LLAMACPP_SLOTS)), ("requests_deferred", "gauge", waiting),
                ("n_busy_slots_per_decode", "gauge", 1.5))
        return "".join(f"# HELP llamacpp:{n} .\n# TYPE llamacpp:{n} {t}\nllamacpp:{n} {v}\n" for n, t, v in rows)
    raise ValueError(f"unknown kind {kind}")


def main() -> None:
    kind, port, control = sys.argv[1], int(sys.argv[2]), sys.argv[3]

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            with open(control, encoding="utf-8") as f:
                s = json.load(f)
            mode = s.get("mode", "ok")
            if (self.path, kind) in (("/info", "tgi"), ("/props", "llamacpp")):
                info = json.dumps({"model_id": "m", "max_batch_total_tokens": TGI_KV_TOKENS} if kind == "tgi" else
                                  {"total_slots": LLAMACPP_SLOTS, "is_sleeping": False}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(info)))
                self.end_headers()
                self.wfile.write(info)
                return
            if mode == "slow":
                time.sleep(float(s.get("delay", 5)))
            if mode == "http500":
                body, code, ctype = b"internal error\n", 500, "text/plain"
            elif mode == "html":
                body, code, ctype = b"<!DOCTYPE html><html><body>Login required</body></html>", 200, "text/html"
            elif mode == "huge":  # an endless exposition (a broken exporter): cut off, never read into memory whole
                body, code, ctype = exposition(kind, s).encode() * 30_000, 200, "text/plain"
            elif mode == "garbage":
                body, code, ctype = b"\x00\x01 this is { not metrics\n", 200, "text/plain"
            else:
                text = exposition(kind, s)
                if mode == "nan":
                    text = text.replace(f" {s.get('kv', 0.0)}\n", " NaN\n")
                body, code, ctype = text.encode(), 200, "text/plain; version=0.0.4; charset=utf-8"
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if mode == "trickle":  # each byte in time, the whole far too late
                for i in range(0, len(body), 64):
                    self.wfile.write(body[i:i + 64])
                    self.wfile.flush()
                    time.sleep(0.1)
            else:
                self.wfile.write(body)

        def log_message(self, *_args: object) -> None:
            pass

    ThreadingHTTPServer.daemon_threads = True
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    main()
