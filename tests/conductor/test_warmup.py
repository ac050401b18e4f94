"""``warm_up`` (:mod:`mooncake_conductor.warmup`) leaves no kernel of the core's compiled
modules to compile later."""

from __future__ import annotations

import pytest
from mooncake_conductor import blockkeys_kernel
from mooncake_conductor.warmup import KERNEL_MODULES, warm_up


def test_warm_up_compiles_every_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    # each compiled loop (and helper) is a module global, None until compiled: forget the
    # ones earlier tests compiled (restored afterwards), so warm_up must do them all
    lazy = [(module, name) for module in KERNEL_MODULES for name in module.__annotations__
            if name.startswith("_") and not name.isupper()]
    assert {"_kernel", "_lookup", "_upsert", "_chain", "_rank", "_decode"} <= {
        name for _, name in lazy}
    for module, name in lazy:
        monkeypatch.setattr(module, name, None)
    warm_up()
    assert [name for module, name in lazy if getattr(module, name) is None] == []
    assert blockkeys_kernel.chain_loaded()
