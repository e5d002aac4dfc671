"""docker/: Prometheus, its alerts and the Grafana dashboard fit compose.yaml and the metrics.

No Docker here: the files are parsed and cross-checked. Every mounted file exists, every scrape
target is a compose service on the port it listens on, every PromQL expression names only
metrics onceflow (``onceflow.metrics.definitions.METRIC_NAMES``) or Flower define, and the
dashboard uses the provisioned data source. With ``promtool`` installed (Debian's
``prometheus`` package) the config, the rules and the dashboard's queries are also checked by
Prometheus' own parser and the alerts' unit tests (docker/prometheus/alerts_test.yml) run.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]

from onceflow.metrics.definitions import METRIC_NAMES

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
COMPOSE: dict[str, Any] = yaml.safe_load((DOCKER / "compose.yaml").read_text())
SERVICES: dict[str, Any] = COMPOSE["services"]
PROMETHEUS_YML = DOCKER / "prometheus" / "prometheus.yml"
ALERTS_YML = DOCKER / "prometheus" / "alerts.yml"
DASHBOARD_JSON = DOCKER / "grafana" / "dashboards" / "onceflow.json"
DATASOURCES = DOCKER / "grafana" / "provisioning" / "datasources"
DASHBOARD_PROVIDERS = DOCKER / "grafana" / "provisioning" / "dashboards"
PROMETHEUS: dict[str, Any] = yaml.safe_load(PROMETHEUS_YML.read_text())
ALERTS: dict[str, Any] = yaml.safe_load(ALERTS_YML.read_text())
DASHBOARD: dict[str, Any] = json.loads(DASHBOARD_JSON.read_text())

#: Metrics Prometheus itself records for every target.
PROMETHEUS_BUILTIN = frozenset({"up"})
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
REQUIRED_ALERTS = {
    "OnceflowOldestQueuedHigh", "OnceflowDeadRequestsRising", "OnceflowZombieWritesRejected",
    "OnceflowLeasesReclaimedSpike", "OnceflowProviderCallsNotSaved", "OnceflowDatabaseDown",
    "OnceflowScrapeFailing", "CeleryWorkerOffline",
}  # fmt: skip


def flower_metric_names() -> frozenset[str]:
    """The metric names Flower's ``PrometheusMetrics`` registers, read from its source."""
    import flower.events

    tree = ast.parse(Path(flower.events.__file__).read_text())
    cls = next(
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "PrometheusMetrics"
    )
    return frozenset(
        n.value for n in ast.walk(cls)
        if isinstance(n, ast.Constant) and isinstance(n.value, str)
        and re.fullmatch(r"flower_[a-z_]+", n.value)
    )  # fmt: skip


FLOWER_METRICS = flower_metric_names()


# -- PromQL ---------------------------------------------------------------------------------
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "inf", "nan", "by", "without",
                       "on", "ignoring", "group_left", "group_right", "atan2"})  # fmt: skip
_IDENT = re.compile(r"(?<![\w.$])[A-Za-z_:][A-Za-z0-9_:]*(?![\w:])(?!\s*\()")


def promql_metric_names(expr: str) -> set[str]:
    """The metric names an expression selects (functions, keywords, labels left out)."""
    s = _STRINGS.sub('""', expr)
    s = re.sub(r"\{[^{}]*\}", " ", s)  # label matchers
    s = re.sub(r"\[[^\[\]]*\]", " ", s)  # ranges and subqueries ($__rate_interval included)
    s = re.sub(r"\boffset\s+\S+", " ", s)
    s = _GROUPING.sub(" ", s)
    return {m for m in _IDENT.findall(s) if m.lower() not in _KEYWORDS}


def known_metric(name: str) -> bool:
    """A name onceflow, Flower or Prometheus defines (histograms by their base name)."""
    if name in METRIC_NAMES or name in FLOWER_METRICS or name in PROMETHEUS_BUILTIN:
        return True
    base = next((name[: -len(s)] for s in HISTOGRAM_SUFFIXES if name.endswith(s)), None)
    return base is not None and (base in METRIC_NAMES or base in FLOWER_METRICS)


def alert_rules() -> Iterator[dict[str, Any]]:
    for group in ALERTS["groups"]:
        yield from group["rules"]


