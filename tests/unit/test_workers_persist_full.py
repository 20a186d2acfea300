"""A full ``--persist-dir``: a write the disk refuses for lack of room (ENOSPC, EDQUOT, also as safetensors
wraps it) is undone in memory and on disk and refused as ``StorageFull`` (a ``CapacityError``), naming the
worker; any other error of a write stays what it is. The disk's refusals are injected at the writes
``workers.persist`` makes (``save_file``, a file's write, ``os.fsync``): no small filesystem is needed."""

import errno
import os

import numpy as np
import pytest
from reference import contract_layout
from safetensors import SafetensorError

from workers import persist
from workers.persist import RECORD, NoSpace, ShardFiles
from workers.store import CapacityError, ShardStore, StorageFull
from workers.tasks import ShardWrite

WORKER = "splitkey-worker-1"  # the store's folder is named for its worker (workers.actor)
#: What safetensors 0.8 raises when the disk is full under its write (seen with the errno injected by strace).
SAFETENSORS_FULL = "Error while serializing: I/O error: No space left on device (os error 28)"


def kv(n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 2, 8)).astype(np.float32), rng.standard_normal((n, 2, 4)).astype(np.float32)


def store(tmp_path) -> ShardStore:
    return ShardStore(10**8, files=ShardFiles(tmp_path / WORKER))


def files_of(root) -> dict[str, bytes]:
    """Every file under ``root`` (relative path -> bytes)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def record(version, length):
    return {"version": version, "id": "c", "shards": [{"index": 0, "length": length, "workers": [WORKER]}]}


def full_segments(monkeypatch, message=SAFETENSORS_FULL):
    """safetensors' writer fails as it does on a full disk: after its file is begun (a torn temporary)."""
    def save_file(tensors, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"\0" * 100)
        raise SafetensorError(message)
    monkeypatch.setattr(persist, "save_file", save_file)


def full_after_write(monkeypatch, code=errno.ENOSPC, only=None):
    """Each atomic write (of files named ``only``: all when None) writes its temporary, then the disk refuses
    the flush with ``code`` (as a filesystem with delayed allocation does at fsync)."""
    real = persist._atomic_write

    def atomic_write(path, write):
        if only is not None and path.name != only:
            return real(path, write)

        def torn(tmp):
            write(tmp)
            raise OSError(code, os.strerror(code))
        return real(path, torn)
    monkeypatch.setattr(persist, "_atomic_write", atomic_write)


# -- ShardFiles: the refusal is typed, leaves no temporary, and nothing else is called full ----------------

@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_a_segment_refused_for_lack_of_room_raises_no_space_and_leaves_no_temporary(tmp_path, monkeypatch, code):
    files = ShardFiles(tmp_path)
    files.create("c", 0, "float32", 10, 100, (2, 8, 4))
    before = files_of(tmp_path)
    full_segments(monkeypatch, SAFETENSORS_FULL.replace("No space left on device (os error 28)",
                                                        f"{os.strerror(code)} (os error {code})"))
    k, v = kv(5)
    with pytest.raises(NoSpace) as err:
        files.write("c", 0, 0, k, v, np.arange(5))
    assert err.value.errno == code and isinstance(err.value.__cause__, SafetensorError)
    assert files_of(tmp_path) == before


@pytest.mark.parametrize("code", [errno.EIO, errno.EACCES, errno.EROFS])
def test_other_errors_of_a_write_are_raised_as_they_are_not_as_a_full_disk(tmp_path, monkeypatch, code):
    files = ShardFiles(tmp_path)
    files.create("c", 0, "float32", 10, 100, (2, 8, 4))
    before = files_of(tmp_path)
    full_segments(monkeypatch, f"Error while serializing: I/O error: {os.strerror(code)} (os error {code})")
    k, v = kv(5)
    with pytest.raises(SafetensorError):
        files.write("c", 0, 0, k, v, np.arange(5))
    full_after_write(monkeypatch, code)
    with pytest.raises(OSError) as err:
        files.save_record("c", record(1, 0))
    assert err.value.errno == code and not isinstance(err.value, NoSpace)
    assert files_of(tmp_path) == before  # no temporary either way


# -- ShardStore: the write undone as a refused capacity is, and refused as StorageFull --------------------

