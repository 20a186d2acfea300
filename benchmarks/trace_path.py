"""Which files and functions of the project one request runs through, in every process.

Run from the repository root (``pip install -e '.[test]'``)::

    .venv/bin/python benchmarks/trace_path.py                      # this checkout
    .venv/bin/python benchmarks/trace_path.py --root /tmp/before    # another checkout, same measurement
    .venv/bin/python benchmarks/trace_path.py --list                # and name every function

The request is the one the architecture is judged by: ``POST /v1/attention?contexts=ID``
with a safetensors body, over a resident context of 4096 keys held by two shard
workers. The app is the checkout's own ``create_app`` with its lifespan (a real
embedded Ray, two real shard workers); requests go through the real ASGI app
(``httpx.ASGITransport``), so only the HTTP socket is skipped. A profiler records every
call of a function defined under ``merge/``, ``workers/`` or ``service/`` of the
checkout: in this process with ``sys.setprofile``, and in every Ray worker process
through Ray's ``worker_process_setup_hook``, each call stamped with the wall clock.
Calls between the start and the end of the traced request (after one untimed
warm-up request) are counted: distinct files and distinct functions, by process. By default
(``--cpu-kernels auto``, the server's default) it first waits, up to 10 minutes, until every
worker says it runs the fused CPU kernel (a worker switches once it is compiled or loaded from
the cache), so the path traced is the one a warm server runs; ``--cpu-kernels numpy`` traces
the NumPy kernel's path at once.

It uses only ``service.app.create_app`` and ``ServiceSettings`` (``service.core.settings``) of the
checkout (and the ``safetensors`` package for the bodies), so that one script measures
any version of the code the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
PACKAGES = ("merge", "workers", "service")
#: The traced request: decode over a 4096-key context of two shards (h_kv = 2, d = 64, float32).
N_K, H_Q, H_KV, D = 4096, 8, 2, 64


def prefixes(root: str) -> tuple[str, ...]:
    return tuple(os.path.join(root, p) + os.sep for p in PACKAGES)


def install_worker_trace() -> None:
    """Ray's worker setup hook: record every call of a project function, stamped, to a file per process."""
    import os as _os
    import sys as _sys
    import threading as _threading
    import time as _time

    root = _os.environ["SPLITKEY_TRACE_ROOT"]
    # Open for the life of the worker process (line-buffered: every call is on disk when the window closes).
    out = open(_os.path.join(_os.environ["SPLITKEY_TRACE_DIR"], f"{_os.getpid()}.tsv"), "a", buffering=1)  # noqa: SIM115
    wanted = tuple(_os.path.join(root, p) + _os.sep for p in ("merge", "workers", "service"))

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(wanted):
            out.write(f"{_time.time()}\t{frame.f_code.co_filename}\t{frame.f_code.co_qualname}\n")

    _sys.setprofile(profile)
    _threading.setprofile(profile)

    # A threaded actor runs its methods in threads Ray starts from C++, which
    # threading.setprofile does not reach: each method installs the profile in the
    # thread that runs it, before the method's own frame (which is then recorded).
    import functools as _functools

    from workers.actor import ShardWorker

    def in_profiled_thread(fn: Any) -> Any:
        @_functools.wraps(fn)
        def method(*args: Any, **kwargs: Any) -> Any:
            if _sys.getprofile() is not profile:
                _sys.setprofile(profile)
            return fn(*args, **kwargs)
        return method

    for name, fn in list(vars(ShardWorker).items()):
        if callable(fn) and not name.startswith("_"):
            setattr(ShardWorker, name, in_profiled_thread(fn))


class FrontEndTrace:
    """The same recording for this process, kept in memory."""

    def __init__(self, root: str) -> None:
        self.wanted = prefixes(root)
        self.calls: list[tuple[float, str, str]] = []

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(self.wanted):
            self.calls.append((time.time(), frame.f_code.co_filename, frame.f_code.co_qualname))

    def __enter__(self) -> FrontEndTrace:
        sys.setprofile(self._profile)
        threading.setprofile(self._profile)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]


#: The traced request's headers: safetensors both ways.
BINARY = {"Content-Type": "application/octet-stream", "Accept": "application/octet-stream"}


def request_tensors() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The traced request's context and query: ``k, v [N_K, H_KV, D]`` and ``q [1, H_Q, D]``, float32 (seed 0)."""
    rng = np.random.default_rng(0)
    k = rng.standard_normal((N_K, H_KV, D), dtype=np.float32)
    v = rng.standard_normal((N_K, H_KV, D), dtype=np.float32)
    return k, v, rng.standard_normal((1, H_Q, D), dtype=np.float32)


def safetensors_body(tensors: dict[str, np.ndarray]) -> bytes:
    import safetensors.numpy

    return safetensors.numpy.save(tensors)


