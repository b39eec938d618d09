"""The Ray runtime: one Ray actor per device, commands as actor method calls.

:class:`RayDriver` implements the runtime interface (:class:`nereus_rl.runtime.base.Runtime`)
on a Ray cluster. It places one :class:`WorkerActor` per device with a placement
group (a ``{"CPU": 1}`` bundle each on CPU, ``{"GPU": 1}`` with ``device="cuda"``),
and each actor joins the job exactly as a store-driven worker does
(:func:`nereus_rl.runtime.worker.join_job`): the job's store (hosted by the driver,
as for local spawn) is where the workers' gloo / NCCL groups rendezvous, where the
World keeps their membership and heartbeats, and where the driver's sealed abort
notices are read. Only the command channel differs: a command is a method call
(``WorkerActor.run``), run by the same function the store loop runs
(:func:`nereus_rl.runtime.worker.run_command`); its reply is an ObjectRef the driver
waits on with ``ray.wait``. Nothing polls the store for commands or replies. Ray
runs an actor's calls from one caller one at a time, in the order they were
submitted, which is the order the store loop gives, and submits are atomic over
their ranks as in :class:`~nereus_rl.runtime.driver.Driver`.

A worker counts as lost on any of: a call on its actor raised ``RayActorError``
(``ActorDiedError``, the actor's node died), its liveness connection closed without a
goodbye, its World heartbeat stopped, or Ray's node table says its node is dead.
Then, as for local spawn, the driver publishes a sealed abort notice and the
survivors' running collectives are broken at once (nereus_rl.runtime.abort). An
actor's own Ray connections (to its raylet, the GCS and its callers) are spared by
that break: the actor tells :class:`~nereus_rl.runtime.abort.AbortState` which
sockets are Ray's (:func:`ray_socket_inodes`).

Elasticity from the cluster: :meth:`RayDriver.cluster_view` reads Ray's view of
the nodes (alive, draining, dead, and how many device slots are free),
:meth:`RayDriver.start_workers` may be called again to place actors on devices
that arrived, and :meth:`RayDriver.place_arrivals` (called by the trainer at its
boundaries when ``max_devices`` allows growth) does so in the background for the
free device slots it finds; those workers are then the driver's spare workers,
which a recovery admits in place of lost devices and a boundary admits onto free
device ids up to ``max_devices`` (``nereus_rl.trainer.recover``).

Ray is imported only here: local spawn never imports it.

Safety: a Ray this module starts (``address=None`` and no Ray running in the
process) listens on 127.0.0.1 only, without dashboard or usage stats, and with
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (without it Ray's address resolution may
switch to the machine's external address).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from nereus_rl.runtime import protocol as P
from nereus_rl.runtime.abort import socket_inodes
from nereus_rl.runtime.driver import Driver, LivenessCadence, PendingCall, reply_values

#: Environment a Ray this module starts (and its actors) runs with: loopback-safe
#: address resolution, no usage reporting.
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
#: Commands sent to several workers with arguments travel once, as one object in
#: Ray's object store, rather than once per actor.
_SHARE_OVER = 1
#: Seconds between two reads of Ray's node table by :meth:`RayDriver.check_liveness`.
NODE_POLL_S = 1.0


def import_ray() -> Any:
    """``ray``, or a RuntimeUserError that says how to install it.

    Ray reads :data:`RAY_ENV` when it is imported: imported first here, it gets them
    (where the user has not set them).
    """
    if "ray" not in sys.modules:
        for k, v in RAY_ENV.items():
            os.environ.setdefault(k, v)
    try:
        import ray
    except ImportError:
        raise P.RuntimeUserError(
            "launcher='ray' needs Ray: pip install 'ray>=2.40' (or the project's 'ray' "
            "extra); the default launcher (local worker processes) needs none"
        ) from None
    return ray


# ---------------------------------------------------------------------- the actor side


def _tcp_table() -> dict[int, tuple[int, int, bool]]:
    """inode -> (local port, remote port, listening) of the TCP sockets in this
    process's network namespace (/proc/self/net/tcp and tcp6)."""
    out: dict[int, tuple[int, int, bool]] = {}
    for name in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(name) as f:
                next(f)
                for line in f:
                    cols = line.split()
                    local, remote, state, inode = cols[1], cols[2], cols[3], int(cols[9])
                    out[inode] = (
                        int(local.rsplit(":", 1)[1], 16),
                        int(remote.rsplit(":", 1)[1], 16),
                        state == "0A",  # TCP_LISTEN
                    )
        except (OSError, StopIteration, IndexError, ValueError):
            continue
    return out


