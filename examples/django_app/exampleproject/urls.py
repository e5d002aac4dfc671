"""URL routes of the example project."""

from django.urls import path

from orders import views

urlpatterns = [path("orders/", views.place_order_view, name="place-order")]
