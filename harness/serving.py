"""A live `hsx serve` on loopback for the tests of `hsx serve` (tests/serve/) and of `hsx regenerate` against it
(tests/jobs/test_regenerate.py, test_regenerate_faults.py): the real CLI in its own process (its private local Ray).

    ServeProcess(model, output, log_path, **flags)   start `hsx serve`, wait for /health; .client() is the official
                                           openai client, .post()/.get() plain requests; .stop() sends SIGTERM
    served(...)                            the same as a context manager (the process group is killed at the end)
    SharedServer(model, base)              the session's one shared server (the `server` fixture of
                                           tests/conftest.py): started on first use, again only if a test stopped it
    free_port(), API_KEY, LAYERS

Ray Serve takes 20-40 s to start on a 2-core machine, so every test that needs a live server shares one (`server`);
the SIGTERM test, which stops it, runs last in tests/serve/, and a test after it would get a fresh one.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import requests

API_KEY = "hsx-test-key"
LAYERS = (1, 2, 4)  # the tiny Llama has 4 decoder layers: 4 = last layer, pre-norm


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    def __init__(self, model: str, output: str | None, log_path: str, *, layers=LAYERS, port: int | None = None,
                 **flags) -> None:
        """output and layers None: left out (a speculative server, --speculative-config in flags)."""
        self.model, self.output, self.port = model, output, port or free_port()
        self.url = f"http://127.0.0.1:{self.port}" + str(flags.get("route_prefix", "")).rstrip("/")
        argv = [sys.executable, "-m", "cli", "serve", "--model", model, "--port", str(self.port), "--api-key", API_KEY]
        argv += ["--output", output] if output is not None else []
        argv += ["--layers", ",".join(map(str, layers))] if layers is not None else []
        for name, value in flags.items():  # True: a switch (--no-files)
            argv += ["--" + name.replace("_", "-")] + ([] if value is True else [str(value)])
        env = {**{k: v for k, v in os.environ.items() if k != "HSX_API_KEY"}, "RAY_DEDUP_LOGS": "0"}
        self.log_path = log_path
        self._log = open(log_path, "wb")
        # its own session: the test signals the hsx process alone, and kills the whole group at the end
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self._wait_healthy(timeout_s=180)

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"hsx serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"hsx serve did not become healthy in {timeout_s}s:\n{self.log()}")

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-5000:]

    def client(self, **kwargs):
        import openai

        return openai.OpenAI(**{"base_url": self.url + "/v1", "api_key": API_KEY, "max_retries": 0, "timeout": 120,
                                **kwargs})

    def headers(self, key: str | None = API_KEY) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"} if key else {}

    def post(self, path: str, body=None, *, key: str | None = API_KEY, timeout: float = 120, **kwargs):
        if isinstance(body, (dict, list)):
            kwargs["json"] = body
        elif body is not None:
            kwargs["data"] = body  # bytes, or a generator: sent chunked, without Content-Length
        return requests.post(self.url + path, headers={**self.headers(key), **kwargs.pop("headers", {})},
                             timeout=timeout, **kwargs)

    def get(self, path: str, *, key: str | None = API_KEY, timeout: float = 30):
        return requests.get(self.url + path, headers=self.headers(key), timeout=timeout)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics: 'name{label="v",...}' -> value."""
        from prometheus_client.parser import text_string_to_metric_families

        out = {}
        for family in text_string_to_metric_families(self.get("/metrics").text):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
        return out

    def stop(self, timeout_s: float = 90) -> int:
        """SIGTERM to the hsx process; its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout_s)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        self._log.close()


@contextlib.contextmanager
def served(model: str, output: str, log_path: str, **flags):
    server = ServeProcess(model, output, log_path, **flags)
    try:
        yield server
    finally:
        try:
            server.stop(timeout_s=60)
        except subprocess.TimeoutExpired:
            pass
        server.kill()


class SharedServer:
    """The shared server, started on first use and again only if a test stopped it (the SIGTERM test does, last)."""

    def __init__(self, model: str, base) -> None:
        self.model, self.base, self.current, self.starts = model, base, None, 0
        self._ctx = None

    def get(self) -> ServeProcess:
        if self.current is None or self.current.proc.poll() is not None:
            self.close()
            self.starts += 1
            out = self.base / f"run{self.starts}"
            output, extra = str(out / "out"), str(out / "extra")
            self._ctx = served(self.model, output, str(out / "serve.log"), replicas=2, max_num_seqs=8,
                               max_queued_requests=8, max_body_bytes=65536, max_prompt_tokens=64,
                               allowed_roots=f"{output},{extra}")
            os.makedirs(out, exist_ok=True)
            self.current = self._ctx.__enter__()
            self.current.extra_root = extra
        return self.current

    def close(self) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(None, None, None)
            self._ctx = self.current = None
