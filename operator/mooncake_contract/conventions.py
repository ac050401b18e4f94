"""Names and numbers the operator, the gateway and the worker agree on.

The operator writes these labels and annotations on the pods it makes; the gateway finds
pods and their ports by them; the worker's agent reads the replica annotation. Changing a
value here changes the wire contract between components (and between versions running
side by side during an upgrade), so every value is pinned by a test.
"""

from __future__ import annotations

from typing import Final

#: Prefix of every label, annotation and API group of the project.
DOMAIN: Final = "mooncake.io"

# -- labels -----------------------------------------------------------------------------------
#: The MooncakeCluster a pod (or Service, ConfigMap, ...) belongs to.
LABEL_CLUSTER: Final = f"{DOMAIN}/cluster"
#: What the pod is: one of :data:`ROLES`.
LABEL_ROLE: Final = f"{DOMAIN}/role"
#: The engine revision (hash over everything that affects the engines) a pod runs.
LABEL_REVISION: Final = f"{DOMAIN}/revision"
#: On ConfigMaps holding a gateway model ("the gateway's view of a cluster").
LABEL_GATEWAY_MODEL: Final = f"{DOMAIN}/gateway-model"
#: Kubernetes' recommended labels.
LABEL_APP_NAME: Final = "app.kubernetes.io/name"
LABEL_APP_INSTANCE: Final = "app.kubernetes.io/instance"
LABEL_APP_COMPONENT: Final = "app.kubernetes.io/component"
LABEL_MANAGED_BY: Final = "app.kubernetes.io/managed-by"
MANAGED_BY: Final = "mooncake-operator"

ROLE_PREFILL: Final = "prefill"
ROLE_DECODE: Final = "decode"
ROLE_STORE_MASTER: Final = "store-master"
ROLE_STORE_NODE: Final = "store-node"
ROLES: Final = (ROLE_PREFILL, ROLE_DECODE, ROLE_STORE_MASTER, ROLE_STORE_NODE)

# -- pod annotations --------------------------------------------------------------------------
#: JSON list of prefixes the pod's agent keeps warm (:mod:`mooncake_contract.annotations`).
ANNOTATION_REPLICAS: Final = f"{DOMAIN}/replicas"
#: The engine's (or relay's) OpenAI HTTP port, KV-event PUB port, replay ROUTER port, topic.
ANNOTATION_HTTP_PORT: Final = f"{DOMAIN}/http-port"
ANNOTATION_KV_EVENTS_PORT: Final = f"{DOMAIN}/kv-events-port"
ANNOTATION_KV_REPLAY_PORT: Final = f"{DOMAIN}/kv-replay-port"
ANNOTATION_KV_TOPIC: Final = f"{DOMAIN}/kv-topic"
#: ``"true"``: the gateway stops sending new requests to the pod (in-flight ones finish);
#: the operator sets it before it retires a pod.
ANNOTATION_DRAIN: Final = f"{DOMAIN}/drain"
#: Where the pod runs in the fleet's network: a JSON object of its node's topology labels
#: (:mod:`mooncake_contract.topology`); the operator writes it, the gateway reads it.
ANNOTATION_TOPOLOGY: Final = f"{DOMAIN}/topology"

# -- ports ------------------------------------------------------------------------------------
#: What a pod serves on when its annotations say nothing else.
PORT_HTTP: Final = 8000
PORT_KV_EVENTS: Final = 5557
PORT_KV_REPLAY: Final = 5558
#: mooncake_master's RPC, HTTP metadata and metrics ports; mooncake_client's service port.
PORT_STORE_RPC: Final = 50051
PORT_STORE_METADATA: Final = 8080
PORT_STORE_METRICS: Final = 9003
PORT_STORE_CLIENT: Final = 50052
#: The gateway's HTTP port.
PORT_GATEWAY: Final = 8080

#: Key of the gateway model document in a gateway-model ConfigMap.
GATEWAY_MODEL_KEY: Final = "model.yaml"
