import pytest

from service.contexts.placement import WorkerLoad, place


def workers(*nodes, held=None):
    return [WorkerLoad(i, n, (held or {}).get(i, 0)) for i, n in enumerate(nodes)]


def test_replicas_of_a_shard_are_on_distinct_workers_and_nodes():
    ws = workers("a", "a", "b", "b", "c")
    for shard in place([100] * 7, 3, ws):
        assert len(set(shard)) == 3
        assert len({ws[i].node_id for i in shard}) == 3


def test_more_replicas_than_nodes_reuse_nodes_but_never_workers():
    ws = workers("a", "a", "b")
    for shard in place([1] * 4, 3, ws):
        assert sorted(shard) == [0, 1, 2]


def test_least_loaded_worker_is_chosen_first_counting_this_placement():
    ws = workers("a", "b", "c", held={0: 1000, 1: 0, 2: 10})
    # loads 1000, 0, 10: worker 1 takes 5, then 10 (still least), then ties with worker 2 at 10: lower index.
    assert place([5, 5, 5], 1, ws) == [[1], [1], [1]]
    assert place([5, 5, 5, 5], 1, ws)[3] == [2]
    spread = place([100] * 3, 1, workers("a", "b", "c"))
    assert sorted(s[0] for s in spread) == [0, 1, 2]


def test_placement_is_deterministic():
    ws = workers("a", "b", "a", "c")
    assert place([3, 1, 4, 1, 5], 2, ws) == place([3, 1, 4, 1, 5], 2, ws)


def test_impossible_replica_counts_raise_naming_them():
    with pytest.raises(ValueError, match="replicas must be at most the number of live workers \\(2\\), got 3"):
        place([1], 3, workers("a", "b"))
    with pytest.raises(ValueError, match="replicas must be >= 1, got 0"):
        place([1], 0, workers("a"))
