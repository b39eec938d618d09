"""The socket route: nereus_comm._C.NetExchange on its own, and NetRoute between ranks.

NetExchange moves region tables over TCP loopback in one process; every received
byte must equal, byte for byte, the slice the test cuts itself from the source
tensor (the regions are written out here, not derived by the code under test).
The shapes cover rows that go as iovecs (>= 4 KiB) and rows that go through the
64 KiB bounce buffer, with rows that straddle its end, and different row layouts on
the two ends of one stream. A peer that closes early ends the exchange with an
error, and cancel() ends one that waits for bytes that never come.

NetRoute between LocalWorkers: a stranger that connects to the listener without the
nonce the control transport carried is turned away while the real peer gets in;
a peer that goes away mid-exchange fails the call with TransportError (not a hang)
and breaks the route for later calls; liveness that reports a peer dead ends a wait
on it within a poll; an exchange aborted by its caller breaks the route too.
"""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest
import torch
from support.net import ipv6_loopback

from nereus_comm import _C


def _pair() -> tuple[socket.socket, socket.socket]:
    with socket.socket() as ls:
        ls.bind(("127.0.0.1", 0))
        ls.listen(1)
        a = socket.create_connection(ls.getsockname())
        b, _ = ls.accept()
    for s in (a, b):
        s.setblocking(False)
    return a, b


def _row(t: torch.Tensor, offset: int, rows: int, row: int, stride: int) -> list[int]:
    """A table row in bytes for a uint8 tensor (written out here, not by pack.py)."""
    return [t.data_ptr() + offset, rows, row, stride]


def _run(sender, receiver, send_rows, recv_rows, owner, timeout_s: float = 30.0):
    ex = _C.NetExchange()
    ex.add(sender.fileno(), True, np.array(send_rows, dtype=np.int64).reshape(-1, 4), owner)
    ex.add(receiver.fileno(), False, np.array(recv_rows, dtype=np.int64).reshape(-1, 4), owner)
    ex.start()
    deadline = time.monotonic() + timeout_s
    while not ex.wait(50):
        assert time.monotonic() < deadline, "the exchange did not end"
    return ex.results()


@pytest.mark.parametrize("row", [100, 768, 4095, 4096, 20000])
def test_strided_rows_arrive_exactly(row: int) -> None:
    a, b = _pair()
    try:
        g = torch.Generator().manual_seed(row)
        rows = 600
        width = 3 * row
        src = torch.randint(0, 256, (rows, width), dtype=torch.uint8, generator=g)
        big = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=g)
        dst = torch.zeros(rows, width, dtype=torch.uint8)
        flat = torch.zeros(rows * row + big.numel() + 7 * width, dtype=torch.uint8)
        # Send: a column block (strided), a large contiguous buffer, 7 whole rows.
        send = [
            _row(src, row, rows, row, width),
            _row(big, 0, 1, big.numel(), big.numel()),
            _row(src, 11 * width, 7, width, width),
        ]
        # Receive the same byte stream cut differently: the column block into another
        # column of dst, the rest into one contiguous buffer.
        recv = [
            _row(dst, 2 * row, rows, row, width),
            _row(flat, 0, 1, big.numel() + 7 * width, 0),
        ]
        results = _run(a, b, send, recv, (src, big, dst, flat))
        total = rows * row + big.numel() + 7 * width
        assert results == [(total, total, 0, False), (total, total, 0, False)]
        assert torch.equal(dst[:, 2 * row : 3 * row], src[:, row : 2 * row])
        assert torch.equal(dst[:, : 2 * row], torch.zeros(rows, 2 * row, dtype=torch.uint8))
        assert torch.equal(flat[: big.numel()], big)
        assert torch.equal(flat[big.numel() : big.numel() + 7 * width], src[11:18].reshape(-1))
    finally:
        a.close()
        b.close()


