"""What listens where, read from /proc/net: for the tests that check a store's bind address."""

import os


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
