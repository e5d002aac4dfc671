"""``python -m onceflow.embedded``: run the dev services until Ctrl-C or SIGTERM."""

from onceflow.embedded import _main

raise SystemExit(_main())
