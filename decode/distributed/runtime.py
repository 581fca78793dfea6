"""The one place that starts Ray: a local instance bound to loopback, checked before any worker starts.

    started = start_local_ray(num_cpus=2)      # or reuse a running instance after checking it
    check_loopback()                           # NonLoopbackError unless every address Ray reports is loopback
    stop_local_ray()                           # ray.shutdown(), then wait until the processes it started are gone

What keeps Ray 2.60 on loopback: ``_node_ip_address="127.0.0.1"`` alone is not enough, because Ray maps a
localhost address to a "remotely reachable" interface address whenever it thinks clusters are enabled
(``ray._private.services.resolve_ip_for_localhost``); ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` turns that off.
Ray reads it when ``ray`` is first imported, so this module sets it before it imports ray (and, when ray was
imported earlier, sets the constant ray read from it). Everything is then checked, not assumed: the node
addresses of ``ray.nodes()``, the GCS address, and every inet socket of the processes this one started (GCS,
raylet, agents, workers: listening and connected ends) plus the listening sockets of this process; any address
that is not loopback (a wildcard ``0.0.0.0`` listener included) makes `check_loopback` raise. Also set: no
dashboard, usage stats off, a small object store, ``num_cpus`` the machine's cores unless given.
"""
import ipaddress
import os
import time

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"      # before ray is imported (module docstring)
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import psutil  # noqa: E402
import ray  # noqa: E402
from ray._private import ray_constants as _ray_constants  # noqa: E402

from .failures import NonLoopbackError  # noqa: E402

LOOPBACK = "127.0.0.1"
OBJECT_STORE_BYTES = 128 << 20
_owned = {"started": False}


def is_loopback(address: str) -> bool:
    """Whether ``address`` (an IP, optionally ``ip:port`` or an IPv4-mapped IPv6 address) is a loopback address."""
    host = address.strip()
    if host.startswith("["):                                      # [ipv6]:port
        host = host[1:].split("]", 1)[0]
    elif host.count(":") == 1:                                    # ipv4:port
        host = host.rsplit(":", 1)[0]
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False                                              # a hostname or garbage: not proven loopback
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def loopback_violations(addresses) -> list[str]:
    """``"where: address"`` for every ``(where, address)`` pair whose address is not loopback."""
    return [f"{where}: {address}" for where, address in addresses if not is_loopback(str(address))]


def socket_addresses():
    """``(where, ip)`` of every inet socket of the processes this one started, and of this process's listeners."""
    me = psutil.Process()
    found = []
    for proc in [me] + me.children(recursive=True):
        try:
            name, conns = proc.name(), proc.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        for c in conns:
            if proc.pid == me.pid and c.status not in (psutil.CONN_LISTEN, psutil.CONN_NONE):
                continue                       # this process's own client sockets need not be Ray's
            found.append((f"{name} (pid {proc.pid}) {c.status.lower()} socket", c.laddr.ip))
            if c.raddr:
                found.append((f"{name} (pid {proc.pid}) peer", c.raddr.ip))
    return found


def reported_addresses():
    """``(where, address)`` of what Ray reports: every node's address and the GCS address, then the sockets."""
    found = []
    for node in ray.nodes():
        found.append((f"node {node.get('NodeID', '?')[:8]} NodeManagerAddress", node.get("NodeManagerAddress", "")))
    found.append(("gcs_address", ray.get_runtime_context().gcs_address))
    return found + socket_addresses()


def check_loopback() -> int:
    """Raise `NonLoopbackError` (listing them) unless every address Ray reports is loopback; returns how many
    addresses were checked."""
    if _ray_constants.ENABLE_RAY_CLUSTER:
        raise NonLoopbackError("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER: expected cluster mode off (localhost kept as "
                               "127.0.0.1), got it on")
    addresses = reported_addresses()
    bad = loopback_violations(addresses)
    if bad:
        raise NonLoopbackError(f"ray: expected every address on loopback, got {len(bad)} that are not: "
                               + "; ".join(bad[:8]))
    return len(addresses)


def start_local_ray(num_cpus: int | None = None, object_store_memory: int = OBJECT_STORE_BYTES) -> bool:
    """Start a local Ray instance on 127.0.0.1 (or reuse the running one) and `check_loopback`.

    Returns True when this call started Ray. A failed check shuts down an instance this module started before
    it raises, so no worker ever runs on a non-loopback instance."""
    _ray_constants.ENABLE_RAY_CLUSTER = False        # what the environment variable sets when read at import
    started = False
    if not ray.is_initialized():
        ray.init(_node_ip_address=LOOPBACK, include_dashboard=False, num_cpus=num_cpus or os.cpu_count(),
                 object_store_memory=object_store_memory, log_to_driver=False, configure_logging=False,
                 namespace="pagedkv")
        _owned["started"] = started = True
    try:
        check_loopback()
    except BaseException:
        if _owned["started"]:
            stop_local_ray()
        raise
    return started


def stop_local_ray(wait_s: float = 20.0) -> list[int]:
    """``ray.shutdown()``, then wait up to ``wait_s`` for the processes this one started to exit; returns the
    pids of those still running (empty when all are gone)."""
    ray.shutdown()
    _owned["started"] = False
    deadline = time.monotonic() + wait_s
    while True:
        left = [p.pid for p in psutil.Process().children(recursive=True) if _is_ray_process(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def _is_ray_process(proc) -> bool:
    try:
        cmd = " ".join(proc.cmdline())
        return proc.status() != psutil.STATUS_ZOMBIE and ("ray" in proc.name() or "/ray/" in cmd)
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def ray_processes() -> list[tuple[int, str]]:
    """``(pid, name)`` of the live Ray processes this process started (empty after `stop_local_ray`)."""
    return [(p.pid, p.name()) for p in psutil.Process().children(recursive=True) if _is_ray_process(p)]