def test_a_create_on_a_full_persist_dir_is_refused_and_leaves_nothing_in_memory_or_on_disk(tmp_path, monkeypatch):
    st = store(tmp_path)
    full_segments(monkeypatch)
    k, v = kv(10)
    with pytest.raises(StorageFull, match=rf"^worker {WORKER}'s --persist-dir is full \(No space left on device\): "
                                          r"shard 0 of context c was refused, and nothing of it was stored$") as err:
        st.create(ShardWrite("c", 0, "float32", 100, np.arange(10), reserve=40), k, v, context=record(1, 10))
    assert isinstance(err.value, CapacityError) and isinstance(err.value.__cause__, NoSpace)
    assert st.held() == [] and st.used == 0
    assert files_of(tmp_path / WORKER) == {}
    assert [p.name for p in (tmp_path / WORKER).iterdir()] == []  # not even its folder
    assert st.restore() == 0 and st.held() == []


@pytest.mark.parametrize("where", ["shard.json", RECORD])
def test_a_create_whose_shard_json_or_record_the_full_disk_refuses_is_undone_too(tmp_path, monkeypatch, where):
    st = store(tmp_path)
    k, v = kv(10)
    st.create(ShardWrite("c", 0, "float32", 100, np.arange(10)), k, v, context=record(1, 10))
    st.note_context("c", record(1, 10))
    before = files_of(tmp_path / WORKER)
    full_after_write(monkeypatch, only=where)
    with pytest.raises(StorageFull, match="nothing of it was stored"):  # a second shard of c on this worker
        st.create(ShardWrite("c", 1, "float32", 100, np.arange(10, 20)), *kv(10, seed=1),
                  context={**record(2, 10), "shards": [*record(2, 10)["shards"], {"index": 1, "length": 10}]})
    assert [(i.context_id, i.index, i.length) for i in st.held()] == [("c", 0, 10)]
    assert st.held()[0].context == record(1, 10)  # the record it held before, in memory and on disk
    assert files_of(tmp_path / WORKER) == before
    again = ShardStore(10**8, files=ShardFiles(tmp_path / WORKER))
    assert again.restore() == 1 and [(i.index, i.length, i.context) for i in again.held()] == [(0, 10, record(1, 10))]


def test_append_to_full_persist_dir_is_refused_and_leaves_shard_unchanged(tmp_path, monkeypatch):
    st = store(tmp_path)
    k, v = kv(30)
    st.create(ShardWrite("c", 0, "float32", 100, np.arange(10)), k[:10], v[:10], context=record(1, 10))
    st.append(ShardWrite("c", 0, "float32", 100, np.arange(10, 20)), k[10:20], v[10:20], committed=10)
    st.note_context("c", record(2, 20))
    info, used, on_disk = st.info("c", 0), st.used, files_of(tmp_path / WORKER)
    full_segments(monkeypatch)
    with pytest.raises(StorageFull, match=rf"^worker {WORKER}'s --persist-dir is full \(No space left on device\): "
                                          r"the append to shard 0 of context c was refused, and nothing of it "
                                          r"was stored$"):
        st.append(ShardWrite("c", 0, "float32", 100, np.arange(20, 30)), k[20:], v[20:], committed=20)
    assert st.info("c", 0) == info and st.used == used
    got_k, got_v = contract_layout(st.view("c", 0, 20))
    assert got_k.tobytes() == k[:20].tobytes() and got_v.tobytes() == v[:20].tobytes()
    assert files_of(tmp_path / WORKER) == on_disk
    monkeypatch.undo()  # room again: the same append is stored, and comes back after a restart
    st.append(ShardWrite("c", 0, "float32", 100, np.arange(20, 30)), k[20:], v[20:], committed=20)
    st.note_context("c", record(3, 30))
    again = ShardStore(10**8, files=ShardFiles(tmp_path / WORKER))
    assert again.restore() == 1
    got_k, got_v = contract_layout(again.view("c", 0, 30))
    assert got_k.tobytes() == k.tobytes() and got_v.tobytes() == v.tobytes()


def test_an_append_that_fails_for_another_disk_error_is_not_called_full(tmp_path, monkeypatch):
    st = store(tmp_path)
    k, v = kv(20)
    st.create(ShardWrite("c", 0, "float32", 100, np.arange(10)), k[:10], v[:10], context=record(1, 10))
    full_segments(monkeypatch, "Error while serializing: I/O error: Input/output error (os error 5)")
    with pytest.raises(SafetensorError, match="os error 5"):
        st.append(ShardWrite("c", 0, "float32", 100, np.arange(10, 20)), k[10:], v[10:], committed=10)
