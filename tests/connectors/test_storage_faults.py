"""Storage that fails: against the real loopback S3 server (moto), through a loopback proxy that plays the faults.

Transient 5xx answers are retried until the write lands; a store that keeps failing, or dies mid-upload, fails
exactly the requests it was writing (reported by wait_for_save) and leaves no object a reader could mistake for data.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
import s3fs
import torch

from connectors import RequestInfo, cleanup_hidden_states, load_hidden_states
from harness.http_proxy import LoopbackProxy
from tests.connectors.conftest import make_spec

pytestmark = pytest.mark.s3


def fast_failing(endpoint: str) -> dict:
    """storage_options with botocore's own retries off, so every retry the test sees is the connector's."""
    return {"client_kwargs": {"endpoint_url": endpoint}, "config_kwargs": {"retries": {"total_max_attempts": 1}},
            "skip_instance_cache": True}


def save(connector, request_id: str, fill: float) -> str:
    connector.start_request(RequestInfo(request_id, 16))
    connector.save_hidden_states(request_id, torch.arange(16), torch.full((16, 3, 32), fill))
    return connector.request_finished(request_id)["hidden_states_path"]


def bucket_keys(s3_bucket) -> set[str]:
    url, options = s3_bucket
    fs = s3fs.S3FileSystem(**options)
    return set(fs.find(url.removeprefix("s3://")))


@pytest.mark.parametrize("failing", ["lock", "safetensors"], ids=["lock-upload", "data-upload"])
def test_transient_5xx_answers_are_retried_until_the_write_lands(s3_bucket, connector_factory, caplog, failing):
    url, options = s3_bucket
    with LoopbackProxy(options["client_kwargs"]["endpoint_url"]) as proxy:
        proxy.fail_next = 2
        proxy.targets = lambda method, path: method == "PUT" and path.endswith(f".{failing}")
        connector = connector_factory(f"{url}/run", make_spec(), storage_options=fast_failing(proxy.endpoint),
                                      max_write_attempts=3, write_retry_backoff_s=0.01)
        with caplog.at_level(logging.WARNING, logger="connectors.storage"):
            path = save(connector, "flaky", 7.0)
            assert connector.wait_for_save() == {}
        assert proxy.injected_failures == 2
        assert [e.status for e in proxy.log].count(503) == 2

    retries = [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()]
    assert len(retries) == 2 and "attempt 1/3" in retries[0] and "attempt 2/3" in retries[1]
    got = load_hidden_states(path, storage_options=options)  # straight from the server, not through the proxy
    assert bool((got["hidden_states"] == 7.0).all())
    assert bucket_keys(s3_bucket) == {f"{url.removeprefix('s3://')}/run/flaky.safetensors"}


def test_storage_that_keeps_failing_fails_that_request_and_leaves_nothing(s3_bucket, connector_factory, caplog):
    url, options = s3_bucket
    bucket = url.removeprefix("s3://")
    with LoopbackProxy(options["client_kwargs"]["endpoint_url"]) as proxy:
        connector = connector_factory(f"{url}/run", make_spec(), storage_options=fast_failing(proxy.endpoint),
                                      max_write_attempts=2, write_retry_backoff_s=0.01)
        save(connector, "before", 1.0)
        assert connector.wait_for_save() == {}
        proxy.fail_next = -1  # from now on every data upload fails; the lock object still goes through
        proxy.targets = lambda method, path: method == "PUT" and path.endswith(".safetensors")
        doomed = save(connector, "doomed", 2.0)
        with caplog.at_level(logging.ERROR, logger="connectors.example_hidden_states_connector"):
            failures = connector.wait_for_save()
        assert proxy.injected_failures == 2  # both attempts were made

    assert list(failures) == ["doomed"] and isinstance(failures["doomed"], OSError)
    assert any("doomed" in r.getMessage() for r in caplog.records)
    # the lock was taken, the upload failed, the lock was removed: only the earlier file is there
    assert bucket_keys(s3_bucket) == {f"{bucket}/run/before.safetensors"}
    with pytest.raises(FileNotFoundError):
        load_hidden_states(doomed, storage_options=options, wait_timeout=1)


def test_server_gone_before_the_write_fails_the_request_and_leaves_nothing(s3_server, s3_bucket, connector_factory):
    from moto.server import ThreadedMotoServer

    url, options = s3_bucket
    bucket = url.removeprefix("s3://")
    # a second server on the same in-process store: stopping it is a real server going away
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        connector = connector_factory(f"{url}/run", make_spec(), storage_options=fast_failing(f"http://{host}:{port}"),
                                      max_write_attempts=2, write_retry_backoff_s=0.01)
        save(connector, "before", 1.0)
        assert connector.wait_for_save() == {}
    finally:
        server.stop()
    save(connector, "after-1", 2.0)
    save(connector, "after-2", 3.0)
    failures = connector.wait_for_save()

    assert sorted(failures) == ["after-1", "after-2"]
    assert all(isinstance(e, Exception) and "Could not connect" in str(e) for e in failures.values()), failures
    assert bucket_keys(s3_bucket) == {f"{bucket}/run/before.safetensors"}


def test_server_dying_mid_upload_fails_the_request_and_no_data_object_appears(s3_bucket, connector_factory):
    url, options = s3_bucket
    bucket = url.removeprefix("s3://")
    proxy = LoopbackProxy(options["client_kwargs"]["endpoint_url"]).start()
    connector = connector_factory(f"{url}/run", make_spec(), storage_options=fast_failing(proxy.endpoint),
                                  max_write_attempts=2, write_retry_backoff_s=0.01)
    proxy.hold_targets = True
    proxy.targets = lambda method, path: method == "PUT" and path.endswith(".safetensors")
    path = save(connector, "cut", 5.0)
    assert proxy.held.wait(30)  # the upload is in the server's hands...
    proxy.stop()  # ...when it dies
    failures = connector.wait_for_save()

    assert list(failures) == ["cut"]
    assert "cut.safetensors" in str(failures["cut"]) and ".lock" not in str(failures["cut"]), \
        f"the upload's error must be reported, not the failed lock removal's: {failures['cut']}"
    # no data object; the lock object, taken before the upload, could not be removed from a dead server
    assert bucket_keys(s3_bucket) == {f"{bucket}/run/cut.safetensors.lock"}
    with pytest.raises(TimeoutError, match="cleanup_hidden_states"):  # a reader is told what happened...
        load_hidden_states(path, storage_options=options, wait_timeout=0.3)
    cleanup_hidden_states(path, storage_options=options)  # ...and what to do
    assert bucket_keys(s3_bucket) == set()


def test_lock_that_cannot_be_removed_does_not_fail_a_landed_write_nor_block_readers(s3_bucket, connector_factory,
                                                                                    caplog):
    url, options = s3_bucket
    bucket = url.removeprefix("s3://")
    with LoopbackProxy(options["client_kwargs"]["endpoint_url"]) as proxy:
        proxy.fail_next = -1
        proxy.targets = lambda method, path: method == "DELETE" and path.endswith(".lock")
        connector = connector_factory(f"{url}/run", make_spec(), storage_options=fast_failing(proxy.endpoint),
                                      max_write_attempts=2, write_retry_backoff_s=0.01)
        with caplog.at_level(logging.WARNING, logger="connectors.storage"):
            path = save(connector, "landed", 4.0)
            assert connector.wait_for_save() == {}
        assert proxy.injected_failures >= 1

    assert any("could not remove" in r.getMessage() for r in caplog.records)
    assert bucket_keys(s3_bucket) == {f"{bucket}/run/landed.safetensors", f"{bucket}/run/landed.safetensors.lock"}
    got = load_hidden_states(path, storage_options=options, wait_timeout=0.5)  # the object is whole: no waiting
    assert bool((got["hidden_states"] == 4.0).all())


def test_an_outage_shorter_than_write_retry_s_costs_time_not_the_request(s3_bucket, connector_factory):
    """Every request to the store fails for 3 s (an outage, lock and data alike): with write_retry_s the write waits
    it out and lands; counted in attempts (max_write_attempts 3, as fast) the same outage fails the request."""
    url, options = s3_bucket
    outcomes = {}
    for name, retry in (("by-time", {"write_retry_s": 30.0}), ("by-attempts", {"max_write_attempts": 3})):
        with LoopbackProxy(options["client_kwargs"]["endpoint_url"]) as proxy:
            connector = connector_factory(f"{url}/{name}", make_spec(), storage_options=fast_failing(proxy.endpoint),
                                          write_retry_backoff_s=0.05, **retry)
            proxy.targets = lambda method, path: True
            proxy.fail_next = -1
            ends = threading.Timer(3.0, lambda p=proxy: setattr(p, "fail_next", 0))
            ends.start()
            started = time.monotonic()
            save(connector, "during", 5.0)
            outcomes[name] = (connector.wait_for_save(), time.monotonic() - started, proxy.injected_failures)
            ends.join()

    failures, seconds, injected = outcomes["by-time"]
    assert failures == {} and seconds >= 3.0 and injected >= 3
    got = load_hidden_states(f"{url}/by-time/during.safetensors", storage_options=options)
    assert bool((got["hidden_states"] == 5.0).all())
    failures, seconds, _ = outcomes["by-attempts"]
    assert list(failures) == ["during"] and seconds < 3.0


def test_missing_credentials_fail_the_write_at_once_not_after_write_retry_s(s3_bucket, connector_factory,
                                                                           monkeypatch, tmp_path):
    """No credentials anywhere (a worker without the driver's environment): no retry brings them, so a write with
    write_retry_s = 60 fails at once with botocore's reason, rather than waiting out the minute."""
    url, options = s3_bucket
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-metadata lookup either
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    connector = connector_factory(f"{url}/no-credentials", make_spec(), write_retry_s=60.0, write_retry_backoff_s=0.05,
                                  storage_options=fast_failing(options["client_kwargs"]["endpoint_url"]))
    started = time.monotonic()
    save(connector, "uncredentialed", 1.0)
    failures = connector.wait_for_save()
    assert list(failures) == ["uncredentialed"] and time.monotonic() - started < 20
    assert "credentials" in str(failures["uncredentialed"]).lower()
