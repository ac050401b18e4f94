from mooncake_conductor.replication import HotPrefixTracker, ReplicationConfig

from .helpers import cluster, queue

KEYS = list(range(10))


def test_hot_prefix_on_loaded_holder_is_copied_to_the_coolest_instance() -> None:
    tr, c, _keys = _hot_cluster()
    actions = tr.plan(c, 30.0)
    assert len(actions) == 1
    a = actions[0]
    assert (a.source, a.target, a.keys, a.prefix) == (0, 2, tuple(KEYS), KEYS[-1])
    assert a.rate_per_s > 0.05


def test_no_action_when_balanced_cold_or_short() -> None:
    c = cluster(3)
    c.index.store(0, KEYS)
    tr = HotPrefixTracker()
    for t in range(30):
        tr.record(KEYS, float(t))
    assert tr.plan(c, 30.0) == []  # holder not loaded
    queue(c.prefill[0], 20.0)
    assert tr.plan(c, 10_000.0) == []  # rate decayed: no longer hot
    tr.record(KEYS[:1], 1.0)
    assert all(len(k) >= 2 for _, _, k in tr.hot(1.0))


def test_max_replicas_and_tracking_bound() -> None:
    c = cluster(3)
    c.index.store(0, KEYS)
    c.index.store(1, KEYS)
    queue(c.prefill[0], 20.0)
    queue(c.prefill[1], 20.0)
    tr = HotPrefixTracker(ReplicationConfig(max_replicas=2, max_tracked=5))
    for t in range(30):
        tr.record(KEYS, float(t))
    assert tr.plan(c, 30.0) == []
    for i in range(20):
        tr.record([1000 + i, 2000 + i], 31.0)
    assert len(tr._tracked) == 5


def test_record_counts_the_leading_blocks_asked_for() -> None:
    tr = HotPrefixTracker(ReplicationConfig(min_rate_per_s=1e-9))
    tr.record(KEYS, 1.0, blocks=4)
    tr.record(KEYS[:4], 1.5)
    tr.record(KEYS, 2.0, blocks=1)  # shorter than min_blocks: not tracked
    [(prefix, rate, keys)] = tr.hot(2.0)
    assert (prefix, keys) == (KEYS[3], tuple(KEYS[:4]))
    assert rate > 0


def test_record_from_a_key_array_tracks_the_same_keys() -> None:
    import numpy as np

    a, b = (HotPrefixTracker(ReplicationConfig(min_rate_per_s=1e-9)) for _ in range(2))
    for t in range(3):
        a.record(KEYS, float(t), blocks=6)
        b.record(KEYS, float(t), blocks=6, key_array=np.array(KEYS, dtype=np.uint64))
    assert a.hot(3.0) == b.hot(3.0)
    assert a.hot(3.0)[0][2] == tuple(KEYS[:6])


def test_assign_replicas_rule() -> None:
    from mooncake_conductor.replication import HotPrefix, InstanceLoad, assign_replicas

    cfg = ReplicationConfig(load_ratio=1.5, load_floor_s=0.5, max_replicas=2, max_actions=4)
    loads = [InstanceLoad("a", 9.0), InstanceLoad("b", 1.0), InstanceLoad("c", 0.2)]
    hot = [HotPrefix("p", 1.0, 8, frozenset({"a"})), HotPrefix("q", 0.5, 8, frozenset({"b"}))]
    out = assign_replicas(hot, loads, {}, cfg)
    # p's only holder is a hot spot (9 > 1.5 * 3.4 + 0.5): one copy on the least loaded
    # instance at most the average; q's holder is not loaded
    assert out == {"a": frozenset(), "b": frozenset(), "c": frozenset({"p"})}
    # kept while hot, also when its holder has cooled; max_replicas caps copies
    calm = [InstanceLoad("a", 0.1), InstanceLoad("b", 0.1), InstanceLoad("c", 0.1)]
    assert assign_replicas(hot, calm, out, cfg)["c"] == frozenset({"p"})
    # released once cold, and an instance that left keeps nothing
    assert assign_replicas([], calm, out, cfg)["c"] == frozenset()
    assert "c" not in assign_replicas(hot, loads[:2], out, cfg)
    # short prefixes are not worth a copy
    short = [HotPrefix("p", 1.0, 1, frozenset({"a"}))]
    assert assign_replicas(short, loads, {}, cfg)["c"] == frozenset()


def test_assign_replicas_agrees_with_the_tracker_plan() -> None:
    """The operator's rule and the simulator's pick the same target for the same state."""
    from mooncake_conductor.replication import HotPrefix, InstanceLoad, assign_replicas

    tr, c, keys = _hot_cluster()
    (action,) = tr.plan(c, 30.0)
    now = 30.0
    loads = [InstanceLoad(str(p.iid), p.wait_time(now)) for p in c.prefill if p.up]
    holders = frozenset(str(p.iid) for p in c.prefill if c.index.match(p.iid, keys) == len(keys))
    out = assign_replicas([HotPrefix("x", 1.0, len(keys), holders)], loads, {}, tr.config)
    assert [n for n, ps in out.items() if ps] == [str(action.target)]


def _hot_cluster():  # type: ignore[no-untyped-def]
    c = cluster(4)
    c.index.store(0, KEYS)
    queue(c.prefill[0], 20.0)
    queue(c.prefill[1], 2.0)
    queue(c.prefill[3], 1.0)
    tr = HotPrefixTracker(ReplicationConfig())
    for t in range(30):
        tr.record(KEYS, float(t))
    return tr, c, KEYS
