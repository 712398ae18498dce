"""The S3 test fixtures do what other tests rely on, checked with s3fs directly.

``s3_server`` is a real SeaweedFS that checks signatures; ``fault_proxy`` relays
requests to it untouched (so signatures made for the proxy verify) and injects
5xx errors, delays, dropped connections and outages. The retry bounds used here
are ``TEST_CONFIG_KWARGS`` / ``TEST_S3FS_RETRIES`` from ``tests/fixtures/s3.py``.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request

import botocore.exceptions
import pytest

from tests.fixtures.s3 import LOOPBACK, TEST_CONFIG_KWARGS, VOLUME_MAX, make_fs

pytestmark = [pytest.mark.s3, pytest.mark.timeout(120)]

# What s3fs raises once retries are used up: ClientErrors are translated to
# OSError subclasses, but connection errors and timeouts come out as botocore's
# own exceptions (BotoCoreError), so storage code must catch both.
STORAGE_ERRORS = (OSError, botocore.exceptions.BotoCoreError)


def test_roundtrip_put_get_list_delete(s3_server, s3_bucket):
    fs = s3_server.fs()
    payload = os.urandom(3 * 1024 * 1024 + 17)
    fs.pipe_file(f"{s3_bucket}/ckpt/step-1/shard.bin", payload)
    assert fs.cat_file(f"{s3_bucket}/ckpt/step-1/shard.bin") == payload
    assert fs.ls(f"{s3_bucket}/ckpt/step-1", detail=False) == [f"{s3_bucket}/ckpt/step-1/shard.bin"]
    fs.rm(f"{s3_bucket}/ckpt/step-1/shard.bin")
    assert not fs.exists(f"{s3_bucket}/ckpt/step-1/shard.bin")


def test_buckets_are_unique_and_env_names_the_server(s3_server):
    assert s3_server.make_bucket() != s3_server.make_bucket()
    env = s3_server.env()
    assert env["AWS_ENDPOINT_URL_S3"] == env["FSSPEC_S3_ENDPOINT_URL"] == s3_server.endpoint_url
    assert env["AWS_ACCESS_KEY_ID"] == s3_server.access_key
    assert env["AWS_SECRET_ACCESS_KEY"] == s3_server.secret_key
    assert env["AWS_DEFAULT_REGION"] == s3_server.region
    assert s3_server.endpoint_url.startswith("http://127.0.0.1:")


def test_wrong_secret_is_refused(s3_server, s3_bucket):
    bad = make_fs(s3_server.endpoint_url, s3_server.access_key, s3_server.secret_key + "x")
    with pytest.raises(PermissionError):
        bad.pipe_file(f"{s3_bucket}/nope", b"x")
    assert not s3_server.fs().exists(f"{s3_bucket}/nope")


def test_proxy_relays_signed_requests_untouched(s3_server, s3_bucket, fault_proxy):
    fs = fault_proxy.fs()
    payload = os.urandom(2 * 1024 * 1024)  # large enough for "Expect: 100-continue"
    fs.pipe_file(f"{s3_bucket}/via-proxy", payload)
    assert fs.cat_file(f"{s3_bucket}/via-proxy") == payload
    assert s3_server.fs().cat_file(f"{s3_bucket}/via-proxy") == payload
    assert fault_proxy.seen.get("PUT") == 1 and fault_proxy.faulted == {}

    bad = make_fs(fault_proxy.endpoint_url, s3_server.access_key, "wrong-secret")
    with pytest.raises(PermissionError):
        bad.pipe_file(f"{s3_bucket}/nope", b"x")


def test_two_503_on_put_are_absorbed_by_client_retries(s3_bucket, fault_proxy):
    fs = fault_proxy.fs()
    fault_proxy.fail_next(2, status=503, methods=("PUT",))
    fs.pipe_file(f"{s3_bucket}/retried", b"payload")
    assert fault_proxy.faulted == {"PUT": 2}
    assert fault_proxy.seen["PUT"] == 3
    assert fault_proxy.pending == 0
    fault_proxy.fail_next(2, status=500, methods=None)  # GETs too
    assert fs.cat_file(f"{s3_bucket}/retried") == b"payload"
    assert fault_proxy.pending == 0


def test_fail_next_only_hits_matching_methods_and_paths(s3_bucket, fault_proxy):
    fs = fault_proxy.fs()
    fault_proxy.fail_next(1, status=503, methods=("PUT",), path_contains="/only-this")
    fs.pipe_file(f"{s3_bucket}/other", b"1")
    assert fault_proxy.pending == 1 and fault_proxy.faulted == {}
    fs.pipe_file(f"{s3_bucket}/only-this", b"2")
    assert fault_proxy.pending == 0 and fault_proxy.faulted == {"PUT": 1}


def test_permanent_outage_surfaces_as_error_then_recovers(s3_bucket, fault_proxy):
    fs = fault_proxy.fs()
    fs.pipe_file(f"{s3_bucket}/before", b"ok")
    fault_proxy.outage(True)
    t0 = time.monotonic()
    with pytest.raises(STORAGE_ERRORS):
        fs.pipe_file(f"{s3_bucket}/during", b"x")
    elapsed = time.monotonic() - t0
    attempts = TEST_CONFIG_KWARGS["retries"]["total_max_attempts"]
    print(f"outage surfaced after {elapsed:.2f}s, {fault_proxy.seen['PUT'] - 1} attempts")
    assert fault_proxy.seen["PUT"] - 1 == attempts
    assert elapsed < 2 ** (attempts - 1) + 2  # full-jitter backoff: sum of rand*2**i
    fault_proxy.outage(False)
    fs.pipe_file(f"{s3_bucket}/after", b"ok")
    assert fs.cat_file(f"{s3_bucket}/after") == b"ok"


def test_delay_holds_a_request_then_forwards_it(s3_bucket, fault_proxy):
    fs = fault_proxy.fs()
    fs.pipe_file(f"{s3_bucket}/slow", b"data")
    fault_proxy.delay_next(1, 0.6, methods=("GET",))
    t0 = time.monotonic()
    assert fs.cat_file(f"{s3_bucket}/slow") == b"data"
    assert time.monotonic() - t0 >= 0.6
    assert fault_proxy.faulted == {"GET": 1}


def test_delay_past_read_timeout_is_retried(s3_server, s3_bucket, fault_proxy):
    fs = s3_server.fs(
        endpoint_url=fault_proxy.endpoint_url,
        config_kwargs={**TEST_CONFIG_KWARGS, "read_timeout": 1},
    )
    fs.pipe_file(f"{s3_bucket}/slow", b"data")
    fault_proxy.delay_next(1, 3.0, methods=("GET",))
    t0 = time.monotonic()
    assert fs.cat_file(f"{s3_bucket}/slow") == b"data"
    elapsed = time.monotonic() - t0
    assert 1.0 <= elapsed < 3.0, elapsed  # timed out after 1 s and retried, not waited out
    assert fault_proxy.seen["GET"] == 2


def test_dropped_connection_is_retried(s3_bucket, fault_proxy):
    fs = fault_proxy.fs()
    fault_proxy.drop_next(1, methods=("PUT",))
    fs.pipe_file(f"{s3_bucket}/dropped-once", b"data")
    assert fault_proxy.faulted == {"PUT": 1} and fault_proxy.seen["PUT"] == 2
    assert fs.cat_file(f"{s3_bucket}/dropped-once") == b"data"


def test_dropped_connections_without_end_surface_as_botocore_error(s3_server, s3_bucket, fault_proxy):
    fs = s3_server.fs(
        endpoint_url=fault_proxy.endpoint_url,
        config_kwargs={**TEST_CONFIG_KWARGS, "retries": {"total_max_attempts": 2, "mode": "standard"}},
        retries=1,
    )
    fault_proxy.drop_next(100)
    with pytest.raises(botocore.exceptions.ConnectionClosedError):
        fs.pipe_file(f"{s3_bucket}/never", b"data")
    assert 2 <= fault_proxy.faulted["PUT"] < 100


def test_the_server_has_room_for_a_bucket_per_test_whatever_the_disk_s_free_space(s3_server):
    """Every bucket is a collection with volumes of its own: the server's volume budget is fixed
    (SeaweedFS mini would otherwise allow one volume per free GiB of disk, too few for the suite's
    buckets on a fuller disk), and 10 more buckets, each written, fit beside the suite's."""
    with urllib.request.urlopen(f"http://{LOOPBACK}:{s3_server.ports['master']}/dir/status", timeout=10) as r:
        topology = json.load(r)["Topology"]
    assert topology["Max"] == VOLUME_MAX, topology
    fs = s3_server.fs()
    for _ in range(10):
        bucket = s3_server.make_bucket()
        fs.pipe_file(f"{bucket}/object", b"ok")
        assert fs.cat_file(f"{bucket}/object") == b"ok"
