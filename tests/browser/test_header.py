"""The header at 1280 px: one line for a lead of two tenants and for staff, its menus usable by keyboard."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from tenants.models import Membership

from .conftest import DESKTOP, PHONE

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def _one_line(page) -> None:
    boxes = page.evaluate("""() => {
        const box = (el) => { const r = el.getBoundingClientRect(); return {top: r.top, bottom: r.bottom}; };
        return {items: [...document.querySelectorAll('header.top > *, header.top nav > ul > li')].map(box),
                overflow: document.documentElement.scrollWidth - window.innerWidth};
    }""")
    tops = [b["top"] for b in boxes["items"]]
    bottoms = [b["bottom"] for b in boxes["items"]]
    assert max(tops) < min(bottoms), f"the header wraps onto a second line: {boxes['items']}"
    assert boxes["overflow"] <= 1


def test_the_header_fits_one_line_at_1280_and_its_menus_work_by_keyboard(world, live_server, new_page, sign_in):
    beta = world.tenants["beta"]
    beta.name = "Large Language Model Pretraining Research"  # the longest a switcher will usually show
    beta.save()
    Membership.objects.create(user=world.users["alpha-lead"], tenant=beta, role="viewer")
    for who in ("alpha-lead", "staff"):
        page = sign_in(new_page(viewport=DESKTOP), who)
        _one_line(page)
        assert page.errors == []

    # Every page is still one key press away: Tab to Manage, Enter opens it, Escape closes it.
    page = sign_in(new_page(viewport=DESKTOP), "alpha-lead")
    manage = page.locator("header nav summary", has_text="Manage")
    manage.focus()
    page.keyboard.press("Enter")
    expect(page.get_by_role("link", name="Audit")).to_be_visible()
    _one_line(page)  # an open menu lies over the page, it pushes nothing
    page.keyboard.press("Escape")
    expect(page.get_by_role("link", name="Audit")).to_be_hidden()
    expect(manage).to_be_focused()
    page.keyboard.press("Enter")
    page.keyboard.press("Tab")
    page.keyboard.press("Tab")  # Notifications, Usage
    page.keyboard.press("Enter")
    page.wait_for_url("**/usage/**")
    expect(page.locator("header nav summary.current")).to_have_text("Manage")

    page.locator(".user-menu summary").click()
    page.get_by_role("link", name="Account").click()
    page.wait_for_url("**/account/**")
    page.locator(".user-menu summary").click()
    page.get_by_role("button", name="Sign out").click()
    page.wait_for_url("**/accounts/login/**")

    # A member has no Manage menu; on a phone an open menu folds out in place, nothing scrolls sideways.
    member = sign_in(new_page(viewport=DESKTOP), "alpha-member")
    expect(member.locator("header nav summary")).to_have_count(0)
    phone = sign_in(new_page(viewport=PHONE), "alpha-lead")
    phone.locator("header nav summary").click()
    expect(phone.get_by_role("link", name="Notifications")).to_be_visible()
    phone.locator(".user-menu summary").click()  # opening one closes the other
    expect(phone.get_by_role("link", name="Notifications")).to_be_hidden()
    expect(phone.get_by_role("button", name="Sign out")).to_be_in_viewport()
    assert phone.evaluate("document.documentElement.scrollWidth - window.innerWidth") <= 1
    assert phone.errors == []
