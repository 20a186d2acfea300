"""PNG plots of a sweep (docs/LOADTEST.md, "Outputs"): latency against context length and against load,
throughput (requests, keys and GB per second) against load.

matplotlib is an optional dependency (the ``loadtest`` extra): imported only here,
only when plots are asked for, with the file-only Agg backend.
"""

from __future__ import annotations

import pathlib
from collections import defaultdict
from collections.abc import Mapping
from typing import Any, Literal

from service.client.loadtest.metrics import MIN_SAMPLES, PointMetrics
from service.client.loadtest.runner import SweepResult

#: (field, name, colour): a colour per percentile, in every latency plot.
PERCENTILES = (("latency_p50_ms", "p50", "tab:blue"), ("latency_p90_ms", "p90", "tab:orange"),
               ("latency_p99_ms", "p99", "tab:red"))
#: Line styles and markers told apart within a panel: one per load, or per context length.
STYLES: tuple[Literal["-", "--", ":", "-."], ...] = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D", "v", "P")
#: Throughput panels: (field, axis label), each on a log axis.
THROUGHPUT = (("requests_per_s", "completed requests/s"), ("keys_per_s", "keys read/s"),
              ("kv_gb_per_s", "GB/s of K+V read"))


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


def _number(y: float) -> str:
    """An axis label: ``20``, ``0.5``, ``2k``, ``2.8M``, ``1.5G``."""
    for size, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(y) >= size:
            return f"{y / size:.3g}{suffix}"
    return f"{y:.3g}"


def footer(environment: Mapping[str, Any]) -> str:
    """The run's metadata, as each image's footer: date, host, shape, dtype, server version and workers."""
    keys = (("date", "{}"), ("host", "host {}"), ("shape", "{}"), ("dtype", "{}"),
            ("server_version", "splitkey {}"), ("service_workers", "{} workers"), ("service_device", "on {}"),
            ("url", "{}"))
    return " | ".join(fmt.format(environment[k]) for k, fmt in keys if environment.get(k) not in (None, ""))


