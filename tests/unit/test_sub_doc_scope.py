"""A stage's sub-doc templates and hand-off targets: checked where declared, matched exactly."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from onceflow.errors import AccessDenied, InvalidRequest, OutOfScope, PermanentError
from onceflow.models.sub_doc_scope import SubDocScope
from onceflow.tasks import Flow

WHERE = {"workspace_id": "w1", "job_id": "j1", "request_id": "r1", "stage": "s"}


class In(BaseModel):
    pass


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("job:{job}", "unknown placeholder {job}"),
        ("job:{job_id", "a brace opens no placeholder"),
        ("job:}x", "a brace opens no placeholder"),
        ("job:*:x", "'*' is allowed only at the end"),
        ("", "must not be empty"),
        ("a\x00b", "control characters"),
    ],
)
def test_a_malformed_template_is_refused_at_the_declaration(template: str, message: str) -> None:
    flow = Flow(name="scope-unit")
    with pytest.raises(InvalidRequest, match=message.replace("*", r"\*").replace("{", r"\{")):
        flow.stage("s", input=In, sub_docs=(template,))
    assert "s" not in flow.stages
    with pytest.raises(InvalidRequest, match="a tuple of templates"):
        flow.stage("s", input=In, sub_docs="job:{job_id}")  # type: ignore[arg-type]


def test_templates_match_the_request_exactly_or_as_a_prefix() -> None:
    scope = SubDocScope.of("s", ("job:{job_id}", "n:{request_id}:{stage}:*", "{workspace_id}"))
    for sub_doc in ("job:j1", "n:r1:s:", "n:r1:s:x:y", "w1"):
        assert scope.allows(sub_doc, WHERE), sub_doc
    for sub_doc in ("job:j10", "job:j", "n:r1:s", "n:r2:s:x", "w1x", "job:j1:x"):
        assert not scope.allows(sub_doc, WHERE), sub_doc
    default = SubDocScope.of("s", None)
    assert default.allows("job:j1", WHERE) and default.allows("job:j1:cells", WHERE)
    assert not default.allows("job:j1x", WHERE) and not default.allows("billing", WHERE)
    assert not SubDocScope.nothing("s").allows("job:j1", WHERE)
    with pytest.raises(OutOfScope, match=r"'billing' is outside .* job:\{job_id\}") as caught:
        default.check("billing", WHERE)
    assert isinstance(caught.value, AccessDenied) and caught.value.status == 403
    assert isinstance(caught.value, PermanentError)  # a stage body is not retried
    rebuild, args = caught.value.__reduce__()  # as Celery's result backend rebuilds it
    assert rebuild(*args).detail == caught.value.detail


def test_hand_off_targets_are_checked_against_the_flow() -> None:
    flow = Flow(name="scope-unit-hand-offs")
    flow.stage("a", input=In, hands_off_to=("b",))(lambda ctx, data: None)
    flow.stage("b", input=In)(lambda ctx, data: None)
    flow.check_declarations()
    flow.check_hand_offs("a", ["b", "b"], declared_only=True)
    with pytest.raises(OutOfScope, match="'a' may not hand off to 'a'"):
        flow.check_hand_offs("a", ["b", "a"], declared_only=True)
    with pytest.raises(OutOfScope, match="hands_off_to: none"):
        flow.check_hand_offs("b", ["a"], declared_only=True)
    flow.check_hand_offs("b", ["a"], declared_only=False)  # a stage body: trusted unless declared
    with pytest.raises(OutOfScope):
        flow.check_hand_offs("a", ["a"], declared_only=False)
    flow.stage("c", input=In, hands_off_to=("bb",))(lambda ctx, data: None)
    with pytest.raises(InvalidRequest, match="'c': hands_off_to names 'bb'"):
        flow.check_declarations()
    with pytest.raises(InvalidRequest, match="tuple of stage names"):
        flow.stage("d", input=In, hands_off_to="b")  # type: ignore[arg-type]
