"""The demo's stages: jobs filled in by LLM and Maps calls.

``ONCEFLOW_APP=onceflow.demo.stages:flow``.

* ``evaluate`` — one LLM call per custom column, each under compute_lock ``eval:<column>``;
  results written as ``cell.set`` ops (layers 2 and 3). Its alternate worker class
  ``tabs`` is a pull class: with ``onceflow demo --browser`` a headless browser tab
  claims those requests over HTTP and runs the same stage in JavaScript
  (``onceflow/demo/browser_tab.html``), sharing the Celery workers' compute locks.
* ``enrich`` — one Maps call per job under compute_lock ``commute``.
* ``tailor`` — several LLM calls in one long stage: deterministic request id, no lock (the
  claim already serializes it), heartbeating between calls.
* ``radar`` — one scrape per request over bundled fixture pages; no lock either.
"""

from __future__ import annotations

import json
import os
import re
from functools import cache
from importlib import resources
from typing import Any

from pydantic import BaseModel, Field

from onceflow.demo.providers import Cascade, MapsClient, llm_from_env, maps_from_env
from onceflow.tasks import Flow, StageContext
from onceflow.tasks.config import celery_config, effective_broker_url, is_amqp

#: The run's id, given by the demo to every process it starts: the demo's broker keys
#: (queues, bindings, unacked wake-ups, pub/sub channels) all carry the run's prefix, so a
#: run never touches another application's queues on the same Redis database.
RUN_ENV = "ONCEFLOW_DEMO_RUN"


def broker_prefix(run_id: str) -> str:
    """The prefix of every broker key of run ``run_id`` (kombu's ``global_keyprefix``)."""
    return f"onceflow-demo-{run_id}:"


#: The pull-worker class of the demo's browser tab (``--browser``): no Celery wake-up.
TAB_CLASS = "tabs"

flow = Flow(pull_worker_classes=(TAB_CLASS,))
app = flow.app


def _broker_namespace() -> dict[str, Any]:
    run_id = os.environ.get(RUN_ENV, "")
    if not run_id or is_amqp(effective_broker_url(flow.settings)):
        return {}  # global_keyprefix is the Redis transport's (the demo runs on Redis)
    options = celery_config(flow.settings, maintenance_queue=flow.maintenance_queue)
    transport = {**options.get("broker_transport_options", {}),
                 "global_keyprefix": broker_prefix(run_id)}  # fmt: skip
    return {"broker_transport_options": transport}


# Added after the Flow's own defaults, so it wins; read when Celery first needs its config.
app.add_defaults(_broker_namespace)


@cache
def _llm() -> Cascade:
    return llm_from_env()


@cache
def _maps() -> MapsClient:
    return maps_from_env()


def job_doc(job_id: str) -> str:
    """The sub-doc holding a job's cells."""
    return f"job:{job_id}"


def _cell(ctx: StageContext, column: str) -> Any:
    return ctx.read_sub_doc(job_doc(ctx.request.job_id)).state.get("cells", {}).get(column)


def _store_cell(ctx: StageContext, column: str, value: Any) -> None:
    op = {"type": "cell.set", "column": column, "value": value}
    ctx.apply_op(job_doc(ctx.request.job_id), op, key=f"cell:{column}")


class EvaluateInput(BaseModel):
    """Which custom columns to evaluate."""

    columns: list[str] = Field(min_length=1, max_length=50)


@flow.stage(
    "evaluate", input=EvaluateInput, worker_class="llm", lease_seconds=4.0,
    alternate_worker_classes=(TAB_CLASS,),
)  # fmt: skip
def evaluate(ctx: StageContext, data: EvaluateInput) -> dict[str, Any]:
    """Score each column with one LLM call per cell, paid once across every caller."""
    job = ctx.request.job_id
    scores: dict[str, Any] = {}
    paths: dict[str, str] = {}
    for column in data.columns:

        def compute(column: str = column) -> float:
            prompt = f"cell: {job}/eval:{column}\nScore job {job} on '{column}' from 0 to 1."
            return float(json.loads(_llm().complete(prompt))["score"])

        outcome = ctx.compute_once(
            f"eval:{column}",
            check=lambda column=column: _cell(ctx, column),  # type: ignore[misc]
            compute=compute,
            store=lambda value, column=column: _store_cell(ctx, column, value),  # type: ignore[misc]
        )
        scores[column] = outcome.value
        paths[column] = str(outcome.path)
    return {"scores": scores, "paths": paths}


class EnrichInput(BaseModel):
    """Where the job is and where the candidate lives."""

    origin: str = Field(min_length=1, max_length=200)
    destination: str = Field(min_length=1, max_length=200)


@flow.stage("enrich", input=EnrichInput, worker_class="fallback", lease_seconds=4.0)
def enrich(ctx: StageContext, data: EnrichInput) -> dict[str, Any]:
    """One Maps call per job (compute_lock ``commute``)."""
    outcome = ctx.compute_once(
        "commute",
        check=lambda: _cell(ctx, "commute_minutes"),
        compute=lambda: _maps().commute_minutes(data.origin, data.destination),
        store=lambda value: _store_cell(ctx, "commute_minutes", value),
    )
    return {"commute_minutes": outcome.value, "path": str(outcome.path)}


class TailorInput(BaseModel):
    """The sections of the cover letter to write."""

    sections: list[str] = Field(min_length=1, max_length=20)


@flow.stage("tailor", input=TailorInput, worker_class="llm", lease_seconds=4.0)
def tailor(ctx: StageContext, data: TailorInput) -> dict[str, Any]:
    """Several LLM calls in one long stage; its request id already makes it run once."""
    job = ctx.request.job_id
    drafts: dict[str, Any] = {}
    for section in data.sections:
        ctx.heartbeat()  # keep the claim through a long stage; stop if it is gone
        prompt = f"cell: {job}/tailor:{section}\nWrite the '{section}' section for job {job}."
        drafts[section] = json.loads(_llm().complete(prompt))["score"]
    op = {"type": "merge", "patch": {"tailored": drafts}}
    ctx.apply_op(job_doc(job), op, key="tailor")
    return {"sections": len(drafts)}


class RadarInput(BaseModel):
    """Which bundled fixture page to scrape."""

    page: str = Field(pattern=r"^radar-[0-9]+$")


@flow.stage("radar", input=RadarInput, worker_class="fallback", lease_seconds=4.0)
def radar(ctx: StageContext, data: RadarInput) -> dict[str, Any]:
    """One scrape per request: the claim serializes it, so no compute_lock."""
    page = resources.files("onceflow.demo").joinpath("fixtures", f"{data.page}.html")
    html = page.read_text(encoding="utf-8")
    match = re.search(r"<title>(.*?)</title>", html, re.S)
    title = match.group(1).strip() if match else ""
    _store_cell(ctx, "radar_title", title)
    return {"title": title}
