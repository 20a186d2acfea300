"""PNG plots of a sweep (docs/LOADTEST.md, "Outputs"): latency against context length and against load,
throughput against concurrency.

matplotlib is an optional dependency (the ``loadtest`` extra): imported only here,
only when plots are asked for, with the file-only Agg backend.
"""

from __future__ import annotations

import pathlib
from collections import defaultdict
from collections.abc import Sequence

from service.client.loadtest.metrics import PointMetrics

PERCENTILES = (("latency_p50_ms", "p50", "-"), ("latency_p90_ms", "p90", "--"), ("latency_p99_ms", "p99", ":"))


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _key_label(n: int) -> str:
    for size, suffix in ((2**20, "M"), (2**10, "K")):
        if n >= size and n % size == 0:
            return f"{n // size}{suffix}"
    return str(n)


def _load_axis(ax: object, arrival: str, series: object) -> None:
    """Concurrency levels on a log2 axis with their own values as ticks; rates as they are."""
    if arrival != "concurrency":
        return
    loads = sorted({p.load for s in series for p in s})  # type: ignore[attr-defined]
    if len(loads) > 1 and loads[-1] / loads[0] >= 4:
        ax.set_xscale("log", base=2)  # type: ignore[attr-defined]
    ax.set_xticks(loads, [f"{x:g}" for x in loads])  # type: ignore[attr-defined]


def write_plots(points: Sequence[PointMetrics], out: pathlib.Path) -> list[pathlib.Path]:
    """The plots the points allow (a plot needs two x values); the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    plain = FuncFormatter(lambda y, _pos: f"{y:g}")  # 20, not 2 x 10^1
    out.mkdir(parents=True, exist_ok=True)
    written: list[pathlib.Path] = []

    def panels_of(n: int) -> list:
        """``n`` axes, at most three a row."""
        cols = min(n, 3)
        rows = -(-n // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 4.2 * rows), squeeze=False)
        flat = list(axes.flat)
        for ax in flat[n:]:
            ax.set_visible(False)
        return [fig, *flat[:n]]

    def save(fig: object, name: str) -> None:
        path = out / name
        fig.tight_layout()  # type: ignore[attr-defined]
        fig.savefig(path, dpi=110, bbox_inches="tight")  # type: ignore[attr-defined]
        plt.close(fig)  # type: ignore[arg-type]
        written.append(path)

    # Latency against context length: one panel per mode, a colour per load, a line style per percentile.
    by_mode: dict[str, dict[tuple[str, float], list[PointMetrics]]] = defaultdict(lambda: defaultdict(list))
    for p in points:
        by_mode[p.mode][(p.arrival, p.load)].append(p)
    modes = [m for m, series in by_mode.items() if any(len({p.n_k for p in s}) > 1 for s in series.values())]
    if modes:
        fig, *axes = panels_of(len(modes))
        for ax, mode in zip(axes, modes):
            for n, ((arrival, load), series) in enumerate(sorted(by_mode[mode].items())):
                series = sorted(series, key=lambda p: p.n_k)
                name = f"c={int(load)}" if arrival == "concurrency" else f"{load:g}/s"
                for field, pct, style in PERCENTILES:
                    ax.plot([p.n_k for p in series], [getattr(p, field) for p in series], style, marker="o",
                            color=f"C{n}", label=f"{name} {pct}")
            ks = sorted({p.n_k for s in by_mode[mode].values() for p in s})
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))  # 10, 20, 50, 100, ...
            ax.yaxis.set_major_formatter(plain)
            ax.yaxis.set_minor_formatter(NullFormatter())
            ax.set_xticks(ks, [_key_label(k) for k in ks])
            ax.set_xlabel("context length (keys)")
            ax.set_ylabel("latency (ms)")
            ax.set_title(f"{mode}: latency against context length")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7, ncol=2)
        save(fig, "latency_vs_context.png")

    # Latency and throughput against load: one panel per (mode, arrival), a colour per context length.
    groups: dict[tuple[str, str], dict[int, list[PointMetrics]]] = defaultdict(lambda: defaultdict(list))
    for p in points:
        groups[(p.mode, p.arrival)][p.n_k].append(p)
    panels = [g for g, series in groups.items() if any(len(s) > 1 for s in series.values())]
    if panels:
        fig, *axes = panels_of(len(panels))
        for ax, (mode, arrival) in zip(axes, panels):
            for n, (n_k, series) in enumerate(sorted(groups[(mode, arrival)].items())):
                series = sorted(series, key=lambda p: p.load)
                for field, pct, style in PERCENTILES:
                    ax.plot([p.load for p in series], [getattr(p, field) for p in series], style, marker="o",
                            color=f"C{n}", label=f"{_key_label(n_k)} {pct}")
            ax.set_xlabel("concurrency (clients)" if arrival == "concurrency" else "offered rate (requests/s)")
            ax.set_ylabel("latency (ms)")
            ax.set_ylim(bottom=0)
            _load_axis(ax, arrival, groups[(mode, arrival)].values())
            ax.set_title(f"{mode}: latency against {'concurrency' if arrival == 'concurrency' else 'rate'}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7, ncol=2)
        save(fig, "latency_vs_load.png")

        fig, *axes = panels_of(len(panels))
        for ax, (mode, arrival) in zip(axes, panels):
            for n, (n_k, series) in enumerate(sorted(groups[(mode, arrival)].items())):
                series = sorted(series, key=lambda p: p.load)
                ax.plot([p.load for p in series], [p.requests_per_s for p in series], "-", marker="o",
                        color=f"C{n}", label=f"{_key_label(n_k)}: req/s ({series[-1].kv_gb_per_s:.2f} GB/s of K+V "
                        "at the last point)")
            ax.set_xlabel("concurrency (clients)" if arrival == "concurrency" else "offered rate (requests/s)")
            ax.set_ylabel("completed requests/s")
            ax.set_ylim(bottom=0)
            _load_axis(ax, arrival, groups[(mode, arrival)].values())
            ax.set_title(f"{mode}: throughput")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
        save(fig, "throughput.png")
    return written
