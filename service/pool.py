"""The pool of Ray shard workers: start or find them, pick one, call it, heal it.

Workers are named actors (``splitkey-worker-<i>`` in the settings' namespace), so
a restarted front end, or a second one on the same cluster, finds the same
workers and the contexts they hold. When the front end joined an existing
cluster the workers are detached (they outlive it); with an embedded Ray they
end with the process. A worker that dies is replaced under the same name by
:meth:`WorkerPool.heal`; what it held is gone, which the contexts layer handles
through replicas.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayActorError

from service.settings import ServiceSettings
from workers.actor import ShardWorker
from workers.config import WorkerConfig
from workers.options import KernelOptions

log = logging.getLogger(__name__)

WORKER_PREFIX = "splitkey-worker-"


class WorkerUnavailable(Exception):
    """A worker did not answer (died, or its node went away)."""


@dataclass
class Slot:
    index: int
    name: str
    handle: Any
    node_id: str = ""
    outstanding: int = 0
    alive: bool = True
    info: dict = field(default_factory=dict)


def worker_config(settings: ServiceSettings, device: str) -> WorkerConfig:
    return WorkerConfig(
        device=device,
        kernel=KernelOptions(block_size=settings.block_size, threads=settings.kernel_threads,
                             gpu_kernels="fused" if settings.fused_gpu_kernels else "generic"),
        memory_budget_bytes=settings.worker_memory_bytes,
    )


def resolve_device(settings: ServiceSettings) -> str:
    """``auto`` means gpu when the cluster has GPUs, cpu otherwise; ``gpu`` needs GPUs."""
    gpus = ray.cluster_resources().get("GPU", 0)
    if settings.device == "auto":
        return "gpu" if gpus >= 1 else "cpu"
    if settings.device == "gpu" and gpus < 1:
        raise WorkerUnavailable("device must be cpu or auto on this cluster, got gpu: the Ray cluster has no GPU")
    return settings.device


def default_worker_count(settings: ServiceSettings, device: str) -> int:
    res = ray.cluster_resources()
    if device == "gpu":
        return max(1, int(res.get("GPU", 1)))
    return max(1, int(res.get("CPU", 1) // settings.worker_cpus))


class WorkerPool:
    def __init__(self, settings: ServiceSettings, slots: list[Slot], device: str, detached: bool) -> None:
        self.settings = settings
        self.slots = slots
        self.device = device
        self.detached = detached
        self._config = worker_config(settings, device)

    # -- lifecycle --------------------------------------------------------------
    @classmethod
    async def start(cls, settings: ServiceSettings, detached: bool) -> WorkerPool:
        device = resolve_device(settings)
        n = settings.workers or default_worker_count(settings, device)
        pool = cls(settings, [], device, detached)
        pool.slots = [Slot(i, f"{WORKER_PREFIX}{i}", pool._spawn(f"{WORKER_PREFIX}{i}")) for i in range(n)]
        await pool.refresh()
        dead = [s.name for s in pool.slots if not s.alive]
        if dead:
            raise WorkerUnavailable(f"workers did not start: {', '.join(dead)}")
        return pool

    def _spawn(self, name: str) -> Any:
        opts: dict[str, Any] = {
            "name": name,
            "namespace": self.settings.ray_namespace,
            "get_if_exists": True,
            "max_restarts": 0,
            "max_concurrency": 1,
            "num_cpus": self.settings.worker_cpus if self.device == "cpu" else 0,
            "num_gpus": 1 if self.device == "gpu" else 0,
            "scheduling_strategy": "SPREAD",
        }
        if self.detached:
            opts["lifetime"] = "detached"
        return ray.remote(ShardWorker).options(**opts).remote(self._config, name)

    async def refresh(self, timeout_s: float = 60.0) -> None:
        """Ping every worker; record node, bytes held and whether it answered."""

        async def one(slot: Slot) -> None:
            try:
                slot.info = await asyncio.wait_for(_await(slot.handle.ping.remote()), timeout_s)
                slot.node_id = slot.info.get("node_id", "")
                slot.alive = True
            except (TimeoutError, RayActorError, ray.exceptions.RayError) as exc:
                log.warning("worker %s did not answer: %s", slot.name, exc)
                slot.alive = False

        await asyncio.gather(*(one(s) for s in self.slots))

    async def heal(self) -> list[str]:
        """Replace dead workers under their names; returns the names replaced."""
        await self.refresh(timeout_s=10.0)
        replaced = []
        for slot in self.slots:
            if not slot.alive:
                slot.handle = self._spawn(slot.name)
                replaced.append(slot.name)
        if replaced:
            await self.refresh()
        return replaced

    def shutdown(self) -> None:
        if self.detached:
            return  # detached workers belong to the cluster, not to this front end
        for slot in self.slots:
            try:
                ray.kill(slot.handle)
            except Exception:  # best effort at exit
                log.debug("could not kill %s", slot.name)

    # -- use --------------------------------------------------------------------
    @property
    def size(self) -> int:
        return len(self.slots)

    def pick(self, candidates: list[int] | None = None, exclude: set[int] | frozenset = frozenset()) -> int:
        """The live worker with the least outstanding work (ties: lowest index)."""
        pool = range(self.size) if candidates is None else candidates
        live = [i for i in pool if i not in exclude and self.slots[i].alive]
        if not live:
            raise WorkerUnavailable("no live worker is left to take this work")
        return min(live, key=lambda i: (self.slots[i].outstanding, i))

    def submit(self, index: int, method: str, *args: Any) -> Any:
        """Submit a call; the ObjectRef is returned at once (await it with :meth:`result`)."""
        slot = self.slots[index]
        slot.outstanding += 1
        return getattr(slot.handle, method).remote(*args)

    def submit_multi(self, index: int, method: str, num_returns: int, *args: Any) -> Any:
        """Submit a call with several return refs; :meth:`result` must be awaited on the first."""
        slot = self.slots[index]
        slot.outstanding += 1
        return getattr(slot.handle, method).options(num_returns=num_returns).remote(*args)

    async def result(self, index: int, ref: Any) -> Any:
        """Await a submitted call; a dead worker is marked and raises WorkerUnavailable."""
        slot = self.slots[index]
        try:
            return await ref
        except RayActorError as exc:
            slot.alive = False
            raise WorkerUnavailable(f"worker {slot.name} died: {type(exc).__name__}") from exc
        finally:
            slot.outstanding -= 1

    async def call(self, index: int, method: str, *args: Any) -> Any:
        return await self.result(index, self.submit(index, method, *args))


async def _await(ref: Any) -> Any:
    return await ref
