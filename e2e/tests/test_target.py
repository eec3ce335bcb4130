"""The local/real switch refuses ambiguous settings instead of guessing."""
from __future__ import annotations

import pytest

from e2e.target import ENV_SWITCH, open_target


def test_real_mode_requires_kubeconfig(monkeypatch):
    monkeypatch.setenv(ENV_SWITCH, "real")
    monkeypatch.delenv("KUBECONFIG", raising=False)
    with pytest.raises(RuntimeError, match="needs KUBECONFIG"):
        open_target()


def test_unknown_mode_is_rejected(monkeypatch):
    monkeypatch.setenv(ENV_SWITCH, "staging")
    with pytest.raises(RuntimeError, match="must be 'local' or 'real'"):
        open_target()


def test_real_mode_starts_no_local_cluster(monkeypatch, tmp_path):
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text("apiVersion: v1\nkind: Config\n")
    monkeypatch.setenv(ENV_SWITCH, "real")
    monkeypatch.setenv("KUBECONFIG", f"{kubeconfig}:/elsewhere")
    target = open_target()
    try:
        assert target.local is None and target.real_node is None and target.kubeconfig == kubeconfig
    finally:
        target.close()
