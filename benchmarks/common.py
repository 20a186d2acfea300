"""Helpers shared by the benchmark scripts ``kernel.py``, ``service.py`` and ``contexts.py``, each defined once.

* arguments: :func:`parse_keys` (``"64K,1M"``), :func:`positive`;
* sizes and numbers: ``KIB``/``MIB``/``GIB``, :func:`size_label`, :func:`bytes_label`,
  :class:`Summary` and :func:`summarize`, :func:`ms`, :func:`ms_spread`,
  :func:`overhead`, :func:`met`;
* the report: :func:`markdown_table`, :func:`machine_lines` (with :func:`cpu_model`,
  :func:`meminfo`, :func:`load_average`), :func:`emit_report`; raw results: :func:`jsonable`, :func:`write_json`; generated blocks of documents
  between markers: :func:`marker`, :func:`replace_marked`;
* Server-Timing stages: ``STAGES``, :class:`Record`, :func:`median_stages`, :func:`stage_cells`;
* in-process runs: :func:`blas_threads`, :func:`time_calls`, :func:`max_diff`, :func:`check_same`;
  :func:`aliased`, an array whose memory repeats so that a kernel streams it from cache
  (with :func:`l2_bytes`);
* waiting until the shared machine is quiet: :func:`wait_for_quiet` (with
  :func:`others_running`, :func:`cpu_times`, :func:`busy_fraction`, :func:`cpu_busy`); what
  other processes took meanwhile: :func:`cpu_sample`, :func:`others_cores` (with
  :func:`process_tree_cpu_s`);
* server processes: :func:`free_port`, :func:`http_status`, :func:`served`,
  :func:`stop_group`, :func:`splitkey_server`, :func:`raise_on_sigterm`.

The scripts import it as ``benchmarks.common`` once they have put the repository
root on ``sys.path``. It imports only the standard library and numpy, nothing of
the repository: ``kernel.py`` runs with ``benchmarks/`` first on ``sys.path``,
where ``benchmarks/service.py`` would shadow the ``service`` package.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import json
import mmap
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
KIB, MIB, GIB = 2**10, 2**20, 2**30
#: Server-Timing stages of the service, in the order of a request.
#: The line `splitkey serve` logs with the HTTP port it bound (service/cli.py).
LISTENING = re.compile(r"splitkey starting on http://\S+:(\d+)")
STAGES = ("parse", "lookup", "scatter", "compute", "merge", "encode", "total")
#: The benchmark the service benchmarks wait for: it loads every core.
QUIET_PATTERN = "benchmarks/kernel.py"


# ------------------------------------------------------------------ arguments


def parse_keys(text: str) -> list[int]:
    """``"64K,256K,1M"`` (or plain integers) to key counts."""
    sizes = []
    for part in text.split(","):
        part = part.strip().upper()
        scale = {"K": KIB, "M": MIB}.get(part[-1:], 1)
        digits = part[:-1] if scale > 1 else part
        if not digits.isdigit() or int(digits) < 1:
            raise argparse.ArgumentTypeError(f"sizes must be positive key counts like 64K or 1M, got {part!r}")
        sizes.append(int(digits) * scale)
    return sizes


def positive(text: str) -> int:
    """An argument that must be an int >= 1."""
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text}")
    return n


def count(text: str) -> int:
    """An argument that must be an int >= 0."""
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be an int >= 0, got {text}")
    return n


# ------------------------------------------------------------------ sizes, statistics and formatting


def size_label(n: int) -> str:
    """1024 -> "1K", 2**20 -> "1M", 3000 -> "3000"."""
    if n >= MIB and n % MIB == 0:
        return f"{n // MIB}M"
    if n >= KIB and n % KIB == 0:
        return f"{n // KIB}K"
    return str(n)


def bytes_label(n: float) -> str:
    """Bytes in GiB, MiB or KiB, whichever reads best."""
    for unit, name in ((GIB, "GiB"), (MIB, "MiB"), (KIB, "KiB")):
        if n >= unit:
            return f"{n / unit:.4g} {name}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class Summary:
    """Percentiles and range of a list of seconds."""

    n: int
    p50: float
    p90: float
    lo: float
    hi: float


def summarize(seconds: Sequence[float]) -> Summary:
    """p50, p90, min and max of ``seconds``; NaN everywhere (n = 0) for an empty list."""
    if not seconds:
        nan = float("nan")
        return Summary(0, nan, nan, nan, nan)
    a = np.asarray(seconds, dtype=np.float64)
    return Summary(len(a), float(np.percentile(a, 50)), float(np.percentile(a, 90)), float(a.min()), float(a.max()))


def ms(seconds: float) -> str:
    """Seconds as milliseconds with 3 significant digits (at least one decimal below 100)."""
    if np.isnan(seconds):
        return "-"
    v = seconds * 1000
    return f"{v:.2f}" if v < 10 else f"{v:.1f}" if v < 100 else f"{v:.0f}"


def ms_spread(s: Summary) -> str:
    """``"p50 (min-max)"`` in milliseconds."""
    return "-" if s.n == 0 else f"{ms(s.p50)} ({ms(s.lo)}-{ms(s.hi)})"


def overhead(service_s: float, inprocess_s: float) -> tuple[float, float]:
    """``(ratio, difference in seconds)`` of the service's time over the in-process one."""
    return service_s / inprocess_s, service_s - inprocess_s


