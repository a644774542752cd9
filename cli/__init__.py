"""The ``rollstream`` command line (typer): it parses, sets up logging and calls library code.

One module per command group, each registering its commands on :data:`app`
(:mod:`cli.app`: the app, global options, logging, the one-line error convention):

* :mod:`~cli.run` — ``run`` (``--prepare-only``, ``--dry-run``), ``resume RUN``, ``service NAME``;
* :mod:`~cli.stack` — ``stack up|down|status``;
* :mod:`~cli.topics` — ``topics list|describe``;
* :mod:`~cli.ops` — ``status RUN``, ``stop RUN``, ``record RUN``;
* :mod:`~cli.runs` — ``runs list|rm``, ``logs RUN [SERVICE]``, ``export RUN DIR``;
* :mod:`~cli.sql` — ``sql`` (SQL, or ``--query NAME``: a ready query of docs/analytics.md);
* :mod:`~cli.report` — ``report``;
* :mod:`~cli.replay` — ``replay into|rescore|step``;
* :mod:`~cli.model` — ``init-model``;
* :mod:`~cli.serve` — ``serve MODEL_DIR``.

User errors print one line ``error: ...`` and exit 1 — never a traceback (``--debug`` shows it).
"""

from __future__ import annotations

# registering order = the order of `rollstream --help`
from cli import run, stack, topics, ops, runs, sql, report, replay, model, serve  # isort: skip
from cli.app import app, main, version

app.command()(version)

__all__ = ["app", "main", "model", "ops", "replay", "report", "run", "runs", "serve", "sql", "stack", "topics"]

if __name__ == "__main__":  # pragma: no cover (`python -m cli` runs __main__.py)
    main()
