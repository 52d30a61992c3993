"""The daemon process: wires the I/O loop, the executor supervisor, the engine and the socket
front end together, runs until asked to stop, and stops gracefully.

This process never imports torch and never runs or unpickles job code (`docs/runtime.md`).
"""

from __future__ import annotations

import logging
import os
import pwd
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from salus.daemon.cluster import ClusterSpec, start_store, stop_store
from salus.daemon.devices.context_cost import executor_cost
from salus.daemon.devices.discovery import DeviceSpec
from salus.daemon.devices.mps import Mps
from salus.daemon.engine.engine import Engine
from salus.daemon.engine.events import Event
from salus.daemon.engine.job_spec import JobSpec
from salus.daemon.engine.persist import Persistence
from salus.daemon.engine.ports import CheckpointPolicy, DataCachePolicy
from salus.daemon.engine.registry import Owner
from salus.daemon.frontend.handlers import Handlers
from salus.daemon.frontend.server import SocketServer
from salus.daemon.k8s.pod_sockets import PodSockets, resolve_pod_user
from salus.daemon.loop import Loop
from salus.daemon.metrics import Metrics
from salus.daemon.state.checkpoint_files import job_has_checkpoint
from salus.daemon.state.store import Store, ensure_admin_token
from salus.daemon.supervisor.supervisor import Supervisor
from salus.daemon.wire.errors import StateDiskFull
from salus.scheduler.policies import DEFAULT_POLICY, POLICIES

if TYPE_CHECKING:
    from salus.daemon.k8s.plugin import GpuMemPlugin
    from salus.daemon.rest.server import RestServer

log = logging.getLogger("salusd")


@dataclass(frozen=True)
class DaemonConfig:
    """What `salusd serve` was asked for (bytes, seconds)."""

    socket_path: str
    devices: Sequence[DeviceSpec]
    policy: str | None = None  # None: the policy last switched to live (the registry's), else pack
    threads: int = 1
    group: str | None = None
    max_connections: int = 1024
    frame_timeout_s: float = 30.0
    cancel_grace_s: float = 5.0
    script_grace_s: float = 30.0
    context_bytes: int | None = None  # a GPU context's cost measured before (None: measure)
    retention_s: float = 3600.0
    standby_executors: int = 2
    shutdown_timeout_s: float = 60.0
    state_dir: Path | None = None  # None: nothing durable, no checkpoints, no REST
    http: tuple[str, int] | None = None  # the REST API's address (needs state_dir)
    job_root: Path | None = None  # where REST batch entrypoints live (default state/job-root)
    checkpoint_every: int | None = None  # iterations; None: every checkpoint_every_s
    checkpoint_every_s: float = 600.0
    cluster: ClusterSpec | None = None  # several daemons joined for multi-node gangs
    cache_dir: Path | None = None  # jobs' data cache, level 1 (default <state-dir>/cache)
    cache_bytes: int = 10 << 30  # its cap per replica
    first_call: str = "auto"  # estimate | measure | auto (see first_call_estimated)
    isolation: str = "lane"  # lane: an owner's jobs of one lane share a process; job: not
    mps: bool = False  # start an NVIDIA MPS control daemon per GPU (salusd/devices/mps.py)
    device_plugin: bool = False  # serve salusd.io/gpu-mem to the kubelet (salusd/k8s/)
    kubelet_dir: Path = Path("/var/lib/kubelet")  # its device-plugins/ and pod-resources/
    alloc_root: Path | None = None  # the plugin's allocation dirs (default <socket dir>/alloc)
    pod_user: str = "nobody"  # the unprivileged user pods' jobs run as (never root)
    # tests on hosts without a GPU: "GPU-uuid=GiB" shares the plugin advertises, all on device 0
    device_plugin_test_gpus: tuple[str, ...] = ()


def first_call_estimated(first_call: str, devices: Sequence[DeviceSpec]) -> bool:
    """Whether jobs' first calls are estimated on fake tensors before admission (`estimate`)
    or admitted with their persistent size as the guess and measured (`measure`). `auto`
    estimates where a lane's limit is enforced (CUDA devices) and measures on CPU devices,
    whose memory is accounted only: there the first call's measured peak is exact, and the
    fake run costs each job at start (measured: a small MLP's first call took 85 ms with it and
    6 ms without; 16 inference executors held 940 MB PSS with it, 836 MB without)."""
    if first_call not in ("auto", "estimate", "measure"):
        raise ValueError(f"first_call is auto, estimate or measure, not {first_call!r}")
    if first_call == "auto":
        return any(d.torch_device.startswith("cuda") for d in devices)
    return first_call == "estimate"


