"""The simulator's topology: places for simulated instances, the true cost of every
cross-domain transfer (whether or not decisions see it), and the CLI flag."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from mooncake_cli.main import main
from mooncake_conductor.cpp import plan_cpp
from mooncake_conductor.engine import ConductorConfig
from mooncake_conductor.topology import LinkLevel, TopologyConfig
from mooncake_sim.engine import SimConfig, Simulation, simulate
from mooncake_sim.presets import LINK_LEVELS, parse_topology
from mooncake_sim.synth import generate, write_trace
from mooncake_sim.trace import TraceRecord
from pydantic import ValidationError

BT = 512
ZONE = LinkLevel(name="zone", gbits_per_s=50, latency_s=1e-3)


def _sim(records: list[TraceRecord], aware: bool = True, domains: int = 2,
         policy: str = "conductor", **kw: Any) -> Simulation:
    return Simulation(records, SimConfig(
        domains=[domains],
        conductor=ConductorConfig(policy=policy,
                                  topology=TopologyConfig(levels=[ZONE], aware=aware)),
        **kw))


def test_instances_get_places_blocked_or_round_robin() -> None:
    s = _sim([], prefill=4, decode=4)
    labels = [s.topology.labels(p.place) for p in s.cluster.prefill]
    assert labels == [("zone-0",), ("zone-0",), ("zone-1",), ("zone-1",)]
    assert [d.place for d in s.cluster.decode] == [p.place for p in s.cluster.prefill]
    rr = _sim([], prefill=4, decode=4, domain_assignment="round-robin")
    assert [rr.topology.labels(p.place)[0] for p in rr.cluster.prefill] == \
        ["zone-0", "zone-1", "zone-0", "zone-1"]
    assert all(p.place == 0 for p in Simulation([], SimConfig()).cluster.prefill)


def test_domains_must_match_the_levels() -> None:
    with pytest.raises(ValidationError, match="one count per topology level"):
        SimConfig(domains=[2])
    with pytest.raises(ValidationError, match="one count per topology level"):
        SimConfig(conductor=ConductorConfig(topology=TopologyConfig(levels=[ZONE])))


@pytest.mark.parametrize("aware", [True, False])
def test_transfers_pay_the_cross_domain_link_either_way(aware: bool) -> None:
    s = _sim([], aware=aware, prefill=4, decode=2, nic_contention=False)
    tokens = 16_384
    near = s._transfer(0, 1, tokens, 0.0)
    far = s._transfer(0, 3, tokens, 0.0)
    assert near == pytest.approx(s.cost.transfer_time(tokens))
    eff = s.cost.config.efficiency.transfer_efficiency
    assert far == pytest.approx(1e-3 + tokens * s.cost.kv_bytes_per_token / (50e9 / 8 * eff))
    assert far > 4 * near


def _one(tokens: int, output: int = 50) -> list[TraceRecord]:
    return [TraceRecord(timestamp_ms=0, input_length=tokens, output_length=output,
                        hash_ids=list(range(1, (tokens + BT - 1) // BT + 1)))]


def test_decode_stream_across_zones_delays_the_second_token() -> None:
    """One long prompt on the prefill instance of zone 0, decoded in zone 0 or zone 1: the
    far decode instance joins later by the far link's last-layer share (the stream
    overlaps the prefill) and its latency, which the first token interval carries."""
    def tbt_for(decode_up: int) -> float:
        s = _sim(_one(131_072), prefill=1, decode=2, policy="least-load", domains=2)
        assert s.cluster.prefill[0].place == s.cluster.decode[0].place
        assert s.cluster.prefill[0].place != s.cluster.decode[1].place
        s.cluster.decode[1 - decode_up].up = False
        s.run()
        return s.reqs[0].tbt

    near, far = tbt_for(0), tbt_for(1)
    s = _sim([], prefill=1, decode=2)
    eff = s.cost.config.efficiency.transfer_efficiency
    layers = s.cost.config.model.layers
    tokens = 131_072
    far_join = tokens * s.cost.kv_bytes_per_token / (50e9 / 8 * eff) / layers + 1e-3
    near_join = s.cost.transfer_time(tokens) / layers
    take = 5  # the longest 10% of 49 intervals
    assert far - near == pytest.approx((far_join - near_join) / take, rel=0.1)


def test_cpp_hand_off_pays_the_slowest_link() -> None:
    s = _sim([], prefill=4, decode=1)
    slow = s.topology.link(s.cost, 0)
    n = 100_000
    near = plan_cpp(s.cost, n, 0, 2, 4096)
    far = plan_cpp(s.cost, n, 0, 2, 4096, slow)
    assert far.makespan_s > near.makespan_s
    assert s.topology.group_level(p.place for p in s.cluster.prefill[:2]) == -1
    assert s.topology.group_level(p.place for p in s.cluster.prefill[1:3]) == 0


def test_aware_choice_keeps_streams_inside_a_zone() -> None:
    records = generate("conversation", 200, seed=4)
    cross: dict[bool, int] = {}
    for aware in (True, False):
        s = _sim(records, aware=aware, prefill=4, decode=4)
        s.run()
        count = 0
        for r in s.reqs:
            d = r.decision
            if d is None or d.rejected or d.placement.prefill is None or d.decode.decode is None:
                continue
            count += (s.cluster.prefill[d.placement.prefill].place
                      != s.cluster.decode[d.decode.decode].place)
        cross[aware] = count
    assert cross[True] < cross[False] / 4


def test_one_domain_with_levels_decides_as_unaware() -> None:
    records = generate("conversation", 150, seed=5)
    a = simulate(records, _sim_config(aware=True, domains=1))
    b = simulate(records, _sim_config(aware=False, domains=1))
    for key in ("ttft_mean_s", "tbt_p99_ms", "token_hit_ratio", "rejected", "steals"):
        assert a[key] == b[key]


def _sim_config(aware: bool, domains: int) -> SimConfig:
    return SimConfig(prefill=4, decode=4, domains=[domains], nic_contention=True,
                     conductor=ConductorConfig(topology=TopologyConfig(levels=[ZONE],
                                                                       aware=aware)))


def test_parse_topology() -> None:
    levels, domains = parse_topology("zone=2,rack=4")
    assert [lv.name for lv in levels] == ["rack", "zone"] and domains == [4, 2]
    assert levels[0] == LINK_LEVELS["rack"]
    for bad in ("zone", "dc=2", "zone=0", "zone=2,zone=3", "rack=2,zone=4", ""):
        with pytest.raises(ValueError):
            parse_topology(bad)


def test_cli_topology_flag_reaches_the_settings(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    write_trace(generate("conversation", 120, seed=2), trace)
    out = tmp_path / "r.json"
    rc = main(["simulate", "--trace", str(trace), "--prefill", "4", "--decode", "4",
               "--topology", "zone=2", "--no-topology-aware", "--json", str(out),
               "--jobs", "1"])
    assert rc == 0
    topo = json.loads(out.read_text())["settings"]["topology"]
    assert topo["domains"] == [2] and topo["topology"]["aware"] is False
    assert topo["topology"]["levels"][0]["name"] == "zone"
    assert main(["simulate", "--trace", str(trace), "--topology", "dc=2"]) == 2
