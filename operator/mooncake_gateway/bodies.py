"""A cap on the request bytes the gateway holds at once, over every connection.

``max_body_bytes`` bounds one request; nothing bounded how many were held together. Twelve
62 MB bodies sent at once took a gateway from 669 MB to a 1.27 GB peak (issue 32), and a
container limit would have killed it, dropping every stream it relayed.

Rule: before a request's body is read, its ``Content-Length`` (``max_body_bytes`` for a
chunked body, whose length is not known) is reserved from ``max_buffered_bytes``. A body
that does not fit is refused with 503 and ``Retry-After`` before a byte of it is read;
the reservation is given back when the request ends (its body is forwarded to the engine,
so it lives that long). Small requests fit beside large ones until the cap is reached.
"""

from __future__ import annotations


class BodyBudget:
    """Bytes of request bodies reserved now, against a limit."""

    __slots__ = ("held", "limit", "peak", "refused")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self.peak = 0
        self.refused = 0

    def take(self, n: int) -> bool:
        """Reserve ``n`` bytes if they fit under the limit; whether they did."""
        if self.held + n > self.limit:
            self.refused += 1
            return False
        self.held += n
        self.peak = max(self.peak, self.held)
        return True

    def give(self, n: int) -> None:
        self.held -= n
        assert self.held >= 0, "gave back more than was taken"
