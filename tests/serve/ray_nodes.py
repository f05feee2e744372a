"""A multi-node Ray cluster on one machine: `ray start --head` and `ray start --address`, each
with its own CPUs and its own loopback address (127.0.0.2, 127.0.0.3, ...: Ray rewrites
127.0.0.1 to the machine's outward address in cluster mode, but leaves the rest of 127/8 alone).
Each node is a `ray start --block` process in its own process group, so a test can find that
node's raylet among its descendants, and stopping the node takes everything it started."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from listening import process_tree
from serve_testing import free_port

RAY = str(Path(sys.executable).with_name("ray"))


def node_env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    return {**env, "RAY_AUTH_MODE": "token"}  # joining nodes default to "disabled"


class Node:
    def __init__(self, ip: str, num_cpus: int, temp_dir: str, head_address: str | None = None):
        """temp_dir: the cluster's own (short: Ray puts sockets in it), so that `ray start
        --head` writes its address file there, not to /tmp/ray/ray_current_cluster, where
        every later `ray.init()` on the machine would find it."""
        self.ip = ip
        self.log = tempfile.NamedTemporaryFile("w+", suffix=f"-ray-{ip}.log", delete=False)
        args = [RAY, "start", "--block", f"--node-ip-address={ip}", f"--num-cpus={num_cpus}",
                f"--temp-dir={temp_dir}", "--disable-usage-stats",
                f"--dashboard-agent-listen-port={free_port()}"]
        if head_address is None:
            self.port = free_port()
            self.address = f"{ip}:{self.port}"
            # every fixed default port moved, so clusters of other users of the machine stay apart
            args += ["--head", f"--port={self.port}", "--include-dashboard=false",
                     f"--ray-client-server-port={free_port()}", f"--dashboard-port={free_port()}"]
        else:
            self.address = head_address
            args += [f"--address={head_address}"]
        self.proc = subprocess.Popen(args, env=node_env(), stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def wait_started(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while "--block" not in Path(self.log.name).read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray node {self.ip} did not start:\n"
                                   f"{Path(self.log.name).read_text()[-3000:]}")
            time.sleep(0.5)

    def raylet_pid(self) -> int:
        for pid in process_tree(self.proc.pid):
            try:
                with open(f"/proc/{pid}/comm") as f:
                    if f.read().strip() == "raylet":
                        return pid
            except OSError:
                continue
        raise RuntimeError(f"no raylet under node {self.ip}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(45)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever the node left behind
        except ProcessLookupError:
            pass
