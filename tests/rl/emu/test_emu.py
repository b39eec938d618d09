"""EMU primitives on 4 live CPU workers: bitwise state after every primitive and sequence."""

from __future__ import annotations

import random

import pytest
import torch

from nereus_comm.plan import plan_reshard
from nereus_comm.pool import CommPool
from nereus_rl.core.spec import local_cpu_cluster
from nereus_rl.costmodel.costmodel import CostModel
from nereus_rl.emu.manager import DriverGroupBackend, EMUError, EMUManager
from nereus_rl.emu.state import stage_state_specs, synthetic, with_training_state
from nereus_rl.runtime import Driver

# Multi-process: out of the fast lane (-m "not slow").
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def emus():
    d = Driver(call_timeout=60.0)
    try:
        d.spawn_local(4, num_threads=1, method="forkserver")
        m = EMUManager(d, transfer_timeout=30.0)
        # Uneven sizes on purpose: 37 and 42 split over tp = 4 leave short shards.
        m.define_stage("actor", stage_state_specs(3, hidden=12, ffn=42, vocab=37), seed=1)
        critic = stage_state_specs(2, hidden=8, ffn=16, vocab=11, training=False)
        m.define_stage("critic", critic, seed=2)
        yield m
    finally:
        d.shutdown()


@pytest.fixture
def clean(emus):
    """Start each test from no units; tear down whatever it left."""
    _reset(emus)
    yield emus
    _reset(emus)


def _reset(m: EMUManager) -> None:
    for u in m.units():
        if m.dp_degree(u.stage) > 1:
            m.destroy(u)
    for u in m.units():  # the last holder of each stage: bypass the refusal
        m._commit([u], [], [])


def assert_bitwise(m: EMUManager, unit) -> None:
    ref = m.reference(unit.stage)
    got = m.full_state(unit)
    assert got.keys() == ref.keys()
    for name, t in ref.items():
        assert torch.equal(got[name], t), f"{unit!r}: {name} differs from the reference"


def unit_shard_bytes(m: EMUManager, unit) -> int:
    st = m.stages[unit.stage]
    total = 0
    for spec in st.specs:
        for r in unit.ranks:
            box = unit.layout.box(spec, r, st.num_layers)
            if box is not None:
                n = 1
                for a, b in box:
                    n *= b - a
                total += n * spec.element_size
    return total


def worker_units(m: EMUManager) -> dict[int, set[int]]:
    return {r: set(v) for r, v in m.driver.call(m.driver.workers, "emu.units").items()}


def test_synthetic_shards_match_the_full_reference():
    spec = next(s for s in stage_state_specs(2, 8, 20, 11) if s.split_dim == 1)
    full = synthetic(spec, tuple((0, n) for n in spec.shape), 5)
    box = ((0, spec.shape[0]), (3, 7))
    assert torch.equal(synthetic(spec, box, 5), full[:, 3:7])
    assert not torch.equal(synthetic(spec, box, 6), full[:, 3:7])


def test_training_state_of_any_params_matches_the_transformer_naming():
    full = stage_state_specs(2, 8, 20, 11)
    params = [s for s in full if not s.name.startswith("optim.") and s.name != "rng"]
    assert with_training_state(params) == full
    moment = next(s for s in full if s.name == "optim.exp_avg_sq.lm_head.weight")
    head = next(s for s in params if s.name == "lm_head.weight")
    assert (moment.shape, moment.split_dim, moment.stage_key) == (
        head.shape,
        head.split_dim,
        head.stage_key,
    )
    assert moment.dtype == torch.float32


def test_extend_same_layout_is_zero_copy_and_bitwise(clean):
    m = clean
    a = m.create("actor", [0, 1], tp=2)
    assert_bitwise(m, a)
    b = m.extend("actor", [2, 3])
    assert (b.tp, b.pp) == (2, 1) and m.dp_degree("actor") == 2
    rec = m.records[-1]
    assert rec.kind == "extend"
    # Every byte of the new unit came over the wire exactly once, straight from the
    # source shards (zero copy): one buffer per shard, one message per planned pair.
    assert rec.bytes_moved == unit_shard_bytes(m, b) and rec.bytes_local == 0
    assert rec.bytes_direct == rec.bytes_moved and rec.bytes_packed == 0
    nonempty = sum(
        1
        for spec in m.stages["actor"].specs
        for r in b.ranks
        if (box := b.layout.box(spec, r, 3)) is not None and all(x < y for x, y in box)
    )
    plan = plan_reshard(m.stages["actor"].specs, a.layout, b.layout)
    assert rec.extra["messages"] == sum(len(plan.sends(r)) for r in a.ranks)
    assert rec.extra["buffers"] == nonempty
    assert_bitwise(m, b)
    assert_bitwise(m, a)


