"""Two "hosts" on one machine: two network namespaces joined by a veth pair.

For the tests and the benchmark that need processes on different hosts. Each
namespace gets one end of a veth pair and one address of a /30 in 10.231.0.0/16,
which exists only inside the namespaces made here (the machine's own namespace,
interfaces and addresses are never touched). Processes run inside with ``ip netns
exec``; they share the machine's kernel, hostname, file system and /dev/shm but not
its network, so nereus_comm's host identity (which includes the network namespace)
sees them as two hosts and moves their bytes through the transport, not shared
memory or cross-memory attach.

gloo binds the address of the hostname unless told otherwise, and that address is
not in the namespaces: :meth:`TwoHosts.env` sets ``GLOO_SOCKET_IFNAME`` to the
namespace's veth end, so every gloo pair is on the test's addresses.

Example::

    reason = netns_unavailable()
    if reason: pytest.skip(reason)
    with two_hosts() as hosts:
        proc = hosts.popen(0, [sys.executable, "-c", "..."])
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["TwoHosts", "netns_unavailable", "two_hosts"]

_IP = shutil.which("ip") or "/usr/sbin/ip"
_COUNTER = itertools.count()
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([_IP, *args], check=check, capture_output=True, text=True, timeout=30)


def netns_unavailable() -> str | None:
    """Why two namespaces cannot be made here (None: they can)."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    if not os.path.exists(_IP):
        return "the `ip` command (iproute2) is not installed"
    try:
        with two_hosts():
            pass
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        return f"cannot make network namespaces here: {detail.strip()}"
    return None


@dataclass(frozen=True)
class TwoHosts:
    """Two namespaces made by :func:`two_hosts`: host i is ``names[i]`` at ``addresses[i]``."""

    names: tuple[str, str]
    links: tuple[str, str]
    addresses: tuple[str, str]

    def env(self, host: int, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment of a process on ``host``: gloo bound to its veth end."""
        env = {k: v for k, v in os.environ.items() if k != "NEREUS_SHM_HOST"}
        env.update(
            GLOO_SOCKET_IFNAME=self.links[host],
            PYTHONPATH=os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")])),
            TORCH_CPP_LOG_LEVEL="ERROR",
        )
        env.update(extra or {})
        return env

    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``host``'s namespace."""
        return [_IP, "netns", "exec", self.names[host], *argv]

    def popen(
        self, host: int, argv: Sequence[str], *, env: Mapping[str, str] | None = None, **kw
    ) -> subprocess.Popen:
        """Start ``argv`` on ``host`` (from the repository root, with :meth:`env`)."""
        kw.setdefault("cwd", ROOT)
        return subprocess.Popen(self.command(host, argv), env=self.env(host, env), **kw)


@contextlib.contextmanager
def two_hosts() -> Iterator[TwoHosts]:
    """Make two namespaces joined by a veth pair; remove them (and the link) on exit.

    Names carry this process's pid and a counter, so parallel runs never collide;
    the /30 is picked from them as well (addresses only exist inside the namespaces).

    Raises:
        subprocess.CalledProcessError: a namespace or link could not be made (not
            root, no netns support); whatever was made is removed first.
    """
    n = next(_COUNTER)
    tag = f"nr{os.getpid() % 10**7}x{n % 100}"  # at most 12 chars + 1: veth names <= 15
    names = (f"{tag}a", f"{tag}b")
    links = (f"{tag}a", f"{tag}b")
    sub = (os.getpid() * 7 + n) % (1 << 14)  # a /30 of 10.231.0.0/16
    base = sub * 4
    addresses = (
        f"10.231.{base >> 8}.{(base & 255) + 1}",
        f"10.231.{base >> 8}.{(base & 255) + 2}",
    )
    made: list[str] = []
    try:
        for name in names:
            _ip("netns", "add", name)
            made.append(name)
        # Created in the first namespace and moved: nothing lingers in the machine's own.
        _ip("-n", names[0], "link", "add", links[0], "type", "veth", "peer", "name", links[1])
        _ip("-n", names[0], "link", "set", links[1], "netns", names[1])
        for name, link, addr in zip(names, links, addresses):
            _ip("-n", name, "addr", "add", f"{addr}/30", "dev", link)
            _ip("-n", name, "link", "set", link, "up")
            _ip("-n", name, "link", "set", "lo", "up")
        yield TwoHosts(names, links, addresses)
    finally:
        # Deleting a namespace deletes its veth end, and with it the peer end.
        for name in reversed(made):
            _ip("netns", "delete", name, check=False)
