"""What a worker pool's start decides before any worker runs: the workers' config, their device and
count, whether they fit the cluster, and whether ``--persist-dir`` holds stores of workers it would not
start (``service.cluster.pool`` starts them)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import ray

from service.core.errors import WorkersUnavailable
from service.core.settings import ServiceSettings
from workers.config import WorkerConfig
from workers.options import KernelOptions
from workers.tracing import enabled as tracing_enabled

#: Workers are named actors ``splitkey-worker-<i>`` in the settings' namespace (``service.cluster.pool``).
WORKER_PREFIX = "splitkey-worker-"


def check_stores(persist_dir: Path, workers: int) -> None:
    """Refuse a start whose ``--persist-dir`` holds stores of workers it does not start.

    Each worker keeps its shards in ``<persist_dir>/<its name>`` (``workers.persist``). A store
    no worker loads is invisible: its contexts can be neither queried nor deleted, and a delete
    of a context it shares with the running workers does not reach it, so that context would
    come back when a later start loads that store again. Only what this host sees is checked
    (on a cluster each node's workers keep their own folders).
    """
    if not persist_dir.is_dir():
        return
    index = re.compile(re.escape(WORKER_PREFIX) + r"([0-9]+)")  # ASCII digits: the names the pool gives
    found = [(int(m[1]), p) for p in persist_dir.iterdir() if (m := index.fullmatch(p.name)) and p.is_dir()]
    extra = sorted((i, p.name) for i, p in found if i >= workers and any(p.iterdir()))
    if extra:
        names = ", ".join(name for _, name in extra)
        raise ValueError(f"--persist-dir {str(persist_dir)!r} holds the stores of {names}, which --workers {workers} "
                         f"does not start: their contexts could be neither queried nor deleted, and would come back "
                         f"when those workers start again; start with --workers {extra[-1][0] + 1}, or move those "
                         f"folders out of it")


def worker_config(settings: ServiceSettings, device: str) -> WorkerConfig:
    return WorkerConfig(
        device=device,
        kernel=KernelOptions(block_size=settings.block_size, threads=settings.kernel_threads,
                             gpu_kernels=settings.gpu_kernels, cpu_kernels=settings.cpu_kernels),
        memory_budget_bytes=settings.worker_memory_bytes,
        batch_rows=settings.batch_rows,
        channel=settings.worker_channel,
        persist_dir=str(settings.persist_dir.resolve()) if settings.persist_dir else None,
        tracing=tracing_enabled(),  # the front end's OTEL_* variables (service.tracing)
    )


def resolve_device(settings: ServiceSettings) -> str:
    """``auto`` means gpu when the cluster has GPUs, cpu otherwise; ``gpu`` needs GPUs."""
    gpus = ray.cluster_resources().get("GPU", 0)
    if settings.device == "auto":
        return "gpu" if gpus >= 1 else "cpu"
    if settings.device == "gpu" and gpus < 1:
        raise WorkersUnavailable("device must be cpu or auto on this cluster, got gpu: the Ray cluster has no GPU")
    return settings.device


def default_worker_count(settings: ServiceSettings, device: str) -> int:
    res = ray.cluster_resources()
    if device == "gpu":
        return max(1, int(res.get("GPU", 1)))
    return max(1, int(res.get("CPU", 1) // settings.worker_cpus))


def check_fits(settings: ServiceSettings, device: str, names: Sequence[str]) -> None:
    """Fail at once, naming what is missing, when the workers still to start cannot be placed.

    Workers that already exist under these names (a joined cluster's detached ones) hold
    their resources already; the others need ``worker_cpus`` CPUs (or one GPU) each from
    what the cluster has free. Without this check Ray would queue them and the start
    would time out a minute later with no reason given.
    """
    new = 0
    for name in names:
        try:
            ray.get_actor(name, namespace=settings.ray_namespace)
        except ValueError:
            new += 1
    if not new:
        return
    resource, each = ("GPU", 1.0) if device == "gpu" else ("CPU", settings.worker_cpus)
    free = float(ray.available_resources().get(resource, 0.0))
    total = float(ray.cluster_resources().get(resource, 0.0))
    if new * each > free + 1e-9:
        raise WorkersUnavailable(
            f"workers must fit the cluster: {new} new worker(s) x {each:g} {resource} each need "
            f"{new * each:g} {resource}, the cluster has {free:g} free of {total:g}; ask for fewer workers "
            f"(--workers) or a smaller share each (--worker-cpus), or add nodes")