@pytest.mark.parametrize(("src", "dst"), [((2, 1), (1, 2)), ((1, 2), (2, 1)), ((2, 1), (1, 1))])
def test_extend_to_another_layout(clean, src, dst):
    m = clean
    a = m.create("actor", [0, 1], tp=src[0], pp=src[1])
    b = m.extend("actor", [3, 2][: dst[0] * dst[1]], tp=dst[0], pp=dst[1])
    rec = m.records[-1]
    assert rec.bytes_moved == unit_shard_bytes(m, b) and rec.bytes_packed > 0
    assert_bitwise(m, b)
    assert_bitwise(m, a)


def test_destroy_releases_devices_and_groups(clean):
    m = clean
    a = m.create("actor", [0, 1], tp=2)
    b = m.extend("actor", [2, 3], tp=2)
    gid = m._unit_gid[b.uid]
    assert gid in m.driver.call([2], "groups")[2]
    assert m.pool.is_held(b.ranks)
    m.destroy(b)
    assert m.units() == [a] and m.free_ranks() == [2, 3]
    # Destroy ends the unit's hold on its group; the pool keeps it, idle, for reuse
    # (it is dropped on the workers when evicted, see the eviction test).
    assert not m.pool.is_held(b.ranks) and m.pool.is_held(a.ranks)
    assert b.ranks in m.pool.cached()
    assert worker_units(m)[2] == set() and worker_units(m)[0] == {a.uid}
    assert_bitwise(m, a)


def test_second_extend_from_the_same_source_reuses_every_group(clean):
    m = clean
    a = m.create("actor", [0, 1], tp=2)
    b = m.extend("actor", [2, 3], tp=2)
    # The pool's counter holds the workers' builds of every group built so far (this
    # test's extend, or an earlier test's on this module's manager), not only the
    # driver's sending of them (microseconds).
    built = sum(r.comm_setup_s for r in m.records)
    assert built > 0.0 and m.comm_stats.create_seconds >= built
    b_gid = m._unit_gid[b.uid]
    m.destroy(b)
    groups = m.driver.call(m.driver.workers, "groups")
    before = m.comm_stats
    c = m.extend("actor", [2, 3], tp=2, source=a)
    after = m.comm_stats
    # The transfer group (0, 1, 2, 3) and the new unit's group (2, 3) are both hits:
    # nothing was built, on the driver's count or on any worker.
    assert (after.hits - before.hits, after.misses - before.misses) == (2, 0)
    assert after.create_seconds == before.create_seconds
    assert m.records[-1].comm_setup_s == 0.0
    assert m.driver.call(m.driver.workers, "groups") == groups
    assert m._unit_gid[c.uid] == b_gid
    assert_bitwise(m, c)
    # Training steps over the same units take their DP groups from the pool too.
    m.train_step("actor", 0)
    mid = m.comm_stats
    m.train_step("actor", 1)
    assert (m.comm_stats.hits - mid.hits, m.comm_stats.misses - mid.misses) == (2, 0)


def test_pool_eviction_drops_the_group_on_its_workers(clean):
    m = clean
    old = m.pool
    m.pool = CommPool(DriverGroupBackend(m.driver), capacity=2, name="small")
    try:
        a = m.create("actor", [0], tp=1)
        m.extend("actor", [1])  # transfer group (0, 1), idle afterwards
        gid01 = m.pool.get((0, 1)).handle
        m.pool.release((0, 1))
        m.extend("actor", [2], source=a)  # (0, 2): the pool is full now
        assert m.pool.cached() == [(0, 1), (0, 2)] and m.comm_stats.evictions == 0
        assert gid01 in m.driver.call([1], "groups")[1]
        m.extend("actor", [3], source=a)  # (0, 3) evicts the least recently used, (0, 1)
        assert m.pool.cached() == [(0, 2), (0, 3)] and m.comm_stats.evictions == 1
        groups = m.driver.call([0, 1], "groups")
        assert gid01 not in groups[0] and gid01 not in groups[1]
        for u in m.units():
            assert_bitwise(m, u)
        _reset(m)
    finally:
        m.pool.destroy_all()
        m.pool = old


def test_split_then_merge_round_trip(clean):
    m = clean
    a = m.create("actor", [0, 1, 2, 3], tp=2, pp=2)
    x, y = m.split(a)
    assert (x.tp, x.pp, x.ranks) == (1, 2, (0, 1)) and (y.tp, y.pp, y.ranks) == (1, 2, (2, 3))
    rec = m.records[-1]
    # Every byte of the two new units is either kept in place or received once.
    assert rec.bytes_moved + rec.bytes_local == unit_shard_bytes(m, x) + unit_shard_bytes(m, y)
    assert rec.bytes_local > 0
    assert m.dp_degree("actor") == 2 and a not in m.units()
    assert_bitwise(m, x)
    assert_bitwise(m, y)
    z = m.merge(x, y, tp=4, pp=1)
    assert (z.tp, z.pp, z.ranks) == (4, 1, (0, 1, 2, 3)) and m.units() == [z]
    assert_bitwise(m, z)
    assert set().union(*worker_units(m).values()) == {z.uid}


