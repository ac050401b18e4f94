"""The worker's side of KV cache events: the ZeroMQ publisher with its replay buffer.

The codec and the subscriber are shared with the gateway: ``mooncake_contract.kvevents``.
"""
