from django.urls import path

from . import views

urlpatterns = [
    path("", views.home, name="home"),
    path("keys/", views.keys, name="keys"),
    path("keys/<int:key_id>/rename/", views.key_rename, name="key_rename"),
    path("keys/<int:key_id>/budget/", views.key_budget, name="key_budget"),
    path("keys/<int:key_id>/disable/", views.key_disable, name="key_disable"),
    path("keys/<int:key_id>/enable/", views.key_enable, name="key_enable"),
    path("keys/<int:key_id>/revoke/", views.key_revoke, name="key_revoke"),
    path("staff/users/<int:user_id>/", views.staff_user_detail, name="staff_user_detail"),
    path("staff/users/<int:user_id>/status/", views.staff_user_status, name="staff_user_status"),
    path("staff/users/<int:user_id>/budget/", views.staff_user_budget, name="staff_user_budget"),
    path("staff/keys/<int:key_id>/budget/", views.staff_key_budget, name="staff_key_budget"),
    path("staff/keys/<int:key_id>/status/", views.staff_key_status, name="staff_key_status"),
]
