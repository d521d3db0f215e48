"""Serving options as the `serve` command reads them: refused when they would silently do the wrong thing."""

from __future__ import annotations

import argparse

import pytest

from serve.cli import add_serve_args, serving_config_from_args
from serve.config import ServingConfig


def args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    return parser.parse_args(["tiny", *argv])


def test_an_empty_auth_token_is_refused(monkeypatch, tmp_path):
    """Issue 14.12: an empty PAGED_JAX_AUTH_TOKEN silently turned auth off."""
    monkeypatch.setenv("PAGED_JAX_AUTH_TOKEN", "")
    with pytest.raises(ValueError, match="^PAGED_JAX_AUTH_TOKEN: is set but empty"):
        serving_config_from_args(args())
    monkeypatch.setenv("PAGED_JAX_AUTH_TOKEN", "tok")
    assert serving_config_from_args(args()).auth_token == "tok"
    (tmp_path / "token").write_text("\n")
    with pytest.raises(ValueError, match="^--auth-token-file: .* is empty"):
        serving_config_from_args(args("--auth-token-file", str(tmp_path / "token")))
    monkeypatch.delenv("PAGED_JAX_AUTH_TOKEN")
    assert serving_config_from_args(args()).auth_token is None


def test_a_queue_of_zero_is_refused():
    """Issue 14.12: --max-queued-requests 0 passed validation and then refused every request."""
    with pytest.raises(ValueError, match="^--max-queued-requests:"):
        serving_config_from_args(args("--max-queued-requests", "0"))
    assert serving_config_from_args(args("--max-queued-requests", "1")).max_queued_requests == 1


def test_a_token_without_tls_off_loopback_is_warned_about():
    """Issue 14.12: a bearer token sent in clear text over a network deserves a warning at start-up."""
    assert ServingConfig(host="0.0.0.0", auth_token="t").warnings()
    assert ServingConfig(host="10.1.2.3", auth_token="t").warnings()
    assert not ServingConfig(host="127.0.0.1", auth_token="t").warnings()
    assert not ServingConfig(host="localhost", auth_token="t").warnings()
    assert not ServingConfig(host="[::1]", auth_token="t").warnings()
    assert not ServingConfig(host="0.0.0.0").warnings()
    assert not ServingConfig(host="0.0.0.0", auth_token="t", tls_cert_file="c", tls_key_file="k").warnings()
