from django.urls import path

from . import usage, views

urlpatterns = [
    path("", views.dashboard, name="dashboard"),
    path("calendar/", views.calendar, name="calendar"),
    path("calendar/events.json", views.calendar_events, name="calendar-events"),
    path("calendar/availability.json", views.calendar_availability, name="calendar-availability"),
    path("reservations/", views.reservation_list, name="reservation-list-page"),
    path("reservations/new/", views.booking_form, name="booking-form"),
    path("reservations/preview/", views.booking_preview, name="booking-preview"),
    path("reservations/<int:pk>/", views.reservation_detail, name="reservation-page"),
    path("reservations/<int:pk>/panel/", views.reservation_panel, name="reservation-panel"),
    path("reservations/<int:pk>/extend/", views.reservation_extend, name="reservation-extend-page"),
    path("reservations/<int:pk>/rename/", views.reservation_rename, name="reservation-rename-page"),
    path("reservations/<int:pk>/cancel/", views.reservation_cancel, name="reservation-cancel-page"),
    path("availability/", views.heatmap, name="heatmap"),
    path("availability/grid/", views.heatmap_grid, name="heatmap-grid"),
    path("fleet/", views.fleet, name="fleet"),
    path("usage/", usage.usage_page, name="usage"),
    path("usage.csv", usage.usage_csv, name="usage-csv"),
    path("ical/<slug:slug>/<str:token>.ics", views.ical_feed, name="ical-feed"),
]
