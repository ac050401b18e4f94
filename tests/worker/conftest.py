"""Worker test fixtures (helpers live in ``worker_fixtures``)."""

from worker_fixtures import mooncake_master, worker

__all__ = ["mooncake_master", "worker"]