def test_both_directions_on_one_stream() -> None:
    a, b = _pair()
    try:
        x = torch.arange(1 << 20, dtype=torch.int32).view(torch.uint8)
        y = torch.arange(1 << 19, dtype=torch.int64).view(torch.uint8)
        x_in, y_in = torch.zeros_like(x), torch.zeros_like(y)
        # One exchange per process side: a sends x and receives y, b the reverse.
        ex_a, ex_b = _C.NetExchange(), _C.NetExchange()
        ex_a.add(a.fileno(), True, np.array([_row(x, 0, 1, x.numel(), 0)]), x)
        ex_a.add(a.fileno(), False, np.array([_row(y_in, 0, 1, y.numel(), 0)]), y_in)
        ex_b.add(b.fileno(), True, np.array([_row(y, 0, 1, y.numel(), 0)]), y)
        ex_b.add(b.fileno(), False, np.array([_row(x_in, 0, 1, x.numel(), 0)]), x_in)
        ex_a.start()
        ex_b.start()
        assert ex_a.wait(20_000) and ex_b.wait(20_000)
        assert torch.equal(x_in, x) and torch.equal(y_in, y)
    finally:
        a.close()
        b.close()


def test_a_peer_that_closes_ends_the_exchange_with_an_error() -> None:
    a, b = _pair()
    got = torch.zeros(1 << 20, dtype=torch.uint8)
    ex = _C.NetExchange()
    ex.add(b.fileno(), False, np.array([_row(got, 0, 1, got.numel(), 0)]), got)
    ex.start()
    a.sendall(b"x" * 1000)
    a.close()
    assert ex.wait(10_000)
    ((done, total, err, eof),) = ex.results()
    assert (done, total) == (1000, got.numel()) and (eof or err), (done, err, eof)
    b.close()


def test_cancel_ends_a_wait_for_bytes_that_never_come() -> None:
    a, b = _pair()
    got = torch.zeros(4096, dtype=torch.uint8)
    ex = _C.NetExchange()
    ex.add(b.fileno(), False, np.array([_row(got, 0, 1, got.numel(), 0)]), got)
    ex.start()
    assert not ex.wait(100)
    started = time.monotonic()
    ex.cancel()
    assert time.monotonic() - started < 5
    assert ex.results() == [(0, 4096, 0, False)]
    a.close()
    b.close()


def test_bad_tables_are_refused_before_anything_moves() -> None:
    a, b = _pair()
    t = torch.zeros(64, dtype=torch.uint8)
    ex = _C.NetExchange()
    with pytest.raises(ValueError, match="int64"):
        ex.add(a.fileno(), True, np.zeros((1, 4), dtype=np.int32), t)
    with pytest.raises(ValueError, match="shape"):
        ex.add(a.fileno(), True, np.zeros((1, 6), dtype=np.int64), t)
    with pytest.raises(ValueError, match="num_rows"):
        ex.add(a.fileno(), True, np.array([[t.data_ptr(), -1, 8, 8]], dtype=np.int64), t)
    with pytest.raises(ValueError, match="overlap"):
        ex.add(a.fileno(), True, np.array([[t.data_ptr(), 4, 8, 4]], dtype=np.int64), t)
    with pytest.raises(ValueError, match="fits"):
        ex.add(a.fileno(), True, np.array([[2**62, 3, 2**61, 2**61]], dtype=np.int64), t)
    with pytest.raises(ValueError, match="fd"):
        ex.add(-1, True, np.array([[t.data_ptr(), 1, 8, 8]], dtype=np.int64), t)
    a.close()
    b.close()


# ---- NetRoute between ranks -------------------------------------------------------


def _stranger_then_accept(route, original, seen: dict):
    """Wrap route._accept: two strangers knock on the listener before the real peer
    (which waits a second before it dials) and are turned away."""

    def accept(listener, expect, nonces, theirs, deadline, timeout, liveness):
        where = listener.getsockname()
        strangers = [socket.create_connection(where) for _ in range(2)]
        strangers[0].sendall(b"\0" * 32 + (1).to_bytes(8, "little"))  # rank 1, wrong nonce
        strangers[1].sendall(b"\1" * 32 + (7).to_bytes(8, "little"))  # not a peer at all
        try:
            return original(listener, expect, nonces, theirs, deadline, timeout, liveness)
        finally:
            for s in strangers:
                s.settimeout(5)
                try:
                    seen.setdefault("answers", []).append(s.recv(64))  # b"": closed, told nothing
                except ConnectionResetError:
                    seen.setdefault("answers", []).append(b"")
                s.close()

    return accept