class Daemon:
    """One salusd: build with a config, `start()`, then `run()` until `request_stop()`."""

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.loop = Loop(time.monotonic)
        estimate_first = first_call_estimated(config.first_call, config.devices)
        self.supervisor = Supervisor(self.loop, standby=config.standby_executors,
                                     threads=config.threads, estimate_first=estimate_first,
                                     gpu_uuids=[d.uuid for d in config.devices if d.uuid],
                                     gpu_total_bytes=[d.total_bytes for d in config.devices
                                                      if d.uuid],
                                     isolation=config.isolation)
        self.store: Store | None = None
        checkpoints = data_cache = None
        if config.state_dir is not None:
            state = prepare_state_dir(config.state_dir)
            cache = config.cache_dir or state / "cache"
            cache.mkdir(parents=True, exist_ok=True)
            os.chmod(cache, 0o711)
            data_cache = DataCachePolicy(str(cache), make_owner_dir, config.cache_bytes)
            self.store = Store.open(state / "salusd.db")
            checkpoints = CheckpointPolicy(str(state / "checkpoints"), make_owner_dir,
                                           config.checkpoint_every, config.checkpoint_every_s)
        # What one more executor costs each device, booked per process (a CUDA context).
        self.contexts = [executor_cost(d, given=config.context_bytes) for d in config.devices]
        self.policy = self._policy(config.policy)
        self.engine = Engine(
            [d.memory_bytes for d in config.devices], self.policy, self.supervisor,
            clock=time.monotonic, timers=self.loop,
            torch_devices=[d.torch_device for d in config.devices], threads=config.threads,
            retention_s=config.retention_s, cancel_grace_s=config.cancel_grace_s,
            script_grace_s=config.script_grace_s,
            store=self.store, checkpoints=checkpoints, cluster=config.cluster,
            data_cache=data_cache,
            compute_slowdowns=[d.compute_slowdown for d in config.devices],
            estimate_first=estimate_first, context_bytes=[c.bytes for c in self.contexts],
            share_lanes=config.isolation == "lane",
            workspace_bytes=[c.workspace_bytes for c in self.contexts],
            gpu_uuids=[d.uuid or "" for d in config.devices])
        self.metrics = Metrics()
        self.engine.events.subscribe(self.metrics.observe)
        if self.store is not None:
            self.engine.events.subscribe(_keep_on_disk_full(Persistence(self.store).observe))
        self.rest: RestServer | None = None
        self.not_restored: list[int] = []  # job ids recorded failed at restore
        if config.http is not None:
            self.rest = self._make_rest(config.http)
        self.supervisor.on_reply = self.engine.on_executor_reply
        self.supervisor.on_died = self.engine.on_executor_died
        handlers = Handlers(self.engine, state_dir=None if config.state_dir is None
                            else str(config.state_dir), store=self.store)
        self.server = SocketServer(config.socket_path, self.loop, handlers,
                                   group=config.group, max_connections=config.max_connections,
                                   frame_timeout_s=config.frame_timeout_s)
        self._stop = False
        self.cluster_store: subprocess.Popen[bytes] | None = None
        self.mps = Mps(config.state_dir or Path(tempfile.gettempdir()) / f"salusd-{os.getpid()}",
                       config.devices)
        self.device_plugin: GpuMemPlugin | None = None
        self.pod_sockets: PodSockets | None = None
        # resolved before anything starts: a pod user that is root, or none, stops salusd here
        self.pod_user = resolve_pod_user(config.pod_user) if config.device_plugin else None

    def _make_rest(self, address: tuple[str, int]) -> RestServer:
        # FastAPI and the routes are imported here, not at the top: a daemon started with
        # `--http none` does without them (a third of its start-up imports, measured).
        from salus.daemon.rest.app import make_app
        from salus.daemon.rest.auth import Auth
        from salus.daemon.rest.bridge import EngineBridge
        from salus.daemon.rest.context import Context
        from salus.daemon.rest.server import RestServer

        assert self.store is not None and self.config.state_dir is not None, (
            "the REST API needs a state dir")
        state = self.config.state_dir
        job_root = self.config.job_root or state / "job-root"
        job_root.mkdir(parents=True, exist_ok=True)
        me = pwd.getpwuid(os.getuid())
        auth = Auth(ensure_admin_token(state), self.store, Owner(me.pw_name, me.pw_uid,
                                                                  me.pw_gid))
        ctx = Context(self.engine, EngineBridge(self.loop), self.store, self.metrics,
                      str(job_root), not_restored=self.not_restored)
        return RestServer(make_app(ctx, auth), *address)

    def start(self) -> None:
        """Start the executor zygote (it imports torch once), bring back the jobs that were
        live when salusd last stopped, then listen."""
        cluster = self.config.cluster
        if cluster is not None and cluster.node_rank == 0:
            self.cluster_store = start_store(cluster)
        if self.config.mps:
            self.mps.start()
        self.supervisor.mps_clients = {  # a client's pinned limit: its cap and its context
            d.index: (pipe, cost.bytes - cost.workspace_bytes)
            for d, cost in zip(self.config.devices, self.contexts, strict=True)
            if (pipe := self.mps.pipe_for(d.uuid)) is not None}
        self.engine.device_sharing[:] = [self.mps.describe(d.uuid if d.kind == "cuda" else None)
                                         for d in self.config.devices]
        self.engine.serve_one_owner(sorted(self.supervisor.mps_clients))
        self.supervisor.on_mps_clients = self.engine.mps_clients
        self.supervisor.start()
        self.supervisor.wait_ready()
        if self.store is not None:
            self._restore()
        if self.rest is not None and self.config.state_dir is not None:
            self.rest.start()
            write_private(self.config.state_dir / "http.url", self.rest.url + "\n")
            log.info("REST API on %s", self.rest.url)
        # The socket comes last: clients take its existence as "the daemon is up", so the REST
        # address must be written before it.
        self.server.start()
        if self.config.device_plugin:
            self._start_device_plugin()

    def _start_device_plugin(self) -> None:
        """Serve `salusd.io/gpu-mem` to the kubelet from every GPU's budget, in threads of its
        own; a host without GPUs has nothing to advertise, and says so."""
        from salus.daemon.k8s.plugin import for_devices, for_test_gpus

        alloc_root = self.config.alloc_root or Path(self.config.socket_path).parent / "alloc"
        plugin: GpuMemPlugin | None
        if self.config.device_plugin_test_gpus:
            plugin = for_test_gpus(self.config.device_plugin_test_gpus,
                                   self.config.kubelet_dir, alloc_root, self.config.state_dir)
        else:
            plugin = for_devices(
                self.config.devices, self.config.kubelet_dir, alloc_root,
                self.config.state_dir,
                {d.uuid: pipe for d in self.config.devices
                 if d.uuid and (pipe := self.mps.pipe_for(d.uuid)) is not None}
                if self.config.mps else None)
        if plugin is None:
            log.warning("--device-plugin: this host has no GPU (salusd serves CPU devices), so "
                        "the device plugin is not started and pods cannot ask for "
                        "salusd.io/gpu-mem here")
            return
        assert self.pod_user is not None
        self.pod_sockets = PodSockets(
            self.loop, self.server.handlers, self.engine, self.pod_user,
            {d.uuid: d.index for d in self.config.devices if d.uuid},
            max_connections=self.config.max_connections,
            frame_timeout_s=self.config.frame_timeout_s)
        plugin.listener = self.pod_sockets
        plugin.start()
        self.device_plugin = plugin

    def _restore(self) -> None:
        assert self.store is not None and self.config.state_dir is not None
        checkpoints = self.config.state_dir / "checkpoints"
        for row in self.store.unfinished_jobs():
            if row.checkpoint_iteration is not None and not job_has_checkpoint(
                    checkpoints / str(row.id)):
                # Starting over from iteration 0 would silently throw the recorded progress
                # away: the job ends failed, saying why, and its files stay for inspection.
                reason = (f"every checkpoint of job {row.id} in {checkpoints / str(row.id)} is "
                          f"unreadable (the registry recorded one at iteration "
                          f"{row.checkpoint_iteration}), so it was not restarted from iteration "
                          "0; its files are left as they are; submit the job again to start "
                          "afresh")
                log.error("%s", reason)
                self.store.update_job(row.id, state="failed", reason=reason)
                self.not_restored.append(row.id)
                continue
            try:
                spec = JobSpec.from_json(row.spec)
            except ValueError as exc:  # a registry damaged by hand
                reason = (f"job {row.id}'s spec in the registry cannot be read ({exc}), so it "
                          "was not restored; submit the job again")
                log.error("%s", reason)
                self.store.update_job(row.id, state="failed", reason=reason)
                self.not_restored.append(row.id)
                continue
            log.info("restoring job %d %r of %s (%s, checkpoint at iteration %s)", row.id,
                     row.name, row.owner, row.kind, row.checkpoint_iteration)
            # a pod's job goes back to its pod alone
            owner = Owner(row.owner, row.uid, row.gid, spec.allocation)
            self.engine.restore(owner, row.id, row.name,
                                row.iterations_total or 1,
                                "batch" if row.kind == "batch" else "interactive",
                                spec, float(row.priority), row.checkpoint_iteration,
                                row.checkpoint_time, row.checkpoint_bytes or 0,
                                iterations_done=row.iterations_done, restarts=row.restarts)

    def request_stop(self) -> None:
        """Safe from a signal handler or another thread."""
        self.loop.call_soon_threadsafe(self._begin_stop)

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.request_stop())

    def run(self) -> None:
        """Serve until stopped; then let running calls finish and answer, and clean up."""
        while not self._stop:
            self.loop.run_once()
        log.info("shutting down: running calls finish, queued calls are refused")
        if self.device_plugin is not None:  # the kubelet takes salusd.io/gpu-mem off the node
            self.device_plugin.stop()
        if self.pod_sockets is not None:
            self.pod_sockets.stop()
        deadline = time.monotonic() + self.config.shutdown_timeout_s
        while not self.engine.idle and time.monotonic() < deadline:
            self.loop.run_once(0.1)
        # Script jobs were sent SIGTERM (their handlers may save a checkpoint and exit); what
        # still runs after the grace is killed with its executor below.
        deadline = time.monotonic() + self.config.script_grace_s
        while self.engine.scripts_running and time.monotonic() < deadline:
            self.loop.run_once(0.1)
        self._retire_executors()
        flush_deadline = time.monotonic() + 2.0
        while any(link.out for link in self.loop.links) and time.monotonic() < flush_deadline:
            self.loop.run_once(0.05)
        self.supervisor.stop()
        self.mps.stop()
        self._answer_stragglers()
        if self.cluster_store is not None:
            stop_store(self.cluster_store)
        if self.rest is not None:
            self.rest.stop()
        self.loop.shutdown()
        if self.store is not None:
            self.store.close()
        log.info("stopped")

    def _policy(self, given: str | None) -> str:
        """The policy to start with: the one given, else the one last switched to live (kept
        in the registry), else pack."""
        if given is not None:
            return given
        kept = self.store.setting("policy") if self.store is not None else None
        if kept is not None and kept not in POLICIES:
            log.warning("the registry's policy %r is unknown to this salusd: using %s", kept,
                        DEFAULT_POLICY)
            kept = None
        return kept or DEFAULT_POLICY

    def _retire_executors(self, timeout_s: float = 3.0) -> None:
        """Ask every job's executor to exit, refusing the direct calls it holds with `salusd is
        shutting down` (the engine refused those queued through the daemon), and wait for them
        (at most `timeout_s` seconds). Killed at once instead, a client waiting on its direct
        channel saw the channel reset. Their jobs stay live in the registry, to be restored."""
        self.supervisor.on_died = lambda *_: None  # their ends now are not the jobs' failures
        executors = {id(ex): ex for record in self.engine.registry
                     for ex in (record.executor, *record.replicas) if ex is not None}
        for ex in executors.values():
            self.supervisor.retire(ex, "shutting_down", "salusd is shutting down")
        deadline = time.monotonic() + timeout_s
        while (any(not getattr(ex, "closed", True) for ex in executors.values())
               and time.monotonic() < deadline):
            self.loop.run_once(0.05)

    def _answer_stragglers(self, quiet_s: float = 0.3, timeout_s: float = 2.0) -> None:
        """Go on answering clients (every job request now gets `salusd is shutting down`) until
        none has sent anything for `quiet_s` seconds (at most `timeout_s`): a client whose
        executor just exited asks salusd why, and closing its connection with the question
        unread would reset it instead."""
        deadline = time.monotonic() + timeout_s
        quiet_since = time.monotonic()
        seen = self.server.requests
        while time.monotonic() < deadline and time.monotonic() - quiet_since < quiet_s:
            self.loop.run_once(0.05)
            if self.server.requests != seen:
                seen, quiet_since = self.server.requests, time.monotonic()

    def _begin_stop(self) -> None:
        if self._stop:
            return
        self._stop = True
        self.server.stop()
        self.engine.begin_shutdown()


def _keep_on_disk_full(observe: Callable[[Event], None]) -> Callable[[Event], None]:
    """`observe` that logs a full state disk instead of raising: the event stream drops a
    subscriber that raises, and the registry must be written again once space is freed."""
    def guarded(event: Event) -> None:
        try:
            observe(event)
        except StateDiskFull as exc:
            log.error("job %d's %s was not recorded in the registry: %s", event.job_id,
                      event.kind, exc)
    return guarded


def prepare_state_dir(path: Path) -> Path:
    """The state dir, mode 0711: the registry and the admin token in it are 0600, and each
    job's checkpoints are in `checkpoints/<id>/`, 0700 and owned by the job's owner, who must be
    able to pass through to reach them."""
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o711)
    (path / "checkpoints").mkdir(exist_ok=True)
    os.chmod(path / "checkpoints", 0o711)
    return path


def make_owner_dir(path: str, owner: Owner) -> None:
    """A job's checkpoint dir, which only its owner (and root) can read."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    if os.geteuid() == 0:
        os.chown(path, owner.uid, owner.gid)


def write_private(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), "w") as f:
        f.write(text)
    os.replace(tmp, path)
