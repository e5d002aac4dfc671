"""The OpenAPI schema describes what the API answers: schemathesis against a real `onceflow api`.

Every operation (but the endless event stream) is driven from the served
``/openapi.json`` with valid keys — an API key scoped to the workspace in the
path, a worker key of the worker class in the path — in schemathesis' positive
and negative modes, and every answer is checked against the schema: no 5xx,
a documented status, the documented content type, body and headers. Bounded
(a few examples per operation and mode) and deterministic (derandomized).

The answers the schema cannot describe per operation are checked by hand: 405
names every method of the path in ``Allow``, and every error — 400, 404, 405,
422 included — is the one documented shape ``{"detail": <one line>, "code"}``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from onceflow.integrations.fastapi.schemas import ID_PATTERN, WORKER_CLASS_PATTERN
from tests.acceptance.conftest import runtime  # noqa: F401 - the fixture
from tests.acceptance.procs import APP, ROOT
from tests.acceptance.test_http_api import (
    API_KEY,
    NOOP,
    OP,
    PULL,
    WORKER_KEY,
    api,  # noqa: F401 - the fixture: a real `onceflow api` process
    auth,
    client,  # noqa: F401 - the fixture
    snapshot,
)

pytestmark = pytest.mark.slow

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
]
EXAMPLES_PER_OPERATION = 15
STREAMING = "workspace_events"


def _one_line(text: Any) -> bool:
    return isinstance(text, str) and text != "" and "\n" not in text


def assert_error_shape(response: httpx.Response) -> dict[str, Any]:
    """An error answer: JSON ``{"detail": <one line>, "code": <str>, …}``."""
    assert response.headers["content-type"].startswith("application/json"), response.text
    body: dict[str, Any] = response.json()
    assert _one_line(body.get("detail")), body
    assert isinstance(body.get("code"), str) and body["code"], body
    return body


@pytest.fixture()
def schema(api: str, client: httpx.Client) -> Any:  # noqa: F811 - fixtures
    return schemathesis.openapi.from_url(f"{api}/openapi.json")


def _bodies(operation_id: str) -> st.SearchStrategy[Any] | None:
    """Bodies that reach past validation now and then (schemathesis alone rarely names a stage)."""
    if operation_id == "enqueue_request":
        return st.fixed_dictionaries(
            {"stage": st.just("noop"), "job_id": st.text("abc", min_size=1, max_size=3)},
            optional={"input": st.just({"value": 1}), "priority": st.integers(-5, 5)},
        )
    if operation_id == "apply_op":
        return st.fixed_dictionaries(
            {"op_id": st.from_regex(r"\A[a-z0-9]{16}\Z"), "op": st.just(OP)},
            optional={"base_clock": st.integers(0, 3)},
        )
    return None


def test_every_operation_answers_as_its_schema_says(
    schema: Any,
    api: str,  # noqa: F811 - the fixture
    client: httpx.Client,  # noqa: F811 - the fixture
    runtime: Any,  # noqa: F811 - the fixture
) -> None:
    operations = [result.ok() for result in schema.get_all_operations()]
    operations = [op for op in operations if op.definition.raw["operationId"] != STREAMING]
    # 12 + the pull routes: locks (3), claim events, sub-doc read, permits (4); + the probes (2)
    assert len(operations) == 23
    # A request that exists, so that reading one answers 200 (and its body is checked) too.
    made = client.post("/v1/workspaces/w1/requests", json=NOOP, headers=auth(API_KEY))
    assert made.status_code == 201, made.text
    existing = made.json()["request_id"]
    statuses: dict[str, set[int]] = {}
    for operation in operations:
        path_params: dict[str, str] = {}
        key = API_KEY
        if "{ws}" in operation.path:
            path_params["ws"] = "w1"
        if "{wc}" in operation.path:
            path_params["wc"] = PULL
        if operation.path.startswith("/v1/claims/") or "{wc}" in operation.path:
            key = WORKER_KEY
        seen = statuses.setdefault(operation.label, set())
        modes = [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE]
        raw = operation.definition.raw
        if not raw.get("parameters") and "requestBody" not in raw:
            modes = modes[:1]  # the probes: nothing to send wrong
        for mode in modes:
            cases = operation.as_strategy(generation_mode=mode, path_parameters=path_params)
            if operation.path == "/v1/workspaces/{ws}/requests/{request_id}":
                known = {**path_params, "request_id": existing}
                cases = cases | operation.as_strategy(generation_mode=mode, path_parameters=known)
            bodies = _bodies(operation.definition.raw["operationId"])
            if bodies is not None and mode is schemathesis.GenerationMode.POSITIVE:
                cases = st.tuples(cases, st.none() | bodies).map(_with_body)
            if operation.definition.raw["operationId"] in ("claim_next", "get_request"):
                cases = cases.map(_short_wait)  # a long poll of up to 60 s per example: cap it
            _drive(cases, api, key, seen)
    # The pass went past authentication and validation: successes and errors both answered.
    everything = set().union(*statuses.values())
    assert {200, 201, 422} <= everything, statuses
    assert statuses["POST /v1/workspaces/{ws}/requests"] >= {201, 422}, statuses
    assert statuses["GET /v1/workspaces/{ws}/requests/{request_id}"] >= {200, 404}, statuses


def _drive(cases: st.SearchStrategy[Any], api: str, key: str, seen: set[int]) -> None:  # noqa: F811
    @settings(
        max_examples=EXAMPLES_PER_OPERATION,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=cases)
    def run(case: Any) -> None:
        response = case.call_and_validate(base_url=api, headers=auth(key), checks=CHECKS)
        seen.add(response.status_code)

    run()


def _short_wait(case: Any) -> Any:
    """A long poll's ``wait`` (in the body of a claim, the query of a read) cut to 0.05 s."""
    for where in (case.body, case.query):
        wait = where.get("wait") if isinstance(where, dict) else None
        if isinstance(wait, int | float) and not isinstance(wait, bool) and 0 < wait <= 60:
            where["wait"] = min(wait, 0.05)
    return case


