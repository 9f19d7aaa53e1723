from django.urls import path

from . import views

app_name = "notifications"

urlpatterns = [
    path("", views.settings_page, name="settings"),
    path("slack/url/", views.slack_url, name="slack-url"),
    path("slack/events/", views.slack_events, name="slack-events"),
    path("slack/test/", views.slack_test, name="slack-test"),
    path("webhooks/", views.webhook_create, name="webhook-create"),
    path("webhooks/<int:pk>/", views.webhook_edit, name="webhook-edit"),
    path("webhooks/<int:pk>/rotate/", views.webhook_rotate, name="webhook-rotate"),
    path("webhooks/<int:pk>/delete/", views.webhook_delete, name="webhook-delete"),
    path("channels/<int:pk>/test/", views.channel_test, name="channel-test"),
    path("channels/<int:pk>/clear/", views.channel_clear, name="channel-clear"),
    path("deliveries/", views.delivery_log, name="deliveries"),
    path("deliveries/<int:pk>/retry/", views.delivery_retry, name="delivery-retry"),
]
