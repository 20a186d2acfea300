"""The watcher that ends what a front end leaves behind: descendants by pid and start time."""

import os
import subprocess
import sys
import time

from service.cluster.reaper import _stat, descendants


def alive(pid: int) -> bool:
    return _stat(pid) is not None  # gone, or a zombie


def test_descendants_are_found_to_any_depth_and_ended_when_the_pipe_closes():
    # A parent shell with a child shell with a grandchild sleep, and a watcher on the parent.
    parent = subprocess.Popen(["sh", "-c", "sh -c 'sleep 60' & sleep 60"])
    try:
        deadline = time.monotonic() + 10
        while len(descendants(parent.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        tree = descendants(parent.pid)
        assert len(tree) >= 3  # sh, sleep, sleep
        read, write = os.pipe()
        watcher = subprocess.Popen([sys.executable, "-m", "service.cluster.reaper", str(parent.pid)], stdin=read)
        os.close(read)
        time.sleep(1.0)  # it has looked at the tree
        assert all(os.path.exists(f"/proc/{pid}") for pid, _ in tree)  # nothing is touched while the pipe is open
        os.close(write)  # as if the front end had ended
        assert watcher.wait(timeout=10) == 0
        assert not any(alive(pid) for pid, _ in tree)
    finally:
        parent.kill()
        parent.wait()


def test_the_watcher_refuses_bad_arguments():
    run = subprocess.run([sys.executable, "-m", "service.cluster.reaper", "x"], capture_output=True, text=True,
                         timeout=30, check=False)
    assert run.returncode == 2 and "usage" in run.stderr
