"""llama.cpp's llama-server on CPU with the tiny generated model: the one real inference engine of the tests, the
benchmark and the demo.

The binary and the gguf-py that writes the model come from scripts/llama-server.sh's cache (built by `make
setup-test`); engine() is None when it has not been built, and the caller says what that means (a skip, or under
CI=true a failure: tests/conftest.py's require).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Sequence

from testkit import tiny_llama
from testkit.agent import agent_env

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "llama-server.sh"
NOT_BUILT = "llama-server is not built (make setup-test builds it: scripts/llama-server.sh)"


def engine() -> Path | None:
    """The cache directory (bin/llama-server, src/gguf-py), or None when it is not built."""
    r = subprocess.run([str(SCRIPT), "path"], capture_output=True, text=True, check=False)
    return Path(r.stdout.strip()) if r.returncode == 0 else None


def model(engine_dir: Path, dest: Path) -> Path:
    """The tiny Llama (testkit/tiny_llama.py) written into dest, by the engine's own gguf-py."""
    return tiny_llama.write(dest / "tiny-llama.gguf", engine_dir / "src" / "gguf-py")


def prompt(n_words: int, seed: int) -> str:
    """Words of English-like text; a different seed starts differently, so no slot reuses another's cached prefix
    (the prompt's tokens are then all prefill, as for a new user)."""
    words = ("the", "of", "and", "to", "in", "is", "that", "it", "for", "on", "with", "as", "at", "by", "this",
             "from", "or", "an", "be", "are", "server", "token", "request", "latency", "model", "queue", "slot")
    x = seed * 2654435761 % 2**32
    out = [f"#{seed}"]
    for _ in range(n_words):
        x = (x * 1103515245 + 12345) % 2**31
        out.append(words[x % len(words)])
    return " ".join(out)


def chat(content: str, max_tokens: int, stream: bool = True) -> dict[str, Any]:
    """An OpenAI chat-completions body. The model can only say printable ASCII and never ends on its own
    (tiny_llama.py): a completion is exactly max_tokens tokens, one SSE event each."""
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "stream": stream}


def stream_chat(host: str, port: int, body: dict[str, Any], source: str = "", timeout: float = 60.0) -> float:
    """One streamed chat completion on a connection of its own (llama-server closes it after the stream anyway):
    the seconds from sending the request to its first token, which comes in the first chunk of the body with the
    role's event. Reads the stream to its end. Raises OSError or http.client.HTTPException when it fails, and
    RuntimeError on a status other than 200 or an empty body."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout, source_address=(source, 0) if source else None)
    try:
        data = json.dumps(body).encode()
        t0 = time.monotonic()
        conn.request("POST", "/v1/chat/completions", body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read(200)!r}")
        first = resp.read1(65536)
        if not first:
            raise RuntimeError("the stream ended before its first token")
        ttft = time.monotonic() - t0
        while resp.read1(65536):
            pass
        return ttft
    finally:
        conn.close()


def get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


class LlamaServer:
    """One llama-server process: `slots` parallel slots (-np) over a context of 2,048 tokens each, `threads` CPU
    threads, /metrics on unless metrics=False. prefix runs it elsewhere (`ip netns exec NS`).

    batch: the most tokens one step of the engine computes (-b and -ub). A long prompt's prefill is done in steps
    of that many, and the other slots' next tokens wait for each step: 128 keeps a step near 25 ms here, where
    the default 2,048 makes one prompt stall every stream for up to ~400 ms."""

    def __init__(self, engine_dir: Path, model_path: Path, port: int, log: Path, host: str = "127.0.0.1",
                 slots: int = 2, threads: int = 1, metrics: bool = True, prefix: Sequence[str] = (),
                 batch: int = 128):
        self.port, self.host, self.slots, self.log = port, host, slots, log
        self.argv = [
            *prefix, str(engine_dir / "bin" / "llama-server"), "-m", str(model_path), "--host", host,
            "--port", str(port), "-np", str(slots), "-c", str(slots * tiny_llama.CONTEXT), "-t", str(threads),
            "-b", str(batch), "-ub", str(batch),
            # Every connection gets an HTTP thread at once, so a request waiting for a slot is in the engine's
            # queue (requests_deferred), not in the listen backlog where nothing counts it.
            "--threads-http", "128",
            # No prompt states copied to RAM between requests: every prompt is new here, and the memory stays flat.
            "--cache-ram", "0", "--no-webui", "--no-warmup", *(["--metrics"] if metrics else []),
        ]
        self.prefix = list(prefix)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> "LlamaServer":
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}: {self.tail()}")
            try:
                if json.loads(self.get("/health", 1.0)).get("status") == "ok":
                    return self
            except (OSError, ValueError):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"llama-server did not answer /health within {timeout:g}s: {self.tail()}")

    def get(self, path: str, timeout: float = 5.0) -> str:
        """A GET of the engine's, from where it runs: through the prefix (inside its network namespace) too."""
        if not self.prefix:
            return get(self.url + path, timeout)
        r = subprocess.run([*self.prefix, sys.executable, "-m", "testkit.llamacpp", "get", self.url + path,
                            str(timeout)], capture_output=True, text=True, timeout=timeout + 30, env=agent_env(),
                           check=False)
        if r.returncode != 0:
            raise OSError(r.stderr.strip()[-300:])
        return r.stdout

    def metrics(self) -> dict[str, float]:
        """The engine's own /metrics, name -> value (its samples carry no labels)."""
        out = {}
        for line in self.get("/metrics").splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def tail(self, n: int = 2000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL, as a crash."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.kill()

    def __enter__(self) -> "LlamaServer":
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()



if __name__ == "__main__":
    # `python -m testkit.llamacpp get URL TIMEOUT`: LlamaServer.get inside the engine's network namespace.
    if sys.argv[1:2] != ["get"]:
        sys.exit("usage: python -m testkit.llamacpp get URL TIMEOUT")
    sys.stdout.write(get(sys.argv[2], float(sys.argv[3])))
