"""A minimal JSON client for the local apiserver (client-cert auth), incl. watch streams."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

JsonDict = dict[str, Any]
DEFAULT_TIMEOUT_S = 30.0
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_PATCH = "application/strategic-merge-patch+json"


class ApiError(RuntimeError):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:500]}")
        self.status = status
        self.body = body


@dataclass
class KubeHttp:
    server: str
    ca_file: Path
    cert_file: Path
    key_file: Path

    def __post_init__(self) -> None:
        ctx = ssl.create_default_context(cafile=str(self.ca_file))
        ctx.load_cert_chain(str(self.cert_file), str(self.key_file))
        self._ctx = ctx

    def _open(
        self,
        method: str,
        path: str,
        body: JsonDict | None = None,
        content_type: str = "application/json",
        timeout: float = DEFAULT_TIMEOUT_S,
    ) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.server + path, data=data, method=method)
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", content_type)
        try:
            return urllib.request.urlopen(req, context=self._ctx, timeout=timeout)
        except urllib.error.HTTPError as err:
            raise ApiError(err.code, err.read().decode(errors="replace")) from None

    def request(
        self,
        method: str,
        path: str,
        body: JsonDict | None = None,
        content_type: str = "application/json",
        timeout: float = DEFAULT_TIMEOUT_S,
    ) -> JsonDict:
        with self._open(method, path, body, content_type, timeout) as resp:
            raw = resp.read()
        parsed: JsonDict = json.loads(raw) if raw else {}
        return parsed

    def get_text(self, path: str, timeout: float = DEFAULT_TIMEOUT_S) -> str:
        with self._open("GET", path, timeout=timeout) as resp:
            text: str = resp.read().decode()
        return text

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
        query = dict(params, watch="true", timeoutSeconds=str(timeout_s))
        url = f"{path}?{urllib.parse.urlencode(query)}"
        with self._open("GET", url, timeout=timeout_s + DEFAULT_TIMEOUT_S) as resp:
            for line in resp:
                if line.strip():
                    event: JsonDict = json.loads(line)
                    yield event
