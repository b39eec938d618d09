"""What listens where, read from /proc/net: for the tests that check a store's bind address;
and whether this host has IPv6 loopback."""

import os
import socket


def listeners(port: int) -> list[tuple[str, str]]:
    """(file, local address in hex) of every socket listening on ``port`` (/proc/net)."""
    found = []
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(name):
            continue
        with open(name) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                addr, _, hex_port = fields[1].rpartition(":")
                if int(hex_port, 16) == port and fields[3] == "0A":  # 0A: LISTEN
                    found.append((name, addr))
    return found


def ipv6_loopback() -> bool:
    """Whether a socket can bind ::1 here (IPv6 may be off in a container)."""
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False