def _slow_dial(original):
    def dial(*args, **kw):
        time.sleep(1.0)
        return original(*args, **kw)

    return dial


def _strangers_are_turned_away(ctx) -> dict:
    from nereus_comm.transport import GlooTransport
    from nereus_comm.transport_net import NetRoute

    transport = GlooTransport()
    route = NetRoute(transport, address="127.0.0.1")
    seen: dict = {}
    if ctx.rank == 0:
        route._accept = _stranger_then_accept(route, route._accept, seen)
    else:
        route._dial = _slow_dial(route._dial)
    peers = route.prepare([1 - ctx.rank], timeout=30)
    g = torch.Generator().manual_seed(5)
    full = torch.randint(0, 256, (300, 700), dtype=torch.uint8, generator=g)
    from nereus_comm.pack import Region, region_table

    out = torch.zeros(300, 350, dtype=torch.uint8)
    # Rank 0 sends its left column block, rank 1 its right one; each lands in `out`.
    mine = Region(full, 0 if ctx.rank == 0 else 350, 300, 350, 700)
    theirs = Region(out, 0, 300, 350, 350)
    peer = 1 - ctx.rank
    pending = route.start(
        {peer: region_table([mine])},
        {peer: region_table([theirs])},
        owners=(full, out),
        deadline=time.monotonic() + 30,
        timeout=30,
    )
    pending.wait()
    other = full[:, 350:] if ctx.rank == 0 else full[:, :350]
    return {
        "peers": sorted(peers),
        "equal": bool(torch.equal(out, other)),
        "stranger_answers": seen.get("answers"),
        # LocalWorkers are on this host: the default address is loopback.
        "default_address": NetRoute(transport).address,
        "rejected": route.rejected,
        "bytes": (route.bytes_sent, route.bytes_received),
    }


def _peer_goes_away(ctx) -> dict:
    from nereus_comm.errors import TransportArgumentError, TransportError
    from nereus_comm.pack import Region, region_table
    from nereus_comm.transport import GlooTransport
    from nereus_comm.transport_net import NetRoute

    transport = GlooTransport()
    route = NetRoute(transport, address="127.0.0.1")
    route.prepare([1 - ctx.rank], timeout=30)
    if ctx.rank == 1:
        route.close()  # as a process that dies would: its streams close
        return {}
    got = torch.zeros(1 << 20, dtype=torch.uint8)
    out = {}
    started = time.monotonic()
    try:
        route.start(
            {}, {1: region_table([Region(got, 0, 1, got.numel(), 0)])}, owners=(got,),
            deadline=time.monotonic() + 60, timeout=60,
        ).wait()  # fmt: skip
        out["error"] = None
    except TransportError as e:
        out["error"] = str(e)
    out["seconds"] = time.monotonic() - started
    try:
        route.prepare([1], timeout=5)
        out["later"] = None
    except TransportArgumentError as e:
        out["later"] = str(e)
    return out


def _abort_breaks_the_route(ctx) -> dict:
    from nereus_comm.errors import TransportArgumentError
    from nereus_comm.pack import Region, region_table
    from nereus_comm.transport import GlooTransport
    from nereus_comm.transport_net import NetRoute

    transport = GlooTransport()
    route = NetRoute(transport, address="127.0.0.1")
    peer = 1 - ctx.rank
    route.prepare([peer], timeout=30)
    buf = torch.full((1024,), ctx.rank, dtype=torch.uint8)
    table = {peer: region_table([Region(buf, 0, 1, 1024, 1024)])}
    sends, recvs = (table, {}) if ctx.rank == 1 else ({}, table)
    pending = route.start(sends, recvs, owners=(buf,), deadline=time.monotonic() + 30, timeout=30)
    if ctx.rank == 1:
        pending.wait()  # 1 KiB fits the socket's buffer whatever rank 0 does
        return {}
    pending.abort("the caller failed")  # as reshard does when a later step raises
    try:
        route.prepare([peer], timeout=5)
        return {"later": None}
    except TransportArgumentError as e:
        return {"later": str(e)}


