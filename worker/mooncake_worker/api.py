"""What the worker's HTTP server and its engine relay share: the OpenAI-style error
response and the liveness path."""

from __future__ import annotations

from aiohttp import web

#: the kubelet's liveness check: this process answers, whatever its engine is doing (in
#: relay mode ``/health`` is the engine's, which may load weights for minutes)
LIVENESS_PATH = "/livez"


class ApiError(Exception):
    """An OpenAI-style error response."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type_: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or {
            400: "invalid_request_error",
            404: "not_found_error",
            405: "invalid_request_error",
            413: "invalid_request_error",
            429: "rate_limit_error",
            503: "service_unavailable_error",
        }.get(status, "server_error")
        self.headers = headers

    def response(self) -> web.Response:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}
        return web.json_response(body, status=self.status, headers=self.headers)
