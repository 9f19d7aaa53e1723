/* GPU Portal: small progressive enhancements shared by every page. */
(function () {
  "use strict";

  // The sign-in form sends the browser's time zone; the server shows times in it until the user picks another.
  function fillTimeZone() {
    var tz = "";
    try { tz = Intl.DateTimeFormat().resolvedOptions().timeZone || ""; } catch (e) { tz = ""; }
    document.querySelectorAll('input[name="tz"][type="hidden"]').forEach(function (input) {
      if (!input.value) { input.value = tz; }
    });
  }

  // The header's menus (<details>) close on a click elsewhere and on Escape (focus back on their summary).
  function closeMenus(except) {
    document.querySelectorAll(".top .menu details[open]").forEach(function (menu) {
      if (menu !== except) { menu.removeAttribute("open"); }
    });
  }

  function onKeyDown(event) {
    if (event.key !== "Escape") { return; }
    var open = document.querySelector(".top .menu details[open]");
    if (open) {
      open.removeAttribute("open");
      open.querySelector("summary").focus();
      return;
    }
    // Escape closes the calendar's side panel (what its Close button does) while focus is in it.
    var panel = document.getElementById("side-panel");
    if (panel && panel.contains(document.activeElement) && panel.querySelector("[data-close-panel]")) {
      event.preventDefault();
      closePanel(panel);
    }
  }

  function onClick(event) {
    closeMenus(event.target.closest && event.target.closest(".top .menu details"));
    var copy = event.target.closest("[data-copy]");
    if (copy) {
      var source = document.querySelector(copy.getAttribute("data-copy"));
      if (source && navigator.clipboard) {
        navigator.clipboard.writeText(source.value).then(function () { copy.textContent = "Copied"; });
      } else if (source) {
        source.select();
      }
      return;
    }
    var close = event.target.closest("[data-close-panel]");
    if (close) { closePanel(close.closest("#side-panel")); }
  }

  function closePanel(panel) {
    var away = panel && panel.getAttribute("data-close-href");
    if (away) { window.location.assign(away); return; }
    if (panel) { panel.innerHTML = ""; }
    // Focus goes back to what opened the panel (the New booking button, an event), not to <body>:
    // a keyboard user's next Tab would otherwise start again at the top of the page.
    var back = panelOpener && panelOpener.isConnected ? panelOpener : document.getElementById("new-booking");
    panelOpener = null;
    if (back) { back.focus(); }
    document.dispatchEvent(new CustomEvent("portal:panel-closed"));
  }

  // What had focus when a side panel was asked for (outside the panel itself): Close returns focus there.
  var panelOpener = null;

  function onBeforeRequest(event) {
    var target = event.detail && event.detail.target;
    var active = document.activeElement;
    if (!target || target.id !== "side-panel" || !active || active === document.body) { return; }
    if (!target.contains(active)) { panelOpener = active; }
  }

  // After htmx swaps a panel in, move focus so keyboard and screen-reader users follow: to what went wrong
  // (an alert) first, else to the first field refused on its own (aria-invalid, its message next to it
  // through aria-describedby), else to what happened (a status), else to the heading. One selector list
  // would take whichever comes first in the panel, and its heading comes before the error of a refused booking.
  function onSwap(event) {
    var target = event.detail && event.detail.target;
    if (!target || target.id !== "side-panel") { return; }
    var invalid = target.querySelector("[aria-invalid=true]");
    if (!target.querySelector("[role=alert]") && invalid) {
      invalid.focus({ preventScroll: false });
      return;
    }
    var focus = target.querySelector("[role=alert]") || target.querySelector("[role=status]") ||
                target.querySelector("h2");
    if (focus) {
      if (!focus.hasAttribute("tabindex")) { focus.setAttribute("tabindex", "-1"); }
      focus.focus({ preventScroll: false });
    }
  }

  // The reason a 403 page gives (403.html: a role that does not allow this, say a lead made a viewer while
  // the page was open); none on a CSRF refusal.
  function refusalReason(xhr) {
    try {
      var doc = new DOMParser().parseFromString(xhr.responseText || "", "text/html");
      var reason = doc.querySelector("[data-refusal]");
      return reason ? reason.textContent.trim() : "";
    } catch (e) {
      return "";
    }
  }

  // htmx swaps only 2xx answers, so a refused (403: CSRF after signing in again elsewhere, or a role that
  // no longer allows it), missing or failed request would leave the user at a button that does nothing.
  // Say so above what they typed.
  function onHtmxError(event) {
    var detail = event.detail || {};
    var status = detail.xhr ? detail.xhr.status : 0;
    var text;
    var reason = status === 403 ? refusalReason(detail.xhr) : "";
    if (reason) {
      text = "The portal refused this: " + reason + " Reload the page to see what you can do now.";
    } else if (status === 403) {
      text = "The portal refused this: your session has changed (signed out or in again in another tab?). " +
             "Reload the page, or sign in again, and try once more.";
    } else if (status === 0) {
      text = "Could not reach the portal. Check your connection and try again.";
    } else {
      text = "Something went wrong (HTTP " + status + "). Try again, or reload the page.";
    }
    var target = detail.target;
    var box = target && target.isConnected ? target : document.getElementById("main");
    if (!box) { window.alert(text); return; }
    var old = box.querySelector("[data-htmx-error]");
    // Focus follows only what the user did (a submit, a click), never a poll or the live preview.
    var cause = detail.requestConfig && detail.requestConfig.triggeringEvent;
    var byUser = cause && (cause.type === "submit" || cause.type === "click");
    // A poll failing again the same way has said so already: a new alert would be read out at every poll.
    if (old && !byUser && old.textContent === text) { return; }
    if (old) { old.remove(); }
    var p = document.createElement("p");
    p.className = "error";
    p.setAttribute("role", "alert");
    p.setAttribute("data-htmx-error", "");
    p.setAttribute("tabindex", "-1");
    p.textContent = text;
    box.insertBefore(p, box.firstChild);
    if (byUser) { p.focus({ preventScroll: false }); }
  }

  // A request to the same place that is answered again takes the error away: a poll answered 204 swaps
  // nothing, so the error said while it failed would otherwise stay on a part that works again.
  function onAfterRequest(event) {
    var detail = event.detail || {};
    var target = detail.target;
    if (!detail.successful || !target || !target.isConnected) { return; }
    var old = target.querySelector(":scope > [data-htmx-error]");
    if (old) { old.remove(); }
  }

  // Plain forms ask first through data-confirm (on the form or its submit button), never an inline
  // onsubmit/onclick: the production CSP has no 'unsafe-inline', so the browser ignores those and the
  // form would post without asking.
  function onSubmit(event) {
    var form = event.target;
    var button = event.submitter;
    var text = (button && button.getAttribute("data-confirm")) || (form.getAttribute && form.getAttribute("data-confirm"));
    if (text && !window.confirm(text)) { event.preventDefault(); }
  }

  document.addEventListener("DOMContentLoaded", fillTimeZone);
  document.addEventListener("submit", onSubmit);
  document.addEventListener("htmx:responseError", onHtmxError);
  document.addEventListener("htmx:sendError", onHtmxError);
  document.addEventListener("htmx:afterRequest", onAfterRequest);
  document.addEventListener("click", onClick);
  document.addEventListener("keydown", onKeyDown);
  document.addEventListener("htmx:beforeRequest", onBeforeRequest);
  document.addEventListener("htmx:afterSwap", onSwap);
})();
