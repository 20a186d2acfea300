"""A sweep's results as a console table, JSON, CSV and (``plots``) PNG files (docs/LOADTEST.md, "Outputs")."""

from __future__ import annotations

import csv
import json
import math
import pathlib
from collections.abc import Sequence
from dataclasses import asdict

from service.client.loadtest.metrics import MIN_SAMPLES, STAGES, PointMetrics
from service.client.loadtest.runner import SweepResult

#: The console table's columns: header, and how a point fills it.
COLUMNS = (
    ("mode", lambda p: p.mode),
    ("n_k", lambda p: str(p.n_k)),
    ("load", lambda p: f"c={int(p.load)}" if p.arrival == "concurrency" else f"{p.load:g}/s"),
    ("ok", lambda p: str(p.completed)),
    ("fail", lambda p: str(p.failed)),
    ("req/s", lambda p: f"{p.requests_per_s:.2f}"),
    ("GB/s", lambda p: f"{p.kv_gb_per_s:.2f}"),
    ("mean", lambda p: _ms(p.latency_mean_ms)),
    ("p50", lambda p: _ms(p.latency_p50_ms) + _thin(p)),
    ("p90", lambda p: _ms(p.latency_p90_ms) + _thin(p)),
    ("p99", lambda p: _ms(p.latency_p99_ms) + _thin(p)),
    ("max", lambda p: _ms(p.latency_max_ms)),
    ("SLO", lambda p: "-" if p.slo_attainment is None else f"{100 * p.slo_attainment:.0f}%"),
    ("checked", lambda p: f"{p.verified - p.wrong}/{p.verified}"),
    ("max err", lambda p: "-" if p.max_error is None else f"{p.max_error:.1e}"),
)


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.1f}"


def _thin(p: PointMetrics) -> str:
    """``*`` after a percentile that rests on fewer than MIN_SAMPLES requests (explained under the table)."""
    return "*" if p.thin else ""


def table(points: Sequence[PointMetrics]) -> str:
    """Fixed-width rows, latencies in ms; then each point's median Server-Timing stages."""
    rows = [[h for h, _ in COLUMNS]] + [[cell(p) for _, cell in COLUMNS] for p in points]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    stages = [f"  {p.label}: " + ", ".join(f"{s} {p.stages_ms[s]:.2f}" for s in STAGES if s in p.stages_ms)
              for p in points if p.stages_ms]
    if any(p.thin for p in points):
        lines += ["", f"* rests on fewer than {MIN_SAMPLES} completed requests: rough (raise --requests or --duration)"]
    if stages:
        lines += ["", "server stages, median ms (Server-Timing):", *stages]
    return "\n".join(lines)


def summary(result: SweepResult) -> str:
    """The table, then what failed, what was wrong and which thresholds were crossed."""
    parts = [table(result.points)]
    warnings = [f"  {p.label}: {w}" for p in result.points for w in p.warnings]
    if warnings:
        parts += ["", "warnings:", *warnings]
    if result.uploads:
        parts += ["", "uploads:", *(f"  {u['label']}: {u['keys']} keys, {u['gb']:.3f} GB in {u['seconds']:.1f} s, "
                                   f"{u['gb_per_s']:.3f} GB/s" for u in result.uploads)]
    if result.failures:
        parts += ["", "failures:", *(f"  {f}" for f in result.failures)]
    if result.violations():
        parts += ["", "--fail-on thresholds crossed:", *(f"  {v}" for v in result.violations())]
    if result.interrupted:
        parts += ["", "interrupted: the points above are the ones that finished"]
    return "\n".join(parts)


def finite(doc: object) -> object:
    """``doc`` with every NaN or infinite float as None: JSON has no such numbers."""
    if isinstance(doc, float):
        return doc if math.isfinite(doc) else None
    if isinstance(doc, dict):
        return {k: finite(v) for k, v in doc.items()}
    if isinstance(doc, (list, tuple)):
        return [finite(v) for v in doc]
    return doc


CSV_FIELDS = ("mode", "n_k", "arrival", "load", "completed", "failed", "duration_s", "requests_per_s", "pairs_per_s",
              "keys_per_s", "kv_gb_per_s", "latency_mean_ms", "latency_p50_ms", "latency_p90_ms", "latency_p99_ms",
              "latency_max_ms", "slo_ms", "goodput_per_s", "slo_attainment", "verified", "wrong", "max_error")


def write(result: SweepResult, out: pathlib.Path) -> list[pathlib.Path]:
    """``results.json``, ``results.csv`` (one row per point, stages as ``stage_<name>_ms``), and with
    ``per_request`` ``requests.csv``; the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.json", out / "results.csv"]
    paths[0].write_text(json.dumps(finite(result.to_json()), indent=2, allow_nan=False) + "\n")
    with paths[1].open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow([*CSV_FIELDS, *(f"stage_{s}_ms" for s in STAGES)])
        for p in result.points:
            d = asdict(p)
            w.writerow([d[k] for k in CSV_FIELDS] + [p.stages_ms.get(s, "") for s in STAGES])
    if result.requests:
        paths.append(out / "requests.csv")
        with paths[-1].open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["point", "index", "due_s", "latency_ms", "status", "code", "keys", "n_q", "verified", "error"])
            for label, samples in result.requests.items():
                for s in samples:
                    w.writerow([label, s.index, f"{s.due_s:.6f}", f"{1000 * s.latency_s:.3f}", s.status, s.code,
                                s.keys, s.n_q, s.verified, "" if s.error is None else f"{s.error:.3e}"])
    return paths
