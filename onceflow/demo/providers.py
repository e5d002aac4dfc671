"""Clients of the third-party services, over real HTTP: an LLM cascade and a Maps client.

Point them at real providers by settings: ``ONCEFLOW_DEMO_LLM_URLS`` (comma-separated
OpenAI-compatible base URLs, tried in order), ``ONCEFLOW_DEMO_LLM_MODEL``, the API key
in ``ONCEFLOW_LLM_API_KEY`` (from the environment only; never logged, never in a task
argument), and ``ONCEFLOW_DEMO_MAPS_URL``.
"""

from __future__ import annotations

import json
import logging
import os
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger("onceflow.demo.providers")


class ProviderError(RuntimeError):
    """A provider failed (the stage retries with backoff)."""


def _request(req: urllib.request.Request, timeout: float) -> Any:
    try:
        with urllib.request.urlopen(req, timeout=timeout) as response:  # noqa: S310 - http(s) URLs from settings
            return json.loads(response.read())
    except (urllib.error.URLError, TimeoutError, ValueError) as exc:
        raise ProviderError(f"{req.get_method()} {req.full_url.split('?')[0]}: {exc}") from None


class LLMClient(Protocol):
    """Anything that completes a prompt."""

    def complete(self, prompt: str) -> str:
        """The model's answer to ``prompt``."""
        ...


@dataclass(frozen=True)
class OpenAICompatible:
    """An OpenAI-compatible chat-completions endpoint."""

    base_url: str
    model: str
    api_key: str  # from the environment; repr hides it below
    timeout: float = 30.0

    def __repr__(self) -> str:
        return f"OpenAICompatible({self.base_url!r}, model={self.model!r})"

    def complete(self, prompt: str) -> str:
        """POST /v1/chat/completions and return the first choice's content."""
        body = json.dumps({"model": self.model, "messages": [{"role": "user", "content": prompt}]})
        req = urllib.request.Request(  # noqa: S310 - http(s) URLs from settings
            self.base_url.rstrip("/") + "/v1/chat/completions",
            data=body.encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {self.api_key}"},
            method="POST",
        )
        answer = _request(req, self.timeout)
        try:
            return str(answer["choices"][0]["message"]["content"])
        except (KeyError, IndexError, TypeError):
            raise ProviderError(f"{self.base_url}: malformed completion") from None


@dataclass(frozen=True)
class Cascade:
    """Try each provider in order; the first answer wins (a failover chain)."""

    providers: tuple[LLMClient, ...]

    def complete(self, prompt: str) -> str:
        """The first provider's answer that does not fail."""
        errors = []
        for provider in self.providers:
            try:
                return provider.complete(prompt)
            except ProviderError as exc:
                log.warning("LLM provider %r failed, trying the next: %s", provider, exc)
                errors.append(str(exc))
        raise ProviderError("every LLM provider failed: " + "; ".join(errors))


@dataclass(frozen=True)
class MapsClient:
    """A commute-time API."""

    base_url: str
    timeout: float = 15.0

    def commute_minutes(self, origin: str, destination: str) -> int:
        """Minutes from ``origin`` to ``destination``."""
        query = urllib.parse.urlencode({"origin": origin, "destination": destination})
        req = urllib.request.Request(f"{self.base_url.rstrip('/')}/v1/commute?{query}")  # noqa: S310
        return int(_request(req, self.timeout)["minutes"])


def llm_from_env() -> Cascade:
    """The LLM cascade configured by the environment."""
    urls = [u for u in os.environ.get("ONCEFLOW_DEMO_LLM_URLS", "").split(",") if u]
    if not urls:
        raise ProviderError("ONCEFLOW_DEMO_LLM_URLS is not set")
    key = os.environ.get("ONCEFLOW_LLM_API_KEY", "")
    model = os.environ.get("ONCEFLOW_DEMO_LLM_MODEL", "standin-1")
    return Cascade(tuple(OpenAICompatible(url, model, key) for url in urls))


def maps_from_env() -> MapsClient:
    """The Maps client configured by the environment."""
    url = os.environ.get("ONCEFLOW_DEMO_MAPS_URL", "")
    if not url:
        raise ProviderError("ONCEFLOW_DEMO_MAPS_URL is not set")
    return MapsClient(url)
