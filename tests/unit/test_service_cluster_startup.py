"""service.cluster.startup: the checks a start makes before it spawns workers."""

import pytest

from service.cluster.startup import WORKER_PREFIX, check_stores


def store(root, index: int, *, empty: bool = False) -> None:
    folder = root / f"{WORKER_PREFIX}{index}"
    folder.mkdir(parents=True)
    if not empty:
        (folder / "ctx").mkdir()


def test_a_start_with_the_stores_workers_or_more_is_allowed(tmp_path):
    check_stores(tmp_path / "absent", 2)  # nothing stored yet
    store(tmp_path, 0)
    store(tmp_path, 1)
    check_stores(tmp_path, 2)
    check_stores(tmp_path, 3)


def test_stores_of_workers_not_started_refuse_the_start_naming_them(tmp_path):
    for i in range(4):
        store(tmp_path, i)
    with pytest.raises(ValueError) as err:
        check_stores(tmp_path, 2)
    message = str(err.value)
    assert f"holds the stores of {WORKER_PREFIX}2, {WORKER_PREFIX}3, which --workers 2 does not start" in message
    assert "start with --workers 4" in message


def test_empty_folders_and_other_names_are_not_stores(tmp_path):
    store(tmp_path, 0)
    store(tmp_path, 5, empty=True)  # left by a worker that held nothing
    (tmp_path / f"{WORKER_PREFIX}x").mkdir()
    (tmp_path / f"{WORKER_PREFIX}\u00b2" / "ctx").mkdir(parents=True)  # a digit to str.isdigit, not a worker's index
    (tmp_path / "notes").mkdir()
    (tmp_path / f"{WORKER_PREFIX}7").write_text("a file, not a store")
    check_stores(tmp_path, 1)
