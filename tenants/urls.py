from django.contrib.auth import views as auth_views
from django.urls import path

from . import views

urlpatterns = [
    path("accounts/login/", views.LoginView.as_view(), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("account/", views.account, name="account"),
    path("account/tokens/", views.api_token_create, name="api-token-create"),
    path("account/tokens/<int:pk>/revoke/", views.api_token_revoke, name="api-token-revoke"),
    path("tenant/switch/", views.tenant_switch, name="tenant-switch"),
    path("team/", views.team, name="team"),
    path("team/members/", views.team_add, name="team-add"),
    path("team/members/<int:pk>/role/", views.team_set_role, name="team-set-role"),
    path("team/members/<int:pk>/remove/", views.team_remove, name="team-remove"),
    path("tenant/calendar-feed/rotate/", views.ical_token_rotate, name="ical-token-rotate"),
]
