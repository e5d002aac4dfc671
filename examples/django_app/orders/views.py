"""``POST /orders/`` with ``{"workspace_id": …, "sku": …}``: place an order."""

import json

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from onceflow import InvalidRequest
from orders.services import place_order


@csrf_exempt  # a JSON API for the example; use your project's auth and CSRF policy
@require_POST
def place_order_view(request: HttpRequest) -> HttpResponse:
    """Place an order; answers 201 with the order id and its confirmation request."""
    try:
        body = json.loads(request.body)
        workspace_id, sku = str(body["workspace_id"]), str(body["sku"])
    except (ValueError, KeyError, TypeError):
        return JsonResponse({"error": "send JSON with workspace_id and sku"}, status=400)
    try:
        order, result = place_order(workspace_id, sku)
    except InvalidRequest as exc:  # e.g. a malformed workspace id: the order rolled back
        return JsonResponse({"error": str(exc)}, status=400)
    return JsonResponse(
        {
            "order_id": order.pk,
            "status": order.status,
            "request_id": result.request_id,
            "created": result.created,
        },
        status=201,
    )
