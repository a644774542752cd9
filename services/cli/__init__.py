"""The ``rollstream`` command line (typer): it parses, sets up logging and calls library code.

One module per command group, each registering its commands on :data:`app`
(:mod:`services.cli.app`: the app, global options, logging, the one-line error convention):

* :mod:`~services.cli.run` — ``run`` (``--prepare-only``), ``service NAME``;
* :mod:`~services.cli.stack` — ``stack up|down|status``;
* :mod:`~services.cli.topics` — ``topics list|describe``;
* :mod:`~services.cli.ops` — ``status RUN``, ``stop RUN``;
* :mod:`~services.cli.sql` — ``sql``;
* :mod:`~services.cli.report` — ``report``;
* :mod:`~services.cli.replay` — ``replay into|rescore|step``;
* :mod:`~services.cli.model` — ``init-model``;
* :mod:`~services.cli.serve` — ``serve MODEL_DIR``.

User errors print one line ``error: ...`` and exit 1 — never a traceback (``--debug`` shows it).
"""

from __future__ import annotations

# registering order = the order of `rollstream --help`
from services.cli import run, stack, topics, ops, sql, report, replay, model, serve  # isort: skip
from services.cli.app import app, main, version
from services.cli.run import SERVICES

app.command()(version)

__all__ = ["SERVICES", "app", "main", "model", "ops", "replay", "report", "run", "serve", "sql", "stack", "topics"]

if __name__ == "__main__":  # pragma: no cover (`python -m services.cli` runs __main__.py)
    main()