async def traced_request(root: str, trace_dir: str, cpu_kernels: str) -> tuple[FrontEndTrace, float, float, dict]:
    import httpx

    from service.app import create_app
    try:
        from service.core.settings import ServiceSettings
    except ImportError:  # a checkout from before service.core (2026-12-06)
        from service.settings import ServiceSettings  # type: ignore[no-redef]

    settings = ServiceSettings(workers=2, ray_namespace="splitkey-trace", heal_interval_s=3600.0,
                               context_shard_keys=N_K // 2, cpu_kernels=cpu_kernels)
    app = create_app(settings)
    k, v, q = request_tensors()
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app), \
            httpx.AsyncClient(transport=transport, base_url="http://splitkey", timeout=120) as client:
        # With --cpu-kernels auto the workers switch to the fused kernel once it is compiled (or loaded from
        # the cache): trace that path, not the NumPy one that serves until then.
        for _ in range(600 if cpu_kernels == "auto" else 0):
            kernels = [w.get("cpu_kernels") for w in (await client.get("/v1/cluster")).json().get("workers", [])]
            if all(kernel in (None, "fused") for kernel in kernels):  # None: a checkout that does not say
                break
            await asyncio.sleep(1.0)
        r = await client.post("/v1/contexts?shards=2", content=safetensors_body({"k": k, "v": v}), headers=BINARY)
        r.raise_for_status()
        ctx = r.json()
        url = f"/v1/attention?contexts={ctx['id']}"
        body = safetensors_body({"q": q})
        (await client.post(url, content=body, headers=BINARY)).raise_for_status()  # warm-up, untimed
        await asyncio.sleep(0.5)  # let the warm-up's stragglers finish before the window opens
        with FrontEndTrace(root) as front:
            t0 = time.time()
            r = await client.post(url, content=body, headers=BINARY)
            t1 = time.time()
        r.raise_for_status()
        await asyncio.sleep(0.5)  # let the workers' trace files catch up
        await client.delete(f"/v1/contexts/{ctx['id']}")
    return front, t0, t1, ctx


def worker_calls(trace_dir: str, t0: float, t1: float) -> dict[int, list[tuple[str, str]]]:
    """Calls inside the window, by worker process."""
    out: dict[int, list[tuple[str, str]]] = {}
    for path in Path(trace_dir).glob("*.tsv"):
        for line in path.read_text().splitlines():
            t, file, func = line.split("\t")
            if t0 <= float(t) <= t1:
                out.setdefault(int(path.stem), []).append((file, func))
    return out


def lines_of_code(root: str) -> int:
    """Non-blank, non-comment lines of the Python files of the three packages."""
    total = 0
    for package in PACKAGES:
        for path in Path(root, package).rglob("*.py"):
            total += sum(1 for line in path.read_text().splitlines() if line.strip() and not line.strip().startswith("#"))
    return total


def summarize(root: str, front: list[tuple[str, str]], workers: dict[int, list[tuple[str, str]]]) -> dict:
    """Distinct files and functions per process and in all. Comprehensions and lambdas
    (``<listcomp>``, ``<lambda>``, ...) are code objects of their own but not functions a
    reader follows: they are counted with the function that holds them."""
    def rel(file: str) -> str:
        return os.path.relpath(file, root)

    def owner(qualname: str) -> str:
        parts = qualname.split(".")
        while len(parts) > 1 and parts[-1].startswith("<") and parts[-1] != "<locals>":
            parts.pop()
        while len(parts) > 1 and parts[-1] == "<locals>":
            parts.pop()
        return ".".join(parts)

    sides = {"front end": front, **{f"worker process {pid}": calls for pid, calls in sorted(workers.items())}}
    report: dict[str, Any] = {"root": root, "lines_of_code": lines_of_code(root), "processes": {}}
    all_files: set[str] = set()
    all_functions: set[tuple[str, str]] = set()
    for name, calls in sides.items():
        functions = {(rel(f), owner(q)) for f, q in calls}
        files = {f for f, _ in functions}
        all_files |= files
        all_functions |= functions
        report["processes"][name] = {"calls": len(calls), "files": len(files), "functions": len(functions),
                                     "by_file": dict(collections.Counter(f for f, _ in sorted(functions))),
                                     "function_names": sorted(f"{f}:{q}" for f, q in functions)}
    report["files"] = len(all_files)
    report["functions"] = len(all_functions)
    report["function_names"] = sorted(f"{f}:{q}" for f, q in all_functions)
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default=str(HERE.parent), help="the checkout to measure (default: this one)")
    p.add_argument("--list", action="store_true", help="also print every function on the path")
    p.add_argument("--json", default=None, help="also write the report as JSON here")
    p.add_argument("--cpu-kernels", choices=("auto", "numpy"), default="auto",
                   help="the workers' CPU kernel: auto (wait for the fused one) or numpy")
    args = p.parse_args(argv)
    root = str(Path(args.root).resolve())
    sys.path.insert(0, root)
    import ray

    with tempfile.TemporaryDirectory(prefix="splitkey-trace-") as trace_dir:
        ray.init(address="local", num_cpus=2, include_dashboard=False, namespace="splitkey-trace",
                 log_to_driver=False, logging_level="ERROR",
                 runtime_env={"worker_process_setup_hook": install_worker_trace,
                              "env_vars": {"PYTHONPATH": root, "SPLITKEY_TRACE_ROOT": root,
                                           "SPLITKEY_TRACE_DIR": trace_dir}})
        try:
            front, t0, t1, _ = asyncio.run(traced_request(root, trace_dir, args.cpu_kernels))
            workers = worker_calls(trace_dir, t0, t1)
        finally:
            ray.shutdown()
    report = summarize(root, [(f, q) for t, f, q in front.calls if t0 <= t <= t1], workers)
    print(f"POST /v1/attention?contexts=ID (safetensors, {N_K}-key context in 2 shards), checkout {root}")
    print(f"{report['files']} files, {report['functions']} functions on the path; "
          f"{report['lines_of_code']} lines of code in {', '.join(PACKAGES)}")
    for name, side in report["processes"].items():
        if side["calls"]:
            print(f"  {name}: {side['files']} files, {side['functions']} functions, {side['calls']} calls")
    if args.list:
        print("\n".join("    " + f for f in report["function_names"]))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