def dashboard_panels() -> Iterator[dict[str, Any]]:
    for panel in DASHBOARD["panels"]:
        yield panel
        yield from panel.get("panels", [])


def dashboard_exprs() -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every dashboard query; templating's label_values(metric, label) too."""
    for panel in dashboard_panels():
        for target in panel.get("targets", []):
            yield f"panel {panel['title']!r} {target['refId']}", target["expr"]
    for var in DASHBOARD["templating"]["list"]:
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = re.fullmatch(r"label_values\((?P<expr>.+),\s*\w+\)", query)
        assert m, f"variable {var['name']}: not a label_values(…) query: {query}"
        yield f"variable {var['name']}", m["expr"]


def all_exprs() -> list[tuple[str, str]]:
    return [(f"alert {r['alert']}", r["expr"]) for r in alert_rules()] + list(dashboard_exprs())


def test_the_metric_name_check_has_teeth() -> None:
    """The extractor finds every metric, skips functions and labels, and flags a typo."""
    expr = (
        'histogram_quantile(0.95, sum by (le, worker_class) (rate('
        'onceflow_pickup_latency_seconds_bucket{worker_class=~"$worker_class"}[$__rate_interval])))'
        ' / on (job) group_left () up offset 5m > bool 1e3 and flower_worker_online'
    )  # fmt: skip
    assert promql_metric_names(expr) == {
        "onceflow_pickup_latency_seconds_bucket", "up", "flower_worker_online",
    }  # fmt: skip
    assert not known_metric("onceflow_request_total")  # a typo of onceflow_requests…
    assert not known_metric("onceflow_requests_total")
    assert known_metric("onceflow_stage_duration_seconds_count")
    assert known_metric("flower_task_runtime_seconds_bucket")


def test_flower_defines_the_six_metrics_the_docs_name() -> None:
    expected = {
        "flower_events_total", "flower_task_runtime_seconds", "flower_task_prefetch_time_seconds",
        "flower_worker_prefetched_tasks", "flower_worker_online",
        "flower_worker_number_of_currently_executing_tasks",
    }  # fmt: skip
    assert expected == FLOWER_METRICS


@pytest.mark.parametrize(("where", "expr"), all_exprs(), ids=[w for w, _ in all_exprs()])
def test_every_promql_expression_names_only_existing_metrics(where: str, expr: str) -> None:
    names = promql_metric_names(expr)
    assert names, f"{where}: selects no metric: {expr}"
    unknown = sorted(n for n in names if not known_metric(n))
    assert not unknown, f"{where}: unknown metrics {unknown} in {expr}"


def test_the_dashboard_covers_every_onceflow_metric() -> None:
    """Each metric of the spec is on the dashboard or in an alert (none forgotten)."""
    used = {n for _, e in all_exprs() for n in promql_metric_names(e)}
    bases = {next((n[: -len(s)] for s in HISTOGRAM_SUFFIXES if n.endswith(s)), n) for n in used}
    assert sorted(METRIC_NAMES - used - bases) == []


# -- compose --------------------------------------------------------------------------------
def _host_path(source: str) -> Path | None:
    """The file a bind mount's source names (relative to docker/), None for a named volume."""
    return (DOCKER / source).resolve() if source.startswith((".", "/")) else None


def _mounts(service: dict[str, Any]) -> Iterator[tuple[str, str]]:
    for volume in service.get("volumes", []):
        if isinstance(volume, dict):
            yield volume["source"], volume["target"]
        else:
            source, target, *_ = volume.split(":")
            yield source, target


def test_every_mounted_file_exists_and_named_volumes_are_declared() -> None:
    declared = set(COMPOSE.get("volumes") or {})
    checked = 0
    for name, service in SERVICES.items():
        for source, _ in _mounts(service):
            path = _host_path(source)
            if path is None:
                assert source in declared, f"{name}: volume {source} is not declared"
            else:
                assert path.exists(), f"{name}: {source} does not exist ({path})"
                checked += 1
        build = service.get("build")
        if build:
            assert (DOCKER / build["context"] / build["dockerfile"]).is_file()
    assert checked >= 5  # prometheus.yml, alerts.yml, grafana's three directories


