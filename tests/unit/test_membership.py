"""Group's retry rule: an unreachable rendezvous is retried within the budget; a refused
site id is not (retrying cannot help, and the worker should exit with the reason at once)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dtrain.configs import GroupConfig
from dtrain.errors import AuthenticationError, RendezvousError
from dtrain.membership import Group
from dtrain.rendezvous.core import SiteIdTaken


class _Rendezvous:
    def __init__(self, errors: list[Exception]) -> None:
        self.errors = errors
        self.calls = 0

    def heartbeat(self, site_id: str, inner_step: int = 0, last_loss=None, round_reports=()):
        raise AssertionError("not called by these tests")

    def join(self, site_id: str, address: str, **kw):
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "joined"


def _group(rdv: _Rendezvous) -> Group:
    engine = SimpleNamespace(site_id="a", address="h:1", state=SimpleNamespace(rounds_applied=0))
    return Group(engine, rdv, GroupConfig(backoff_max_s=0.1))


@pytest.mark.timeout(10)
def test_a_refused_site_id_is_not_retried() -> None:
    rdv = _Rendezvous([SiteIdTaken("site id 'a' is held by a live site at h:2")])
    with pytest.raises(SiteIdTaken, match="held by a live site"):
        _group(rdv)._call_with_backoff(lambda: rdv.join("a", "h:1"), 30.0)
    assert rdv.calls == 1


@pytest.mark.timeout(10)
def test_a_refused_token_is_not_retried() -> None:
    rdv = _Rendezvous([AuthenticationError("rendezvous join at h:1 refused this site's token (UNAUTHENTICATED)")])
    with pytest.raises(AuthenticationError, match="UNAUTHENTICATED"):
        _group(rdv)._call_with_backoff(lambda: rdv.join("a", "h:1"), 30.0)
    assert rdv.calls == 1


@pytest.mark.timeout(10)
def test_an_unreachable_rendezvous_is_retried_within_the_budget() -> None:
    rdv = _Rendezvous([RendezvousError("unavailable"), RendezvousError("unavailable")])
    assert _group(rdv)._call_with_backoff(lambda: rdv.join("a", "h:1"), 30.0) == "joined"
    assert rdv.calls == 3
