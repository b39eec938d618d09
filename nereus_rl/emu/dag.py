"""Transition DAG primitives as live EMU primitives, for the concurrent executor.

:func:`live_impls` turns an :class:`~nereus_rl.emu.manager.EMUManager` into the
``impls`` of :func:`nereus_rl.transition.execute.execute_dag`: each DAG node
becomes ``extend / destroy / split / merge`` on the live units the DAG names
(``live``: DAG uid -> EMU; the DAG's devices are mapped to worker ranks by
``ranks_of``). The executor starts every ready primitive at once; the manager
lets those on disjoint workers run at the same time and runs two that share a
worker one after the other (see :mod:`nereus_rl.emu.manager`), so the DAG's
concurrency is real on live workers while its edges keep their order.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, MutableMapping, Sequence

from nereus_rl.emu.manager import EMUManager
from nereus_rl.emu.types import EMU
from nereus_rl.transition import KINDS, Primitive

RanksOf = Callable[[Sequence[int]], list[int]]


def run_primitive(
    m: EMUManager,
    p: Primitive,
    live: MutableMapping[str, EMU],
    ranks_of: RanksOf,
    lock: threading.Lock,
) -> None:
    """Run DAG primitive ``p`` live on ``m``; ``live`` gains its outputs, loses its inputs.

    Arguments:
        m: the manager holding the units.
        p: the primitive (its inputs are in ``live``: the DAG's edges saw to it).
        live: DAG uid -> live unit, shared by the executor's threads.
        ranks_of: plan devices -> worker ranks.
        lock: guards ``live`` (held only for lookups and updates, never while bytes move).
    """
    with lock:
        ins = [live[u.uid] for u in p.inputs]
        source = live[p.source.uid] if p.kind == "extend" and p.source is not None else None
    if p.kind == "extend":
        u = p.outputs[0]
        new = m.extend(u.stage, ranks_of(u.devices), tp=u.tp, pp=u.pp, source=source)
        with lock:
            live[u.uid] = new
    elif p.kind == "destroy":
        m.destroy(ins[0])
        with lock:
            live.pop(p.inputs[0].uid)
    elif p.kind == "split":
        a, b = p.outputs
        halves = (ranks_of(a.devices), ranks_of(b.devices))
        ea, eb = m.split(ins[0], tp=a.tp, pp=a.pp, halves=halves)
        with lock:
            live.pop(p.inputs[0].uid)
            live[a.uid], live[b.uid] = ea, eb
    elif p.kind == "merge":
        (u,) = p.outputs
        new = m.merge(ins[0], ins[1], tp=u.tp, pp=u.pp, ranks=ranks_of(u.devices))
        with lock:
            for x in p.inputs:
                live.pop(x.uid)
            live[u.uid] = new
    else:
        raise ValueError(f"unknown primitive kind {p.kind!r}; expected one of {KINDS}")


def live_impls(
    m: EMUManager,
    live: MutableMapping[str, EMU],
    ranks_of: RanksOf,
) -> dict[str, Callable[[Primitive], None]]:
    """``impls`` for ``execute_dag`` that run every primitive live on ``m`` (see the module
    docstring); ``live`` starts as the DAG's current units and ends as its target's."""
    lock = threading.Lock()

    def run(p: Primitive) -> None:
        run_primitive(m, p, live, ranks_of, lock)

    return dict.fromkeys(KINDS, run)