def _with_body(pair: tuple[Any, Any]) -> Any:
    case, body = pair
    if body is not None:
        case.body = body
    return case


# ------------------------------------------------------------ by hand: 405, 404, 400, 422


def test_405_names_every_method_of_the_path(client: httpx.Client) -> None:  # noqa: F811
    for method, path, allow in [
        ("DELETE", "/v1/workspaces/w1/requests", "GET, POST"),
        ("PUT", "/v1/workspaces/w1/requests", "GET, POST"),
        ("PATCH", "/v1/workspaces/w1/sub-docs/d/ops", "GET, POST"),
        ("GET", "/v1/claims/abc/complete", "POST"),
        ("DELETE", "/v1/workspaces/w1/requests/abc", "GET"),
    ]:
        response = client.request(method, path, headers=auth(API_KEY))
        assert response.status_code == 405, (method, path, response.text)
        assert response.headers["allow"] == allow, (method, path)
        assert assert_error_shape(response)["code"] == "method_not_allowed"


def test_unknown_route_and_unparseable_body_answer_the_error_shape(
    client: httpx.Client,  # noqa: F811 - the fixture
) -> None:
    missing = client.get("/v1/nothing-here", headers=auth(API_KEY))
    assert missing.status_code == 404
    assert assert_error_shape(missing)["code"] == "not_found"
    nested = client.post(
        "/v1/workspaces/w1/requests",
        content=b"[" * 5000 + b"]" * 5000,
        headers={**auth(API_KEY), "content-type": "application/json"},
    )
    assert nested.status_code == 422  # refused by the body scan before the parser recurses
    assert assert_error_shape(nested)["code"] == "invalid_request"
    unparseable = client.post(  # an integer Python's json refuses to convert (4300 digits)
        "/v1/workspaces/w1/requests",
        content=b'{"stage": "noop", "job_id": "j", "input": {"value": ' + b"1" * 5000 + b"}}",
        headers={**auth(API_KEY), "content-type": "application/json"},
    )
    assert unparseable.status_code == 400
    assert assert_error_shape(unparseable)["code"] == "bad_request"


def test_every_422_is_one_shape_with_a_one_line_detail(
    client: httpx.Client,  # noqa: F811 - the fixture
    runtime: Any,  # noqa: F811 - the fixture
) -> None:
    calls = [
        # FastAPI's own validation: wrong type, unknown field, malformed JSON.
        ("POST", "/v1/workspaces/w1/requests", {**NOOP, "job_id": 5}),
        ("POST", "/v1/workspaces/w1/requests", {**NOOP, "workspace_id": "w2"}),
        # onceflow's: a stage input that does not fit its model (pydantic's text was multi-line).
        ("POST", "/v1/workspaces/w1/requests", {**NOOP, "input": {"value": "seven", "x": [1]}}),
        ("POST", "/v1/workspaces/w1/sub-docs/d/ops", {"op_id": "a" * 16, "op": {"type": "merge"}}),
    ]
    for method, path, body in calls:
        response = client.request(method, path, json=body, headers=auth(API_KEY))
        assert response.status_code == 422, response.text
        shape = assert_error_shape(response)
        assert shape["code"] == "invalid_request"
    typed = client.post(
        "/v1/workspaces/w1/requests", json={**NOOP, "job_id": 5}, headers=auth(API_KEY)
    ).json()
    assert typed["errors"] == [
        {"loc": ["body", "job_id"], "msg": "Input should be a valid string", "type": "string_type"}
    ]
    assert "job_id" in typed["detail"]
    malformed = client.post(
        "/v1/workspaces/w1/requests",
        content=b"{oops",
        headers={**auth(API_KEY), "content-type": "application/json"},
    )
    assert malformed.status_code == 422
    assert assert_error_shape(malformed)["errors"][0]["type"] == "json_invalid"