def _liveness_ends_the_wait(ctx) -> dict:
    from nereus_comm.errors import PeerLostError
    from nereus_comm.pack import Region, region_table
    from nereus_comm.transport import GlooTransport
    from nereus_comm.transport_net import NetRoute

    transport = GlooTransport()
    route = NetRoute(transport, address="127.0.0.1")
    route.prepare([1 - ctx.rank], timeout=30)
    if ctx.rank == 1:
        time.sleep(2.0)  # alive, stream open, sends nothing: only liveness can end it
        return {}
    got = torch.zeros(4096, dtype=torch.uint8)
    started = time.monotonic()

    def dead() -> set[int]:
        return {1} if time.monotonic() - started > 0.3 else set()

    try:
        route.start(
            {}, {1: region_table([Region(got, 0, 1, 4096, 4096)])}, owners=(got,),
            deadline=started + 60, timeout=60, liveness=dead,
        ).wait()  # fmt: skip
        return {"error": None}
    except PeerLostError as e:
        return {"error": str(e), "ranks": sorted(e.ranks), "s": time.monotonic() - started}


@pytest.mark.slow
def test_net_route_between_ranks() -> None:
    from nereus_comm.testing import LocalWorkers

    with LocalWorkers(2, timeout=60) as pool:
        first, second = pool.run(_strangers_are_turned_away)
        assert first["peers"] == [1] and second["peers"] == [0]
        assert first["equal"] and second["equal"]
        # Both strangers closed at once; rank 1 never listened (it dials rank 0).
        assert first["rejected"] == 2 and second["rejected"] == 0
        assert first["stranger_answers"] == [b"", b""]
        assert first["default_address"] == second["default_address"] == "127.0.0.1"
        assert first["bytes"] == second["bytes"] == (300 * 350, 300 * 350)

        lost, _ = pool.run(_peer_goes_away)
        assert lost["error"] and "recv from 1" in lost["error"], lost
        assert lost["seconds"] < 30, lost
        assert lost["later"] and "broke earlier" in lost["later"], lost

        told, _ = pool.run(_liveness_ends_the_wait)
        assert told["error"] and told["ranks"] == [1] and told["s"] < 1.5, told

        aborted, _ = pool.run(_abort_breaks_the_route)
        assert aborted["later"] and "the caller failed" in aborted["later"], aborted


