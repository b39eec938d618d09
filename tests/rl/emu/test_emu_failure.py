"""A worker joins a running job and gets a unit by Extend; a worker dies (SIGKILL) and the
job rebuilds the lost capacity from the intact units, without reading anything from disk."""

from __future__ import annotations

import threading
import time

import pytest
from support.emu import assert_bitwise
from support.joiner import reap, start_joiner

from nereus_rl.emu.manager import EMUError, EMUManager, EMUStateLostError
from nereus_rl.emu.state import stage_state_specs
from nereus_rl.runtime import Driver, WorkerLostError

# Multi-process: out of the fast lane (-m "not slow").
pytestmark = pytest.mark.slow


def _tp2_and_tp1(d: Driver, seed: int):
    """3 local workers; the actor as a tp2 unit on workers 0-1 and a tp1 one on 2."""
    d.spawn_local(3, num_threads=1, method="forkserver")
    m = EMUManager(d, transfer_timeout=20.0)
    m.define_stage("actor", stage_state_specs(2, hidden=8, ffn=20, vocab=13), seed=seed)
    a = m.create("actor", [0, 1], tp=2)
    return m, a, m.extend("actor", [2], tp=1)


def test_join_then_kill_then_recover():
    d = Driver(heartbeat_timeout=2.0, call_timeout=60.0)
    joiner = None
    try:
        m, a, b = _tp2_and_tp1(d, seed=3)

        # A worker started by hand joins the running job and gets a unit by Extend.
        joiner = start_joiner(d.address, "nereus_rl.runtime.worker")
        assert d.wait_for_workers(4, timeout=60) == [0, 1, 2, 3]
        assert m.free_ranks() == [3]
        c = m.extend("actor", [3], tp=1, source=a)
        assert_bitwise(m, c)
        assert m.dp_degree("actor") == 3

        # SIGKILL a worker of unit a: noticed within the heartbeat bound.
        d.kill(1)
        t0 = time.monotonic()
        assert d.wait_for_loss(timeout=10) == (1,)
        assert time.monotonic() - t0 < d.heartbeat_timeout + 2
        held_before = d.call([2, 3], "emu.units")

        new = m.recover()
        # a is gone; b and c were not touched; a's surviving device holds a new unit
        # extended from an intact one (one device left, so tp shrinks to 1).
        assert len(new) == 1 and new[0].ranks == (0,) and new[0].tp == 1
        assert m.units() == [b, c, new[0]] and m.dp_degree("actor") == 3
        assert d.call([2, 3], "emu.units") == held_before
        kinds = [(r.kind, r.extra.get("reason")) for r in m.records[-2:]]
        assert kinds == [("destroy", "lost worker"), ("extend", None)]
        for u in m.units():
            assert_bitwise(m, u)

        # Lose every holder but one, then that one too: the state is gone from memory.
        m.destroy(new[0])
        m.destroy(c)
        d.kill(2)
        d.wait_for_loss(timeout=10)
        try:
            m.recover()
        except EMUStateLostError as e:
            assert "actor" in str(e)
        else:
            raise AssertionError("recover() must refuse when no intact unit is left")
    finally:
        d.shutdown()
        reap(joiner)


def test_kill_during_transfers_leaves_the_intact_units_whole():
    d = Driver(heartbeat_timeout=2.0, call_timeout=60.0)
    try:
        d.spawn_local(3, num_threads=1, method="forkserver")
        # A survivor blocked on the dead peer is freed by the transfer timeout at worst.
        m = EMUManager(d, transfer_timeout=4.0)
        m.define_stage("actor", stage_state_specs(2, hidden=256, ffn=512, vocab=1000), seed=4)
        a = m.create("actor", [0], tp=1)
        b = m.extend("actor", [1])
        killer = threading.Timer(0.3, d.kill, args=(2,))
        killer.start()
        t0 = time.monotonic()
        # Extend onto worker 2 and destroy, over and over, until its death shows.
        with pytest.raises((WorkerLostError, EMUError)):
            while time.monotonic() - t0 < 30:
                c = m.extend("actor", [2], source=a)
                m.destroy(c)
        killer.join()
        assert d.wait_for_loss(timeout=10) == (2,)
        assert m.recover() == []  # no free device left to rebuild on
        assert m.units() == [a, b]
        for u in (a, b):
            assert_bitwise(m, u)
    finally:
        d.shutdown()


def test_a_worker_joining_after_a_death_gets_the_lost_capacity_by_extend():
    # A tp2 unit loses a worker; `nereus-rl worker --store` joins afterwards, and recovery
    # extends the stage from the intact unit onto the joiner and the broken unit's
    # surviving device, with the broken unit's layout (tp2).
    d = Driver(heartbeat_timeout=2.0, call_timeout=60.0)
    joiner = None
    try:
        m, a, b = _tp2_and_tp1(d, seed=5)
        d.kill(1)
        assert d.wait_for_loss(timeout=10) == (1,)
        held_before = d.call([2], "emu.units")
        joiner = start_joiner(d.address)
        assert d.wait_for_workers(4, timeout=60) == [0, 1, 2, 3]
        assert d.workers == [0, 2, 3] and m.free_ranks() == [3]
        new = m.recover(spare_ranks=[3])
        assert len(new) == 1 and new[0].ranks == (3, 0) and (new[0].tp, new[0].pp) == (2, 1)
        assert a not in m.units() and m.units() == [b, new[0]]
        assert d.call([2], "emu.units") == held_before  # the intact unit was not touched
        assert [(r.kind, r.inputs) for r in m.records[-2:]] == [
            ("destroy", (a.uid,)),
            ("extend", (b.uid,)),
        ]
        for u in m.units():
            assert_bitwise(m, u)
    finally:
        d.shutdown()
        reap(joiner)
