"""onceflow's Flower settings: what `onceflow flower` runs with when the working directory has
no flower.cfg of its own (Flower reads this file as its --conf: Python, its globals).

A flower.cfg of your own starts from these with ``from onceflow.flower_conf import *`` and
changes or adds Flower options below. Secrets come from the environment and are never
written here.
"""

import os

from onceflow.flower_auth import InvalidBasicAuth, basic_auth_from_env

# Loopback only unless an operator opens it on purpose (behind a proxy with TLS).
address = os.environ.get("ONCEFLOW_FLOWER_ADDRESS", "127.0.0.1")
port = int(os.environ.get("ONCEFLOW_FLOWER_PORT", "5555"))

# "user:password", or several separated by commas. `onceflow flower` refuses to start
# without it unless --insecure-no-auth is given. One parser for the CLI and this file: a value
# with an empty or malformed entry ("," ":" "user:" ":pw") stops Flower here too.
try:
    _credentials = basic_auth_from_env()
except InvalidBasicAuth as _exc:
    raise SystemExit(f"onceflow: refusing to start Flower: {_exc}") from None
if _credentials is not None:
    basic_auth = _credentials

# Task arguments are request ids only (never claim tokens), so showing them is safe.
max_tasks = 10000
purge_offline_workers = 300
