"""ServiceAccount tokens for pod processes, requested and refreshed like the kubelet's.

The ServiceAccount admission plugin gives every pod that automounts a token (neither the
pod nor its ServiceAccount says ``automountServiceAccountToken: false``) a projected
volume ``kube-api-access-*`` mounted at ``/var/run/secrets/kubernetes.io/serviceaccount``:
a ``serviceAccountToken`` source (``expirationSeconds: 3607``, file ``token``), the
``kube-root-ca.crt`` ConfigMap's ``ca.crt`` and the namespace from the downward API. For
a ``serviceAccountToken`` source the kubelet (and the pod runner) asks the TokenRequest
API (``POST .../serviceaccounts/<sa>/token``) for a token bound to the pod, for the
source's audience (none given: the API server's own audiences, i.e. its issuer), and
requests a new one once 80% of its lifetime has passed (or after 24 h). Deleting the pod
invalidates its tokens.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

JsonDict = dict[str, Any]

DEFAULT_EXPIRATION_S = 3600  # the API's default for a serviceAccountToken source
REFRESH_AT_FRACTION = 0.8  # the kubelet's token manager: refresh with 20% of the TTL left
MAX_TOKEN_AGE_S = 24 * 3600  # ... or once the token is a day old
DEFAULT_SERVICE_ACCOUNT = "default"


@dataclass(frozen=True)
class Token:
    token: str
    issued_at: float  # epoch seconds: expiry minus the requested lifetime
    expires_at: float  # epoch seconds, from status.expirationTimestamp

    def refresh_at(self) -> float:
        """When the kubelet would ask for a new one (without its up-to-10 s jitter)."""
        ttl = self.expires_at - self.issued_at
        return self.issued_at + min(REFRESH_AT_FRACTION * ttl, MAX_TOKEN_AGE_S)

    def refresh_due(self, now: float) -> bool:
        return now >= self.refresh_at()


def service_account(pod: JsonDict) -> str:
    spec = pod.get("spec") or {}
    return str(spec.get("serviceAccountName") or spec.get("serviceAccount") or
               DEFAULT_SERVICE_ACCOUNT)


def request_path(pod: JsonDict) -> str:
    namespace = pod["metadata"]["namespace"]
    return f"/api/v1/namespaces/{namespace}/serviceaccounts/{service_account(pod)}/token"


def token_request(pod: JsonDict, source: JsonDict) -> JsonDict:
    """The TokenRequest for one ``serviceAccountToken`` projected source of ``pod``."""
    meta = pod["metadata"]
    spec: JsonDict = {
        "expirationSeconds": int(source.get("expirationSeconds") or DEFAULT_EXPIRATION_S),
        "boundObjectRef": {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": meta["name"],
            "uid": meta["uid"],
        },
    }
    if source.get("audience"):
        spec["audiences"] = [str(source["audience"])]
    return {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec}


def parse_rfc3339(text: str) -> float:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def token_from_response(response: JsonDict) -> Token:
    """The token and its lifetime from a TokenRequest response."""
    status = response.get("status") or {}
    token = str(status.get("token") or "")
    if not token:
        raise ValueError("TokenRequest returned no token")
    expires_at = parse_rfc3339(str(status["expirationTimestamp"]))
    ttl = int((response.get("spec") or {}).get("expirationSeconds") or DEFAULT_EXPIRATION_S)
    return Token(token=token, issued_at=expires_at - ttl, expires_at=expires_at)
