"""The TCP sockets a process tree listens on, read from /proc (no ss/lsof needed)."""
from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Listener:
    address: str   # as bound: "127.0.0.1", "::ffff:127.0.0.1", "0.0.0.0", "::", ...
    port: int
    pid: int
    process: str

    @property
    def loopback(self) -> bool:
        ip = ipaddress.ip_address(self.address)
        mapped = getattr(ip, "ipv4_mapped", None)
        return (mapped or ip).is_loopback


def process_tree(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(name))
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        tree.add(pid)
        todo.extend(children.get(pid, ()))
    return tree


def _listening_inodes() -> dict[int, tuple[str, int]]:
    """socket inode -> (address, port) of every TCP socket in LISTEN state."""
    out = {}
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        with open(table) as f:
            rows = f.read().splitlines()[1:]
        for row in rows:
            cols = row.split()
            if cols[3] != "0A":  # TCP_LISTEN
                continue
            hex_ip, hex_port = cols[1].split(":")
            raw = bytes.fromhex(hex_ip)
            # /proc prints the address as 32-bit words in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, width, 4))
            out[int(cols[9])] = (str(ipaddress.ip_address(raw)), int(hex_port, 16))
    return out


def listeners(root: int) -> list[Listener]:
    inodes = _listening_inodes()
    found = set()
    for pid in process_tree(root):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            with open(f"/proc/{pid}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inode = int(target[8:-1])
                if inode in inodes:
                    found.add(Listener(*inodes[inode], pid, comm))
    return sorted(found, key=lambda s: (s.port, s.pid))
