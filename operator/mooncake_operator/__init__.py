"""The kopf operator: reconciles ``MooncakeCluster`` objects into prefill and decode pods, a
Mooncake Store and the gateway's view of the cluster, and runs the Conductor controller
that places hot-prefix replicas.

Its surface for the other packages: ``engines.support`` (the engine releases it makes pods
for, which the conformance kit installs); the CLI loads ``cli`` by name. The rest is
internal (an import-linter contract holds this).
"""

__version__ = "0.1.0"
