"""The spend benchmark's stand-in provider and a smoke run of ``bench/spend_bench.py``.

* the stand-in (``bench/harness/provider.py``, its own process) answers 429 with a
  Retry-After beyond its requests or its tokens per window, takes nothing from the window
  for a refused call, and counts what it billed;
* ``bench/spend_bench.py --smoke`` runs its sides on real Celery workers; the onceflow side
  under spend control gets no 429 and spends no token beyond a workspace's budget, while
  the naive side, calling the same provider, gets 429s. Nothing here asserts a duration.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.harness.provider import (
    RateLimited,
    complete,
    count_tokens,
    output_tokens,
    provider_reset,
    provider_stats,
    standin_provider,
)

ROOT = Path(__file__).resolve().parents[2]


def test_the_standin_refuses_beyond_its_limits_and_counts_what_it_billed(tmp_path: Path) -> None:
    prompt = "one two three four five"
    tokens = count_tokens(prompt) + output_tokens(prompt, 10)
    with standin_provider(rpm=2, tpm=1_000, window=60, latency=0, logdir=tmp_path) as url:
        first = complete(url, "ws-a", prompt, 10)
        assert (first.input_tokens, first.output_tokens) == (5, output_tokens(prompt, 10))
        complete(url, "ws-b", prompt, 10)
        with pytest.raises(RateLimited) as refused:  # the third request of the window
            complete(url, "ws-a", prompt, 10)
        assert 55 < refused.value.retry_after <= 60
        stats = provider_stats(url)
        assert (stats["requests"], stats["accepted"], stats["rejected"]) == (3, 2, 1)
        assert stats["tokens"] == 2 * tokens
        ws_a = stats["per_workspace"]["ws-a"]
        assert (ws_a["calls"], ws_a["tokens"], ws_a["rejected"]) == (1, tokens, 1)
        assert stats["distinct_prompts"] == 2  # one prompt, two workspaces
        assert stats["most_in_a_window"]["calls"] == 2

        provider_reset(url)
        long_prompt = " ".join(["word"] * 999)  # 999 input tokens + 2 to 5 output: over 1,000
        with pytest.raises(RateLimited):  # the token limit, not the request limit
            complete(url, "ws-a", long_prompt, 5)
        assert complete(url, "ws-a", prompt, 10).text
        assert provider_stats(url)["accepted"] == 1


@pytest.mark.slow
def test_spend_bench_smoke_run(services: tuple[str, str]) -> None:
    admin, redis_url = services
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "spend_bench.py"), "--smoke", "--json",
         "--sides", "naive,onceflow-spend"],
        cwd=ROOT,
        env={**os.environ, "ONCEFLOW_BENCH_DATABASE_URL": admin,
             "ONCEFLOW_BENCH_REDIS_URL": redis_url},
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    sides = {r["side"]: r for r in json.loads(proc.stdout)["sides"]}
    assert set(sides) == {"naive", "onceflow-spend"}
    naive, spend = sides["naive"], sides["onceflow-spend"]
    assert naive["complete"] and spend["complete"], proc.stderr[-4000:]
    assert naive["cells_done"] == naive["cells"]
    # K = 2 clients: the naive side pays every cell twice and is refused on the way.
    assert naive["calls"] == 2 * naive["cells"] and naive["rejected_429"] > 0
    assert spend["rejected_429"] == 0
    assert spend["budget_enforced"] and spend["overrun_tokens"] == 0
    assert 0 < spend["calls"] <= spend["cells"]
    assert spend["most_in_a_window"]["calls"] <= 6  # the stand-in's limit
