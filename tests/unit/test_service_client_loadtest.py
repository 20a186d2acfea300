"""`splitkey loadtest` against a real server: every mode and arrival process, checked answers, outputs,
a server that answers wrongly, thresholds, and contexts deleted also when interrupted."""

import io
import re


from service.client import SplitkeyError, UploadError
from service.client.loadtest.cli import setup_failed
from service.client.loadtest.progress import LiveLine, UploadProgress

SMALL = ["--h-q", "4", "--h-kv", "2", "--d", "16"]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_upload_progress_rewrites_one_line_on_a_terminal():
    out = Terminal()
    bar = UploadProgress(key_bytes=1000, stream=out)
    for done in (250, 500, 750, 1000):
        bar(done, 1000)
    text = out.getvalue()
    assert text.count("\r") == 4 and text.endswith("\n") and text.count("\n") == 1
    assert re.fullmatch(r"(\rupload +[0-9.]+%  \d+/1000 keys  [0-9.]+ GB/s)+\n", text)
    assert "\rupload 100.0%  1000/1000 keys" in text


def test_upload_progress_writes_a_line_per_tenth_elsewhere_and_nothing_for_one_chunk():
    out = io.StringIO()
    bar = UploadProgress(key_bytes=1000, stream=out, label="upload context of 100 keys")
    for done in range(7, 101, 7):
        bar(min(done, 100), 100)
    bar(100, 100)
    lines = out.getvalue().splitlines()
    assert [line.split("%")[0] for line in lines] == [f"upload context of 100 keys {p:5.1f}"
                                                      for p in (14, 21, 35, 42, 56, 63, 70, 84, 91, 100)]
    quiet = io.StringIO()
    UploadProgress(key_bytes=1000, stream=quiet)(100, 100)
    assert quiet.getvalue() == ""


def test_the_live_line_counts_requests_and_ends_with_a_newline():
    out = Terminal()
    line = LiveLine("decode n_k=4096 c=2", out)
    line.every = 0.0
    line.add(True, 0.010)
    line.add(False, 1.0)
    line.add(True, 0.030)
    line.close()
    text = out.getvalue()
    assert text.endswith("\n") and "\rdecode n_k=4096 c=2: 2 done, 1 failed" in text and "p50 30.0 ms" in text


def test_a_context_that_does_not_fit_suggests_what_to_try():
    full = UploadError("abc", 0, 10, 507, "insufficient_capacity", "the context does not fit")
    assert "try --dtype bfloat16 (half the bytes of float32), fewer keys" in setup_failed(full, "float32")
    assert "context upload failed" in setup_failed(full, "float32")
    assert "try fewer keys (--n-k)" in setup_failed(full, "bfloat16")
    assert "try" not in setup_failed(SplitkeyError(503, "workers_unavailable", "gone"), "float32")
