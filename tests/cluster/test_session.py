"""The Ray session's checks that need no Ray (cluster/session.py): an address is probed before Ray is asked (nothing
listening, or a listener that is not Ray, fails in seconds with the fix), a command's missing resources are an error
on a private local Ray and a warning on a cluster that may grow, and Ray's errors are shown by their first line."""

from __future__ import annotations

import logging
import socket
import time

import pytest

from cluster.session import check_fits, first_line, ray_cluster


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("form", ["127.0.0.1:{port}", "ray://127.0.0.1:{port}"])
def test_an_address_where_nothing_listens_is_refused_before_ray_is_asked(form):
    address = form.format(port=closed_port())
    start = time.monotonic()
    with pytest.raises(ValueError, match=rf"--address {address}: cannot connect to a Ray cluster there .*leave "
                                         "--address out to run on a private local Ray"):
        with ray_cluster(address):
            pass
    assert time.monotonic() - start < 10


def test_a_listener_that_is_not_ray_is_refused_in_seconds():
    with socket.socket() as listener:  # a web server, a dashboard port: the TCP connection is accepted
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        start = time.monotonic()
        with pytest.raises(ValueError, match=rf"--address {address}: something listens there but it is not Ray"):
            with ray_cluster(address):
                pass
    assert time.monotonic() - start < 15


def test_missing_resources_fail_on_a_private_ray_and_warn_on_a_cluster_that_may_grow(caplog):
    problems = ["--workers 4 need 8 CPUs", "1 GPU"]
    with pytest.raises(ValueError, match=r"^--workers 4 need 8 CPUs; 1 GPU; pass fewer --workers$"):
        check_fits(problems, local=True, fix="pass fewer --workers", waiting="waiting for nodes")
    with caplog.at_level(logging.WARNING, logger="cluster.session"):
        check_fits(problems, local=False, fix="pass fewer --workers", waiting="waiting for nodes")
    assert [r.getMessage() for r in caplog.records] == [
        "--workers 4 need 8 CPUs; 1 GPU; pass fewer --workers (waiting for nodes)"]
    check_fits([], local=True, fix="never said", waiting="never said")  # nothing missing: nothing happens


def test_an_error_is_shown_by_its_first_line_or_its_type():
    assert first_line(RuntimeError("the GCS is gone\n  at line 12\n  at line 13")) == "the GCS is gone"
    assert first_line(ConnectionError("")) == "ConnectionError"
    assert first_line(ValueError("  \n")) == "ValueError"


def test_a_private_ray_that_does_not_start_is_one_line_and_exit_1(monkeypatch, serve_model, capsys):
    """A private Ray whose node timed out starting on a loaded machine (Ray raises a plain Exception) printed a
    traceback from `hsx serve`: the work failed, one line, exit 1. The fault is Ray's own message, raised where
    ray.init raises it."""
    import ray

    from cli.main import main

    def timed_out(*args, **kwargs):
        raise Exception("The current node timed out during startup. This could happen because some of the raylet "
                        "failed to startup or the GCS has become overloaded.")

    monkeypatch.setattr(ray, "init", timed_out)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    code = main(["serve", "--model", serve_model, "--speculative-config",
                 '{"method": "ngram", "num_speculative_tokens": 2}'])
    err = capsys.readouterr().err
    assert code == 1 and "a private local Ray could not start (The current node timed out during startup" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
