"""The result cache's statements (psycopg ``%(name)s`` placeholders), on the database clock.

Each statement exists for both scopes: ``"workspace"`` (``result_cache``, keyed by the
workspace and the key's digest) and ``"global"`` (``result_cache_global``, by the digest).
"""

from __future__ import annotations

from typing import Final

_COLUMNS = "value, provider, model, input_tokens, output_tokens, cost"

GET: Final = {
    "workspace": f"""
SELECT {_COLUMNS} FROM result_cache
WHERE workspace_id = %(ws)s AND digest = %(digest)s AND expires_at > now()
""",
    "global": f"""
SELECT {_COLUMNS} FROM result_cache_global WHERE digest = %(digest)s AND expires_at > now()
""",
}

_VALUES = """%(value)s::jsonb, %(provider)s, %(model)s, %(input_tokens)s, %(output_tokens)s,
        %(cost)s, now(), now() + make_interval(secs => %(ttl)s)"""
_REPLACE = """value = EXCLUDED.value, provider = EXCLUDED.provider, model = EXCLUDED.model,
    input_tokens = EXCLUDED.input_tokens, output_tokens = EXCLUDED.output_tokens,
    cost = EXCLUDED.cost, created_at = EXCLUDED.created_at, expires_at = EXCLUDED.expires_at"""

PUT: Final = {
    "workspace": f"""
INSERT INTO result_cache (workspace_id, digest, {_COLUMNS}, created_at, expires_at)
VALUES (%(ws)s, %(digest)s, {_VALUES})
ON CONFLICT (workspace_id, digest) DO UPDATE SET {_REPLACE}
""",
    "global": f"""
INSERT INTO result_cache_global (digest, {_COLUMNS}, created_at, expires_at)
VALUES (%(digest)s, {_VALUES})
ON CONFLICT (digest) DO UPDATE SET {_REPLACE}
""",
}

INVALIDATE: Final = {
    "workspace": "DELETE FROM result_cache WHERE workspace_id = %(ws)s AND digest = %(digest)s",
    "global": "DELETE FROM result_cache_global WHERE digest = %(digest)s",
}

PURGE: Final = {
    "workspace": "DELETE FROM result_cache WHERE expires_at <= now()",
    "global": "DELETE FROM result_cache_global WHERE expires_at <= now()",
}

# A hit's ledger row: nothing paid (no tokens, cost NULL), the entry's cost as saved_cost.
HIT: Final = """
INSERT INTO spend_ledger (workspace_id, permit_id, stage, request_id, cell_key, provider,
                          model, input_tokens, output_tokens, cost, saved_cost, outcome,
                          started_at, ended_at)
VALUES (%(ws)s, %(permit_id)s, %(stage)s, %(request_id)s, %(cell_key)s, %(provider)s,
        %(model)s, 0, 0, NULL, %(saved_cost)s, 'cache_hit', now(), now())
ON CONFLICT (workspace_id, permit_id) DO NOTHING
"""
