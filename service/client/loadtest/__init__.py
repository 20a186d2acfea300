"""The load generator (docs/LOADTEST.md): workloads over long contexts, closed and open loops,
answers checked against a float64 reference, results as tables, JSON, CSV and plots.

``run_sweep(SweepConfig(...)) -> SweepResult`` is the library; ``splitkey loadtest``
(``cli``) its command line; ``run_level`` the plain closed loop of the benchmark scripts.
"""

from service.client.loadtest.config import FailOn, Shape, SweepConfig
from service.client.loadtest.metrics import Level, PointMetrics, Sample, run_level
from service.client.loadtest.runner import SweepResult, run_sweep

__all__ = ["FailOn", "Level", "PointMetrics", "Sample", "Shape", "SweepConfig", "SweepResult", "run_level",
           "run_sweep"]
