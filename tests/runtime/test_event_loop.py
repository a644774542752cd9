"""The event loop of a service process (runtime.event_loop)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import uvloop

from runtime import event_loop


async def _loop_type() -> type:
    await asyncio.sleep(0)
    return type(asyncio.get_running_loop())


def test_run_is_on_uvloop_where_it_is_installed() -> None:
    assert event_loop.loop_factory() is uvloop.new_event_loop
    assert event_loop.run(_loop_type()) is uvloop.Loop


def test_run_on_a_given_loop_returns_the_result_and_raises_the_error() -> None:
    assert issubclass(event_loop.run(_loop_type(), factory=asyncio.new_event_loop), asyncio.BaseEventLoop)
    assert event_loop.run(asyncio.sleep(0, result=42)) == 42

    async def fail() -> None:
        raise ValueError("from the coroutine")

    try:
        event_loop.run(fail())
    except ValueError as e:
        assert str(e) == "from the coroutine"
    else:
        raise AssertionError("the coroutine's error was not raised")


def test_without_uvloop_it_falls_back_to_asyncio() -> None:
    code = (
        "import sys, asyncio\n"
        "sys.modules['uvloop'] = None  # import uvloop now raises ImportError\n"
        "from runtime import event_loop\n"
        "assert event_loop.loop_factory() is None\n"
        "async def main():\n"
        "    return type(asyncio.get_running_loop()).__module__\n"
        "print(event_loop.run(main()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().startswith("asyncio."), out.stdout
