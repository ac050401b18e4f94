"""The kopf operator: reconciles ``MooncakeCluster`` objects into prefill and decode pods, a
Mooncake Store and the gateway's view of the cluster, and runs the Conductor controller
that places hot-prefix replicas."""

__version__ = "0.1.0"
