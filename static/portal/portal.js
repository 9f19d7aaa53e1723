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

  function onClick(event) {
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
    if (close) {
      var panel = close.closest("#side-panel");
      if (panel) { panel.innerHTML = ""; }
      document.dispatchEvent(new CustomEvent("portal:panel-closed"));
    }
  }

  // After htmx swaps a panel in, move focus to its heading so keyboard and screen-reader users follow.
  function onSwap(event) {
    var target = event.detail && event.detail.target;
    if (!target || target.id !== "side-panel") { return; }
    var focus = target.querySelector("[role=alert], [role=status], h2");
    if (focus) {
      if (!focus.hasAttribute("tabindex")) { focus.setAttribute("tabindex", "-1"); }
      focus.focus({ preventScroll: false });
    }
  }

  document.addEventListener("DOMContentLoaded", fillTimeZone);
  document.addEventListener("click", onClick);
  document.addEventListener("htmx:afterSwap", onSwap);
})();