def met(ok: bool) -> str:
    """A target's cell: "met" or "missed"."""
    return "met" if ok else "missed"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table; every row must have one cell per header."""
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"rows must have {len(headers)} cells as the headers, got {len(row)}: {row!r}")
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def marker(name: str, end: bool = False) -> str:
    """The HTML comment that opens (or closes) the generated block ``name`` of a document."""
    return f"<!-- {name}:{'end' if end else 'begin'} -->"


def replace_marked(text: str, name: str, body: str) -> str:
    """``text`` with what lies between the markers of block ``name`` replaced by ``body``.

    The markers stay, so the next run finds them; everything outside them is kept as it is.
    Raises ValueError when the block's markers are missing, repeated or out of order.
    """
    begin, end = marker(name), marker(name, end=True)
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise ValueError(f"the document must hold {begin} once, then {end} once")
    head, rest = text.split(begin)
    _, tail = rest.split(end)
    return f"{head}{begin}\n{body.strip()}\n{end}{tail}"


def jsonable(obj: Any) -> Any:
    """Dataclasses (their fields), dicts, lists and numbers as JSON values; numpy scalars as
    numbers; numpy arrays (answers kept for checks) as None: raw timings, not data."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return None
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def write_json(path: str | Path, data: Any) -> None:
    """``data`` (through :func:`jsonable`) as indented JSON at ``path``, parent folders created."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(jsonable(data), indent=1))


def emit_report(text: str, out: str | None) -> None:
    """Print the report, and also write it to ``out`` (parent folders created) when given."""
    print(text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)


# ------------------------------------------------------------------ Server-Timing stages


@dataclass
class Record:
    """One request: client-side seconds and the server's stages (seconds)."""

    seconds: float
    stages: dict[str, float] = field(default_factory=dict)


def median_stages(records: Sequence[dict[str, float]]) -> dict[str, float]:
    """Median of each stage over the records that have it."""
    names = {n for r in records for n in r}
    return {n: statistics.median(r[n] for r in records if n in r) for n in names}


def critical_seconds(shard_s: Sequence[float], workers: Sequence[str]) -> float:
    """The busiest worker's summed compute seconds (a worker runs its shards one after the other)."""
    per_worker: dict[str, float] = {}
    for w, s in zip(workers, shard_s):
        per_worker[w] = per_worker.get(w, 0.0) + s
    return max(per_worker.values())


