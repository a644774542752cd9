"""Write today's encoded events to tests/schemas/fixtures/<version>/ (run once per schema release).

    .venv/bin/python -m tests.schemas.make_fixtures v1
    .venv/bin/python -m tests.schemas.make_fixtures batched-v1   # batched records, one per hot topic

Fixtures are never rewritten: every later version must still decode them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec

from schemas.topics import BATCHED_TOPICS, TOPICS, pack_values
from tests.schemas.examples import example_events

HERE = Path(__file__).parent / "fixtures"
BATCHED = Path(__file__).parent / "fixtures_batched"
"""Batched records (``kafka.samples_per_record``): ``<version>/<topic>.msgpack``, each the example
events of that hot topic packed into one record, twice over (a record of several events)."""


def batched(version: str) -> None:
    out = BATCHED / version
    if out.exists():
        raise SystemExit(f"{out} exists: fixtures of a released version are never rewritten")
    out.mkdir(parents=True)
    enc = msgspec.msgpack.Encoder()
    for name in sorted(BATCHED_TOPICS):
        dec = msgspec.msgpack.Decoder(TOPICS[name].event_type)
        mine = [enc.encode(e) for e in example_events() if _accepts(dec, enc.encode(e))]
        (out / f"{name}.msgpack").write_bytes(pack_values(mine * 2))
    print(f"wrote {len(BATCHED_TOPICS)} batched fixtures to {out}")


def _accepts(dec: msgspec.msgpack.Decoder, data: bytes) -> bool:
    try:
        dec.decode(data)
        return True
    except msgspec.ValidationError:
        return False


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
    arg = sys.argv[1] if len(sys.argv) > 1 else "v1"
    if arg.startswith("batched-"):
        batched(arg.removeprefix("batched-"))
    else:
        main(arg)
