"""A fault soak (issue 50): a verifying workload on three Ray nodes while faults are injected at random.

Run from the repository root::

    .venv/bin/python benchmarks/chaos.py --duration 300 --seed 1 --out /tmp/chaos
    .venv/bin/python benchmarks/chaos.py --duration 60 --faults worker_kill,worker_pause

Three one-CPU Ray nodes on loopback (``ray.cluster_utils.Cluster``, Ray token auth on), three
shard workers with ``--persist-dir`` and two front ends joined to them (``--ray-address``). The
workload (:mod:`benchmarks.chaos_check` says why every answer can be checked):

* a writer per long-lived context (two with two replicas, one with one) appends chunks of
  ``CHUNK`` keys with ``after=`` the length it last saw, each outcome recorded (acknowledged,
  refused, unknown); after a refusal or no answer it reads the length back and goes on from it;
* readers query a random context, every answer kept for the checker;
* a churn thread creates a context, appends to it, reads it and deletes it, over and over.

Each request goes to one of the front ends at random. A scheduler injects a fault every
``--gap`` seconds (a random kind of ``--faults``): ``worker_kill`` (SIGKILL a shard worker),
``worker_pause`` (SIGSTOP, SIGCONT 3-12 s later), ``directory_kill`` (``ray.kill``, Ray restarts
it), ``frontend_term`` / ``frontend_kill`` (SIGTERM / SIGKILL a front end, then start it again),
``segment_corrupt`` (flip a byte of a stored segment of a context with two replicas, then SIGKILL
the worker that holds it, so that it reloads its folder; a context's only copy damaged is lost by
design, docs/RELIABILITY.md "A damaged store"), ``persist_full`` (fill the persist filesystem for 3-8 s; only where a
tmpfs can be mounted for it, i.e. as root: else left out and said so), ``node_pause`` (a stand-in
for a partition: SIGSTOP a non-head node's raylet and every process under it, SIGCONT 3-10 s
later). Then the faults stop, the service is given up to 120 s to recover, every context is read
a last time, and the history (``history.jsonl``) is checked. Exit status 1 on any violation.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]  # see benchmarks/service.py
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import common
from benchmarks.chaos_check import (
    CHUNK,
    availability,
    check,
    outside_faults,
    query,
    read_history,
    stream,
    write_history,
)
from service.wire.safetensors import decode_safetensors, encode_safetensors

NAMESPACE = "splitkey"
FAULTS = ("worker_kill", "worker_pause", "directory_kill", "frontend_term", "frontend_kill",
          "segment_corrupt", "persist_full", "node_pause")
#: Keys a context is created with.
FIRST = 8 * CHUNK
#: (replicas) of the long-lived contexts, one writer each.
LONG_LIVED = (2, 2, 1)
BINARY = "application/octet-stream"
#: Not stored: the request was refused before it was sent, or answered with an error.
REFUSED_TRANSPORT = (httpx.ConnectError,)


@dataclass(frozen=True)
class Options:
    duration_s: float = 300.0
    seed: int = 1
    out: Path = Path("chaos-out")
    faults: tuple[str, ...] = FAULTS
    gap_s: tuple[float, float] = (6.0, 12.0)
    readers: int = 2
    persist_mib: int = 256
    recover_s: float = 120.0
    check_only: bool = False  #: check the history in ``out`` instead of running a soak

    def __post_init__(self) -> None:
        if not self.duration_s > 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")
        unknown = set(self.faults) - set(FAULTS)
        if unknown:
            raise ValueError(f"faults must be among {', '.join(FAULTS)}, got {', '.join(sorted(unknown))}")
        if not 0 < self.gap_s[0] <= self.gap_s[1]:
            raise ValueError(f"gap_s must be 0 < low <= high, got {self.gap_s}")


class History:
    """The operations recorded so far (thread-safe), times in seconds since the soak began."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.ops: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def now(self) -> float:
        return round(time.monotonic() - self.start, 4)

    def add(self, op: dict[str, Any]) -> None:
        with self._lock:
            self.ops.append(op)


# -- the cluster ------------------------------------------------------------------------------

