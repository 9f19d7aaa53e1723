"""Usability defects found walking the portal as a lead, a member and a viewer."""

from __future__ import annotations

import pytest

from .conftest import open_day

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def _empty_panel_hint(page) -> str:
    return page.evaluate(
        "getComputedStyle(document.getElementById('side-panel'), '::before').content")


def test_the_empty_side_panel_invites_only_those_who_can_book_to_book(world, live_server, new_page, sign_in, day):
    lead = sign_in(new_page(), "alpha-lead")
    open_day(lead, live_server, day)
    assert "book" in _empty_panel_hint(lead).lower()

    viewer = sign_in(new_page(), "alpha-viewer")
    open_day(viewer, live_server, day)
    hint = _empty_panel_hint(viewer)
    assert hint not in ("", "none", "normal")
    assert "book" not in hint.lower(), hint  # a viewer cannot book: dragging does nothing
    assert "reservation" in hint.lower()