def test_published_ports_are_loopback_only_and_images_are_pinned() -> None:
    for name, service in SERVICES.items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), (
                f"{name}: {port} is published beyond loopback"
            )
        image = service.get("image", "")
        if "build" not in service:
            repo, _, tag = image.rpartition(":")
            assert repo and re.fullmatch(r"v?\d+(\.\d+)*", tag), f"{name}: image {image} not pinned"
    for exporter in ("metrics-llm", "metrics-fallback"):
        assert "ports" not in SERVICES[exporter], (
            "the exporter is unauthenticated: keep it internal"
        )


def _listens_on(service: dict[str, Any], port: int) -> bool:
    """The service's command, published ports or healthcheck name ``port``."""
    command = [str(c) for c in service.get("command", [])]
    if "--port" in command and command[command.index("--port") + 1] == str(port):
        return True
    if any(str(p).rsplit(":", 1)[-1] == str(port) for p in service.get("ports", [])):
        return True
    return f":{port}/" in json.dumps(service.get("healthcheck", {}))


def test_scrape_targets_are_compose_services_on_their_ports() -> None:
    targets: dict[str, list[str]] = {}
    for job in PROMETHEUS["scrape_configs"]:
        for static in job["static_configs"]:
            targets.setdefault(job["job_name"], []).extend(static["targets"])
    assert set(targets) == {"onceflow-api", "onceflow-workers", "flower"}
    for job, hosts in targets.items():
        for target in hosts:
            host, _, port = target.rpartition(":")
            assert host in SERVICES, f"{job}: {host} is not a compose service"
            assert _listens_on(SERVICES[host], int(port)), f"{job}: {host} not on :{port}"
    # Every worker service's exporter is scraped.
    workers = [n for n, s in SERVICES.items() if s.get("command", [None])[0] == "worker"]
    assert workers
    for worker in workers:
        exporters = [n for n, s in SERVICES.items() if s.get("pid") == f"service:{worker}"]
        assert len(exporters) == 1, f"{worker}: no exporter sharing its PID namespace"
        assert f"{exporters[0]}:9808" in targets["onceflow-workers"]


def test_the_api_is_scraped_with_a_key_from_a_secret_never_in_the_clear() -> None:
    (job,) = [j for j in PROMETHEUS["scrape_configs"] if j["job_name"] == "onceflow-api"]
    auth = job["authorization"]
    assert auth["type"] == "Bearer"
    assert set(auth) == {"type", "credentials_file"}, "no inline credentials"
    secret = PurePosixPath(auth["credentials_file"])
    assert secret.parent == PurePosixPath("/run/secrets")
    assert secret.name in SERVICES["prometheus"]["secrets"]
    source = COMPOSE["secrets"][secret.name]
    assert set(source) == {"environment"}, "the key comes from the environment, not a file"
    assert "bearer_token" not in PROMETHEUS_YML.read_text()
    assert "ONCEFLOW_OPERATOR_KEYS" in SERVICES["api"]["environment"]
    # Flower's /metrics and the exporters are unauthenticated: no credentials sent there.
    for other in PROMETHEUS["scrape_configs"]:
        if other["job_name"] != "onceflow-api":
            assert "authorization" not in other and "basic_auth" not in other


def test_prometheus_loads_the_mounted_rules() -> None:
    mounts = dict(_mounts(SERVICES["prometheus"]))
    config_in_container = PurePosixPath(mounts["./prometheus/prometheus.yml"])
    for rule_file in PROMETHEUS["rule_files"]:
        in_container = config_in_container.parent / rule_file
        assert str(in_container) in mounts.values(), f"{rule_file} is not mounted"
        assert (PROMETHEUS_YML.parent / rule_file).is_file()
    assert f"--config.file={config_in_container}" in SERVICES["prometheus"]["command"]


def test_workers_write_metrics_to_a_volume_their_exporter_reads() -> None:
    for name, service in SERVICES.items():
        if service.get("command", [None])[0] not in ("worker", "metrics"):
            continue
        directory = service["environment"]["PROMETHEUS_MULTIPROC_DIR"]
        mounted = [s for s, t in _mounts(service) if t == directory]
        assert mounted, f"{name}: nothing mounted at {directory}"
        assert COMPOSE["volumes"][mounted[0]]["driver_opts"]["type"] == "tmpfs"
        if service["command"][0] == "metrics":
            worker = service["pid"].removeprefix("service:")
            assert (mounted[0], directory) in set(_mounts(SERVICES[worker])), name
            assert worker in service["depends_on"]