class _CountingCostModel(CostModel):
    """A real cost model that also keeps the arguments of each observe_primitive call."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[str, dict]] = []

    def observe_primitive(self, kind, **kwargs) -> None:
        self.calls.append((kind, dict(kwargs)))
        super().observe_primitive(kind, **kwargs)


def test_each_primitive_feeds_its_record_to_the_cost_model(clean):
    m = clean
    cm = _CountingCostModel(local_cpu_cluster(4))
    m.costmodel = cm
    try:
        a = m.create("actor", [0, 1], tp=2)  # builds, copies nothing: not a primitive
        assert cm.calls == []
        b = m.extend("actor", [2, 3], tp=1, pp=2)
        x, y = m.split(b)
        z = m.merge(x, y, tp=2, pp=1)
        m.destroy(a)
    finally:
        m.costmodel = None
    assert m.units() == [z]
    recs = m.records[-4:]
    assert [r.kind for r in recs] == ["extend", "split", "merge", "destroy"]
    assert [k for k, _ in cm.calls] == ["extend", "split", "merge", "destroy"]
    assert cm.primitives_seen() == 4
    for rec, (_, kw) in zip(recs, cm.calls):
        assert kw["bytes_moved"] == rec.bytes_moved
        assert kw["max_bytes_per_device"] == rec.max_bytes_per_device
        assert kw["seconds"] == rec.seconds and kw["setup_s"] == rec.comm_setup_s
        assert kw["tier"] == "intra"  # four workers on one host
        assert (rec.max_bytes_per_device > 0) == (rec.bytes_moved > 0)
        assert rec.max_bytes_per_device <= rec.bytes_moved
    assert recs[0].bytes_moved > 0  # extend onto new ranks copies the whole state
    assert [(kw["new_units"], kw["new_ranks"]) for _, kw in cm.calls] == [
        (1, 2), (2, 2), (1, 2), (0, 0),
    ]  # fmt: skip
    # The three transfers refined the local link's efficiency; the inter tier is unseen.
    assert cm.seen("p2p:intra") >= 1 and cm.seen("p2p:inter") == 0


def test_bad_input_is_refused_before_anything_moves(clean):
    m = clean
    a = m.create("actor", [0, 1], tp=2)
    c = m.create("critic", [2])
    d = m.extend("critic", [3])
    before = (m.units(), len(m.records), worker_units(m))
    with pytest.raises(EMUError, match="device 1 is already owned"):
        m.extend("actor", [1, 3], tp=2)
    with pytest.raises(EMUError, match="degree 1"):
        m.split(c)
    with pytest.raises(EMUError, match="different stages"):
        m.merge(a, c)
    with pytest.raises(EMUError, match="last unit"):
        m.destroy(a)
    with pytest.raises(EMUError, match="not live workers"):
        m.extend("actor", [9], tp=1)
    with pytest.raises(EMUError, match="unknown stage"):
        m.extend("policy", [3])
    assert (m.units(), len(m.records), worker_units(m)) == before
    m.destroy(d)
    b = m.extend("actor", [3], tp=1)
    with pytest.raises(EMUError, match="different layouts"):
        m.merge(a, b)
    with pytest.raises(EMUError, match="not a live unit"):
        m.merge(c, d)
    assert m.units() == [a, c, b]
    for u in (a, b, c):
        assert_bitwise(m, u)


def test_random_sequences_keep_every_unit_bitwise(clean):
    m = clean
    rng = random.Random(1234)
    m.create("actor", [0, 1], tp=2)
    done = []
    for _ in range(10):
        units = m.units("actor")
        free = m.free_ranks()
        options = []
        if free:
            options.append("extend")
        if len(units) > 1:
            options.append("destroy")
        if any(u.degree > 1 for u in units):
            options.append("split")
        pairs = [
            (u, v) for u in units for v in units if u.uid < v.uid and (u.tp, u.pp) == (v.tp, v.pp)
        ]
        if pairs:
            options.append("merge")
        op = rng.choice(options)
        if op == "extend":
            n = rng.choice([k for k in (1, 2, 4) if k <= len(free)])
            tp = rng.choice([t for t in (1, 2, 4) if n % t == 0])
            m.extend("actor", rng.sample(free, n), tp=tp, pp=n // tp, source=rng.choice(units))
        elif op == "destroy":
            m.destroy(rng.choice(units))
        elif op == "split":
            m.split(rng.choice([u for u in units if u.degree > 1]))
        else:
            u, v = rng.choice(pairs)
            tp = rng.choice(
                [t for t in (1, 2, 4) if (2 * u.degree) % t == 0 and 2 * u.degree // t <= 3]
            )
            m.merge(u, v, tp=tp, pp=2 * u.degree // tp)
        done.append(op)
        for u in m.units():
            assert_bitwise(m, u)
        owned = [r for u in m.units() for r in u.ranks]
        assert len(owned) == len(set(owned))
        assert {uid for v in worker_units(m).values() for uid in v} == {u.uid for u in m.units()}
    assert set(done) == {"extend", "destroy", "split", "merge"}, done


def test_training_with_transitions_matches_the_uninterrupted_run(clean):
    m = clean
    a = m.create("actor", [0, 1], tp=2)
    for step in range(4):
        m.train_step("actor", step)
    want = m.full_state(a)
    initial = m.reference("actor")
    assert not torch.equal(want["embed_tokens.weight"], initial["embed_tokens.weight"])
    assert want["optim.step"].item() == initial["optim.step"].item() + 4
    assert not torch.equal(want["rng"], initial["rng"])
    _reset(m)

    # The same steps, with the DP degree, tp and devices changing between them.
    x = m.create("actor", [0], tp=1)
    m.train_step("actor", 0)
    y = m.extend("actor", [1])  # dp 1 -> 2
    m.train_step("actor", 1)
    z = m.merge(x, y, tp=2)  # dp 2 -> 1, tp 1 -> 2
    w = m.extend("actor", [3, 2], tp=2)  # dp 1 -> 2 on other devices
    with pytest.raises(EMUError, match="differ in layout"):
        m.destroy(z)
        m.extend("actor", [0], tp=1)
        m.train_step("actor", 2)
    for u in m.units("actor"):
        if u.degree == 1:
            m.destroy(u)
    m.extend("actor", [0, 1], tp=1, pp=2)
    m.destroy(w)
    m.train_step("actor", 2)  # dp 1, pp 2
    for u in m.units("actor"):
        m.split(u)  # dp 2 of tp 1 pp 1
    m.train_step("actor", 3)
    assert m.dp_degree("actor") == 2
    for u in m.units("actor"):
        got = m.full_state(u)
        for name, t in want.items():
            assert torch.equal(got[name], t), f"{u!r}: {name} differs from the uninterrupted run"


def test_shared_devices_cross_stage_extend_and_explicit_halves(emus):
    # The trainer's mode: colocated stages share devices, units of one model copy from
    # each other, and the DAG names the ranks of split halves and merged units.
    m = EMUManager(emus.driver, transfer_timeout=30.0, shared_devices=True, unit_groups=False)
    train = stage_state_specs(3, hidden=12, ffn=42, vocab=37)
    infer = stage_state_specs(3, hidden=12, ffn=42, vocab=37, training=False)
    m.define_stage("p.train", train, seed=4, model="p")
    m.define_stage("p.infer", infer, seed=4, model="p")
    m.define_stage("q.infer", infer, seed=4)  # another model: never a source for p
    try:
        t = m.create("p.train", [0, 1], tp=2)
        i = m.extend("p.infer", [1, 0], tp=1, pp=2, source=t)  # on t's devices
        assert_bitwise(m, i)
        assert_bitwise(m, t)
        q = m.create("q.infer", [2])
        before = (m.units(), len(m.records))
        with pytest.raises(EMUError, match="does not hold"):
            m.extend("p.infer", [3], source=q)
        with pytest.raises(EMUError, match="does not hold"):
            m.extend("p.train", [3], source=i)  # an inference unit has no Adam moments
        assert (m.units(), len(m.records)) == before
        j = m.extend("p.infer", [2, 3], tp=2, source=t)
        m.destroy(i)
        a, b = m.split(j, tp=1, pp=1, halves=([3], [2]))
        assert (a.ranks, b.ranks) == ((3,), (2,))
        with pytest.raises(EMUError, match="exactly"):
            m.merge(a, b, tp=2, ranks=[2, 0])
        k = m.merge(a, b, tp=1, pp=2, ranks=[2, 3])
        assert k.ranks == (2, 3)
        for u in (t, k):
            assert_bitwise(m, u)
        # the last inference unit may go: the training unit holds all of its state ...
        m.destroy(k)
        # ... but nothing else holds the training stage's Adam moments
        with pytest.raises(EMUError, match="last unit"):
            m.destroy(t)
        assert_bitwise(m, t)
    finally:
        m.close()
    assert not any(worker_units(m).values())
