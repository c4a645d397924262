from django.contrib.auth import views as auth_views
from django.urls import path

from . import views
from .forms import LoginForm

urlpatterns = [
    path("", views.home, name="home"),
    path("favicon.ico", views.favicon, name="favicon"),
    path("apply/", views.apply, name="apply"),
    path(
        "login/",
        auth_views.LoginView.as_view(
            authentication_form=LoginForm, redirect_authenticated_user=True
        ),
        name="login",
    ),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("keys/", views.keys, name="keys"),
    path("keys/<int:key_id>/rename/", views.key_rename, name="key_rename"),
    path("keys/<int:key_id>/budget/", views.key_budget, name="key_budget"),
    path("keys/<int:key_id>/disable/", views.key_disable, name="key_disable"),
    path("keys/<int:key_id>/enable/", views.key_enable, name="key_enable"),
    path("keys/<int:key_id>/revoke/", views.key_revoke, name="key_revoke"),
    path("staff/applications/", views.staff_applications, name="staff_applications"),
    path(
        "staff/applications/<int:application_id>/decide/",
        views.staff_application_decide,
        name="staff_application_decide",
    ),
    path("staff/users/", views.staff_users, name="staff_users"),
    path("staff/users/<int:user_id>/", views.staff_user_detail, name="staff_user_detail"),
    path("staff/users/<int:user_id>/status/", views.staff_user_status, name="staff_user_status"),
    path("staff/users/<int:user_id>/budget/", views.staff_user_budget, name="staff_user_budget"),
    path("staff/keys/<int:key_id>/budget/", views.staff_key_budget, name="staff_key_budget"),
    path("staff/keys/<int:key_id>/status/", views.staff_key_status, name="staff_key_status"),
    path("staff/audit/", views.staff_audit, name="staff_audit"),
    path("staff/spend-cap/", views.staff_spend_cap, name="staff_spend_cap"),
]