def ray_socket_inodes(listen_ports: Iterable[int], service_ports: Iterable[int]) -> set[int]:
    """Inodes of this process's TCP sockets that belong to Ray.

    Ray's are: connections to or from this process's own Ray listening ports (the
    actor's RPC server: its callers' connections come in there), and connections to
    Ray's services (GCS, raylets, object managers, agents). Gloo's connections are
    none of these: its listeners are opened later, on other ports.

    Arguments:
        listen_ports: the ports this process listened on before it ran any command.
        service_ports: the cluster's service ports (:func:`_service_ports`).
    """
    mine = socket_inodes()
    listen, service = set(listen_ports), set(service_ports)
    return {
        inode
        for inode, (lport, rport, _) in _tcp_table().items()
        if inode in mine and (lport in listen or rport in service)
    }


def _service_ports(ray: Any) -> set[int]:
    """The ports of the cluster's Ray services that an actor may connect to."""
    ports: set[int] = set()
    try:
        gcs = ray.get_runtime_context().gcs_address
        ports.add(int(str(gcs).rsplit(":", 1)[1]))
    except Exception:
        pass
    keys = (
        "NodeManagerPort",
        "ObjectManagerPort",
        "MetricsExportPort",
        "MetricsAgentPort",
        "DashboardAgentListenPort",
        "RuntimeEnvAgentPort",
    )
    try:
        for node in ray.nodes():
            for k in keys:
                v = node.get(k)
                if isinstance(v, int) and v > 0:
                    ports.add(v)
    except Exception:
        pass
    return ports


