"""``rollstream topics list|describe``: a run's Kafka topics."""

from __future__ import annotations

from typing import Any

import typer

from cli.app import UserError, app, find_broker, friendly, out

topics_app = typer.Typer(help="Inspect a run's Kafka topics.", no_args_is_help=True)
app.add_typer(topics_app, name="topics")


def _kafka_settings() -> Any:
    from schemas.config import KafkaSettings

    return KafkaSettings()


def bootstrap_or_fail() -> str:
    """The broker to talk to (:func:`cli.app.find_broker`), checked to answer within 5 s (so an
    unreachable one is one line, not a client timeout)."""
    from runtime.probe import NO_BROKER, kafka_reachable

    bootstrap = find_broker()
    if not bootstrap:
        raise UserError(NO_BROKER)
    if not kafka_reachable(bootstrap, timeout_s=5):
        raise UserError(f"no Kafka broker answers at {bootstrap}")
    return bootstrap


async def _topics_list(bootstrap: str, run: str | None) -> list[tuple[str, list[str]]]:
    from runtime.bus import TopicAdmin

    async with TopicAdmin(_kafka_settings(), bootstrap) as admin:
        runs = [run] if run else await admin.list_runs()
        return [(r, await admin.run_topics(r)) for r in runs]


async def _topics_describe(bootstrap: str, run: str) -> list[tuple[str, str, int, str, int]]:
    from runtime.bus import TopicAdmin, message_counts

    settings = _kafka_settings()
    async with TopicAdmin(settings, bootstrap) as admin:
        infos = await admin.describe(run)
    if not infos:
        raise UserError(f"run {run!r} has no topics on {bootstrap} (see `rollstream topics list`)")
    counts = await message_counts(settings, bootstrap, {i.topic: i.partitions for i in infos.values()},
                                  client_suffix="cli")
    return [(name, info.topic, info.partitions, info.configs.get("cleanup.policy", "delete"), counts[info.topic])
            for name, info in infos.items()]


@topics_app.command("list")
@friendly
def topics_list(run: str = typer.Argument(None, help="Only this run.")) -> None:
    """List runs that have topics on the broker, with their topics."""
    import asyncio

    from schemas.topics import check_run_id

    if run:
        check_run_id(run)
    found = asyncio.run(_topics_list(bootstrap_or_fail(), run))
    if not found:
        out.print("no runs on this broker")
    for r, topics in found:
        out.print(f"{r}: {len(topics)} topics")
        for t in topics:
            out.print(f"  {t}")


@topics_app.command("describe")
@friendly
def topics_describe(run: str = typer.Argument(..., help="Run id.")) -> None:
    """Partitions, cleanup policy and message counts of a run's topics."""
    import asyncio

    from rich.table import Table

    from schemas.topics import check_run_id

    check_run_id(run)
    rows = asyncio.run(_topics_describe(bootstrap_or_fail(), run))
    table = Table(title=f"topics of run {run}")
    for col in ("name", "topic", "partitions", "cleanup", "messages"):
        table.add_column(col)
    for row in rows:
        table.add_row(*(str(c) for c in row))
    out.print(table)
