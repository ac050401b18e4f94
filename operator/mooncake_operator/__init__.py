"""The mooncake-operator CLI, kopf operator, manifests and the embedded local cluster."""
