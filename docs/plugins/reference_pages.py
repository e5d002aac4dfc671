"""MkDocs hook: the reference pages generated from the code at every build.

``reference/settings.md`` from the settings model, ``reference/metrics.md`` from the
metric definitions, ``reference/http-api.md`` and ``reference/openapi.json`` from the
FastAPI app's OpenAPI schema. They exist only in the built site, so they cannot drift from
the code; nothing here needs a running server.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

sys.path.insert(0, str(Path(__file__).resolve().parent))

import http_api_page
import metrics_page
import settings_page


def pages() -> dict[str, str]:
    """Every generated file, by its path under docs/."""
    schema = http_api_page.openapi_schema()
    return {
        settings_page.PAGE: settings_page.render(),
        metrics_page.PAGE: metrics_page.render(),
        http_api_page.PAGE: http_api_page.render(schema),
        http_api_page.SCHEMA_FILE: json.dumps(schema, indent=2, ensure_ascii=False) + "\n",
    }


def on_files(files: Files, config: Any) -> Files:
    """Add the generated pages to the site's files."""
    for path, content in pages().items():
        files.append(File.generated(config, path, content=content))
    return files
