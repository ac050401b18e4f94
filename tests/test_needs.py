"""A missing external program fails the test with its instruction unless opted out by name."""

from __future__ import annotations

import pytest

from tests import needs


def test_missing_fails_with_the_instruction(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(needs.OPT_OUT_ENV, raising=False)
    with pytest.raises(pytest.fail.Exception, match="pip install x") as err:
        needs.missing("store", "x is not installed: pip install x")
    assert f"{needs.OPT_OUT_ENV}=store" in str(err.value)
    assert "\n" not in str(err.value)


def test_an_explicit_opt_out_skips_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(needs.OPT_OUT_ENV, "helm, store")
    with pytest.raises(pytest.skip.Exception, match="pip install x"):
        needs.missing("store", "x is not installed: pip install x")
    with pytest.raises(pytest.fail.Exception):  # opting out of helm says nothing of kubectl
        needs.missing("kubectl", "kubectl is not installed")


def test_an_unknown_opt_out_is_an_error_not_a_silent_no_op(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(needs.OPT_OUT_ENV, "stor")
    with pytest.raises(pytest.fail.Exception, match="unknown"):
        needs.missing("store", "x")
    with pytest.raises(ValueError):
        needs.missing("no-such-requirement", "x")
