"""Bind a Serve replica's inter-deployment gRPC server to its node's IP, not every interface.

Ray Serve (2.60) starts one gRPC server per replica, for calls from the proxy and from other
deployments, with a literal address and no setting to change it:

    ReplicaActor._on_initialized:  add_port_to_grpc_server(self._server, "[::]:0")
                                   (ray/serve/_private/replica.py)

Its callers dial `<replica's node IP>:<port>` and nothing else (RunningReplicaInfo.node_ip,
ray/serve/_private/request_router/replica_wrapper.py), so binding the node IP instead loses no
caller. On the local cluster `raypaged serve` starts, the node IP is 127.0.0.1 (serve/cli.py),
and this was the one socket of the whole process tree that listened beyond the loopback; on a
cluster it is the pod's or host's address, as every other Ray server there.

The router calls `bind_replica_grpc_to_node_ip()` first thing in its constructor: Serve runs the
constructor before `_on_initialized`, in the replica's own process. Where a Ray version no
longer has the hook, the replica keeps Ray's binding (still guarded by Ray's token) and says so;
tests/serve/test_loopback.py fails there.
"""
from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

RAY_REPLICA_GRPC_ADDRESS = "[::]:0"


def bind_replica_grpc_to_node_ip() -> None:
    import ray
    from ray.serve._private import replica

    original = getattr(replica, "add_port_to_grpc_server", None)
    if original is None:
        logger.warning("this Ray version has no replica.add_port_to_grpc_server: the replica's "
                       "gRPC server keeps Ray's own binding (all interfaces, token-guarded)")
        return
    if getattr(original, "binds_node_ip", False):  # already in place in this process
        return
    node_ip = ray.util.get_node_ip_address()

    def add_port(server, address: str) -> int:
        if address == RAY_REPLICA_GRPC_ADDRESS:  # the node IP, any port (IPv6 in brackets)
            address = f"[{node_ip}]:0" if ":" in node_ip else f"{node_ip}:0"
        return original(server, address)

    add_port.binds_node_ip = True
    replica.add_port_to_grpc_server = add_port
