"""Typed configuration of a shard worker, passed to the Ray actor's constructor."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any

from workers.batch import MAX_BATCH_ROWS
from workers.options import KernelOptions

DEVICES = ("cpu", "gpu")


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a shard worker needs to know; never read from globals.

    * ``device``: ``"cpu"`` (numpy kernel) or ``"gpu"`` (cupy; the actor asks Ray for a GPU).
    * ``kernel``: how the kernel walks the keys (block size, scratch, threads, GPU kernels).
    * ``memory_budget_bytes``: bytes of resident context shards this worker may hold.
    * ``batch_rows``: query rows (``n_q * h_q``) one pass over resident keys may serve
      together (``workers.batch``); 1 serves every request alone.
    * ``persist_dir``: where the worker keeps its shards on disk (``<persist_dir>/<name>``,
      ``workers.persist``) and loads them from when it starts; None: memory only.
    * ``channel``: open the direct channel (``workers.channel``): resident queries then come
      over a socket of their own instead of a Ray call; False: Ray calls only.
    * ``tracing``: the front end traces requests: the worker draws its passes for them with the
      tracer the ``OTEL_*`` variables of its own process ask for (``workers.tracing``).
    """

    device: str = "cpu"
    kernel: KernelOptions = field(default_factory=KernelOptions)
    memory_budget_bytes: int = 4 * 2**30
    batch_rows: int = MAX_BATCH_ROWS
    persist_dir: str | None = None
    channel: bool = True
    tracing: bool = False

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.memory_budget_bytes < 0:
            raise ValueError(f"memory_budget_bytes must be >= 0, got {self.memory_budget_bytes}")
        if self.batch_rows < 1:
            raise ValueError(f"batch_rows must be >= 1, got {self.batch_rows}")


def settings_of(config: WorkerConfig) -> dict[str, Any]:
    """``config`` as flat ``{name: value}`` (the kernel's options as ``kernel.NAME``): what a worker
    reports in its ping, so that a front end joining running workers sees what they were started with."""
    flat: dict[str, Any] = {}
    for name, value in dataclasses.asdict(config).items():
        if isinstance(value, dict):
            flat.update({f"{name}.{k}": _plain(v) for k, v in value.items()})
        else:
            flat[name] = _plain(value)
    return flat


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, enum.Enum) else value
