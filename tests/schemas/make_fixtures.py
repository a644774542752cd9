"""Write today's encoded events to tests/schemas/fixtures/<version>/ (run once per schema release).

    .venv/bin/python -m tests.schemas.make_fixtures v1

Fixtures are never rewritten: every later version must still decode them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec

from tests.schemas.examples import example_events

HERE = Path(__file__).parent / "fixtures"


def main(version: str) -> None:
    out = HERE / version
    if out.exists():
        raise SystemExit(f"{out} exists: fixtures of a released version are never rewritten")
    out.mkdir(parents=True)
    enc = msgspec.msgpack.Encoder()
    for event in example_events():
        (out / f"{type(event).__name__}.msgpack").write_bytes(enc.encode(event))
    print(f"wrote {len(example_events())} fixtures to {out}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "v1")