def test_path_ids_are_checked_as_the_schema_says(client: httpx.Client) -> None:  # noqa: F811
    doc = client.get("/openapi.json").json()
    for path, item in doc["paths"].items():
        for spec in item.values():
            for param in spec.get("parameters", []):  # the probes take none
                if param["in"] != "path":
                    continue
                rules = param["schema"]
                if param["name"] == "permit_id":  # minted by the client: a narrower rule
                    assert (rules["minLength"], rules["maxLength"]) == (16, 64), (path, param)
                    assert rules["pattern"] == "^[A-Za-z0-9_-]{16,64}$", (path, param)
                    continue
                if param["name"] == "wc":  # a worker class names a queue: a narrower rule
                    assert (rules["minLength"], rules["maxLength"]) == (1, 100), (path, param)
                    assert rules["pattern"] == "^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$", (path, param)
                    continue
                assert (rules["minLength"], rules["maxLength"]) == (1, 200), (path, param)
                assert rules["pattern"] == ID_PATTERN, (path, param)
    pattern = re.compile(ID_PATTERN)
    # A worker key passes the scope check of any claim path, so these reach validation.
    for raw, segment, allowed_by_pattern in [
        ("r" * 201, "r" * 201, True),  # over maxLength
        ("r\x01", "r%01", False),  # a control character
        ("r\x85", "r%C2%85", False),  # a C1 control character
        ("r\u200b", "r%E2%80%8B", True),  # a format character: the documented difference
        ("r\u2028", "r%E2%80%A8", True),  # a line separator: the documented difference
    ]:
        assert bool(pattern.match(raw)) is allowed_by_pattern, raw
        response = client.post(f"/v1/claims/{segment}/heartbeat", json={"claim_token": "t"},
                               headers=auth(WORKER_KEY))  # fmt: skip
        assert response.status_code == 422, (raw, response.text)
        body = assert_error_shape(response)
        assert body["code"] == "invalid_request"
        assert body["errors"][0]["loc"] == ["path", "request_id"], body
    # What the pattern allows and check_id accepts goes through to the operation.
    for segment in ["...", "r%20x", "%C3%A9t%C3%A9"]:
        response = client.post(f"/v1/claims/{segment}/heartbeat", json={"claim_token": "t"},
                               headers=auth(WORKER_KEY))  # fmt: skip
        assert response.status_code == 409, (segment, response.text)
        assert assert_error_shape(response)["code"] == "lease_lost"


def test_the_schema_names_the_stages_op_types_and_worker_classes_the_server_takes(
    client: httpx.Client,  # noqa: F811 - the fixture
    runtime: Any,  # noqa: F811 - the fixture
) -> None:
    # Before: `stage` and an op's `type` were free strings and the worker_class filter had
    # no pattern, yet the server answers 422 for a name it does not know: the schema now
    # says which names pass.
    doc = client.get("/openapi.json").json()
    models = doc["components"]["schemas"]
    stages = sorted(runtime.flow.stages)
    for model in ("EnqueueIn", "FollowUp"):
        assert models[model]["properties"]["stage"]["enum"] == stages, model
    # The op types the server's own process registers (importing its app), not this test
    # process's: other test modules register op types of their own here.
    served = json.loads(subprocess.run(
        [sys.executable, "-c", "import importlib, json; from onceflow.models.ops import op_types; "
         f"importlib.import_module({APP.split(':')[0]!r}); print(json.dumps(op_types()))"],
        check=True, capture_output=True, text=True, cwd=ROOT,
    ).stdout)  # fmt: skip
    for model in ("OpIn", "ClaimOpIn"):
        op = models[model]["properties"]["op"]
        assert op["properties"]["type"]["enum"] == served and op["required"] == ["type"]
    [param] = [p for p in doc["paths"]["/v1/workspaces/{ws}/requests"]["get"]["parameters"]
               if p["name"] == "worker_class"]  # fmt: skip
    [rules] = [r for r in param["schema"]["anyOf"] if r.get("type") == "string"]
    assert rules["pattern"] == WORKER_CLASS_PATTERN and rules["maxLength"] == 100
    # Every route taking one of them lists the 422 a name outside the enum gets …
    for path, method in [("/v1/workspaces/{ws}/requests", "post"),
                         ("/v1/claims/{request_id}/complete", "post"),
                         ("/v1/workspaces/{ws}/sub-docs/{sub_doc}/ops", "post"),
                         ("/v1/claims/{request_id}/ops", "post"),
                         ("/v1/workspaces/{ws}/requests", "get")]:  # fmt: skip
        assert "422" in doc["paths"][path][method]["responses"], (path, method)
    # … and gets it: nothing written.
    before = snapshot(runtime.flow.queue.engine)
    outside = [
        ("POST", "/v1/workspaces/w1/requests", {**NOOP, "stage": "not-a-stage"}, None),
        ("POST", "/v1/workspaces/w1/sub-docs/d/ops",
         {"op_id": "b" * 16, "op": {"type": "cell.explode"}}, None),
        ("GET", "/v1/workspaces/w1/requests", None, {"worker_class": "-bad/class"}),
    ]  # fmt: skip
    for method, path, body, query in outside:
        response = client.request(method, path, json=body, params=query, headers=auth(API_KEY))
        assert response.status_code == 422, (path, response.text)
        assert assert_error_shape(response)["code"] == "invalid_request"
    assert snapshot(runtime.flow.queue.engine) == before
    assert re.fullmatch(WORKER_CLASS_PATTERN.strip("^$"), PULL)
