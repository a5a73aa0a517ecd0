"""The webhook's bearer token (file or variable, reloaded on change) and the receiver off without one."""

from __future__ import annotations

import dataclasses
import os
import socket

import pytest

from sits.operator.webhook import MAX_BODY_BYTES, condition_message, printable
from sits.operator.webhook_auth import BearerToken, WebhookTokenError, token_from
from tests.operator.helpers import WEBHOOK_TOKEN, post_alerts, sitsdeployment, wait_for_status
from tests.support.services import free_port, wait_for_port


def test_a_token_matches_only_as_a_bearer_credential():
    token = BearerToken(token=f"  {WEBHOOK_TOKEN}\n")  # surrounding whitespace is not part of it
    assert token.accepts(f"Bearer {WEBHOOK_TOKEN}") and token.accepts(f"bearer  {WEBHOOK_TOKEN} ")
    for header in (None, "", "Bearer", f"Basic {WEBHOOK_TOKEN}", WEBHOOK_TOKEN, f"Bearer {WEBHOOK_TOKEN}x",
                   f"Bearer {WEBHOOK_TOKEN[:-1]}", "Bearer é" + WEBHOOK_TOKEN):
        assert not token.accepts(header), header


def test_unusable_tokens_are_refused_with_the_reason(tmp_path):
    with pytest.raises(WebhookTokenError, match="has 5 characters; at least 16"):
        BearerToken(token="short")
    with pytest.raises(WebhookTokenError, match="visible ASCII"):
        BearerToken(token="a token with spaces inside")
    with pytest.raises(WebhookTokenError, match="not both"):
        token_from(str(tmp_path / "token"), WEBHOOK_TOKEN)
    with pytest.raises(WebhookTokenError, match="cannot read the webhook token file"):
        token_from(str(tmp_path / "missing"), None)
    assert token_from(None, None) is None


def test_a_token_file_is_reread_when_the_secret_changes(tmp_path):
    # Kubernetes updates a mounted Secret by swapping a symlink to a new directory
    for version, token in (("v1", WEBHOOK_TOKEN), ("v2", "rotated-token-fedcba9876543210")):
        (tmp_path / version).mkdir()
        (tmp_path / version / "token").write_text(token)
    link = tmp_path / "current"
    link.symlink_to(tmp_path / "v1")
    token = BearerToken(path=link / "token")
    assert token.accepts(f"Bearer {WEBHOOK_TOKEN}")
    link.unlink()
    link.symlink_to(tmp_path / "v2")
    assert token.accepts("Bearer rotated-token-fedcba9876543210")
    assert not token.accepts(f"Bearer {WEBHOOK_TOKEN}")
    (tmp_path / "v2" / "token").write_text("short")  # a bad update keeps the last good token
    os.utime(tmp_path / "v2" / "token", ns=(1, 1))
    assert token.accepts("Bearer rotated-token-fedcba9876543210")


def test_condition_text_is_printable_bounded_and_one_line():
    assert condition_message("A", "") == "alert A firing"
    assert condition_message("A\tB", "x\n\x1b]0;title\x07y") == "alert A B firing: x ]0;title y"
    assert printable("é" * 300, 10) == "é" * 9 + "…" and len(condition_message("A", "z" * 10_000)) == 256


def refuses(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) != 0


def test_without_a_token_the_webhook_does_not_listen(kube, deployments, run_operator, operator_config):
    untokened = dataclasses.replace(operator_config, webhook_token=None, health_port=free_port())
    with run_operator(untokened):
        wait_for_port(untokened.health_port)  # startup ran: the webhook would have started with it
        kube.create(sitsdeployment("plain"))
        wait_for_status(kube, "plain", lambda s: s.get("phase") == "Healthy", what="Healthy")
        assert refuses(untokened.webhook_port)
    open_config = dataclasses.replace(untokened, webhook_allow_unauthenticated=True)
    with run_operator(open_config):
        wait_for_port(open_config.webhook_port)
        assert post_alerts(open_config.webhook_port, {"alerts": []}, token=None) == (200, {"status": "received"})
        huge = b'{"alerts": [], "padding": "' + b"x" * MAX_BODY_BYTES + b'"}'
        assert post_alerts(open_config.webhook_port, huge, token=None) == (
            413, {"error": f"the body is larger than {MAX_BODY_BYTES} bytes"})