def model_stages(requests: Sequence[tuple[float, dict[str, float]]], directory_s: Sequence[float],
                 probe_wall_s: Sequence[float], probe_shard_s: Sequence[Sequence[float]],
                 probe_workers: Sequence[str], rounds: Sequence[float] = ()) -> dict[str, float]:
    """One cell's stages as the cost model (benchmarks/model.py) names them, in seconds (medians).

    ``requests``: ``(client seconds, Server-Timing stages)``; the probes: directory lookups,
    and rounds of every shard's compute called at once (wall seconds, each shard's reported
    compute seconds, its worker). Server-Timing does not split two of the model's stages, so:

    * directory = Server-Timing ``lookup`` (the record from the front end's cache or the
      directory actor), measured by the server; for results from before that stage existed
      (scatter then included the lookup), the probe lookups' median, and scatter minus that;
    * state return = the probes' wall minus their busiest worker's compute (dispatch, queueing,
      the states' way back: both measured in the same call, never negative);
      compute = Server-Timing compute minus that state return;
    * front end = client seconds minus scatter, compute and merge (parse, encode, HTTP, client);
    * total = the median of ``rounds`` (each round's median client seconds), else of every request.
      ``critical`` is the probes' own busiest-worker compute.
    """
    nan = float("nan")
    st = median_stages([stages for _, stages in requests]) if requests else {}
    front = [sec - sum(stages.get(x, 0.0) for x in ("lookup", "scatter", "compute", "merge")) for sec, stages in requests]
    if "lookup" in st:
        directory, scatter = st["lookup"], st.get("scatter", nan)
    else:
        directory = statistics.median(directory_s) if directory_s else nan
        scatter = st.get("scatter", nan) - directory
    critical = [critical_seconds(s, probe_workers) for s in probe_shard_s]
    back = statistics.median(max(0.0, w - c) for w, c in zip(probe_wall_s, critical)) if critical else nan
    return {"frontend": statistics.median(front) if front else nan, "directory": directory,
            "scatter": scatter, "compute": st.get("compute", nan) - back,
            "state_return": back, "merge": st.get("merge", nan),
            "total": statistics.median(rounds or [sec for sec, _ in requests]) if requests else nan,
            "critical": statistics.median(critical) if critical else nan}


def stage_cells(stages: dict[str, float]) -> list[str]:
    """One cell per stage of STAGES, in milliseconds (a dash when absent)."""
    return [ms(stages[s]) if s in stages else "-" for s in STAGES]


# ------------------------------------------------------------------ in-process runs


def blas_threads(n: int) -> contextlib.AbstractContextManager:
    """Limit BLAS to ``n`` threads (threadpoolctl, in the ``bench`` and ``test`` extras).

    Without threadpoolctl BLAS would keep its default thread count (every core) while the
    report says ``n``: a "one-thread" sgemm measured twice its rate on 2 cores
    (benchmarks/results/2026-12-07/NOTES.md, "Sixteen lanes"). So it refuses instead.
    """
    try:
        from threadpoolctl import threadpool_limits
    except ImportError as exc:
        raise RuntimeError("benchmarks set BLAS thread counts with threadpoolctl, which is not installed: "
                           "pip install -e '.[bench]'") from exc
    return threadpool_limits(limits=n, user_api="blas")


def time_calls(fn: Callable[[], Any], repeat: int) -> tuple[list[float], Any]:
    """One warm-up call, then ``repeat`` timed calls; the timings and the last result."""
    result = fn()
    seconds = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        seconds.append(time.perf_counter() - t0)
    return seconds, result


def max_diff(a: np.ndarray, b: np.ndarray) -> float:
    """Largest |a - b|, computed in float64."""
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))


def check_same(name: str, got: np.ndarray, want: np.ndarray) -> float:
    """Largest |got - want|; raises when the service answered something else."""
    diff = max_diff(got, want)
    if not diff <= 1e-3 * max(1.0, float(np.max(np.abs(want)))):
        raise RuntimeError(f"{name}: the service's out differs from the in-process one by {diff:.3g}")
    return diff


