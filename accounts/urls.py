from django.contrib.auth import views as auth_views
from django.urls import path

from . import views

urlpatterns = [
    path("favicon.ico", views.favicon, name="favicon"),
    path("apply/", views.apply, name="apply"),
    path("login/", views.LoginView.as_view(), name="login"),
    path("second-factor/", views.second_factor_verify, name="second_factor_verify"),
    path("second-factor/enrol/", views.second_factor_enrol, name="second_factor_enrol"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("staff/applications/", views.staff_applications, name="staff_applications"),
    path(
        "staff/applications/<int:application_id>/decide/",
        views.staff_application_decide,
        name="staff_application_decide",
    ),
    path("staff/users/", views.staff_users, name="staff_users"),
    path("staff/audit/", views.staff_audit, name="staff_audit"),
    path("staff/spend-cap/", views.staff_spend_cap, name="staff_spend_cap"),
]