class FrontEnd:
    """One ``splitkey serve --ray-address`` in its own session; :meth:`start` again after a stop."""

    def __init__(self, name: str, workdir: Path, args: Sequence[str], env: dict[str, str]) -> None:
        self.name, self.workdir, self.args, self.env = name, workdir, list(args), env
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        self.starts = 0

    def start(self, startup_s: float = 180.0) -> None:
        self.starts += 1
        log = self.workdir / f"{self.name}-{self.starts}.log"
        home = self.workdir / f"home-{self.name}"
        home.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "service.cli", "serve", "--port", "0", *self.args]
        with log.open("w") as out:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env={**self.env, "HOME": str(home)}, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + startup_s
        while time.monotonic() < deadline:
            found = common.LISTENING.search(log.read_text())
            if found and common.http_status(f"http://127.0.0.1:{found.group(1)}/readyz") == 200:
                self.url = f"http://127.0.0.1:{found.group(1)}"
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{log.read_text()[-4000:]}")
            time.sleep(0.25)
        raise RuntimeError(f"{self.name} not ready in {startup_s} s:\n{log.read_text()[-4000:]}")

    def signal(self, signum: int) -> None:
        """``signum`` to the front end (SIGKILL: to its whole session); waits for it to exit."""
        proc, self.url = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            if signum == signal.SIGKILL:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.send_signal(signum)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            common.stop_group(proc)

    def stop(self) -> None:
        if self.proc is not None:
            common.stop_group(self.proc)
            self.url = None


@contextlib.contextmanager
def tmpfs(path: Path, mib: int) -> Iterator[bool]:
    """A tmpfs of ``mib`` MiB mounted on ``path`` while inside (True), or nothing (False) where mount is refused."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(path)],
                             check=False, capture_output=True).returncode == 0
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


@contextlib.contextmanager
def three_nodes() -> Iterator[Any]:
    """Three one-CPU Ray nodes on loopback, this process connected to them; yields the Cluster."""
    import ray
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "node_ip_address": "127.0.0.1",
                                                                "include_dashboard": False})
    try:
        for _ in range(2):
            c.add_node(num_cpus=1, node_ip_address="127.0.0.1")
        c.wait_for_nodes()
        ray.init(address=c.address, namespace=NAMESPACE, log_to_driver=False)
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


# -- the workload -----------------------------------------------------------------------------

class Service:
    """The front ends' URLs as they are now (a stopped one has none), and requests to a random one."""

    def __init__(self, front_ends: Sequence[FrontEnd], rng: random.Random) -> None:
        self.front_ends = front_ends
        self.rng = rng
        self._lock = threading.Lock()

    def url(self) -> str | None:
        with self._lock:
            urls = [fe.url for fe in self.front_ends if fe.url]
            return self.rng.choice(urls) if urls else None

    def call(self, method: str, path: str, *, params: dict[str, Any] | None = None,
             tensors: dict[str, np.ndarray] | None = None, timeout: float = 60.0) -> tuple[str, Any]:
        """``(outcome, answer)``: ``ok`` and the answer (JSON, or tensors for a query), ``refused`` and the
        error (an error status, or no front end to send to), ``unknown`` and the error (no answer)."""
        url = self.url()
        if url is None:
            return "refused", "no front end up"
        body = None if tensors is None else b"".join(bytes(b) for b in encode_safetensors(tensors))
        headers = {"Content-Type": BINARY, "Accept": BINARY + ", application/json"} if body is not None else {}
        try:
            resp = httpx.request(method, url + path, params=params, content=body, headers=headers, timeout=timeout)
        except REFUSED_TRANSPORT as exc:
            return "refused", type(exc).__name__
        except httpx.HTTPError as exc:
            return "unknown", type(exc).__name__
        if resp.status_code >= 500 and resp.status_code not in (503, 507):  # 507: not stored (a full disk too)
            return "unknown", f"{resp.status_code} {resp.text[:200]}"  # 500, 504: perhaps stored
        if resp.status_code >= 400:
            return "refused", f"{resp.status_code} {_code(resp)}"
        if resp.headers.get("content-type", "").startswith(BINARY):
            return "ok", decode_safetensors(resp.content, {"out", "lse"})
        return "ok", resp.json()


def _code(resp: httpx.Response) -> str:
    with contextlib.suppress(ValueError, AttributeError):
        return str(resp.json().get("code", ""))
    return ""


@dataclass
class Context:
    ctx: int  #: its number in the history (its stream)
    replicas: int
    id: str | None = None
    length: int = 0  #: as its writer last saw it
    reads: int = 0
    deleted: bool = False


