"""Which session a request continues and what it keeps (``cluster.sessions``): the headers
agent clients send, the bounds, the last turn, and the 400s."""

from __future__ import annotations

import pytest

from cluster.api.errors import APIError
from cluster.config import SessionsConfig
from cluster.sessions import retention, session_id
from cluster.tenants import Tenant
from replica.messages import Retention

CONFIG = SessionsConfig(max_retention_s=120, default_retention_s=0)
TENANT = Tenant("team")


def test_the_session_comes_from_ours_or_an_agent_clients_header_in_that_order() -> None:
    assert session_id({}) is None
    assert session_id({"x-claude-code-session-id": "cc-1"}) == "cc-1"
    assert session_id({"thread-id": "codex-7", "x-dynamo-session-id": "dyn"}) == "dyn"
    assert session_id({"x-session-id": "ours", "session-id": "codex"}) == "ours"
    for bad in ("", "has space", "x" * 129):
        with pytest.raises(APIError) as error:
            session_id({"x-session-id": bad})
        assert error.value.status == 400 and error.value.param == "x-session-id"


def test_retention_is_qualified_by_tenant_capped_and_released_on_the_last_turn() -> None:
    session = {"x-session-id": "s1"}
    assert retention(CONFIG, TENANT, session, None) is None  # no hint, no default
    assert retention(CONFIG, TENANT, session, 30) == Retention("team/s1", "team", 30)
    header = {**session, "x-cache-retention-s": "45"}
    assert retention(CONFIG, TENANT, header, None) == Retention("team/s1", "team", 45)
    assert retention(CONFIG, TENANT, header, 10) == Retention("team/s1", "team", 10)  # body
    assert retention(CONFIG, TENANT, session, 9999).ttl_s == 120  # the cluster's bound
    strict = Tenant("strict", max_retention_s=5)
    assert retention(CONFIG, strict, session, 60) == Retention("strict/s1", "strict", 5)
    final = {**session, "x-session-final": "true"}
    assert retention(CONFIG, TENANT, final, None) == Retention("team/s1", "team", 0)
    assert retention(CONFIG, TENANT, {**final, "x-cache-retention-s": "30"}, None).ttl_s == 0
    default = SessionsConfig(default_retention_s=20)
    assert retention(default, TENANT, session, None) == Retention("team/s1", "team", 20)
    assert retention(default, TENANT, {}, None) is None


def test_retention_without_a_session_keeps_blocks_under_a_key_of_their_own() -> None:
    one, two = retention(CONFIG, TENANT, {}, 30), retention(CONFIG, TENANT, {}, 30)
    assert one is not None and two is not None and one.session != two.session
    assert one.session.startswith("team/~") and one.ttl_s == 30
    assert retention(CONFIG, TENANT, {}, 0) is None  # nothing kept, nothing to release


def test_a_bad_retention_header_is_a_400() -> None:
    for bad in ("-1", "soon", "nan", "inf"):
        with pytest.raises(APIError) as error:
            retention(CONFIG, TENANT, {"x-session-id": "s", "x-cache-retention-s": bad}, None)
        assert error.value.status == 400 and error.value.param == "x-cache-retention-s"
