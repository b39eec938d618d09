"""A short pure-Python reference of the shard-remap planner: clear over fast.

It walks rank pairs and boxes directly (no shard classes) and applies the same
source-choice rules as csrc/remap, so its plan must equal the C++ plan:

1. For every destination rank and tensor, cut the rank's box along the cut
   dim (TensorSpec.cut_dim) at the source's tp chunk boundaries; the holders
   of a segment are the source ranks whose box contains it. A segment the
   rank holds itself is a local copy. Otherwise it joins the rank's block
   (segments in tensor order) for that holder set.
2. Holder sets are visited smallest first (ties: sorted holder lists). The
   level is the least L with sum(max(0, L - load[h])) >= the bytes the set's
   receivers need; holder h may take cap[h] = max(0, L - load[h]).
3. Each receiver's block is handed out front to back. A share for holder h
   runs to the first allowed cut at or after done + max(cap[h], MIN) (or to
   the block's end): an item boundary, or a unit boundary inside an item at
   least MIN from both its ends; the whole rest of the block if that cut
   leaves less than MIN. Passes, receivers in position order:
   a. each holder already sending to the receiver (position order), with
      room = max(cap, highest load of the set's holders before - load): all
      the rest if it fits in room + MSG, else a share of room if room > 0;
   b. per node (ascending), the receivers on it from the holders on it: each
      takes shares from the first of them with cap > 0 until done;
   c. likewise the rest from all holders.
"""

from __future__ import annotations

import itertools

from nereus_comm.errors import PlanError
from nereus_comm.layout import Layout, TensorSpec, chunk_range, infer_num_layers

MSG = 64 << 10  # kMessageCostBytes: slack for a holder already sending to the receiver
MIN = 4 * MSG  # kMinPieceBytes: the smallest cut piece / share
Item = tuple[int, int, int]  # (tensor, start, stop) along the split axis


def _axis(spec: TensorSpec, layout: Layout, rank: int, num_layers: int):
    """The rank's (start, stop) along the cut axis ((0, 1) if there is none), or None."""
    box = layout.box(spec, rank, num_layers)
    if box is None:
        return None
    return box[spec.cut_dim] if spec.cut_dim is not None else (0, 1)


def _unit(spec: TensorSpec) -> int:
    if spec.cut_dim is None:
        return spec.nbytes
    n = spec.shape[spec.cut_dim]
    return spec.nbytes // n if n else 0