@dataclass
class Workload:
    service: Service
    history: History
    seed: int
    stop: threading.Event = field(default_factory=threading.Event)
    contexts: list[Context] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def new_context(self, replicas: int) -> Context:
        with self._lock:
            c = Context(len(self.contexts), replicas)
            self.contexts.append(c)
        return c

    def replicated(self) -> set[str]:
        with self._lock:
            return {c.id for c in self.contexts if c.id is not None and c.replicas >= 2 and not c.deleted}

    def create(self, c: Context) -> bool:
        k, v = stream(self.seed, c.ctx, FIRST)
        t0 = self.history.now()
        outcome, answer = self.service.call("POST", "/v1/contexts", params={"replicas": c.replicas},
                                            tensors={"k": k, "v": v})
        op = {"op": "create", "ctx": c.ctx, "after": 0, "n": FIRST, "t0": t0, "t1": self.history.now(),
              "outcome": outcome, "replicas": c.replicas}
        if outcome == "ok":
            c.id, c.length = answer["id"], FIRST
            op["id"] = c.id
        else:
            op["error"] = answer
        self.history.add(op)
        return outcome == "ok"

    def append(self, c: Context, writer: bool) -> None:
        after = c.length
        k, v = stream(self.seed, c.ctx, after + CHUNK)
        t0 = self.history.now()
        outcome, answer = self.service.call("POST", f"/v1/contexts/{c.id}/append", params={"after": after},
                                            tensors={"k": k[after:], "v": v[after:]})
        op = {"op": "append", "ctx": c.ctx, "after": after, "n": CHUNK, "t0": t0, "t1": self.history.now(),
              "outcome": outcome, "writer": writer}
        if outcome == "ok":
            c.length = int(answer["length"])
            op["length"] = c.length
        else:
            op["error"] = answer
            self.reread(c)
        self.history.add(op)

    def reread(self, c: Context) -> None:
        """The context's length read back (after a refusal or no answer), until it answers or the soak ends."""
        while not self.stop.is_set():
            outcome, answer = self.service.call("GET", f"/v1/contexts/{c.id}", timeout=15)
            if outcome == "ok":
                c.length = int(answer["length"])
                return
            time.sleep(0.5)

    def read(self, c: Context, op_name: str = "read") -> dict[str, Any]:
        with self._lock:
            serial = c.reads
            c.reads += 1
        t0 = self.history.now()
        outcome, answer = self.service.call("POST", "/v1/attention", params={"contexts": c.id, "causal": "false"},
                                            tensors={"q": query(self.seed, c.ctx, serial)}, timeout=60)
        op = {"op": op_name, "ctx": c.ctx, "q": serial, "t0": t0, "t1": self.history.now(), "outcome": outcome}
        if outcome == "ok":
            op["out"], op["lse"] = np.asarray(answer["out"]).tolist(), np.asarray(answer["lse"]).tolist()
        else:
            op["error"] = answer
        return op

    def delete(self, c: Context) -> None:
        t0 = self.history.now()
        outcome, answer = self.service.call("DELETE", f"/v1/contexts/{c.id}")
        self.history.add({"op": "delete", "ctx": c.ctx, "t0": t0, "t1": self.history.now(), "outcome": outcome,
                          **({} if outcome == "ok" else {"error": answer})})
        c.deleted = c.deleted or outcome == "ok"

    def writer(self, c: Context, pause_s: float = 0.1) -> None:
        while not self.stop.is_set():
            self.append(c, writer=True)
            self.stop.wait(pause_s)

    def reader(self, rng: random.Random, pause_s: float = 0.05) -> None:
        while not self.stop.is_set():
            with self._lock:
                live = [c for c in self.contexts if c.id is not None and not c.deleted]
            if live:
                self.history.add(self.read(rng.choice(live)))
            self.stop.wait(pause_s)

    def churn(self, rng: random.Random, pause_s: float = 1.0) -> None:
        """Create, append to, read and delete a context, over and over (a delete refused is tried again)."""
        while not self.stop.is_set():
            c = self.new_context(rng.choice((1, 2)))
            if self.create(c):
                for _ in range(rng.randint(1, 4)):
                    self.append(c, writer=False)
                    self.history.add(self.read(c))
                while not c.deleted and not self.stop.is_set():
                    self.delete(c)
            self.stop.wait(pause_s)

    def readable(self, c: Context) -> tuple[bool, dict[str, Any]]:
        """One look at ``c`` after the faults: its record, then a read; (answered, the op to record)."""
        t0 = self.history.now()
        outcome, answer = self.service.call("GET", f"/v1/contexts/{c.id}", timeout=30)
        if outcome != "ok":
            return False, {"op": "final", "ctx": c.ctx, "t0": t0, "t1": self.history.now(), "outcome": outcome,
                           "error": answer}
        op = self.read(c, "final")
        op["length"] = int(answer["length"])
        return op["outcome"] == "ok", op

    def final(self, within_s: float) -> None:
        """Each context's length and one read, once the faults have stopped and the service recovered.

        A context that does not answer is looked at again each second for up to ``within_s`` in all (a
        holder killed by the last fault may be found dead only now, and reloaded after); each look
        that failed is kept as a ``final_retry`` (the checker reads only the last, as ``final``)."""
        deadline = time.monotonic() + within_s
        for c in self.contexts:
            if c.id is None:
                continue
            answered, op = self.readable(c)
            while not answered and not c.deleted and time.monotonic() < deadline:
                self.history.add({**op, "op": "final_retry"})
                time.sleep(1)
                answered, op = self.readable(c)
            self.history.add(op)


