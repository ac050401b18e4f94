"""``warm_up`` (:mod:`mooncake_conductor.warmup`) leaves no kernel of
:mod:`mooncake_conductor.kernels` to compile later."""

from __future__ import annotations

import pytest
from mooncake_conductor import kernels
from mooncake_conductor.warmup import warm_up


def test_warm_up_compiles_every_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    # each compiled loop (and helper) is a module global, None until compiled: forget the
    # ones earlier tests compiled (restored afterwards), so warm_up must do them all
    lazy = [name for name in kernels.__annotations__ if name.startswith("_")
            and not name.isupper()]
    assert {"_kernel", "_lookup", "_upsert", "_chain", "_rank", "_decode"} <= set(lazy)
    for name in lazy:
        monkeypatch.setattr(kernels, name, None)
    warm_up()
    assert [name for name in lazy if getattr(kernels, name) is None] == []
    assert kernels.chain_loaded()