def _entrypoint_script(name: str) -> list[str]:
    """The worker's entrypoint as the container runs it (compose's ``$$`` is a literal ``$``)."""
    return [part.replace("$$", "$") for part in SERVICES[name]["entrypoint"]]


@pytest.mark.parametrize("name", ["worker-llm", "worker-fallback"])
def test_the_worker_entrypoint_empties_the_directory_then_execs_onceflow(
    name: str, tmp_path: Path
) -> None:
    """Run the entrypoint with /bin/sh: stale files go, then `onceflow <command>` runs."""
    multiproc = tmp_path / "multiproc"
    (multiproc / "sub").mkdir(parents=True)
    for stale in ("counter_1.db", "histogram_7.db", ".hidden", "sub/x.db"):
        (multiproc / stale).write_text("stale")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # Stands in for the image's `onceflow`: reports its parent, what it saw and its arguments.
    (bin_dir / "onceflow").write_text(
        '#!/bin/sh\necho "ppid=$PPID left=$(ls -A "$PROMETHEUS_MULTIPROC_DIR" | wc -l) args=$*"\n'
    )
    (bin_dir / "onceflow").chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "PROMETHEUS_MULTIPROC_DIR": str(multiproc)}
    argv = [*_entrypoint_script(name), *SERVICES[name]["command"]]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    ran = re.fullmatch(r"ppid=(\d+) left=\s*(\d+) args=(.*)\n", done.stdout)
    assert ran, done.stdout
    assert int(ran[1]) == os.getpid(), "onceflow must replace the shell (exec), to get signals"
    assert int(ran[2]) == 0, "the multiprocess directory was not emptied first"
    assert ran[3] == " ".join(SERVICES[name]["command"])
    assert multiproc.is_dir()
    # Without the variable the entrypoint refuses instead of deleting something else.
    unset = subprocess.run(argv, env={"PATH": env["PATH"]}, capture_output=True, text=True,
                           timeout=30)  # fmt: skip
    assert unset.returncode != 0 and "pid=" not in unset.stdout


# -- alerts and Grafana ---------------------------------------------------------------------
def test_alert_rules_have_the_required_fields() -> None:
    names = []
    for rule in alert_rules():
        names.append(rule["alert"])
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations", "keep_firing_for"}
        assert rule["expr"].strip() and re.fullmatch(r"\d+[smh]", rule["for"]), rule["alert"]
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
    assert len(names) == len(set(names)), "duplicate alert names"
    assert set(names) >= REQUIRED_ALERTS, REQUIRED_ALERTS - set(names)


def _provisioned(directory: Path, key: str) -> list[dict[str, Any]]:
    files = sorted(directory.glob("*.yaml"))
    assert files, f"nothing provisioned in {directory}"
    out: list[dict[str, Any]] = []
    for path in files:
        doc = yaml.safe_load(path.read_text())
        assert doc["apiVersion"] == 1
        out.extend(doc[key])
    return out


def test_the_dashboard_uses_the_provisioned_datasource_and_is_provisioned() -> None:
    (datasource,) = _provisioned(DATASOURCES, "datasources")
    assert datasource["type"] == "prometheus"
    host, _, port = datasource["url"].removeprefix("http://").partition(":")
    assert host in SERVICES and _listens_on(SERVICES[host], int(port))
    uids = set()
    for panel in dashboard_panels():
        if panel["type"] == "row":
            continue
        uids.add(panel["datasource"]["uid"])
        assert panel["targets"], panel["title"]
        uids.update(t["datasource"]["uid"] for t in panel["targets"])
    uids.update(v["datasource"]["uid"] for v in DASHBOARD["templating"]["list"])
    assert uids == {datasource["uid"]}
    (provider,) = _provisioned(DASHBOARD_PROVIDERS, "providers")
    grafana_mounts = {t: s for s, t in _mounts(SERVICES["grafana"])}
    assert grafana_mounts[provider["options"]["path"]] == "./grafana/dashboards"
    assert "/etc/grafana/provisioning/datasources" in grafana_mounts
    ids = [p["id"] for p in dashboard_panels()]
    assert len(ids) == len(set(ids)) and DASHBOARD["uid"] == "onceflow"