# -- faults -----------------------------------------------------------------------------------

def worker_pids() -> list[int]:
    """The shard workers' processes (ShardWorker actors) among this process's descendants."""
    found = []
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "ShardWorker" in " ".join(p.cmdline()):
                found.append(p.pid)
    return found


def worker_pid(name: str) -> int | None:
    """The process of the shard worker ``name`` (its ping), None if it does not answer in 5 s."""
    import ray

    try:
        return int(ray.get(ray.get_actor(name, namespace=NAMESPACE).ping.remote(), timeout=5)["pid"])
    except Exception:  # noqa: BLE001 - dead, paused, being replaced: no target this time
        return None


def signal_all(pids: Sequence[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


@dataclass
class Injector:
    """The faults: each returns a description of its target, after the fault is over (a pause resumed)."""

    cluster: Any
    front_ends: Sequence[FrontEnd]
    persist: Path
    rng: random.Random
    stop: threading.Event
    replicated: Callable[[], set[str]]  #: ids of the contexts with two replicas or more, now

    def worker_kill(self) -> str:
        pids = worker_pids()
        pid = self.rng.choice(pids)
        signal_all([pid], signal.SIGKILL)
        return f"pid {pid}"

    def worker_pause(self) -> str:
        pid = self.rng.choice(worker_pids())
        return self._paused([pid], self.rng.uniform(3, 12), f"pid {pid}")

    def directory_kill(self) -> str:
        import ray

        ray.kill(ray.get_actor("splitkey-directory", namespace=NAMESPACE), no_restart=False)
        return "splitkey-directory"

    def frontend_term(self) -> str:
        return self._restart(signal.SIGTERM)

    def frontend_kill(self) -> str:
        return self._restart(signal.SIGKILL)

    def segment_corrupt(self) -> str:
        ids = self.replicated()  # one replica damaged: the other must serve (one replica: lost, by design)
        segments = sorted(s for s in self.persist.glob("*/*/*/*.safetensors") if s.parts[-3] in ids)
        if not segments:
            return "no segment of a replicated context stored"
        seg = self.rng.choice(segments)
        data = bytearray(seg.read_bytes())
        at = self.rng.randrange(len(data) // 2, len(data))  # past the header: in the tensors
        data[at] ^= 0xFF
        seg.write_bytes(bytes(data))
        worker = seg.relative_to(self.persist).parts[0]
        pid = worker_pid(worker)
        if pid is not None:
            signal_all([pid], signal.SIGKILL)
        return f"{seg.relative_to(self.persist)} byte {at}, {worker} pid {pid} killed"

    def persist_full(self) -> str:
        filler = self.persist / ".chaos-filler"
        with filler.open("wb") as f, contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        try:
            self.stop.wait(self.rng.uniform(3, 8))
        finally:
            filler.unlink()
        return "filled"

    def node_pause(self) -> str:
        node = self.rng.choice(list(self.cluster.worker_nodes))
        raylet = node.all_processes["raylet"][0].process.pid
        pids = [raylet, *(p.pid for p in psutil.Process(raylet).children(recursive=True))]
        return self._paused(pids, self.rng.uniform(3, 10), f"node raylet {raylet} and {len(pids) - 1} under it")

    def _paused(self, pids: Sequence[int], seconds: float, target: str) -> str:
        signal_all(pids, signal.SIGSTOP)
        try:
            self.stop.wait(seconds)
        finally:
            signal_all(pids, signal.SIGCONT)
        return f"{target} for {seconds:.1f} s"

    def _restart(self, signum: int) -> str:
        fe = self.rng.choice(self.front_ends)
        fe.signal(signum)
        fe.start()
        return fe.name


def inject(injector: Injector, kinds: Sequence[str], gap_s: tuple[float, float], history: History,
           stop: threading.Event, rng: random.Random) -> None:
    while not stop.wait(rng.uniform(*gap_s)):
        kind = rng.choice(kinds)
        t0 = history.now()
        try:
            target = getattr(injector, kind)()
        except Exception as exc:  # noqa: BLE001 - a fault that could not be injected is recorded as such
            target = f"not injected: {type(exc).__name__}: {exc}"
        history.add({"op": "fault", "kind": kind, "t0": t0, "t1": history.now(), "target": target})


# -- the run ----------------------------------------------------------------------------------

def recovered(service: Service, work: Workload, within_s: float) -> float | None:
    """Seconds until every front end answers /readyz 200 and every context left is ``ready`` and answers
    a read (recorded, and checked as any other); None if not within ``within_s``."""
    start = time.monotonic()
    while time.monotonic() - start < within_s:
        urls = [fe.url for fe in service.front_ends]
        ready = all(u and common.http_status(u + "/readyz", timeout=10) == 200 for u in urls)
        live = [c for c in work.contexts if c.id is not None and not c.deleted]
        states = [service.call("GET", f"/v1/contexts/{c.id}", timeout=15) for c in live]
        if ready and all(o == "ok" and a.get("state") == "ready" for o, a in states):
            reads = [work.read(c) for c in live]
            for op in reads:
                work.history.add(op)
            if all(op["outcome"] == "ok" for op in reads):
                return time.monotonic() - start
        time.sleep(1)
    return None


def soak(opts: Options) -> dict[str, Any]:
    """Run the soak; the summary (also written to ``out/summary.json``), the history in ``out/history.jsonl``."""
    opts.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback stays loopback (tests/conftest.py)
    rng = random.Random(opts.seed)
    persist = opts.out / "persist"
    with tmpfs(persist, opts.persist_mib) as mounted, three_nodes() as cluster:
        kinds = [k for k in opts.faults if mounted or k != "persist_full"]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "SPLITKEY_HEAL_INTERVAL_S": "0.5",
               "SPLITKEY_CONTEXT_SHARD_KEYS": "256"}
        args = ("--ray-address", cluster.address, "--workers", "3", "--persist-dir", str(persist))
        front_ends = [FrontEnd(f"fe{i}", opts.out, args, env) for i in range(2)]
        try:
            for fe in front_ends:
                fe.start()
            return _run(opts, cluster, front_ends, persist, kinds, mounted, rng)
        finally:
            for fe in front_ends:
                fe.stop()


def _run(opts: Options, cluster: Any, front_ends: Sequence[FrontEnd], persist: Path, kinds: Sequence[str],
         mounted: bool, rng: random.Random) -> dict[str, Any]:
    history = History()
    service = Service(front_ends, random.Random(rng.random()))
    work = Workload(service, history, opts.seed)
    long_lived = [work.new_context(r) for r in LONG_LIVED]
    for c in long_lived:
        if not work.create(c):
            raise RuntimeError(f"the context of {c.replicas} replicas could not be created: {history.ops[-1]}")
    faults_stop = threading.Event()
    injector = Injector(cluster, front_ends, persist, random.Random(rng.random()), faults_stop, work.replicated)
    threads = [threading.Thread(target=work.writer, args=(c,)) for c in long_lived]
    threads += [threading.Thread(target=work.reader, args=(random.Random(rng.random()),)) for _ in range(opts.readers)]
    threads.append(threading.Thread(target=work.churn, args=(random.Random(rng.random()),)))
    scheduler = threading.Thread(target=inject, args=(injector, kinds, opts.gap_s, history, faults_stop,
                                                      random.Random(rng.random())))
    for t in [*threads, scheduler]:
        t.start()
    time.sleep(opts.duration_s)
    faults_stop.set()
    scheduler.join()
    for fe in front_ends:  # a front end stopped at the very end is started again
        if fe.url is None:
            fe.start()
    work.stop.set()
    for t in threads:
        t.join()
    recovery = recovered(service, work, opts.recover_s)
    work.final(opts.recover_s if recovery is None else opts.recover_s - recovery)
    write_history(opts.out / "history.jsonl", history.ops)
    return summarize(opts, read_history(opts.out / "history.jsonl"), kinds, mounted, recovery)


def summarize(opts: Options, ops: list[dict[str, Any]], kinds: Sequence[str], mounted: bool,
              recovery: float | None) -> dict[str, Any]:
    report = check(ops, opts.seed)
    figures = availability(ops)
    outside = outside_faults(ops)
    summary = {
        "seed": opts.seed, "duration_s": opts.duration_s, "faults_included": list(kinds),
        "not_injected": [] if mounted else ["persist_full (no tmpfs could be mounted: not root)"],
        "cpu": common.cpu_model(), "cores": os.cpu_count(),
        "operations": len(ops), "reads_checked": report.reads_checked,
        "appends_acknowledged": report.appends_acknowledged, "finals_checked": report.finals_checked,
        "unavailable_at_end": report.unavailable_at_end, "recovered_after_faults_s": recovery,
        "final_retries": [{"ctx": op["ctx"], "t0": op["t0"], "error": op.get("error")} for op in ops
                          if op["op"] == "final_retry"][:20],
        "unavailable_errors": [{"ctx": op["ctx"], "error": op.get("error")} for op in ops
                               if op["op"] == "final" and op["ctx"] in report.unavailable_at_end],
        "violations": {rule: report.count(rule) for rule in ("stale_read", "lost_ack", "unsent", "wrong",
                                                                       "resurrected")},
        "violation_examples": [{"rule": v.rule, "ctx": v.ctx, "detail": v.detail, "op": v.op}
                               for v in report.violations[:10]],
        "not_injected_errors": [op for op in ops if op["op"] == "fault" and op["target"].startswith("not injected")],
        "replicated_outside_faults": {"grace_s": outside.grace_s, "requests": outside.requests,
                                      "answered": outside.answered, "share": round(outside.share, 5),
                                      "errors": dict(outside.errors.most_common(5))},
        "per_fault": {kind: {"injected": f.injected, "requests": f.requests, "answered": f.answered,
                             "availability": round(f.availability, 4),
                             "recovery_s_median": round(float(np.median(f.recovery_s)), 2) if f.recovery_s else None,
                             "recovery_s_max": round(max(f.recovery_s), 2) if f.recovery_s else None,
                             "unrecovered_before_next": f.unrecovered, "errors": dict(f.errors.most_common(5))}
                      for kind, f in figures.items()},
    }
    with (opts.out / "summary.json").open("w") as f:
        json.dump(summary, f, indent=2)
    return summary


def table(summary: dict[str, Any]) -> str:
    rows = [[kind, f["injected"], f["requests"], f"{100 * f['availability']:.1f}%",
             "-" if f["recovery_s_median"] is None else f"{f['recovery_s_median']} / {f['recovery_s_max']}",
             f["unrecovered_before_next"]] for kind, f in summary["per_fault"].items()]
    out = summary["replicated_outside_faults"]
    return common.markdown_table(["fault", "injected", "requests", "answered", "recovery s (median / max)",
                                  "not recovered before the next"], rows) + (
        f"\n\nreplicated contexts, outside each fault and the {out['grace_s']:g} s after it: "
        f"{out['answered']} of {out['requests']} answered ({100 * out['share']:.2f}%)")


def parse(argv: Sequence[str] | None = None) -> Options:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of faults (default 300)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None, help="folder for history.jsonl, summary.json, logs")
    ap.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, of {', '.join(FAULTS)}")
    ap.add_argument("--gap", default="6,12", help="seconds between faults: LOW,HIGH (default 6,12)")
    ap.add_argument("--check", action="store_true",
                    help="no soak: check the history.jsonl already in --out (with the same --seed) and write its "
                         "summary.json (a run whose checker was cut short; the recovery time is not in a history)")
    a = ap.parse_args(argv)
    low, high = (float(x) for x in a.gap.split(","))
    out = a.out if a.out is not None else Path(tempfile.mkdtemp(prefix="chaos-"))
    return Options(duration_s=a.duration, seed=a.seed, out=out, faults=tuple(re.split(r"\s*,\s*", a.faults)),
                   gap_s=(low, high), check_only=a.check)


def main(argv: Sequence[str] | None = None) -> int:
    common.raise_on_sigterm()
    opts = parse(argv)
    if opts.check_only:
        ops = read_history(opts.out / "history.jsonl")
        kinds = sorted({op["kind"] for op in ops if op["op"] == "fault"})
        summary = summarize(opts, ops, kinds, mounted=True, recovery=None)
    else:
        summary = soak(opts)
    print(json.dumps({k: v for k, v in summary.items() if k != "per_fault"}, indent=2))
    print(table(summary))
    print(f"history: {opts.out / 'history.jsonl'}")
    return 0 if not any(summary["violations"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
