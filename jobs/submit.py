"""`hsx submit`: hand an `hsx run` command to a Ray cluster through Ray's job submission API (the dashboard).

    submit_job(address, entrypoint, runtime_env=None, submission_id=None) -> job id
    follow_job(address, job_id) -> final status             streams the job's logs to stdout while it runs

The job runs `hsx run ...` on the head node as its driver; inside it $RAY_ADDRESS points at the cluster, so the run
joins it instead of starting a local Ray. The cluster needs hsx installed (infra/Dockerfile) and must reach the
model, corpus and output paths (shared storage or object store URLs).
"""

from __future__ import annotations

import logging
import re
import time

import requests
from tenacity import Retrying, retry_if_exception, stop_after_delay, wait_exponential

logger = logging.getLogger(__name__)

TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
# For the first seconds after a head node starts, its dashboard answers 500 "No available agent to submit job,
# please try again later" (the job agent registers later): submit_job waits that long for it.
AGENT_WAIT_S = 60.0


def _agent_not_up(error: BaseException) -> bool:
    return isinstance(error, RuntimeError) and "no available agent" in str(error).lower()


def _reason(error: BaseException) -> str:
    """What the dashboard said, in one line: the exception its answer carries (the answer can hold the server's
    whole traceback), else the answer."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    carried = [line for line in lines if re.match(r"^[\w.]+(Error|Exception): ", line)]
    return carried[-1] if carried else " ".join(lines)


def _client(address: str):
    from ray.job_submission import JobSubmissionClient

    try:
        return JobSubmissionClient(address)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise ValueError(f"--address {address!r}: cannot reach a Ray dashboard there ({e}); pass the head's "
                         "dashboard URL, e.g. http://HEAD:8265") from e


def submit_job(address: str, entrypoint: str, *, runtime_env: dict | None = None,
               submission_id: str | None = None, agent_wait_s: float = AGENT_WAIT_S) -> str:
    """The job id. ValueError (one line, naming the fix) when the cluster refuses the job or its job agent is not
    up after `agent_wait_s`."""
    client = _client(address)
    retrying = Retrying(stop=stop_after_delay(agent_wait_s), wait=wait_exponential(multiplier=0.5, max=5),
                        retry=retry_if_exception(_agent_not_up), reraise=True,
                        before_sleep=lambda rs: logger.warning("the job agent of %s is not up yet; retrying", address))
    try:
        return retrying(client.submit_job, entrypoint=entrypoint, runtime_env=runtime_env,
                        submission_id=submission_id, metadata={"tool": "hsx"})
    except requests.RequestException as e:  # the dashboard went away mid-request (not the builtin ConnectionError)
        raise ValueError(f"the Ray dashboard at {address} stopped answering: {type(e).__name__}: {e}; check that "
                         "the head is up, then submit again") from e
    except RuntimeError as e:  # the SDK's error for every refusal: "Request failed with status code N: reason"
        said = _reason(e)
        if _agent_not_up(e):
            raise ValueError(f"the Ray cluster at {address} has no job agent up after {agent_wait_s:.0f} s ({said}); "
                             "check `ray status` on the head, then submit again") from e
        raise ValueError(f"the Ray cluster at {address} refused the job: {said}") from e


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
