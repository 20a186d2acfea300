"""benchmarks/uploads.py and batching.py: their pure parts and a tiny in-process run, without a server.

No timing is asserted: the roof arithmetic, the reports built from made-up rounds,
and that the in-process batch measurement checks every batched state bitwise.
"""

import numpy as np
import pytest
from benchloader import benchmark_module

from service.client.loadtest import Level


@pytest.fixture(scope="module")
def uploads():
    with benchmark_module("uploads.py") as module:
        yield module


@pytest.fixture(scope="module")
def batching():
    with benchmark_module("batching.py") as module:
        yield module


def test_a_decode_query_does_two_flop_per_float32_byte_and_four_per_16_bit_byte(batching):
    assert batching.flop_per_byte("float32") == 2 and batching.flop_per_byte("bfloat16") == 4


def test_the_roof_is_the_batch_until_the_products_run_out(batching):
    r = batching.KernelResult("float32", alone_s=batching.kv_bytes(1000, "float32") / 10e9)  # B = 10 GB/s
    assert r.roof(16, 60.0, 1000) == pytest.approx(3.0)  # 60 GFLOP/s / (2 flop/B * 10 GB/s)
    assert r.roof(2, 60.0, 1000) == 2


def test_a_tiny_in_process_run_batches_bitwise_and_reports(batching):
    res = batching.measure_kernel("float16", 2048, 1, seed=3)
    assert res.bitwise and set(res.batch_s) == set(batching.BATCHES) and res.c1_gflops > 0
    args = batching.parse_args(["--quick"])
    service = [batching.ServiceResult("float32", True, [Level(1, 4, 0, 1.0, 10.0, 11.0, 12.0, 4.0),
                                                        Level(16, 64, 0, 4.0, 40.0, 50.0, 60.0, 16.0)])]
    host = batching.HostRoof(sgemm_gflops=100.0, gemv_gbs=20.0)
    text = batching.report(args, [res], service, host, [])
    assert "| float16 |" in text and "4.00x" in text and "req/s at concurrency 16 / concurrency 1: 4.00" in text
    assert "a 16-query pass / the host's roof of it" in text


def test_a_pass_is_bound_by_its_flops_at_sgemm_or_its_bytes_at_the_gemv_whichever_is_slower(batching):
    host = batching.HostRoof(sgemm_gflops=100.0, gemv_gbs=20.0)
    n_k = 1000
    flops = batching.query_flops(n_k)
    # float32: 2 flop a byte per query. One query is memory-bound (40 GFLOP/s at 20 GB/s), 16 are compute-bound.
    assert host.of_pass(1, n_k, "float32") == (pytest.approx(40.0), "memory")
    assert host.of_pass(16, n_k, "float32") == (pytest.approx(100.0), "compute")
    r = batching.KernelResult("float32", batch_s={16: 16 * flops / 50e9})  # 50 GFLOP/s
    assert r.pass_gflops(16, n_k) == pytest.approx(50.0)


def test_the_upload_report_takes_medians_over_rounds(uploads):
    args = uploads.parse_args(["--quick"])
    chunk = 2048
    chunk_bytes = 2 * chunk * 8 * 128 * 2
    total = 2 * args.n_k * 8 * 128 * 2
    rounds = [uploads.Round(idle=[0.010] * 50, during=[0.020] * 50,
                            inline=[uploads.common.Record(chunk_bytes / 1e9, {"parse": 0.5})],
                            upload_s=total / 0.8e9, probed_upload_s=total / 0.5e9, chunks=[{"store": 0.1}],
                            raw_s=[total / 1.0e9, total / 2.0e9, total / 1.5e9])
              for _ in range(3)]
    text = uploads.report(args, rounds, chunk, [])
    assert "upload >= 0.8 x inline ingest: 0.80 (met)" in text
    assert "upload >= 0.5 x the raw socket: 0.40 (missed)" in text  # the best of three: 2 GB/s
    assert "probe p99 during the upload <= 3 x idle: 2.00 (met)" in text
    assert "store 100" in text and "parse 500" in text


def test_the_raw_socket_moves_every_byte_into_another_process(uploads):
    a, b = np.arange(3000, dtype=np.uint16), np.ones((5, 7), np.float32)
    seconds = uploads.raw_socket([a, b], tries=2)
    assert len(seconds) == 2 and all(s > 0 for s in seconds)