# ------------------------------------------------------------------ the machine


#: /proc/cpuinfo flags that decide the kernels' rates: vector width, fused multiply-add, F16C, and the
#: 16-bit arithmetic a host may offer beyond them (AVX-512 BF16 and FP16 instructions, AMX tiles).
CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")


def describe_cpu(cpuinfo: str) -> str:
    """The first processor of a /proc/cpuinfo text: its model name, and where given its family,
    model and the :data:`CPU_FLAGS` it has, e.g. ``"AMD EPYC (family 23, model 1; avx2 fma f16c)"``.

    A VM often names its CPU only as "AMD EPYC": the family and model tell the
    micro-architecture apart (AMD family 23 is Zen 1/2, 25 is Zen 3/4), which decides how
    many multiply-adds a core issues per cycle, so that runs on different hosts are not
    compared as if they were one machine.
    """
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor's block only
            continue
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name", "unknown")
    detail = [f"{label} {fields[key]}" for label, key in (("family", "cpu family"), ("model", "model"))
              if key in fields]
    flags = set(fields.get("flags", "").split())
    have = " ".join(f for f in CPU_FLAGS if f in flags)
    extra = ", ".join(detail) + (f"; {have}" if have else "")
    return f"{name} ({extra})" if extra else name


def cpu_model() -> str:
    """:func:`describe_cpu` of this machine's /proc/cpuinfo (``platform.processor()`` where there is none)."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        return describe_cpu(f.read())
    return platform.processor() or "unknown"


def l2_bytes(default: int = 1 * MIB) -> int:
    """The first CPU's level-2 cache in bytes (sysfs), ``default`` where it is not given."""
    with contextlib.suppress(OSError, ValueError):
        for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
            if (index / "level").read_text().strip() == "2":
                size = (index / "size").read_text().strip().upper()  # e.g. "2048K"
                unit = {"K": KIB, "M": MIB}.get(size[-1], 1)
                return int(size.rstrip("KM")) * unit
    return default


