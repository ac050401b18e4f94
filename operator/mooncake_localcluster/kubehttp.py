"""The embedded cluster's API client: the project's one client, with client-cert auth.

The pod runner, the service proxy and ``local-cluster`` itself speak to the API server
as its components do, with the admin client certificate. Requests go through
:class:`mooncake_kube.client.KubeClient` (pooled TLS connections, one error type);
this module keeps the path-style calls these components make.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mooncake_kube.client import (
    JSON,
    MERGE_PATCH,
    REQUEST_TIMEOUT_S,
    STRATEGIC_PATCH,
    KubeClient,
    KubeError,
    api_client_with_cert,
)

JsonDict = dict[str, Any]
DEFAULT_TIMEOUT_S = REQUEST_TIMEOUT_S
#: an API error (``status``, ``body``): the one client's error type
ApiError = KubeError

__all__ = ["DEFAULT_TIMEOUT_S", "MERGE_PATCH", "STRATEGIC_PATCH", "ApiError", "KubeHttp"]


@dataclass
class KubeHttp:
    server: str
    ca_file: Path
    cert_file: Path
    key_file: Path
    client: KubeClient = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.client = KubeClient(
            api_client_with_cert(self.server, self.ca_file, self.cert_file, self.key_file))

    def request(
        self,
        method: str,
        path: str,
        body: JsonDict | None = None,
        content_type: str = JSON,
        timeout: float = DEFAULT_TIMEOUT_S,
    ) -> JsonDict:
        out: JsonDict = self.client.call(method, path, body, content_type, timeout_s=timeout)
        return out or {}

    def get_text(self, path: str, timeout: float = DEFAULT_TIMEOUT_S) -> str:
        return self.client.text(path, timeout)

    def get(self, path: str) -> JsonDict:
        return self.request("GET", path)

    def post(self, path: str, body: JsonDict) -> JsonDict:
        return self.request("POST", path, body)

    def patch(self, path: str, body: JsonDict, content_type: str = MERGE_PATCH) -> JsonDict:
        return self.request("PATCH", path, body, content_type)

    def delete(self, path: str) -> JsonDict:
        return self.request("DELETE", path)

    def watch(self, path: str, params: dict[str, str], timeout_s: int) -> Iterator[JsonDict]:
        """Yield watch events (``{"type": ..., "object": ...}``) until the server closes."""
        stream = self.client.watch(path, params, timeout_s)
        try:
            yield from stream
        finally:
            stream.close()
