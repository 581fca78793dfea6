"""The Ray helper keeps to loopback: the address check on its own (every form of address), on the live local
instance (what Ray reports, every socket of its processes), its refusal when an address is not loopback (the
reports are replaced, no traffic leaves the machine), and shutdown leaving no Ray process behind."""
import os

import pytest

pytest.importorskip("ray")

import ray  # noqa: E402

from decode.distributed import (NonLoopbackError, ShardedDecoder, check_loopback, ray_processes,  # noqa: E402
                                start_local_ray, stop_local_ray)
from decode.distributed import runtime  # noqa: E402

from .workload import CALL_TIMEOUT_S  # noqa: E402


@pytest.mark.parametrize("address,loopback", [
    ("127.0.0.1", True), ("127.0.0.1:6379", True), ("127.5.5.5", True), ("::1", True), ("[::1]:8265", True),
    ("::ffff:127.0.0.1", True),
    ("10.0.0.5", False), ("192.168.1.20:6379", False), ("0.0.0.0", False), ("::", False), ("[::]:80", False),
    ("::ffff:10.1.2.3", False), ("localhost", False), ("", False), ("vm.example", False),
])
def test_is_loopback(address, loopback):
    assert runtime.is_loopback(address) is loopback


def test_violations_name_where_and_what():
    bad = runtime.loopback_violations([("node", "127.0.0.1"), ("raylet listen socket", "0.0.0.0"),
                                       ("peer", "10.2.3.4")])
    assert bad == ["raylet listen socket: 0.0.0.0", "peer: 10.2.3.4"]


@pytest.fixture(scope="module")
def local_ray():
    assert start_local_ray() in (True, False)
    yield
    assert stop_local_ray() == []


def test_the_environment_keeps_ray_on_loopback(local_ray):
    from ray._private import ray_constants
    assert os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0" and ray_constants.ENABLE_RAY_CLUSTER is False
    assert os.environ["RAY_USAGE_STATS_ENABLED"] == "0"
    addresses = runtime.reported_addresses()
    nodes = [a for where, a in addresses if "NodeManagerAddress" in where]
    sockets = [(where, a) for where, a in addresses if "socket" in where]
    assert nodes == ["127.0.0.1"]
    assert any("gcs_server" in where and "listen" in where for where, _ in sockets), sockets
    assert runtime.loopback_violations(addresses) == []
    assert check_loopback() > 0     # the live report: its size moves as Ray opens and closes connections


def test_check_loopback_checks_every_reported_address(local_ray, monkeypatch):
    frozen = runtime.reported_addresses()     # one report held still, so the count cannot race Ray's sockets
    monkeypatch.setattr(runtime, "reported_addresses", lambda: list(frozen))
    assert check_loopback() == len(frozen)
    monkeypatch.setattr(runtime, "reported_addresses", lambda: list(frozen) + [("peer", "10.9.8.7")])
    with pytest.raises(NonLoopbackError, match=r"peer: 10\.9\.8\.7"):
        check_loopback()


def test_a_worker_started_on_the_instance_keeps_to_loopback(local_ray):
    with ShardedDecoder(workers=2, shard="heads", num_q_heads=2, num_kv_heads=2, head_dim=4,
                        timeout=CALL_TIMEOUT_S) as dec:
        pids = dec.worker_pids
        listeners = [where for where, _ in runtime.reported_addresses() if "listen" in where]
        assert any(str(pids[0]) in where for where in listeners), listeners   # the worker's own sockets checked
        assert check_loopback() > 0
        cpus = int(ray.cluster_resources()["CPU"])
        assert [s["threads"] for s in dec.worker_states().values()] == [max(1, cpus // 2)] * 2   # its CPU share
    assert not any(p in [pid for pid, _ in ray_processes()] for p in pids)   # close() ended them


def test_refuses_when_ray_reports_a_node_off_loopback(local_ray, monkeypatch):
    real = ray.nodes
    monkeypatch.setattr(runtime.ray, "nodes", lambda: [dict(n, NodeManagerAddress="10.1.2.3") for n in real()])
    with pytest.raises(NonLoopbackError, match=r"NodeManagerAddress: 10\.1\.2\.3"):
        check_loopback()
    before = len(ray_processes())
    with pytest.raises(NonLoopbackError):
        ShardedDecoder(workers=2, shard="heads", num_q_heads=2, num_kv_heads=2, head_dim=4)
    assert len(ray_processes()) <= before                            # no worker was started


def test_refuses_a_wildcard_listener(local_ray, monkeypatch):
    real = runtime.socket_addresses
    monkeypatch.setattr(runtime, "socket_addresses", lambda: real() + [("raylet (pid 1) listen socket", "0.0.0.0")])
    with pytest.raises(NonLoopbackError, match="raylet \\(pid 1\\) listen socket: 0.0.0.0"):
        check_loopback()


def test_a_failed_check_shuts_down_the_instance_it_started(local_ray, monkeypatch):
    assert stop_local_ray() == [] and ray_processes() == []
    monkeypatch.setattr(runtime, "socket_addresses", lambda: [("gcs_server (pid 1) listen socket", "0.0.0.0")])
    with pytest.raises(NonLoopbackError):
        start_local_ray()
    assert not ray.is_initialized() and ray_processes() == []
    monkeypatch.undo()
    assert start_local_ray() is True                                 # the fixture's teardown stops it


def test_import_decode_never_imports_ray():
    import subprocess
    import sys
    code = "import sys, decode, decode.partial, kvcache; assert 'ray' not in sys.modules, 'ray imported'"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).returncode == 0
