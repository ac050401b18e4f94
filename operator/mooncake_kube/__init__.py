"""The one Kubernetes client of the operator, the gateway and the embedded cluster.

Surface: :mod:`.client` (``KubeClient``, ``KubeError``, the ApiClient makers, patch
content types) and :mod:`.listwatch` (``ListWatch``, ``object_key``). It stands on the
``kubernetes`` package only, below every part that talks to an API server.
"""
