"""Deployment settings: typed, from arguments or ``SPLITKEY_*`` environment variables.

Read once when the app is built and passed down explicitly (to the pool, the
orchestrator, each worker's constructor); nothing reads them from globals later.
"""

from __future__ import annotations

import ipaddress
import os
import pathlib
import re
import stat
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from service.core.connections import ConnectionLimits
from service.core.limits import Limits, Pace
from service.core.logs import LogFormat, LogLevel
from workers.options import CpuKernels, GpuKernels

#: Ray counts resources in steps of 1e-4 and refuses a finer quantity (once it has started).
RAY_CPU_STEP = 0.0001


#: A host name: labels of letters, digits, '-' (and '_', which container networks allow) joined by dots.
HOST_NAME = re.compile(r"(?=.{1,253}$)[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
                       r"(?:\.[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)*\.?")


def _may_overlap(a: str, b: str) -> bool:
    """Whether sockets bound to hosts ``a`` and ``b`` on one port would collide: the same host, or a
    wildcard address on either side."""
    wild = {"0.0.0.0", "::", "[::]", ""}
    return a == b or a in wild or b in wild


class ServiceSettings(BaseSettings):
    """Every setting of ``splitkey serve``: each is a flag and a ``SPLITKEY_<NAME>`` variable
    (``service.cli_settings`` makes the flags and the table in docs/API.md section 9)."""

    # allow_inf_nan=False: every float setting is a finite number (an infinite request timeout started the
    # server, then failed every context query on the workers).
    model_config = SettingsConfigDict(env_prefix="SPLITKEY_", extra="forbid", frozen=True, allow_inf_nan=False)

    host: str = Field("127.0.0.1", description="Address to bind; loopback unless told otherwise.")
    port: int = Field(8000, ge=0, le=65535, description="Port to listen on (0: any free port).")
    ray_address: str | None = Field(None, description="Unset: embedded local Ray; 'auto' or HOST:PORT: join a "
                                                          "cluster.")
    ray_namespace: str = Field("splitkey", description="Ray namespace of the named actors (workers, directory).")
    workers: int | None = Field(None, ge=1, description="Shard workers; default one per CPU (GPU) in the cluster.")
    device: Literal["auto", "cpu", "gpu"] = Field("cpu", description="Kernel device: cpu, gpu, or auto (gpu "
                                                                      "when the cluster has one).")
    grpc_port: int | None = Field(None, ge=0, le=65535, description="Also serve the KServe v2 gRPC protocol on "
                                  "this port (0: any free one; needs the grpc extra); unset: HTTP only.")
    api_key_file: pathlib.Path | None = Field(None, description="File holding the bearer token; unset: no auth.")
    api_key_group_readable: bool = Field(False, description="Accept an --api-key-file its group may read (a group "
                                         "this process is in): a Kubernetes Secret mounted with fsGroup is 0440.")

    # Request bounds
    max_body_bytes: int = Field(2 * 2**30, ge=1024, description="Largest request body (413 above).")
    max_inflight: int = Field(64, ge=1, description="Requests working at once (a body counts once it has arrived); "
                                                    "more get 429.")
    max_inflight_bytes: int = Field(4 * 2**30, ge=1024, description="Request body bytes held at once, by all "
                                                                   "requests together; past it 429. At least "
                                                                   "max_body_bytes.")
    body_timeout_s: float = Field(120.0, gt=0, description="A request's line and headers, and then its body, must "
                                                         "each arrive within this (408 past it).")
    min_body_rate: float = Field(65536.0, ge=0, description="Bytes/s a body must average after body_grace_s "
                                                            "(408 below it), and an answer waiting unsent must "
                                                            "leave at (the connection aborted); 0: no minimum.")
    body_grace_s: float = Field(10.0, ge=0, description="Seconds a body may start slowly or pause before "
                                                        "min_body_rate applies; an answer waiting unsent is "
                                                        "checked this often (at least 1 s).")
    request_timeout_s: float = Field(120.0, gt=0, description="Per-request deadline (504 past it).")
    retry_after_s: int = Field(1, ge=1, description="Retry-After of a 429, in seconds.")
    max_connections: int | None = Field(None, ge=1, description="HTTP connections held at once; at the limit the "
                                        "one idle longest is closed for a new one, else the new one gets 503 "
                                        "too_many_connections. Default: 4/9 of the open-file limit (RLIMIT_NOFILE, "
                                        "raised as Ray does), docs/SERVICE.md \"Connections\".")
    max_client_connections: int | None = Field(None, ge=1, description="HTTP connections one client address holds "
                                               "at once, by the same rule; unset: no bound per client (behind a "
                                               "proxy, every client has the proxy's address).")
    shutdown_grace_s: float = Field(30.0, ge=0, description="On SIGTERM/SIGINT, how long requests in flight may "
                                                            "run before they are cut with 503 (service.core.drain).")

    # Sharding and merge
    shards: int | None = Field(None, ge=1, description="Shards per inline request; default: the number of workers.")
    min_shard_keys: int = Field(4096, ge=1, description="Do not cut inline keys into shards smaller than this.")
    merge_fanin: int = Field(2, ge=2, description="Fan-in of the merge tree.")
    remote_merge_bytes: int = Field(8 * 2**20, ge=0, description="States larger than this merge on the workers.")

    # Kernel and workers
    block_size: int | None = Field(None, ge=1, description="Keys per kernel block; default: from the scratch "
                                                           "budget.")
    kernel_threads: int = Field(1, ge=1, description="Threads per worker's kernel (one CPU each by default).")
    worker_cpus: float = Field(1.0, gt=0, allow_inf_nan=False, description="CPUs Ray reserves for each worker.")
    worker_memory_bytes: int = Field(4 * 2**30, ge=0, description="Resident context bytes per worker (a 1M-key "
                                                                 "decode-shape bfloat16 context fits on two).")
    worker_concurrency: int = Field(64, ge=1, description="Calls a worker accepts at once (each waits in its own "
                                                          "thread; one compute thread serves them, docs/CONTEXTS.md).")
    worker_channel: bool = Field(True, description="Send resident queries and small appends to the workers, and "
                                 "a write's lease and commit to the contexts directory, over a direct socket each "
                                 "(token-checked, no pickle) instead of a Ray call; false: Ray only.")
    batch_rows: int = Field(1024, ge=1, description="Query rows (n_q*h_q) one pass over resident keys serves at "
                                                    "most; 1 turns batching off.")
    gpu_kernels: GpuKernels = Field(GpuKernels.GENERIC, description="GPU implementation: generic or fused "
                                                                    "(docs/GPU.md).")
    cpu_kernels: CpuKernels = Field(CpuKernels.AUTO, description="CPU implementation: numpy, fused (numba, "
                                                                 "decode, and prefill over resident keys; compiled "
                                                                 "before the worker "
                                                                 "serves) or auto (numpy at once, fused once compiled "
                                                                 "in the background).")
    heal_interval_s: float = Field(2.0, gt=0, description="How often dead workers are looked for and replaced.")

    # Resident contexts
    # 2048: a 4096-key context is cut over two workers, whose halves run in parallel (a decode call
    # 1.2-2.7 ms faster at p50 on two workers than as one 4096-key shard: benchmarks/results/2026-12-05/NOTES.md, "Contexts
    # over both workers"); much below it a call's fixed cost outweighs what a shorter kernel saves.
    context_shard_keys: int = Field(2048, ge=1, description="Keys a context shard holds at least before a new one "
                                                            "opens; a create uses one shard per worker down to this size.")
    max_replicas: int = Field(8, ge=1, description="Most replicas a context may ask for.")
    # A write to a hung worker answers within 4 x this (service.contexts.fencing), at most 56 s: inside
    # the write's 60 s lease (service.contexts.directory.LEASE_TTL_S), so it answers before the lease lapses.
    write_timeout_s: float = Field(10.0, gt=0, le=14, description="Seconds a context write waits for a worker "
                                                                  "before it pings it; one that answers neither the "
                                                                  "write nor the ping in this time each is killed "
                                                                  "and replaced, and the write answered 503.")
    record_cache: int = Field(4096, ge=0, description="Context records a front end keeps to resolve queries "
                                                      "without asking the directory (workers check their version); "
                                                      "0: ask it every time.")
    tombstone_horizon_s: float = Field(7 * 86400.0, ge=0, description="How long a deleted context's tombstone "
                                       "is kept at least, once no worker's folder holds files of it "
                                       "(docs/CONTEXTS.md, \"Surviving a restart\").")
    persist_dir: pathlib.Path | None = Field(None, description="Keep resident contexts on disk here and load them "
                                                              "at start (workers.persist); unset: memory only.")

    # Operations
    metrics_port: int | None = Field(None, ge=0, le=65535, description="Also serve GET /metrics on this port, "
                                     "without the API key, for a Prometheus scraper (0: any free one); unset: "
                                     "/metrics only on the API port, behind the key.")
    metrics_host: str = Field("127.0.0.1", description="Address the metrics port binds; loopback unless told "
                                                       "otherwise (a scraper in the cluster needs the pod's address "
                                                       "or 0.0.0.0).")
    log_format: LogFormat = Field("text", description="The log's lines: text, or json (one object per line: time, "
                                                     "level, logger, message and the line's fields).")
    log_level: LogLevel = Field(
        "info", description="The least severe lines logged; info has one access-log line per request. debug also "
                            "forwards Ray's own start-up lines and the workers' output to the log.")

    @field_validator("api_key_file", mode="before")
    @classmethod
    def _key_file(cls, v: object) -> object:
        if isinstance(v, str) and not v.strip():  # "" would be the current directory
            raise ValueError("must be the path of a file holding the token, not blank")
        return v

    @field_validator("worker_cpus")
    @classmethod
    def _cpu_share(cls, v: float) -> float:
        # Ray refuses resource quantities finer than 1e-4, after Ray has started: refuse them here.
        steps = v / RAY_CPU_STEP
        if abs(steps - round(steps)) > 1e-6 * max(1.0, steps):
            raise ValueError(f"must be a multiple of {RAY_CPU_STEP} (the finest share of a CPU Ray reserves)")
        return v

    @field_validator("persist_dir", mode="before")
    @classmethod
    def _store_dir_given(cls, v: object) -> object:
        if isinstance(v, str) and not v.strip():  # "" would become the current directory
            raise ValueError("must be the path of a folder, not blank (unset it to keep contexts in memory only)")
        return v

    @field_validator("ray_namespace")
    @classmethod
    def _namespace(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must name a Ray namespace, not blank")
        return v

    @field_validator("host", "metrics_host")
    @classmethod
    def _host(cls, v: str) -> str:
        # An address or a host name that could resolve: a typo fails here, as a setting, not as a start failure.
        try:
            ipaddress.ip_address(v.strip("[]"))
            return v
        except ValueError:
            pass
        if not HOST_NAME.fullmatch(v):
            raise ValueError("must be an IP address or a host name (letters, digits, '-', '_' and '.')")
        return v

    @field_validator("persist_dir")
    @classmethod
    def _store_dir(cls, v: pathlib.Path | None) -> pathlib.Path | None:
        # The workers make their folders under it once Ray has started: a path that cannot be a
        # folder is refused before anything starts, naming the setting.
        if v is None:
            return v
        if not str(v).strip():
            raise ValueError("must be the path of a folder, not blank")
        for part in (v, *v.parents):
            if part.exists():
                if not part.is_dir():
                    raise ValueError(f"must be a folder or a path where one can be made, but {str(part)!r} "
                                     f"is not a folder")
                break
        return v

    @field_validator("ray_address")
    @classmethod
    def _address(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("must be 'auto' or HOST:PORT, not blank")
        return v

    @model_validator(mode="after")
    def _budget_holds_a_body(self) -> ServiceSettings:
        if self.max_inflight_bytes < self.max_body_bytes:
            raise ValueError(f"--max-inflight-bytes (SPLITKEY_MAX_INFLIGHT_BYTES) must be at least --max-body-bytes "
                             f"(SPLITKEY_MAX_BODY_BYTES, {self.max_body_bytes}), got {self.max_inflight_bytes}")
        return self

    @model_validator(mode="after")
    def _ports_apart(self) -> ServiceSettings:
        # The HTTP socket is bound, not yet listening, while the others are tried (service.cli): the
        # same port would pass that try, and whichever listened first would take the other's requests.
        ports = [("--port (SPLITKEY_PORT)", self.host, self.port),
                 ("--grpc-port (SPLITKEY_GRPC_PORT)", self.host, self.grpc_port),
                 ("--metrics-port (SPLITKEY_METRICS_PORT)", self.metrics_host, self.metrics_port)]
        for i, (name, host, port) in enumerate(ports):
            for other, other_host, other_port in ports[:i]:
                if port and port == other_port and _may_overlap(host, other_host):
                    raise ValueError(f"{name} must differ from {other}, got {port} for both")
        return self

    def pace(self) -> Pace:
        """How fast a request body must arrive (service.wire.body.Pace)."""
        return Pace(timeout_s=self.body_timeout_s, min_rate=self.min_body_rate, grace_s=self.body_grace_s)

    def connection_limits(self, open_files: int) -> ConnectionLimits:
        """The connection limits, the unset ones sized from ``open_files`` (the process's limit)."""
        return ConnectionLimits.sized(self.max_connections, self.max_client_connections, open_files)

    def limits(self) -> Limits:
        """The request limits these settings imply (built once, when the app is)."""
        return Limits(max_body_bytes=self.max_body_bytes,
                      max_json_body_bytes=min(self.max_body_bytes, Limits().max_json_body_bytes),
                      max_replicas=self.max_replicas)

    def loopback(self) -> bool:
        """Whether ``host`` is a loopback address (only this machine can connect)."""
        if self.host in ("localhost", "ip6-localhost"):
            return True
        try:
            return ipaddress.ip_address(self.host.strip("[]")).is_loopback
        except ValueError:  # a host name: it may resolve to anything
            return False

    def check_exposure(self, insecure: bool) -> str | None:
        """Refuse a service reachable from other machines without a key; the warning to log, if any.

        Raises ValueError for a non-loopback ``host`` with no ``api_key_file`` unless ``insecure``.
        """
        if self.loopback() or self.api_key_file is not None:
            return None
        if not insecure:
            raise ValueError(f"host {self.host!r} is not loopback and no --api-key-file is set: anyone who reaches "
                             "the port could use the service; give --api-key-file, or --insecure to run it open")
        return (f"INSECURE: listening on {self.host} without an API key (--insecure): anyone who reaches port "
                f"{self.port} can use the service and read its contexts")

    def api_key(self) -> str | None:
        """The bearer token, read from ``api_key_file`` (stripped), or None."""
        if self.api_key_file is None:
            return None
        where = f"--api-key-file (SPLITKEY_API_KEY_FILE) {str(self.api_key_file)!r}"
        if not self.api_key_file.is_file():
            raise ValueError(f"{where} must be a readable file holding the token, got "
                             f"{'a directory' if self.api_key_file.is_dir() else 'no such file'}")
        info = self.api_key_file.stat()  # of the file a symlink names: the one read
        mode = info.st_mode
        if mode & stat.S_IROTH:
            raise ValueError(f"{where} must not be readable by every user, got mode {stat.S_IMODE(mode):04o}: "
                             "chmod 600 it")
        if mode & (stat.S_IWOTH | stat.S_IWGRP):
            raise ValueError(f"{where} must not be writable by other users (they could replace the key), got mode "
                             f"{stat.S_IMODE(mode):04o}: chmod 600 it")
        if mode & stat.S_IRGRP:
            if not self.api_key_group_readable:
                raise ValueError(f"{where} must not be readable by its group, got mode {stat.S_IMODE(mode):04o}: "
                                 "chmod 600 it (a Kubernetes Secret mounted with fsGroup is 0440: allow that with "
                                 "--api-key-group-readable true)")
            # Then only for a group this process is in (Kubernetes gives a secret the pod's fsGroup: 0440).
            if info.st_gid not in {os.getgid(), *os.getgroups()}:
                raise ValueError(f"{where} must not be readable by a group this process is not in, got mode "
                                 f"{stat.S_IMODE(mode):04o} and group {info.st_gid}: chmod 600 it")
        # Nor replaceable: in a directory every user may write to, anyone could put another key in its place
        # (unless the sticky bit keeps them to their own files, as in /tmp).
        folder = self.api_key_file.resolve().parent
        dir_mode = folder.stat().st_mode
        if dir_mode & stat.S_IWOTH and not dir_mode & stat.S_ISVTX:
            raise ValueError(f"{where} must be in a folder other users cannot write to (they could replace the key), "
                             f"got {str(folder)!r} with mode {stat.S_IMODE(dir_mode):04o}: chmod o-w it")
        key = self.api_key_file.read_text().strip()
        if not key:
            raise ValueError(f"{where} must hold a non-empty token, got an empty file")
        return key


#: The settings by topic, in the order ``splitkey serve --help`` and docs/API.md list them.
GROUPS: dict[str, tuple[str, ...]] = {
    "network and cluster": ("host", "port", "grpc_port", "ray_address", "ray_namespace", "api_key_file",
                            "api_key_group_readable"),
    "request bounds": ("max_body_bytes", "max_inflight", "max_inflight_bytes", "body_timeout_s", "min_body_rate",
                       "body_grace_s", "request_timeout_s", "retry_after_s", "max_connections",
                       "max_client_connections", "shutdown_grace_s"),
    "workers and kernels": ("workers", "device", "worker_cpus", "worker_memory_bytes", "worker_concurrency",
                            "worker_channel", "kernel_threads", "block_size", "batch_rows", "gpu_kernels", "cpu_kernels",
                            "heal_interval_s"),
    "sharding and merge": ("shards", "min_shard_keys", "merge_fanin", "remote_merge_bytes"),
    "resident contexts": ("context_shard_keys", "max_replicas", "write_timeout_s", "record_cache", "persist_dir",
                          "tombstone_horizon_s"),
    "operations": ("metrics_port", "metrics_host", "log_format", "log_level"),
}
