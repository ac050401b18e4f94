"""Running a server process until it is told to stop (shared by the worker and gateway
commands)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable, Coroutine
from typing import Any

#: signals that end a server cleanly (what Kubernetes and a terminal send)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def run_until_stopped(
    serve: Callable[[], Coroutine[Any, Any, None]],
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
) -> None:
    """Run ``serve()`` on a new event loop until it returns or a stop signal cancels
    it (its cleanup runs either way); errors while starting propagate to the caller."""

    async def main() -> None:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        if task is not None:
            for sig in STOP_SIGNALS:
                loop.add_signal_handler(sig, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await serve()

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(main())