def test_the_dashboard_has_the_panels_the_issue_asks_for() -> None:
    exprs = " ".join(e for _, e in dashboard_exprs())
    q = "histogram_quantile"
    for needle in (
        "sum by (worker_class, status) (max by (worker_class, stage, status) (onceflow_requests{",
        "onceflow_oldest_queued_age_seconds",
        f"{q}(0.5, sum by (le, worker_class) (rate(onceflow_pickup_latency_seconds_bucket",
        f"{q}(0.95, sum by (le, worker_class) (rate(onceflow_pickup_latency_seconds_bucket",
        f"{q}(0.95, sum by (le, worker_class, stage) (rate(onceflow_stage_duration_seconds_bucket",
        "sum by (outcome) (rate(onceflow_attempts_total",
        "onceflow_leases_reclaimed_total",
        "onceflow_zombie_writes_rejected_total",
        "sum by (worker_class, kind) (rate(onceflow_wakeups_sent_total",
        "sum by (outcome) (rate(onceflow_compute_lock_total",
        "onceflow_provider_calls_saved_total",
        "sum by (outcome) (rate(onceflow_ops_total",
        "sum by (route, status) (rate(onceflow_http_requests_total",
        "flower_worker_online",
        "flower_task_runtime_seconds_bucket",
    ):
        assert needle in exprs, needle
    stacked = [p for p in dashboard_panels() if "onceflow_requests{" in json.dumps(p)]
    assert stacked[0]["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"


# -- promtool, when installed ---------------------------------------------------------------
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (optional)")


def _promtool(*args: str, cwd: Path) -> None:
    assert PROMTOOL
    done = subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"promtool {' '.join(args)}:\n{done.stdout}\n{done.stderr}"


@needs_promtool
def test_promtool_accepts_the_config_and_the_alert_unit_tests_pass() -> None:
    _promtool("check", "config", "--syntax-only", "prometheus.yml", cwd=PROMETHEUS_YML.parent)
    _promtool("check", "rules", "alerts.yml", cwd=ALERTS_YML.parent)
    _promtool("test", "rules", "alerts_test.yml", cwd=ALERTS_YML.parent)


@needs_promtool
def test_promtool_parses_every_dashboard_query(tmp_path: Path) -> None:
    """Grafana's variables replaced by values, each query is a recording rule promtool parses."""
    grafana_vars = {"$__rate_interval": "1m", "$__range": "1h", "$__interval": "15s"}
    rules = []
    for i, (_, expr) in enumerate(dashboard_exprs()):
        for var, value in grafana_vars.items():
            expr = expr.replace(var, value)
        rules.append({"record": f"dashboard:query_{i}", "expr": expr})
    (tmp_path / "dashboard.yml").write_text(
        yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]})
    )
    _promtool("check", "rules", "dashboard.yml", cwd=tmp_path)


@needs_promtool
def test_the_depth_panel_sums_stages_and_counts_each_target_once(tmp_path: Path) -> None:
    """The API and every exporter serve the same database gauges: take one copy per series
    (max over targets), then add the stages of a class up (sum) — not the max of the stages."""
    [expr] = [
        t["expr"]
        for p in dashboard_panels()
        for t in p.get("targets", [])
        if "onceflow_requests{" in t.get("expr", "")
    ]
    expr = expr.replace('worker_class=~"$worker_class"', 'worker_class=~".*"')
    rules = {"groups": [{"name": "panel", "rules": [{"record": "panel_depth", "expr": expr}]}]}
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    series = [
        (job, stage, n)
        for job in ("onceflow-api", "onceflow-workers")
        for stage, n in (("summarise", 10), ("evaluate", 5))
    ]
    test = {
        "rule_files": ["rules.yml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {
                        "series": f'onceflow_requests{{job="{job}",worker_class="llm",'
                        f'stage="{stage}",status="queued"}}',
                        "values": f"{n}x5",
                    }
                    for job, stage, n in series
                ],
                "promql_expr_test": [
                    {
                        "expr": "panel_depth",
                        "eval_time": "2m",
                        "exp_samples": [
                            {
                                "labels": 'panel_depth{worker_class="llm",status="queued"}',
                                "value": 15,
                            }
                        ],
                    }
                ],
            }
        ],
    }
    (tmp_path / "test.yml").write_text(yaml.safe_dump(test))
    _promtool("test", "rules", "test.yml", cwd=tmp_path)
