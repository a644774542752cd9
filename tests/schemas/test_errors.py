"""schemas.errors.one_line: the one way errors become one line (pure unit tests)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

from runtime import bus
from schemas.errors import one_line, surfaced, to_thread


class KafkaLikeError(Exception):
    pass


def test_exception_gets_its_type_and_first_line() -> None:
    assert one_line(ValueError("bad value\nsecond line")) == "ValueError: bad value"
    assert one_line(ValueError("\n  first   real\tline \n")) == "ValueError: first real line"
    assert one_line(RuntimeError()) == "RuntimeError"
    # a message that already names its class (aiokafka's) is not prefixed twice
    assert one_line(KafkaLikeError("KafkaLikeError: broker down")) == "KafkaLikeError: broker down"


def test_untyped_exception_is_its_message_alone() -> None:
    err = RuntimeError("Code: 47. DB::Exception: Unknown identifier\nstack trace")
    assert one_line(err, typed=False) == "Code: 47. DB::Exception: Unknown identifier"
    assert one_line(RuntimeError(), typed=False) == "RuntimeError"


def test_text_and_limit() -> None:
    assert one_line("\n\n  Cannot lock file   x \nmore") == "Cannot lock file x"
    assert one_line("") == "unknown error"
    long = one_line("x" * 1000, limit=300)
    assert len(long) == 300 and long.endswith("...")
    assert len(one_line(ValueError("y" * 1000))) == 500


def test_the_bus_uses_it() -> None:
    assert bus.one_line is one_line


def _exhausted() -> int:
    return next(iter([]))  # raises StopIteration


async def test_a_thread_call_raising_stop_iteration_ends_its_await() -> None:
    # plain asyncio.to_thread would never end: asyncio cannot set StopIteration on a future
    with pytest.raises(RuntimeError, match="_exhausted raised StopIteration"):
        await asyncio.wait_for(to_thread(_exhausted), 10)
    with ThreadPoolExecutor(1) as pool:
        with pytest.raises(RuntimeError, match="StopIteration"):
            await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(pool, surfaced(_exhausted)), 10)
    assert await to_thread(lambda a, b=0: a + b, 2, b=3) == 5  # arguments and results pass through