def write_plots(result: SweepResult, out: pathlib.Path) -> list[pathlib.Path]:
    """The plots the points allow (a plot needs two x values); the paths written.

    Latency: a colour per percentile, a line style and marker per load (or context length), each
    point labelled with its sample count (``n=``), hollow where its percentiles rest on fewer
    than MIN_SAMPLES requests; the ``--slo-ms`` objective as a line. Throughput: requests/s,
    keys/s and GB/s, on log axes. Every image has the run's metadata as its footer.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    points, slo_ms = result.points, result.config.slo_ms
    plain = FuncFormatter(lambda y, _pos: _number(y))  # 20, not 2 x 10^1
    out.mkdir(parents=True, exist_ok=True)
    written: list[pathlib.Path] = []
    meta = footer(result.environment)
    thin_note = f"hollow: fewer than {MIN_SAMPLES} samples (rough percentiles); n = completed requests"

    def panels_of(n: int, rows_each: int = 1) -> tuple[Any, list[list[Any]]]:
        """``n`` panels, at most three a row, each ``rows_each`` axes tall."""
        cols = min(n, 3)
        rows = -(-n // cols)
        fig, axes = plt.subplots(rows * rows_each, cols, figsize=(5.5 * cols, 4.2 * rows * rows_each),
                                 squeeze=False)
        panels = [[axes[r * rows_each + k][c] for k in range(rows_each)] for r in range(rows) for c in range(cols)]
        for extra in panels[n:]:
            for ax in extra:
                ax.set_visible(False)
        return fig, panels[:n]

    def save(fig: Any, name: str) -> None:
        path = out / name
        fig.tight_layout(rect=(0, 0.04, 1, 1))
        fig.text(0.01, 0.005, meta, fontsize=7, color="0.35", ha="left", va="bottom")
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append(path)

    def log_y(ax: Any) -> None:
        """A log axis labelled 10, 20, 50, ... (2k, 5M past a thousand); within one decade, its minor ticks too."""
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))  # 10, 20, 50, 100, ...
        ax.yaxis.set_major_formatter(plain)
        low, high = ax.get_ylim()
        ax.yaxis.set_minor_formatter(plain if 0 < low and high / low < 10 else NullFormatter())

    def latency_lines(ax: Any, series_by_name: list[tuple[str, list[PointMetrics]]], x: Any) -> None:
        """The percentiles of each series: colour by percentile, style and marker by series; ``n=`` on each
        point (once, at its p99); the SLO line; a legend of both keys."""
        for n, (_name, series) in enumerate(series_by_name):
            style, marker = STYLES[n % len(STYLES)], MARKERS[n % len(MARKERS)]
            for field, _pct, colour in PERCENTILES:
                xs, ys = [x(p) for p in series], [getattr(p, field) for p in series]
                ax.plot(xs, ys, style, color=colour, alpha=0.8)
                for p, xv, yv in zip(series, xs, ys):
                    ax.plot([xv], [yv], marker, color=colour, markerfacecolor="none" if p.thin else colour)
            for p in series:
                ax.annotate(f"n={p.completed}", (x(p), p.latency_p99_ms), textcoords="offset points", xytext=(3, 4),
                            fontsize=6, color="tab:red" if p.thin else "0.3")
        if slo_ms is not None:
            ax.axhline(slo_ms, color="black", linestyle=(0, (6, 3)), linewidth=1)
        handles = [Line2D([], [], color=colour, label=pct) for _f, pct, colour in PERCENTILES]
        handles += [Line2D([], [], color="0.4", linestyle=STYLES[n % len(STYLES)], marker=MARKERS[n % len(MARKERS)],
                           label=name) for n, (name, _s) in enumerate(series_by_name)]
        if slo_ms is not None:
            handles.append(Line2D([], [], color="black", linestyle=(0, (6, 3)), label=f"SLO {slo_ms:g} ms"))
        if any(p.thin for _n, s in series_by_name for p in s):
            handles.append(Line2D([], [], color="0.4", marker="o", markerfacecolor="none", linestyle="none",
                                  label=f"< {MIN_SAMPLES} samples"))
        ax.legend(handles=handles, fontsize=7, ncol=2)

    def load_name(arrival: str, load: float) -> str:
        return f"c={int(load)}" if arrival == "concurrency" else f"{load:g}/s"

    # Latency against context length: one panel per mode.
    by_mode: dict[str, dict[tuple[str, float], list[PointMetrics]]] = defaultdict(lambda: defaultdict(list))
    for p in points:
        by_mode[p.mode][(p.arrival, p.load)].append(p)
    modes = [m for m, series in by_mode.items() if any(len({p.n_k for p in s}) > 1 for s in series.values())]
    if modes:
        fig, panels = panels_of(len(modes))
        for [ax], mode in zip(panels, modes):
            named = [(load_name(arrival, load), sorted(s, key=lambda p: p.n_k))
                     for (arrival, load), s in sorted(by_mode[mode].items())]
            latency_lines(ax, named, lambda p: p.n_k)
            ks = sorted({p.n_k for s in by_mode[mode].values() for p in s})
            ax.set_xscale("log", base=2)
            log_y(ax)
            ax.set_xticks(ks, [_key_label(k) for k in ks])
            ax.set_xlabel("context length (keys)")
            ax.set_ylabel("latency (ms)")
            ax.set_title(f"{mode}: latency against context length", fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
        if any(p.thin for p in points):
            fig.suptitle(thin_note, fontsize=8, color="tab:red")
        save(fig, "latency_vs_context.png")

    # Latency and throughput against load: one panel per (mode, arrival).
    groups: dict[tuple[str, str], dict[int, list[PointMetrics]]] = defaultdict(lambda: defaultdict(list))
    for p in points:
        groups[(p.mode, p.arrival)][p.n_k].append(p)
    panels_wanted = [g for g, series in groups.items() if any(len(s) > 1 for s in series.values())]
    if panels_wanted:
        fig, panels = panels_of(len(panels_wanted))
        for [ax], (mode, arrival) in zip(panels, panels_wanted):
            named = [(_key_label(n_k), sorted(s, key=lambda p: p.load)) for n_k, s in sorted(groups[(mode, arrival)].items())]
            latency_lines(ax, named, lambda p: p.load)
            ax.set_xlabel("concurrency (clients)" if arrival == "concurrency" else "offered rate (requests/s)")
            ax.set_ylabel("latency (ms)")
            log_y(ax)
            _load_axis(ax, arrival, groups[(mode, arrival)].values())
            ax.set_title(f"{mode}: latency against {'concurrency' if arrival == 'concurrency' else 'rate'}",
                         fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
        if any(p.thin for p in points):
            fig.suptitle(thin_note, fontsize=8, color="tab:red")
        save(fig, "latency_vs_load.png")

        fig, panels = panels_of(len(panels_wanted), rows_each=len(THROUGHPUT))
        for axes, (mode, arrival) in zip(panels, panels_wanted):
            for ax, (field, ylabel) in zip(axes, THROUGHPUT):
                for n, (n_k, series) in enumerate(sorted(groups[(mode, arrival)].items())):
                    series = sorted(series, key=lambda p: p.load)
                    xs, ys = [p.load for p in series], [getattr(p, field) for p in series]
                    ax.plot(xs, ys, STYLES[n % len(STYLES)], marker=MARKERS[n % len(MARKERS)], color=f"C{n}",
                            label=_key_label(n_k))
                    for p, xv, yv in zip(series, xs, ys):
                        ax.annotate(f"n={p.completed}", (xv, yv), textcoords="offset points", xytext=(3, 4),
                                    fontsize=6, color="tab:red" if p.thin else "0.3")
                ax.set_xlabel("concurrency (clients)" if arrival == "concurrency" else "offered rate (requests/s)")
                ax.set_ylabel(ylabel)
                if any(getattr(p, field) > 0 for s in groups[(mode, arrival)].values() for p in s):
                    log_y(ax)
                _load_axis(ax, arrival, groups[(mode, arrival)].values())
                ax.set_title(f"{mode}: {ylabel}", fontsize=10)
                ax.grid(True, which="both", alpha=0.3)
                ax.legend(fontsize=7, title="context", title_fontsize=7)
        save(fig, "throughput.png")
    return written