def reference_plan(
    specs: list[TensorSpec], src: Layout, dst: Layout, num_layers: int | None = None
) -> dict:
    """Plan like nereus_comm.plan.plan_reshard, slowly.

    Returns:
        {"local": {dst_rank: sorted [items]}, "messages": {(src_rank, dst_rank):
        sorted [items]}, "send": {src_rank: bytes}, "recv": {dst_rank: bytes},
        "local_bytes": int, "lower_bound_bytes": int}. Items are (tensor, start,
        stop) along the split axis ((0, 1) for replicated tensors).
    """
    inferred = infer_num_layers(specs)
    ls = src.num_layers or num_layers or inferred
    ld = dst.num_layers or num_layers or inferred
    units = [_unit(s) for s in specs]

    local: dict[int, list[Item]] = {}
    blocks: dict[tuple[int, ...], dict[int, list[Item]]] = {}  # holders -> dst pos -> items
    needed = 0
    for r in dst.ranks:
        for i, spec in enumerate(specs):
            want = _axis(spec, dst, r, ld)
            if want is None or want[0] >= want[1] or units[i] == 0:
                continue
            needed += (want[1] - want[0]) * units[i]
            a, b = want
            cuts = {a, b}
            if spec.split_dim is not None:
                n = spec.shape[spec.split_dim]
                starts = (chunk_range(n, src.tp, t)[0] for t in range(src.tp))
                cuts |= {c for c in starts if a < c < b}
            cuts = sorted(cuts)
            for s0, s1 in itertools.pairwise(cuts):
                holders = []
                for q in src.ranks:
                    have = _axis(spec, src, q, ls)
                    if have is not None and have[0] <= s0 and s1 <= have[1]:
                        holders.append(q)
                if not holders:
                    raise PlanError(f"no source holds {spec!r}")
                if r in holders:
                    local.setdefault(r, []).append((i, s0, s1))
                else:
                    key = tuple(sorted(src.position(q) for q in holders))
                    blocks.setdefault(key, {}).setdefault(dst.position(r), []).append((i, s0, s1))

    def src_node(s: int) -> int:
        return src.node_of[s] if src.node_of else 0

    def dst_node(r: int) -> int:
        return dst.node_of[r] if dst.node_of else 0

    def nbytes(items: list[Item]) -> int:
        return sum((b - a) * units[t] for t, a, b in items)

    load = [0] * src.world_size
    messages: dict[tuple[int, int], list[Item]] = {}
    peers: dict[int, set[int]] = {}  # dst position -> source positions chosen so far

    def place(holders: tuple[int, ...], need: dict[int, list[Item]]) -> None:
        """Hand out the blocks `need` (dst position -> items) over `holders` (rules 2-3)."""
        size = {r: nbytes(items) for r, items in need.items()}
        want = sum(size.values())
        lo, hi = 0, max(load[h] for h in holders) + want  # binary search for the level
        while lo < hi:
            mid = (lo + hi) // 2
            if sum(max(0, mid - load[h]) for h in holders) >= want:
                hi = mid
            else:
                lo = mid + 1
        cap = {h: max(0, lo - load[h]) for h in holders}
        before = {h: load[h] for h in holders}
        highest = max(before.values())
        done = dict.fromkeys(need, 0)  # bytes of each receiver's block handed out

        def cut(r: int, offset: int) -> int:
            """The first allowed cut of r's block at or after byte `offset`."""
            base = 0
            for t, a, b in need[r]:
                n = (b - a) * units[t]
                if offset <= base:
                    return base
                if offset < base + n:
                    k = -(-max(offset - base, MIN) // units[t])
                    return base + k * units[t] if k * units[t] <= n - MIN else base + n
                base += n
            return base

        def give(r: int, h: int, upto: int) -> None:
            base, out = 0, []
            for t, a, b in need[r]:  # the part of r's block in [done[r], upto)
                u = units[t]
                x0, x1 = max(done[r], base), min(upto, base + (b - a) * u)
                if x0 < x1:
                    out.append((t, a + (x0 - base) // u, a + (x1 - base) // u))
                base += (b - a) * u
            messages.setdefault((src.ranks[h], dst.ranks[r]), []).extend(out)
            load[h] += upto - done[r]
            cap[h] -= upto - done[r]
            done[r] = upto
            peers.setdefault(r, set()).add(h)

        def share(r: int, h: int, room: int) -> None:
            upto = cut(r, min(size[r], done[r] + max(room, MIN)))
            give(r, h, size[r] if size[r] - upto < MIN else upto)

        def fill(rs: list[int], hs: list[int]) -> None:
            for r in rs:
                while done[r] < size[r]:
                    ready = [h for h in hs if cap[h] > 0]
                    if not ready:
                        return
                    share(r, ready[0], cap[ready[0]])

        for r in need:  # a. holders already sending to the receiver
            for h in sorted(peers.get(r, set()) & set(holders)):
                if done[r] == size[r]:
                    break
                room = max(cap[h], highest - load[h])
                if size[r] - done[r] <= room + MSG:
                    give(r, h, size[r])
                elif room > 0:
                    share(r, h, room)
        for node in sorted({src_node(h) for h in holders}):  # b. on the receiver's node
            on_node = [r for r in need if dst_node(r) == node and done[r] < size[r]]
            fill(on_node, [h for h in holders if src_node(h) == node])
        fill([r for r in need if done[r] < size[r]], list(holders))  # c. the rest
        assert all(done[r] == size[r] for r in need)
        # balance: a holder ends at most four pieces and a unit (or MSG) above
        # max(its load before, the level, the highest load before)
        unit = max(units[t] for items in need.values() for t, _, _ in items)
        assert all(load[h] <= max(highest, lo) + max(MSG, 4 * MIN + unit) for h in holders)

    for holders in sorted(blocks, key=lambda h: (len(h), h)):
        place(holders, blocks[holders])

    local_bytes = sum(nbytes(v) for v in local.values())
    return {
        "local": {r: sorted(v) for r, v in local.items()},
        "messages": {k: sorted(v) for k, v in messages.items()},
        "send": {src.ranks[s]: b for s, b in enumerate(load) if b},
        "recv": {
            r: sum(nbytes(v) for (_, d), v in messages.items() if d == r)
            for r in {d for _, d in messages}
        },
        "local_bytes": local_bytes,
        "lower_bound_bytes": needed - local_bytes,
    }