def _random_regions(rng: np.random.Generator, t: torch.Tensor, total: int) -> list[list[int]]:
    """Regions over uint8 tensor ``t`` holding ``total`` bytes in all, disjoint, in
    storage order: a mix of contiguous runs and strided rows of 1 B to 20 KB."""
    out, at, left = [], 0, total
    while left:
        row = int(min(left, rng.choice([1, 7, 300, 4095, 4096, 5000, 20000])))
        rows = int(min(left // row, rng.integers(1, 40)))
        gap = int(rng.choice([0, 0, 1, 64, 3000]))
        stride = row + gap
        out.append([t.data_ptr() + at, rows, row, stride])
        at += (rows - 1) * stride + row + int(rng.integers(0, 50))
        left -= rows * row
    assert at <= t.numel(), "the test's tensor is too small for its regions"
    return out


def _gather(t: torch.Tensor, regions: list[list[int]]) -> torch.Tensor:
    """The bytes of ``regions`` in order, cut out with slicing (the reference)."""
    base = t.data_ptr()
    parts = []
    for addr, rows, row, stride in regions:
        off = addr - base
        parts += [t[off + r * stride : off + r * stride + row] for r in range(rows)]
    return torch.cat(parts)


@pytest.mark.parametrize("seed", range(6))
def test_random_tables_on_both_ends_move_every_byte_in_order(seed: int) -> None:
    rng = np.random.default_rng(seed)
    total = int(rng.integers(1, 3 << 20))
    src = torch.from_numpy(rng.integers(0, 256, 8 * total + 4096, dtype=np.uint8))
    dst = torch.zeros(8 * total + 4096, dtype=torch.uint8)
    send, recv = _random_regions(rng, src, total), _random_regions(rng, dst, total)
    a, b = _pair()
    try:
        results = _run(a, b, send, recv, (src, dst))
    finally:
        a.close()
        b.close()
    assert results == [(total, total, 0, False), (total, total, 0, False)]
    assert torch.equal(_gather(dst, recv), _gather(src, send))
    # Nothing outside the receive regions was written.
    outside = torch.ones_like(dst, dtype=torch.bool)
    for addr, rows, row, stride in recv:
        off = addr - dst.data_ptr()
        for r in range(rows):
            outside[off + r * stride : off + r * stride + row] = False
    assert not dst[outside].any()


def test_setup_records_carry_ipv4_and_ipv6_addresses() -> None:
    from nereus_comm.errors import TransportError
    from nereus_comm.transport_net import _parse, _record

    nonce = bytes(range(32))
    assert _parse(_record("10.1.2.3", 4242, nonce), 1) == (True, "10.1.2.3", 4242, nonce, 4)
    got = _parse(_record("2001:db8::7", 65535, nonce), 1)
    assert got == (True, "2001:db8::7", 65535, nonce, 6)
    assert _parse(_record(None, 0, nonce), 1) == (False, "", 0, nonce, 0)
    bad = _record("10.1.2.3", 1, nonce)
    bad[5] = 5  # neither family
    with pytest.raises(TransportError, match="something else"):
        _parse(bad, 3)


def test_addresses_the_route_can_and_cannot_use() -> None:
    from nereus_comm.transport_net import _interface_address, _ipv6_of, _usable

    assert _usable("127.0.0.1") == "127.0.0.1"
    assert _usable("[::1]") == "::1" and _usable("2001:DB8:0::1") == "2001:db8::1"
    # a link-local address needs its interface's scope, which the record does not carry
    assert _usable("fe80::1") is None
    assert _usable("node-7.cluster") is None and _usable(None) is None
    table = (
        "fe800000000000000000000000000001 02 40 20 80     eth0\n"
        "20010db8000000000000000000000042 02 40 00 80     eth0\n"
        "00000000000000000000000000000001 01 80 10 80       lo\n"
    )
    assert _ipv6_of("eth0", table) == "2001:db8::42"  # the link-local one is skipped
    assert _ipv6_of("lo", table) == "::1"
    assert _ipv6_of("eth1", table) is None
    assert _ipv6_of("eth0", "garbage\nzz 1 2 3 4 eth0\n") is None
    assert _interface_address("lo") == "127.0.0.1"  # IPv4 before IPv6, as gloo takes it
    assert _interface_address("no-such-interface0") is None


def _over_addresses(ctx, addresses: list[str]) -> dict:
    from nereus_comm.pack import Region, region_table
    from nereus_comm.transport import GlooTransport
    from nereus_comm.transport_net import NetRoute

    transport = GlooTransport()
    route = NetRoute(transport, address=addresses[ctx.rank])
    peer = 1 - ctx.rank
    peers = route.prepare([peer], timeout=30)
    if not peers:
        return {"peers": [], "address": route.address}
    g = torch.Generator().manual_seed(11)
    full = torch.randint(0, 256, (200, 900), dtype=torch.uint8, generator=g)
    out = torch.zeros(200, 450, dtype=torch.uint8)
    mine = Region(full, 0 if ctx.rank == 0 else 450, 200, 450, 900)
    route.start(
        {peer: region_table([mine])}, {peer: region_table([Region(out, 0, 200, 450, 450)])},
        owners=(full, out), deadline=time.monotonic() + 30, timeout=30,
    ).wait()  # fmt: skip
    other = full[:, 450:] if ctx.rank == 0 else full[:, :450]
    equal = bool(torch.equal(out, other))
    return {"peers": sorted(peers), "equal": equal, "address": route.address}


@pytest.mark.slow
@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback here")
def test_net_route_over_ipv6_and_mixed_families() -> None:
    from nereus_comm.testing import LocalWorkers

    with LocalWorkers(2, timeout=60) as pool:
        first, second = pool.run(_over_addresses, ["::1", "::1"])
        assert first["peers"] == [1] and second["peers"] == [0], (first, second)
        assert first["equal"] and second["equal"]
        assert first["address"] == "::1"
        # One side IPv4, the other IPv6: neither may reach the other's family, so the
        # pair keeps the control transport, on both sides alike.
        first, second = pool.run(_over_addresses, ["127.0.0.1", "::1"])
        assert first["peers"] == [] and second["peers"] == [], (first, second)
