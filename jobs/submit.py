"""`hsx submit`: hand an `hsx run` command to a Ray cluster through Ray's job submission API (the dashboard).

    submit_job(address, entrypoint, runtime_env=None, submission_id=None) -> job id
    follow_job(address, job_id) -> final status             streams the job's logs to stdout while it runs

The job runs `hsx run ...` on the head node as its driver; inside it $RAY_ADDRESS points at the cluster, so the run
joins it instead of starting a local Ray. The cluster needs hsx installed (infra/Dockerfile) and must reach the
model, corpus and output paths (shared storage or object store URLs).
"""

from __future__ import annotations

import time

TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


def _client(address: str):
    from ray.job_submission import JobSubmissionClient

    try:
        return JobSubmissionClient(address)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise ValueError(f"--address {address!r}: cannot reach a Ray dashboard there ({e}); pass the head's "
                         "dashboard URL, e.g. http://HEAD:8265") from e


def submit_job(address: str, entrypoint: str, *, runtime_env: dict | None = None,
               submission_id: str | None = None) -> str:
    client = _client(address)
    return client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env, submission_id=submission_id,
                             metadata={"tool": "hsx"})


def follow_job(address: str, job_id: str, poll_s: float = 1.0, out=None) -> str:
    """Print new log lines until the job ends; return its final status ("SUCCEEDED", "FAILED", "STOPPED")."""
    import sys

    out = out or sys.stdout
    client = _client(address)
    shown = 0
    while True:
        status = str(client.get_job_status(job_id)).rsplit(".", 1)[-1]
        logs = client.get_job_logs(job_id)
        if len(logs) > shown:
            out.write(logs[shown:])
            out.flush()
            shown = len(logs)
        if status in TERMINAL:
            return status
        time.sleep(poll_s)