def aliased(shape: tuple[int, ...], dtype: Any, period_bytes: int, seed: int) -> np.ndarray:
    """An array of ``shape`` whose memory repeats every ``period_bytes`` (rounded up to an odd
    number of pages), filled with normal draws: the same physical pages mapped again and again.

    A kernel that streams the whole array then reads data that stays in cache, at the
    array's own size, strides and key count: its rate is what the kernel's arithmetic
    allows, not what memory delivers (kernel.py's in-cache roof). The page count is odd so
    that rows whose length is a power of two pages start at different offsets of the
    period, and a block of every row is a different part of it. Linux only
    (``memfd_create``); the mappings go back to the system with the array.
    """
    dt = np.dtype(dtype)
    page = mmap.PAGESIZE
    pages = max(1, -(-period_bytes // page)) | 1
    period = pages * page
    count = int(np.prod(shape, dtype=np.int64))
    size = -(-max(count, 1) * dt.itemsize // period) * period
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    fd = os.memfd_create("splitkey-in-cache")
    try:
        os.ftruncate(fd, period)
        # Reserve the whole range (PROT_NONE: 0), then lay the period over it again and again (MAP_FIXED: 0x10).
        base = libc.mmap(None, size, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        if base is None or base == ctypes.c_void_p(-1).value:
            raise OSError(ctypes.get_errno(), f"mmap of {size} bytes failed")
        for off in range(0, size, period):
            got = libc.mmap(base + off, period, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | 0x10, fd, 0)
            if got != base + off:
                libc.munmap(base, size)
                raise OSError(ctypes.get_errno(), f"mapping the period at offset {off} failed")
    finally:
        os.close(fd)  # the mappings hold the memory
    first = np.frombuffer((ctypes.c_char * period).from_address(base), dtype=dt)  # [period / itemsize]
    first[:] = np.random.default_rng(seed).standard_normal(first.size, dtype=np.float32).astype(dt)
    buffer = (ctypes.c_char * size).from_address(base)
    # Every view of the array keeps ``buffer`` alive (numpy's base chain): unmapped when the last one goes.
    weakref.finalize(buffer, libc.munmap, base, size)
    return np.frombuffer(buffer, dtype=dt, count=count).reshape(shape)


def meminfo(field_name: str) -> int | None:
    """A /proc/meminfo field in bytes (e.g. "MemAvailable"), or None."""
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    return None


def load_average() -> str:
    """The 1, 5 and 15 minute load averages."""
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f}, {five:.2f}, {fifteen:.2f}"


def machine_lines() -> list[str]:
    """The report's line on the CPU, memory, Python and numpy."""
    total = meminfo("MemTotal")
    return [(f"- CPU: {cpu_model()}, {os.cpu_count()} cores; memory {bytes_label(total or 0)}; "
             f"Python {platform.python_version()}, numpy {np.__version__}")]


# ------------------------------------------------------------------ waiting for a quiet machine


def others_running(pattern: str = QUIET_PATTERN) -> bool:
    """True while a process whose command line contains ``pattern`` runs (pgrep -f)."""
    try:
        return subprocess.run(["pgrep", "-f", pattern], capture_output=True, check=False).returncode == 0
    except FileNotFoundError:
        return False


def cpu_times() -> tuple[int, int] | None:
    """``(idle, total)`` jiffies of all CPUs from /proc/stat, or None."""
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
        return fields[3] + fields[4], sum(fields[:8])
    return None


def busy_fraction(a: tuple[int, int] | None, b: tuple[int, int] | None) -> float:
    """Share of CPU time not idle between two ``cpu_times`` samples (0 when unknown)."""
    if a is None or b is None or b[1] <= a[1]:
        return 0.0
    return 1.0 - (b[0] - a[0]) / (b[1] - a[1])


def cpu_busy(sample_s: float = 5.0) -> float:
    """Share of CPU time not idle over the next ``sample_s`` seconds."""
    a = cpu_times()
    time.sleep(sample_s)
    return busy_fraction(a, cpu_times())


def process_tree_cpu_s(root: int) -> float:
    """CPU seconds (user + system) spent so far by process ``root`` and its live descendants (/proc)."""
    parent: dict[int, int] = {}
    spent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError), open(f"/proc/{entry}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, ... utime, stime
            parent[int(entry)] = int(fields[1])
            spent[int(entry)] = int(fields[11]) + int(fields[12])
    inside = {root}
    changed = True
    while changed:  # the descendants: processes whose parent is inside, to a fixed point
        grown = {pid for pid, ppid in parent.items() if ppid in inside} - inside
        inside |= grown
        changed = bool(grown)
    return sum(spent.get(pid, 0) for pid in inside) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class CpuSample:
    """All CPUs' busy seconds and this process tree's CPU seconds at one moment."""

    busy_s: float
    ours_s: float
    t: float


def cpu_sample(root: int | None = None) -> CpuSample:
    times = cpu_times()
    busy = 0.0 if times is None else (times[1] - times[0]) / os.sysconf("SC_CLK_TCK")
    return CpuSample(busy, process_tree_cpu_s(os.getpid() if root is None else root), time.monotonic())


def others_cores(a: CpuSample, b: CpuSample) -> float:
    """Cores other processes than this tree kept busy between two samples (0 when unknown)."""
    if b.t <= a.t:
        return 0.0
    return max(0.0, (b.busy_s - a.busy_s) - (b.ours_s - a.ours_s)) / (b.t - a.t)


def wait_for_quiet(enabled: bool, poll_s: float = 30.0, max_s: float = 1200.0, pattern: str = QUIET_PATTERN,
                   max_busy: float = 0.25) -> str:
    """Wait until no ``pattern`` process runs and the CPUs are mostly idle; returns a line for the report."""
    if not enabled:
        return "- waiting for other benchmarks: skipped (--no-wait)"
    t0 = time.monotonic()
    while True:
        running, busy = others_running(pattern), cpu_busy()
        waited = time.monotonic() - t0
        if not running and busy <= max_busy:
            return (f"- machine quiet when measuring: no {pattern}, CPUs {busy:.0%} busy over 5 s "
                    f"(waited {waited:.0f} s)")
        if waited >= max_s:
            return (f"- **machine still busy after {waited:.0f} s ({pattern} running: {running}, CPUs {busy:.0%} "
                    "busy): measured anyway, numbers are pessimistic**")
        print(f"waiting for a quiet machine: {pattern} running: {running}, CPUs {busy:.0%} busy", file=sys.stderr)
        time.sleep(poll_s)


# ------------------------------------------------------------------ server processes


def free_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_status(url: str, timeout: float = 2.0) -> int | None:
    """GET ``url``'s status, or None if nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


@contextlib.contextmanager
def served(cmd: Sequence[str], env: dict[str, str], ready_url: str | Callable[[str], str | None], log: Path,
           startup_s: float = 180.0, cwd: Path = ROOT) -> Iterator[None]:
    """Run ``cmd`` in ``cwd``, in its own process group, until ``ready_url`` answers 200; always stop it.

    ``ready_url`` may be a function of the log so far, None until the URL is known (a server
    that picks its own port and logs it)."""
    with log.open("w") as out:
        proc = subprocess.Popen(list(cmd), cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            deadline = time.monotonic() + startup_s
            while True:
                url = ready_url(log.read_text()) if callable(ready_url) else ready_url
                if url is not None and http_status(url) == 200:
                    break
                if proc.poll() is not None:
                    raise RuntimeError(f"{cmd[:4]} exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{cmd[:4]} not ready in {startup_s} s:\n{log.read_text()[-4000:]}")
                time.sleep(0.25)
            yield
        finally:
            stop_group(proc)


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the group's leader ``proc`` alone, SIGKILL to the group if it is still there after
    30 s; then SIGKILL to what is left of the group.

    The leader alone, as Kubernetes and systemd's ``KillMode=mixed`` stop a server (docs/SERVICE.md,
    "Stopping it"): a SIGTERM to the whole group also reaches an embedded Ray's processes, and
    ``ray.shutdown`` then waits on the dead raylet (8.6 s to exit instead of 2.0 s, 2026-12-05).
    """
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


@contextlib.contextmanager
def splitkey_server(workdir: Path, workers: int = 2, args: Sequence[str] = (),
                    env: dict[str, str] | None = None, cwd: Path = ROOT) -> Iterator[str]:
    """``splitkey serve`` (embedded Ray, its own HOME under ``workdir``) on a free loopback port; yields its URL.

    ``cwd``: the checkout whose ``service`` package runs (another commit's, for a side-by-side run).
    """
    port = free_port()  # a name for its files; this tree's server picks its own port (0) and logs it
    home = workdir / f"home-{port}"
    home.mkdir(parents=True)
    full_env = {**os.environ, "HOME": str(home), "PYTHONUNBUFFERED": "1", **(env or {})}
    own = cwd == ROOT
    cmd = [sys.executable, "-m", "service.cli", "serve", "--port", "0" if own else str(port),
           "--workers", str(workers), *args]
    if not own:  # its own packages first, whatever the venv's editable install points to
        full_env["PYTHONPATH"] = os.pathsep.join([str(cwd), full_env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    url = f"http://127.0.0.1:{port}"

    def ready(log: str) -> str | None:
        nonlocal url
        if own:  # an older commit (cwd) may not log its port: it is given one, and a small race remains
            found = LISTENING.search(log)
            if found is None:
                return None
            url = f"http://127.0.0.1:{found.group(1)}"
        return url + "/readyz"

    with served(cmd, full_env, ready, workdir / f"splitkey-{port}.log", cwd=cwd):
        yield url


def raise_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit so every ``finally`` (server stops) runs."""
    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
