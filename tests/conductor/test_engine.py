from mooncake_conductor.engine import Conductor, ConductorConfig

from .helpers import cluster, queue, request

KEYS = list(range(20))


def test_admission_rejects_predicted_ttft_miss() -> None:
    c = cluster(2)
    for p in c.prefill:
        queue(p, 40.0)
    d = Conductor(ConductorConfig(policy="conductor", params={"cpp": {"enabled": False}})).schedule(
        request(KEYS), c, 0.0
    )
    assert d.rejected and d.reject_reason == "ttft-slo"
    # a policy without admission serves it anyway
    d = Conductor(ConductorConfig(policy="least-load")).schedule(request(KEYS), c, 0.0)
    assert not d.rejected


def test_admission_rejects_predicted_tbt_miss_only_with_admission() -> None:
    c = cluster(2, decode=1)
    c.decode[0].batch, c.decode[0].context_tokens = 300, 1_300_000
    cfg = {"slo": {"ttft_s": 30.0, "tbt_s": 0.02}}
    assert (
        Conductor(ConductorConfig(policy="conductor", **cfg))
        .schedule(request(KEYS), c, 0.0)
        .reject_reason
        == "tbt-slo"
    )
    assert (
        not Conductor(ConductorConfig(policy="random", **cfg))
        .schedule(request(KEYS), c, 0.0)
        .rejected
    )
    forced = ConductorConfig(policy="random", admission=True, decode_selector="tbt-slo", **cfg)
    assert Conductor(forced).schedule(request(KEYS), c, 0.0).rejected


def test_schedule_feeds_hot_prefix_tracker() -> None:
    c = cluster(2)
    c.index.store(0, KEYS)
    cond = Conductor(ConductorConfig(policy="conductor"))
    for t in range(10):
        cond.schedule(request(KEYS, arrival=float(t)), c, float(t))
    hot = cond.hot.hot(10.0)
    assert hot and hot[0][2][-1] == KEYS[-1]
