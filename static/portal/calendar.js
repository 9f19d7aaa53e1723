/* The booking calendar: FullCalendar (MIT standard bundle) in the user's time zone (Luxon plugin),
 * the tenant's reservations plus the selected pool's free capacity as background shading.
 * Drag-select opens the htmx booking form; drag/resize PATCHes the REST API and snaps back on refusal. */
(function () {
  "use strict";
  var cfgEl = document.getElementById("calendar-config");
  var el = document.getElementById("calendar");
  if (!cfgEl || !el || !window.FullCalendar) { return; }
  var cfg = JSON.parse(cfgEl.textContent);
  var panel = document.getElementById("side-panel");
  var statusEl = document.getElementById("calendar-status");
  var csrf = document.querySelector('meta[name="csrf-token"]').getAttribute("content");
  var narrow = window.matchMedia("(max-width: 720px)").matches;
  var cal;

  function say(message, kind) {
    statusEl.textContent = message;
    statusEl.setAttribute("data-kind", kind || "info");
  }

  // A column's day as the site writes a date ("Fri 4 Dec"), whatever the browser's language: FullCalendar
  // passes the day's fields in the calendar's zone.
  var DAY_NAMES = ["Sun", "Mon", "Tue", "Wed", "Thu", "Fri", "Sat"];
  var MONTH_NAMES = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"];
  function dayHeading(arg) {
    var d = arg.date;
    return DAY_NAMES[new Date(Date.UTC(d.year, d.month, d.day)).getUTCDay()] + " " + d.day + " " + MONTH_NAMES[d.month];
  }

  // The toolbar's title for a day or a week, day before month as every date on the site ("Sun 6 Dec 2026",
  // "7 – 13 Dec 2026", "28 Dec 2026 – 3 Jan 2027"), not FullCalendar's US "December 6, 2026" / "Dec 7 – 13, 2026".
  function rangeTitle(arg) {
    var s = arg.start, e = arg.end || arg.start;
    if (s.year === e.year && s.month === e.month && s.day === e.day) { return dayHeading({ date: s }) + " " + s.year; }
    var first = s.day + (s.month === e.month && s.year === e.year ? "" : " " + MONTH_NAMES[s.month]) +
                (s.year === e.year ? "" : " " + s.year);
    return first + " – " + e.day + " " + MONTH_NAMES[e.month] + " " + e.year;
  }

  // A time as the site writes one ("Tue 8 Dec 13:00 CET", PAGE_TIME_FORMAT), whatever the browser's language:
  // built from the instant's fields in the calendar's zone, not from a formatter in the browser's locale (a US
  // browser wrote "Tue, Dec 8, 13:00 GMT+1"). One formatter per kind: building one per call costs more than
  // the rendering.
  var fieldsFormat = new Intl.DateTimeFormat("en-GB", { timeZone: cfg.tz, year: "numeric", month: "numeric",
                                                        day: "numeric", hour: "2-digit", minute: "2-digit",
                                                        hourCycle: "h23" });
  // The zone's short name as the pages write it ("CET", "EST", "GMT"): British English names Europe's zones,
  // US English America's; where neither has a name (Asia/Tokyo) the offset ("GMT+9").
  var zoneFormats = ["en-GB", "en-US"].map(function (locale) {
    return new Intl.DateTimeFormat(locale, { timeZone: cfg.tz, timeZoneName: "short" });
  });
  function parts(format, date) {
    var out = {};
    format.formatToParts(date).forEach(function (p) { out[p.type] = p.value; });
    return out;
  }
  function zoneName(date) {
    var names = zoneFormats.map(function (f) { return parts(f, date).timeZoneName || ""; });
    for (var i = 0; i < names.length; i++) {
      if (/^[A-Z]{2,5}$/.test(names[i])) { return names[i]; }
    }
    return names[0];
  }
  function clock(date) {
    var p = parts(fieldsFormat, date);
    return (p.hour === "24" ? "00" : p.hour) + ":" + p.minute + " " + zoneName(date);
  }
  function when(iso) {
    var date = new Date(iso);
    var p = parts(fieldsFormat, date);
    var day = Number(p.day), month = Number(p.month) - 1;
    return DAY_NAMES[new Date(Date.UTC(Number(p.year), month, day)).getUTCDay()] + " " + day + " " +
           MONTH_NAMES[month] + " " + clock(date);
  }
  var timeFormat = { format: clock };

  // An event's whole label, for its tooltip and accessible name: its box may be too small for the time and
  // title it shows, and its colour alone is no way to say its status (or that it is billed as burst).
  function fullLabel(event) {
    var props = event.extendedProps || {};
    var status = (props.status ? " · " + props.status : "") +
                 (event.classNames.indexOf("bill-burst") >= 0 ? " · burst" : "");
    if (!event.start) { return event.title + status; }
    var start = when(event.start.toISOString());
    var end = "";
    if (event.end) {
      var sameDay = dayKeyFormat.format(event.start) === dayKeyFormat.format(event.end);
      end = " – " + (sameDay ? timeFormat.format(event.end) : when(event.end.toISOString()));
    }
    return start + end + " · " + event.title + status;
  }

  // The API gives the times in its refusals in UTC ("2026-12-04 10:00Z"); the page says every time in the
  // user's zone, so those are shown the way this page shows times.
  function localTimes(text) {
    return String(text).replace(/(\d{4}-\d{2}-\d{2}) (\d{2}:\d{2})Z/g, function (match, date, time) {
      return when(date + "T" + time + ":00Z");
    });
  }

  function loadPanel(url) {
    return window.htmx.ajax("GET", url, { target: panel, swap: "innerHTML" });
  }

  function openForm(start, end) {
    var params = new URLSearchParams({ start: start, end: end });
    if (cfg.pool) { params.set("pool", cfg.pool); }
    return loadPanel(cfg.formUrl + "?" + params.toString());
  }

  // A month can hold a thousand bookings. FullCalendar puts every event in the DOM even when a day shows
  // "+N more" (fullcalendar#6148), so the month view gets the first few per day and one link to the rest.
  var MONTH_PER_DAY = 4;
  var dayKeyFormat = new Intl.DateTimeFormat("en-CA", { timeZone: cfg.tz, year: "numeric", month: "2-digit",
                                                        day: "2-digit" });

  function compactMonth(events) {
    var perDay = {};
    var order = [];
    events.forEach(function (e) {
      var day = dayKeyFormat.format(new Date(e.start));
      if (!perDay[day]) { perDay[day] = []; order.push(day); }
      perDay[day].push(e);
    });
    var out = [];
    order.forEach(function (day) {
      var list = perDay[day];
      for (var i = 0; i < Math.min(list.length, MONTH_PER_DAY); i++) { out.push(list[i]); }
      if (list.length > MONTH_PER_DAY) {
        out.push({
          id: "more-" + day, title: "+" + (list.length - MONTH_PER_DAY) + " more", start: day, allDay: true,
          url: "?view=timeGridDay&date=" + day + (cfg.pool ? "&pool=" + encodeURIComponent(cfg.pool) : ""),
          classNames: ["more-link"], extendedProps: { more: day }
        });
      }
    });
    return out;
  }

  function reservations(info, success, failure) {
    var params = new URLSearchParams({ start: info.startStr, end: info.endStr });
    if (cfg.pool) { params.set("pool", cfg.pool); }
    var month = (info.end.valueOf() - info.start.valueOf()) / 86400000 > 8;
    fetch(cfg.eventsUrl + "?" + params.toString(), {
      credentials: "same-origin", headers: { Accept: "application/json" }
    }).then(function (r) { return r.ok ? r.json() : Promise.reject(r); }).then(function (events) {
      success(month && !cfg.showAll ? compactMonth(events) : events);
    }).catch(function (err) {
      say(err && err.status === 401 ? "You are signed out. Reload the page to sign in again."
        : "Could not load reservations.", "error");
      failure(err);
    });
  }

  function availability(info, success, failure) {
    if (!cfg.pool) { success([]); return; }
    var days = (info.end.valueOf() - info.start.valueOf()) / 86400000;
    var params = new URLSearchParams({
      pool: cfg.pool, start: info.startStr, end: info.endStr, granularity: days > 8 ? "day" : "slot"
    });
    fetch(cfg.availabilityUrl + "?" + params.toString(), {
      credentials: "same-origin", headers: { Accept: "application/json" }
    }).then(function (r) { return r.ok ? r.json() : Promise.reject(r); }).then(success).catch(failure);
  }

  function answer(r) {
    return r.json().catch(function () { return {}; }).then(function (data) {
      if (!r.ok) { throw data; }
      return data;
    });
  }

  // Two ISO times (one from the API, one an event's startStr/endStr, offsets and all) naming the same instant.
  function sameInstant(a, b) {
    return !!a && !!b && new Date(a).valueOf() === new Date(b).valueOf();
  }

  // Move or extend through the REST API; the server decides, a refusal puts the event back.
  // The new window is worked out from the box as shown: if the booking was changed since the calendar loaded
  // it (another lead extended it), the gesture is refused and the calendar reloaded — a stale box dragged
  // "longer" would otherwise send an end earlier than the booking has by now.
  function change(info, body, verb) {
    var id = info.event.id;
    var url = cfg.apiUrl.replace("/0/", "/" + id + "/");
    say("Saving reservation #" + id + "…");
    fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } }).then(answer)
      .then(function (now) {
        if (!sameInstant(now.start, info.oldEvent.startStr) || !sameInstant(now.end, info.oldEvent.endStr)) {
          throw { stale: true, detail: "reservation #" + id + " was changed since this calendar was loaded (it " +
                  "now runs " + when(now.start) + " – " + when(now.end) + "); the calendar shows it as it is now." };
        }
        return fetch(url, {
          method: "PATCH",
          credentials: "same-origin",
          headers: { "Content-Type": "application/json", Accept: "application/json", "X-CSRFToken": csrf },
          body: JSON.stringify(body)
        }).then(answer);
      }).then(function (data) {
        say("Reservation #" + id + " " + verb + ": " + when(data.start) + " – " + when(data.end) + ".", "ok");
        cal.refetchEvents();
      }).catch(function (err) {
        info.revert();
        say("Not changed — " + ((err && err.detail && localTimes(err.detail)) || "the server refused the change."),
            "error");
        if (err && err.stale) { cal.refetchEvents(); }
      });
  }

  // The browser's own zone needs no conversion library: only a different chosen zone goes through Luxon.
  var browserTz = "";
  try { browserTz = Intl.DateTimeFormat().resolvedOptions().timeZone; } catch (e) { browserTz = ""; }

  // Where the day's first slot starts: the pool's slots run from the UTC epoch, so in a zone whose
  // offset is not a whole number of slots (+05:30 with hourly slots) they start off local midnight,
  // and selections must snap to them, not to local hours. Daily and longer slots: the whole day.
  function gridStart(minutes, offset) {
    if (!minutes || minutes >= 1440) { return "00:00:00"; }
    var shift = ((offset % minutes) + minutes) % minutes;
    var pad = function (n) { return (n < 10 ? "0" : "") + n; };
    return pad(Math.floor(shift / 60)) + ":" + pad(shift % 60) + ":00";
  }

  // The zone's UTC offset (minutes) on the days shown, which daylight saving changes: a 2-hour pool's
  // slots start at 01:00 Berlin time in winter and at 00:00 in summer. The server sends the offset of
  // the day the page opened on; paging on takes the one most of the shown days have.
  var viewOffset = cfg.utcOffsetMinutes || 0;

  function offsetOf(info) {
    if (!window.luxon) { return viewOffset; }
    var day = window.luxon.DateTime.fromISO(info.startStr.slice(0, 10) + "T12:00", { zone: cfg.tz });
    var days = Math.min(Math.round((info.end.valueOf() - info.start.valueOf()) / 86400000), 42);
    if (!day.isValid || days < 1) { return viewOffset; }
    var count = {}, best = viewOffset, most = 0;
    for (var i = 0; i < days; i++) {
      var offset = day.plus({ days: i }).offset;
      count[offset] = (count[offset] || 0) + 1;
      if (count[offset] > most) { most = count[offset]; best = offset; }
    }
    return best;
  }

  // A whole day picked in the month view starts at that day's first slot on the pool's grid, as the day
  // view's first row does: local midnight is off the grid where the offset is not a whole number of
  // slots (00:30 for an hourly pool in +05:30). Computed per day, so a day past a clock change gets its
  // own offset; sent with the offset, so a repeated hour is never guessed.
  function dayOnGrid(day) {
    var minutes = cfg.poolSlots[cfg.pool] || cfg.slotMinutes || 60;
    if (!window.luxon) { return day + "T" + gridStart(minutes, viewOffset); }
    var midnight = window.luxon.DateTime.fromISO(day, { zone: cfg.tz });
    if (!midnight.isValid) { return day; }
    var ms = minutes * 60000;
    var first = Math.ceil(midnight.toMillis() / ms) * ms;
    return window.luxon.DateTime.fromMillis(first, { zone: cfg.tz }).toISO({ suppressMilliseconds: true });
  }

  function selectDays(startDay, endDay) {
    var start = dayOnGrid(startDay), end = dayOnGrid(endDay);
    if (window.luxon && window.luxon.DateTime.fromISO(end) <= window.luxon.DateTime.fromISO(start)) {
      // Slots longer than the days picked: one whole slot.
      var minutes = cfg.poolSlots[cfg.pool] || cfg.slotMinutes || 60;
      end = window.luxon.DateTime.fromISO(start, { setZone: true }).plus({ minutes: minutes })
        .toISO({ suppressMilliseconds: true });
    }
    openForm(start, end);
  }

  // The hint of the first not-bookable shading [start, end) overlaps, or "" when it overlaps none.
  var refusedSelection = false;
  function notBookable(start, end) {
    var events = cal.getEvents();
    for (var i = 0; i < events.length; i++) {
      var ev = events[i];
      if (ev.display === "background" && ev.extendedProps.bookable === false && ev.start && ev.end &&
          ev.start < end && ev.end > start) {
        return ev.extendedProps.hint || "this time cannot be booked.";
      }
    }
    return "";
  }

  function layGrid() {
    var wanted = gridStart(cfg.poolSlots[cfg.pool] || cfg.slotMinutes, viewOffset);
    if (cal && cal.getOption("slotMinTime") !== wanted) { cal.setOption("slotMinTime", wanted); }
  }

  function hideIcons() {
    el.querySelectorAll(".fc-icon[role='img']").forEach(function (icon) { icon.setAttribute("aria-hidden", "true"); });
  }

  cal = new FullCalendar.Calendar(el, {
    timeZone: cfg.tz === browserTz ? "local" : cfg.tz,
    initialView: cfg.initialView || (narrow ? "timeGridDay" : "timeGridWeek"),
    initialDate: cfg.initialDate || undefined,
    // The days its feeds take: "Previous" and "Next" are disabled at the edges, not paged into an error.
    validRange: cfg.validRange || undefined,
    headerToolbar: narrow
      ? { left: "prev,next", center: "title", right: "today" }
      : { left: "prev,next today", center: "title", right: "dayGridMonth,timeGridWeek,timeGridDay" },
    footerToolbar: narrow ? { center: "dayGridMonth,timeGridWeek,timeGridDay" } : false,
    buttonText: { today: "Today", month: "Month", week: "Week", day: "Day" },
    firstDay: 1,
    // "Week" is the next seven days from the shown date: the days worth booking, not a half-gone calendar week.
    // Column headings name the month, day first as every date on the site ("Fri 4 Dec"): FullCalendar's
    // default "Fri 12/4" reads as 12 April to most, and its "Fri, Dec 4" is US order.
    views: { timeGridWeek: { duration: { days: 7 }, buttonText: "Week", dayHeaderFormat: dayHeading,
                             titleFormat: rangeTitle },
             timeGridDay: { titleFormat: rangeTitle } },
    eventDisplay: "block",
    height: "auto",
    expandRows: true,
    nowIndicator: true,
    allDaySlot: false,
    scrollTime: "07:00:00",
    slotDuration: { minutes: cfg.slotMinutes },
    snapDuration: { minutes: cfg.slotMinutes },
    slotMinTime: gridStart(cfg.slotMinutes, viewOffset),
    slotLabelFormat: { hour: "2-digit", minute: "2-digit", hour12: false },
    eventTimeFormat: { hour: "2-digit", minute: "2-digit", hour12: false },
    dayMaxEvents: false,  // the month view is compacted before rendering (compactMonth)
    lazyFetching: false,  // so a day or week view never reuses a compacted month's events
    selectable: !!cfg.canBook,
    selectMirror: true,
    unselectAuto: false,
    editable: false,
    eventResizableFromStart: false,
    eventSources: [
      { id: "reservations", events: reservations },
      { id: "availability", events: availability }
    ],
    // No selection across time no booking may take now (the past, beyond the booking horizon): the
    // availability feed shades it not bookable, cut where the service's rule is (services.bookable_span),
    // and the status line says why instead of the form's preview refusing it.
    selectAllow: function (info) {
      var closed = notBookable(info.start, info.end);
      if (closed) {
        refusedSelection = true;
        say(closed, "error");  // the hint says "Not bookable" and why
        return false;
      }
      if (refusedSelection) { refusedSelection = false; say(""); }
      return true;
    },
    select: function (info) {
      if (!cfg.canBook) { return; }
      if (info.allDay) { selectDays(info.startStr, info.endStr); return; }
      openForm(info.startStr, info.endStr);
    },
    eventClick: function (info) {
      if (info.event.display === "background") { return; }
      info.jsEvent.preventDefault();
      if (info.event.extendedProps.more) { cal.changeView("timeGridDay", info.event.extendedProps.more); return; }
      loadPanel(cfg.panelUrl.replace("/0/", "/" + info.event.id + "/"));
    },
    eventDrop: function (info) {
      change(info, { start: info.event.startStr, end: info.event.endStr }, "moved");
    },
    eventResize: function (info) {
      var longer = info.event.end > info.oldEvent.end;
      change(info, { end: info.event.endStr }, longer ? "extended" : "shortened");
    },
    eventDidMount: function (arg) {
      // Shading where nothing can be booked (the past, beyond the horizon) says why in its tooltip.
      if (arg.event.display === "background" && arg.event.extendedProps.hint) {
        arg.el.setAttribute("title", arg.event.extendedProps.hint);
      }
      // Events are links to their page (focusable, Enter opens the panel); tests and scripts find them by id.
      if (arg.event.display !== "background" && !arg.event.extendedProps.more) {
        arg.el.setAttribute("data-reservation-id", arg.event.id);
        arg.el.setAttribute("title", fullLabel(arg.event));
        // Its status in words in the box (not only its colour, WCAG 1.4.1), after the time and title, so its
        // accessible name says it once, last. It never shrinks: a long title gives way to it (ellipsis).
        var status = arg.event.extendedProps.status;
        if (status) {
          var shown = document.createElement("span");
          shown.className = "ev-status";
          shown.textContent = status;
          if (arg.event.classNames.indexOf("bill-burst") >= 0) {
            // Shown where there is room (a week or day column); a month cell has only the stripes for it.
            var burst = document.createElement("span");
            burst.className = "ev-burst";
            burst.textContent = " · burst";
            shown.appendChild(burst);
          }
          (arg.el.querySelector(".fc-event-main-frame") || arg.el).appendChild(shown);
        }
      }
    },
    // FullCalendar's prev/next buttons are named by their title; the icon inside is an unnamed role="img"
    // that screen readers announce as an empty image. Hide it (the toolbar re-renders with each view).
    // Each new range of days also lays the slots on the pool's grid at that range's UTC offset.
    datesSet: function (info) {
      hideIcons();
      viewOffset = offsetOf(info);
      layGrid();
    },
    loading: function (isLoading) {
      if (isLoading) { el.setAttribute("data-ready", "0"); return; }
      // Two frames after the last source renders, the events are painted.
      requestAnimationFrame(function () {
        requestAnimationFrame(function () {
          el.setAttribute("data-ready", "1");
          if (window.performance && performance.mark) { performance.mark("portal:events-painted"); }
        });
      });
    }
  });
  cal.render();
  hideIcons();
  window.portalCalendar = cal;

  document.body.addEventListener("reservation-changed", function () {
    cal.unselect();
    cal.refetchEvents();
  });
  document.addEventListener("portal:panel-closed", function () { cal.unselect(); });

  // Changing the pool re-shades without a page load (the form still works without JavaScript).
  var poolForm = document.getElementById("pool-form");
  if (poolForm) {
    poolForm.addEventListener("submit", function (e) {
      e.preventDefault();
      cfg.pool = poolForm.elements.pool.value;
      var slot = { minutes: cfg.poolSlots[cfg.pool] || 60 };
      cal.setOption("slotDuration", slot);
      cal.setOption("snapDuration", slot);
      layGrid();
      var url = new URL(window.location.href);
      url.searchParams.set("pool", cfg.pool);
      window.history.replaceState(null, "", url);
      var newBooking = document.getElementById("new-booking");
      if (newBooking) {
        newBooking.setAttribute("hx-get", cfg.formUrl + "?pool=" + encodeURIComponent(cfg.pool));
        window.htmx.process(newBooking);
      }
      cal.refetchEvents();
    });
  }
})();
