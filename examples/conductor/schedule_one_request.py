"""Ask the Conductor core where one request should go, with no I/O at all.

    python examples/conductor/schedule_one_request.py

Builds a 4-instance cluster in memory, lets instance 0 hold a 16-block prefix and
be busy, and shows the decision with its top candidates (queue, transfer, prefill).
"""

from mooncake_conductor.blockkeys import block_keys, namespace_seed
from mooncake_conductor.engine import Conductor, ConductorConfig
from mooncake_conductor.index import PrefixIndex
from mooncake_conductor.state import ClusterState, DecodeState, PrefillState, RequestInfo

BLOCK = 512
seed = namespace_seed("meta-llama/Llama-3-70B", BLOCK)
conversation = list(range(20 * BLOCK))  # token ids of a 10,240-token prompt
keys = block_keys(conversation, BLOCK, seed)

index = PrefixIndex(capacity_blocks=6000, instances=4)  # 3M tokens per instance
cluster = ClusterState(
    prefill=[PrefillState(iid=i, name=f"prefill-{i}") for i in range(4)],
    decode=[DecodeState(iid=i, name=f"decode-{i}", capacity_tokens=1_300_000) for i in range(2)],
    index=index,
)
index.store(0, keys[:16])  # instance 0 already holds the first 16 blocks ...
cluster.prefill[0].busy_until = 4.0  # ... but is busy for another 4 s

conductor = Conductor(ConductorConfig(policy="conductor", params={"explain": True}))
request = RequestInfo(rid=1, arrival=0.0, input_tokens=len(conversation), output_tokens=300,
                      keys=keys, block_tokens=BLOCK)
decision = conductor.schedule(request, cluster, now=0.0)
pl = decision.placement
print(f"prefill on instance {pl.prefill}: reuse {pl.local_blocks} local + {pl.fetch_blocks} "
      f"fetched blocks (from {pl.source}), predicted TTFT {pl.ttft_s:.2f} s")
print(f"decode on instance {decision.decode.decode}, predicted TBT "
      f"{1000 * decision.decode.predicted_tbt_s:.1f} ms; rejected: {decision.reject_reason}")
for c in pl.candidates:
    print("  candidate", {k: round(v, 3) for k, v in c.items()})