class WorkerActor:
    """One device's worker as a Ray actor (wrapped with ``ray.remote`` by :class:`RayDriver`).

    Created without joining (the process starts and imports); :meth:`join` then joins
    the job, so that the driver orders the joins (ranks follow device order).

    Arguments:
        host, port: the job's store.
        secret: the job's secret.
        num_threads: torch threads of this worker.
        group_timeout, connect_timeout: as for ``nereus-rl worker``.
    """

    def __init__(
        self,
        host: str,
        port: int,
        secret: bytes,
        num_threads: int = 1,
        group_timeout: float = 60.0,
        connect_timeout: float = 30.0,
    ) -> None:
        self._args = (host, port, secret, num_threads, group_timeout, connect_timeout)
        self._membership = None
        self._listen: set[int] = set()
        self._service: set[int] = set()

    def node_id(self) -> str:
        """The Ray node this actor runs on (hex id)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def join(self) -> P.WorkerInfo:
        """Join the job (see nereus_rl.runtime.worker.join_job); returns its WorkerInfo."""
        import ray

        from nereus_rl.runtime.worker import join_job

        host, port, secret, num_threads, group_timeout, connect_timeout = self._args
        # Before any command: every listener now is Ray's (gloo listens later).
        mine = socket_inodes()
        self._listen = {lp for i, (lp, _, lis) in _tcp_table().items() if lis and i in mine}
        self._service = _service_ports(ray)
        self._membership = join_job(
            host,
            port,
            secret,
            num_threads=num_threads,
            connect_timeout=connect_timeout,
            group_timeout=group_timeout,
            spare=self._spare,
        )
        return self._membership.info

    def _spare(self) -> set[int]:
        return ray_socket_inodes(self._listen, self._service)

    def run(self, seq: int, payload: tuple[str, tuple, dict], abort_epoch: int) -> P.Reply:
        """Run one command: ``payload`` is (fn, args, kwargs)."""
        from nereus_rl.runtime.worker import run_command

        fn, args, kwargs = payload
        return run_command(self._membership.ctx, P.Command(seq, fn, args, kwargs, abort_epoch))

    def stop(self) -> None:
        """Leave the job cleanly (the driver is shutting down)."""
        if self._membership is not None:
            self._membership.close(clean=True)
            self._membership = None


# ---------------------------------------------------------------------- the driver side


@dataclass
class RayPendingCall(PendingCall):
    """A command sent to actors: each rank's reply is an ObjectRef."""

    refs: dict[int, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ClusterView:
    """Ray's view of the cluster's nodes, as a devices signal reads it.

    Attributes:
        alive: node id -> device slots (CPUs, or GPUs with ``device="cuda"``) it has.
        free: node id -> device slots not held by anyone now (room for new workers).
        draining: node id -> its drain deadline (ms since the epoch; 0: none given).
        dead: node ids Ray reports dead.
        workers: node id -> this job's live workers on it.
    """

    alive: dict[str, float]
    free: dict[str, float]
    draining: dict[str, int]
    dead: frozenset[str]
    workers: dict[str, list[int]]

    def draining_workers(self) -> list[int]:
        """This job's workers on draining nodes (to move off before they go)."""
        return sorted(w for n in self.draining for w in self.workers.get(n, []))

    def free_devices(self) -> int:
        """Whole device slots free on alive, not draining nodes."""
        return sum(int(v) for n, v in self.free.items() if n not in self.draining)


class RayDriver(Driver):
    """The runtime on a Ray cluster: one actor per device (see the module docstring).

    Arguments:
        address: the Ray cluster, when this process has not initialized Ray yet (a
            Ray already initialized is used as it is): None (a new local Ray on
            loopback), ``"auto"`` (the cluster this machine belongs to) or
            ``HOST:PORT`` / ``ray://HOST:PORT``.
        host: the address the job's store listens on; workers on every node must reach
            it. Default: this node's address as Ray knows it (127.0.0.1 for a Ray
            started here; another address lets anyone who reaches the port disrupt the
            job, see :class:`~nereus_rl.runtime.driver.Driver`).
        device: ``"cpu"`` (a ``{"CPU": 1}`` bundle per worker) or ``"cuda"``
            (``{"GPU": 1}``).
        num_cpus: logical CPUs of a local Ray this driver starts (default: enough for
            ``max(os.cpu_count(), 8)`` workers).
        strategy: the placement group's strategy (``PACK`` keeps a job's workers on as
            few nodes as possible; ``SPREAD`` spreads them).
        num_threads: torch threads per worker.
        group_timeout: seconds a worker's gloo op may wait for a peer.
        heartbeat_timeout, call_timeout, secret: as for :class:`Driver`.

    Raises:
        RuntimeUserError: Ray is not installed, or an unknown device.
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        host: str | None = None,
        device: str = "cpu",
        num_cpus: int | None = None,
        strategy: str = "PACK",
        num_threads: int = 1,
        group_timeout: float = 60.0,
        heartbeat_timeout: float = 30.0,
        call_timeout: float = 120.0,
        secret: bytes | None = None,
    ) -> None:
        ray = import_ray()
        if device not in ("cpu", "cuda"):
            raise P.RuntimeUserError(f"device must be 'cpu' or 'cuda', got {device!r}")
        self._ray = ray
        self._owns_ray = False
        self._saved_cluster_flag: bool | None = None
        if not ray.is_initialized():
            if address is None:
                # Ray imported before import_ray read the variable already: a Ray
                # started here must not resolve its address to an external interface.
                consts = ray._private.ray_constants
                self._saved_cluster_flag = consts.ENABLE_RAY_CLUSTER
                consts.ENABLE_RAY_CLUSTER = False
                ray.init(
                    _node_ip_address="127.0.0.1",
                    include_dashboard=False,
                    num_cpus=num_cpus or max(os.cpu_count() or 1, 8),
                    log_to_driver=True,
                    configure_logging=False,
                )
            else:
                ray.init(address=address, log_to_driver=True, configure_logging=False)
            self._owns_ray = True
        if host is None:
            # This node's address as Ray knows it: 127.0.0.1 on a Ray started here.
            host = ray.util.get_node_ip_address()
        self.device = device
        self.strategy = strategy
        self.num_threads = num_threads
        self.group_timeout = group_timeout
        self._actors: dict[int, Any] = {}
        self.node_of: dict[int, str] = {}
        self._groups: list[Any] = []  # placement groups, one per start_workers
        self._ray_dead: set[int] = set()
        self._placing = 0
        self._next_node_poll = 0.0
        self._next_drain_poll = 0.0
        self._draining: frozenset[int] = frozenset()
        self._node_lock = threading.Lock()
        # placing actors on capacity that arrived (place_arrivals), one batch at a time
        self._arrivals: threading.Thread | None = None
        self._next_arrival_poll = 0.0
        self.arrival_errors: list[str] = []
        self._actor_cls = ray.remote(WorkerActor)
        try:
            super().__init__(
                host,
                0,
                heartbeat_timeout=heartbeat_timeout,
                call_timeout=call_timeout,
                secret=secret,
            )
        except BaseException:
            if self._owns_ray:
                ray.shutdown()
            if self._saved_cluster_flag is not None:
                ray._private.ray_constants.ENABLE_RAY_CLUSTER = self._saved_cluster_flag
            raise

    # ---------------------------------------------------------------- membership

    def spawn_local(self, num_workers: int, **kwargs: Any) -> list[int]:
        """Not on Ray: workers are actors (:meth:`start_workers`)."""
        raise P.RuntimeUserError("a RayDriver places Ray actors: use start_workers(n)")

    def start_workers(self, num_workers: int, timeout: float = 300.0) -> list[int]:
        """Place ``num_workers`` actors with a new placement group and join them.

        Call it again when devices arrive: the new actors are spare workers of the job.

        Returns:
            Their ranks, in device order: grouped by node (a node's workers
            consecutive, nodes in the order of their first bundle), so that the
            trainer's ``nodes`` failure domains match Ray's nodes.

        Raises:
            WorkerTimeoutError: the cluster has no room for them within ``timeout``.
            WorkerLostError: an actor died while starting.
        """
        ray = self._ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        kind = "GPU" if self.device == "cuda" else "CPU"
        pg = placement_group([{kind: 1}] * num_workers, strategy=self.strategy)
        if not _ready(ray, pg.ready(), timeout):
            remove_placement_group(pg)
            raise P.WorkerTimeoutError(
                f"the Ray cluster has no room for {num_workers} workers of {{{kind!r}: 1}} "
                f"within {timeout:g} s (available: {ray.available_resources()})",
                (),
            )
        self._groups.append(pg)
        env = dict(RAY_ENV)
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        env["THP_MEM_ALLOC_ENABLE"] = os.environ.get("THP_MEM_ALLOC_ENABLE", "1")
        if self.device == "cuda":
            env["LOCAL_RANK"] = "0"  # Ray shows each actor its one GPU as cuda:0
        opts: dict[str, Any] = {"num_cpus": 1 if kind == "CPU" else 0}
        if kind == "GPU":
            opts["num_gpus"] = 1
        actors = [
            self._actor_cls.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=i
                ),
                max_restarts=0,
                runtime_env={"env_vars": env},
                **opts,
            ).remote(
                self.host,
                self.port,
                self._secret,
                self.num_threads,
                self.group_timeout,
                timeout,
            )
            for i in range(num_workers)
        ]
        try:
            nodes = self._get([a.node_id.remote() for a in actors], timeout, "start")
            # Nodes in the order of their first bundle, each node's workers consecutive.
            first = {n: i for i, n in reversed(list(enumerate(nodes)))}
            order = sorted(range(num_workers), key=lambda i: (first[nodes[i]], i))
            ranks = []
            with self._lock:
                self._placing += 1
            try:
                # One at a time: member ids (ranks) are taken in this order.
                for i in order:
                    info = self._get([actors[i].join.remote()], timeout, "join")[0]
                    with self._lock:
                        self._actors[info.rank] = actors[i]
                        self.node_of[info.rank] = nodes[i]
                    ranks.append(info.rank)
            finally:
                with self._lock:
                    self._placing -= 1
            with self._lock:
                self._poll_joined_locked()
            missing = [r for r in ranks if r not in self.infos]
            if missing:
                raise P.WorkerTimeoutError(f"actors {missing} joined but wrote no info", ())
        except BaseException:
            for a in actors:
                ray.kill(a, no_restart=True)
            raise
        return ranks

    def place_arrivals(self, room: int, timeout: float = 120.0) -> int:
        """Place actors on device slots that arrived in the cluster (new nodes, freed
        devices), at most ``room`` of them, in the background.

        Reads :meth:`cluster_view` (at most every NODE_POLL_S) and, when whole device
        slots are free on alive nodes that are not draining, starts a thread that runs
        :meth:`start_workers` for them; the actors join as the driver's spare workers,
        which the trainer admits at its next boundary (up to its ``max_devices``). One
        batch is placed at a time; a batch that finds no room or fails is logged (and
        kept in :attr:`arrival_errors`) and the next call tries again.

        Returns:
            How many actors this call started placing (0: none).
        """
        if room <= 0 or self._closed:
            return 0
        busy = self._arrivals
        now = time.monotonic()
        if (busy is not None and busy.is_alive()) or now < self._next_arrival_poll:
            return 0
        self._next_arrival_poll = now + NODE_POLL_S
        try:
            n = min(self.cluster_view().free_devices(), room)
        except Exception as e:  # the GCS is away: the next boundary asks again
            P.log.warning("could not read the Ray cluster's free devices: %s", e)
            return 0
        if n <= 0:
            return 0

        def place() -> None:
            try:
                self.start_workers(n, timeout=timeout)
            except Exception as e:  # capacity taken meanwhile, or an actor died starting
                self.arrival_errors.append(f"{type(e).__name__}: {e}")
                P.log.warning("placing %d actors on arrived capacity failed: %s", n, e)

        self._arrivals = threading.Thread(target=place, name="nereus-ray-arrivals", daemon=True)
        self._arrivals.start()
        return n

    def wait_arrivals(self, timeout: float | None = None) -> None:
        """Wait for the actors :meth:`place_arrivals` is placing to join (if any)."""
        busy = self._arrivals
        if busy is not None:
            busy.join(timeout)

    def _get(self, refs: list[Any], timeout: float, what: str) -> list[Any]:
        ray = self._ray
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        if pending:
            raise P.WorkerTimeoutError(
                f"{len(pending)} of {len(refs)} Ray actors did not {what} within {timeout:g} s",
                (),
            )
        try:
            return ray.get(refs)
        except ray.exceptions.RayActorError as e:
            raise P.WorkerLostError(f"a Ray actor died during {what}: {e}", ()) from None
        except ray.exceptions.RayTaskError as e:
            raise P.RuntimeUserError(f"a Ray actor failed to {what}: {e}") from None

    def _poll_joined_locked(self) -> list[P.WorkerInfo]:
        if self._placing:
            # Joins under way register themselves (their ranks then have actors).
            return []
        new = super()._poll_joined_locked()
        for info in new:
            if info.rank not in self._actors:
                # A worker that joined the store by hand: a Ray job sends it nothing.
                P.log.warning(
                    "worker %d joined the store of a Ray job without being one of its "
                    "actors; it is left out",
                    info.rank,
                )
                self._lost.add(info.rank)
        return new

    def _check_liveness_locked(self) -> tuple[int, ...]:
        self._poll_nodes()
        dead = sorted(r for r in self._ray_dead if r in self.infos and r not in self._lost)
        if dead:
            self._lost.update(dead)
            self._publish_abort(dead)
        return super()._check_liveness_locked()

    def _poll_nodes(self) -> None:
        """Actors on nodes Ray reports dead are dead (at most every NODE_POLL_S)."""
        now = time.monotonic()
        if now < self._next_node_poll or not self.node_of:
            return
        self._next_node_poll = now + NODE_POLL_S
        try:
            dead = {n["NodeID"] for n in self._ray.nodes() if not n.get("Alive", True)}
        except Exception:  # the GCS is away: the other signs still answer
            return
        self._ray_dead.update(r for r, n in self.node_of.items() if n in dead)

    def cluster_view(self) -> ClusterView:
        """Ray's view of the nodes now: alive, draining, dead, free device slots, and
        where this job's workers are (the devices signal on a Ray cluster)."""
        ray = self._ray
        kind = "GPU" if self.device == "cuda" else "CPU"
        nodes = ray.nodes()
        alive = {n["NodeID"]: float(n["Resources"].get(kind, 0.0)) for n in nodes if n["Alive"]}
        dead = frozenset(n["NodeID"] for n in nodes if not n["Alive"])
        free: dict[str, float] = {}
        try:
            from ray._private.state import available_resources_per_node

            for nid, res in available_resources_per_node().items():
                if nid in alive:
                    free[nid] = float(res.get(kind, 0.0))
        except Exception:
            free = {}
        draining: dict[str, int] = {}
        try:
            gcs = ray._private.worker.global_worker.gcs_client
            draining = {str(k): int(v) for k, v in gcs.get_draining_nodes().items()}
        except Exception:  # an older Ray, or the GCS is away: nothing known drains
            draining = {}
        live = set(self.workers)
        workers: dict[str, list[int]] = {}
        for r, n in self.node_of.items():
            if r in live:
                workers.setdefault(n, []).append(r)
        return ClusterView(alive, free, draining, dead, workers)

    def draining_workers(self) -> frozenset[int]:
        """This job's live workers on nodes Ray is draining (announced preemption, a
        scale-down): read from the GCS at most every NODE_POLL_S, else the last answer.

        The trainer plans off them (``Trainer.device_worker``): a plan that uses one
        becomes infeasible, and the adaptation loop moves off it at once (urgent)
        while the node still runs.
        """
        now = time.monotonic()
        with self._node_lock:
            if now < self._next_drain_poll:
                return self._draining
            self._next_drain_poll = now + NODE_POLL_S
            try:
                gcs = self._ray._private.worker.global_worker.gcs_client
                nodes = {str(n) for n in gcs.get_draining_nodes()}
            except Exception:  # an older Ray, or the GCS is away: nothing known drains
                nodes = set()
            self._draining = frozenset(w for w, n in self.node_of.items() if n in nodes)
        return self._draining - set(self.check_liveness())

    def actor(self, rank: int) -> Any:
        """The Ray actor handle of worker ``rank``."""
        return self._actors[rank]

    def kill(self, rank: int) -> None:
        """Kill worker ``rank``'s actor (``ray.kill``); it is known lost on return."""
        actor = self._actors.get(rank)
        if actor is None:
            raise P.RuntimeUserError(f"worker {rank} is not an actor of this driver")
        self._ray.kill(actor, no_restart=True)
        # ray.kill returns before the process ends: its liveness connection closing
        # is the sign that it did (a dead process holds no socket).
        deadline = time.monotonic() + 5.0
        while rank not in self.check_liveness() and time.monotonic() < deadline:
            time.sleep(0.01)
        with self._lock:
            self._ray_dead.add(rank)
        self.check_liveness()

    # ---------------------------------------------------------------- calls

    def submit(self, ranks: Iterable[int], fn: str, *args: Any, **kwargs: Any) -> RayPendingCall:
        """Call ``fn(*args, **kwargs)`` on each worker's actor; do not wait.

        Raises:
            RuntimeUserError: a rank is not a joined worker.
            WorkerLostError: a rank is known to be lost.
        """
        ranks = list(ranks)
        payload: Any = (fn, tuple(args), dict(kwargs))
        with self._lock:  # atomic over the ranks (see Driver)
            self._check_ranks(ranks)
            strangers = [r for r in ranks if r not in self._actors]
            if strangers:
                raise P.RuntimeUserError(f"worker(s) {strangers} are not actors of this job")
            if len(ranks) > _SHARE_OVER and (args or kwargs):
                payload = self._ray.put(payload)  # serialized once for every actor
            seqs, refs = {}, {}
            for rank in ranks:
                seq = self._seq[rank]
                self._seq[rank] = seq + 1
                refs[rank] = self._actors[rank].run.remote(seq, payload, self._abort_epoch)
                seqs[rank] = seq
        return RayPendingCall(fn, seqs, time.monotonic(), refs)

    def wait(self, pending: PendingCall, timeout: float | None = None) -> dict[int, Any]:
        """Collect the replies of a submitted call (see :meth:`Driver.wait`).

        Raises:
            RemoteError: the command raised on a worker (the lowest such rank).
            WorkerLostError: a worker that owes a reply died.
            WorkerTimeoutError: some workers did not answer within ``timeout``.
        """
        ray = self._ray
        if not isinstance(pending, RayPendingCall):
            raise P.RuntimeUserError(f"{pending!r} was not submitted by this RayDriver")
        timeout = self.call_timeout if timeout is None else timeout
        deadline = pending.sent_at + timeout
        rank_of = {ref: rank for rank, ref in pending.refs.items()}
        waiting = list(pending.refs.values())
        replies: dict[int, P.Reply] = {}
        liveness = LivenessCadence(self._liveness)
        while waiting:
            now = time.monotonic()
            # Short slices: a death the liveness listener saw is acted on within one.
            ready, waiting = ray.wait(
                waiting, num_returns=1, timeout=max(0.0, min(0.05, deadline - now))
            )
            for ref in ready:
                rank = rank_of[ref]
                try:
                    replies[rank] = ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    with self._lock:
                        self._ray_dead.add(rank)
                    self.check_liveness()
                    raise P.WorkerLostError(
                        f"worker(s) [{rank}] died before answering {pending.fn!r} ({e})",
                        (rank,),
                    ) from None
                except ray.exceptions.RayError as e:
                    # Ray could not carry the reply (it does not pickle, ...).
                    replies[rank] = P.Reply(
                        pending.seqs[rank], rank, False, None, type(e).__name__, str(e)
                    )
            if not waiting:
                break
            now = time.monotonic()
            if liveness.due(now):
                lost = set(self.check_liveness())
                owing = sorted(rank_of[r] for r in waiting if rank_of[r] in lost)
                if owing:
                    raise P.WorkerLostError(
                        f"worker(s) {owing} died before answering {pending.fn!r}", tuple(owing)
                    )
            if now > deadline:
                late = sorted(rank_of[r] for r in waiting)
                raise P.WorkerTimeoutError(
                    f"worker(s) {late} did not answer {pending.fn!r} within {timeout:g} s",
                    tuple(late),
                )
        return reply_values(pending.fn, replies)

    # ---------------------------------------------------------------- shutdown

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop every actor, remove the placement groups, close the store; shut Ray
        down if this driver started (or connected) it. Idempotent."""
        ray = self._ray
        # actors still being placed on arrived capacity are stopped with the others
        self.wait_arrivals(timeout)
        with self._lock:
            if self._closed:
                return
            if self._liveness is not None:
                self._liveness.expect_exit()  # the actors' goodbyes are no deaths
            live = [r for r in self.infos if r not in self._lost and r in self._actors]
        try:
            refs = [self._actors[r].stop.remote() for r in live]
            if refs:
                ray.wait(refs, num_returns=len(refs), timeout=timeout)
        except Exception as e:  # the cluster is going away: so are the actors
            P.log.warning("could not stop the Ray actors cleanly: %s", e)
        try:
            super().shutdown(timeout)
        finally:
            try:
                from ray.util.placement_group import remove_placement_group

                for a in self._actors.values():
                    ray.kill(a, no_restart=True)
                for pg in self._groups:
                    remove_placement_group(pg)
            except Exception as e:
                P.log.warning("could not release the Ray actors: %s", e)
            if self._owns_ray:
                ray.shutdown()
            if self._saved_cluster_flag is not None:
                ray._private.ray_constants.ENABLE_RAY_CLUSTER = self._saved_cluster_flag


def _ready(ray: Any, ref: Any, timeout: float) -> bool:
    ready, _ = ray.wait([ref], timeout=timeout)
    return bool(ready)
