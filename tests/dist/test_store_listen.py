"""Rank 0's rendezvous store listens on the address it is given and nowhere else.

torch's TCPStore server answers anyone, with no authentication, and listens on every interface
whatever host it is given; ``create_store`` binds the socket itself (127.0.0.1 in an embedded
run, the node's cluster address on a cluster) and hands it to torch. The embedded run's whole
listener check, Ray's processes and a worker's store together, is
tests/ray/test_embedded_cluster.py.
"""

from __future__ import annotations

import datetime

import psutil
import pytest
import torch.distributed as dist

from ringtrain.actors.cluster import CLUSTER_MARK_VARIABLE, loopback_interface, rank_interfaces
from ringtrain.train.mesh import create_store, init_process_group


def listening_addresses(port: int) -> list[str]:
    return [c.laddr.ip for c in psutil.Process().net_connections(kind="inet") if c.status == psutil.CONN_LISTEN and c.laddr.port == port]


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_the_store_listens_on_its_host_only_and_forms_a_world(host: str) -> None:
    if host == "::1" and not _has_ipv6_loopback():
        pytest.skip("no IPv6 loopback here")
    store, port = create_store(host, 1, timeout_s=10.0)
    try:
        assert listening_addresses(port) == [host]  # torch alone would listen on '::', every interface
        client = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=5))
        client.set("key", "value")
        assert store.get("key") == b"value"
        init_process_group(backend="gloo", host=host, port=port, rank=0, world_size=1, timeout_s=10.0)
        try:
            assert dist.get_world_size() == 1
        finally:
            dist.destroy_process_group()
    finally:
        del store
    assert listening_addresses(port) == []  # the socket went with the store


def test_an_embedded_clusters_ranks_connect_over_loopback_and_a_clusters_as_configured() -> None:
    """gloo listens on the address the machine's hostname resolves to, NCCL on its first
    interface that is not loopback: a worker of an embedded cluster names the loopback interface
    for both, unless the user chose one; a worker of another cluster is left to them."""
    embedded = {CLUSTER_MARK_VARIABLE: "/tmp/rt-x"}
    lo = loopback_interface()
    assert lo is not None and "127.0.0.1" in [a.address for a in psutil.net_if_addrs()[lo]]
    assert rank_interfaces(embedded) == {"GLOO_SOCKET_IFNAME": lo, "NCCL_SOCKET_IFNAME": lo}
    assert rank_interfaces({**embedded, "NCCL_SOCKET_IFNAME": "ib0"}) == {"GLOO_SOCKET_IFNAME": lo, "NCCL_SOCKET_IFNAME": "ib0"}
    assert rank_interfaces({}) == {}


def _has_ipv6_loopback() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False
