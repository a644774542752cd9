"""Every handler module the table of services names has the same entry (``settings_from``,
``service_settings``, ``run``), subscribes what its row says, and runs on the loop its row names
(pure: no Kafka, no model is loaded)."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from types import ModuleType

import pytest

from runtime.runner import Service, loop_kind
from runtime.settings import ServiceSettings, Subscription
from schemas.config import RunConfig, parse_raw
from schemas.services import SERVICES, ServiceSpec
from schemas.topics import topic_name
from services import ServiceStart

RUN = "entries-run"


def start(tmp_path: Path, cfg: RunConfig | None = None, label: str = "") -> ServiceStart:
    return ServiceStart(config=cfg or RunConfig(), run_id=RUN, run_dir=tmp_path / RUN, model_dir=str(tmp_path / "m"),
                        label=label)


def handler(spec: ServiceSpec) -> ModuleType:
    return importlib.import_module(spec.handler)


def service_class(spec: ServiceSpec) -> type[Service]:
    """The runtime service class of ``spec``'s handler module (the one named like the service)."""
    mod = handler(spec)
    found = {c for c in vars(mod).values() if inspect.isclass(c) and issubclass(c, Service) and c.name == spec.name}
    assert len(found) == 1, f"{spec.handler}: service classes named {spec.name!r}: {found}"
    return found.pop()


@pytest.mark.parametrize("spec", SERVICES.values(), ids=list(SERVICES))
def test_each_handler_has_the_entry_and_subscribes_its_row(spec: ServiceSpec, tmp_path: Path) -> None:
    mod = handler(spec)
    assert inspect.iscoroutinefunction(mod.run), f"{spec.handler}.run is not async"
    settings = mod.settings_from(start(tmp_path))
    assert settings.run_id == RUN
    runtime = mod.service_settings(settings)
    assert isinstance(runtime, ServiceSettings)
    assert runtime.subscription == Subscription.of(spec, RUN)
    sub = runtime.subscription
    assert sub.group_id == (spec.group_id(RUN) if spec.grouped else None)
    assert sorted(sub.topics) == sorted(topic_name(RUN, t) for t in (*spec.consumes, *spec.observes))
    assert sub.observed_topics == [topic_name(RUN, t) for t in spec.observes]


@pytest.mark.parametrize("spec", SERVICES.values(), ids=list(SERVICES))
def test_each_service_runs_on_the_loop_its_row_names_by_default(spec: ServiceSpec, tmp_path: Path) -> None:
    mod = handler(spec)
    runtime = mod.service_settings(mod.settings_from(start(tmp_path)))
    assert loop_kind(service_class(spec), runtime) == spec.loops[0]


def test_the_reward_routers_other_loop_is_the_at_least_once_one(tmp_path: Path) -> None:
    spec = SERVICES["reward"]
    mod = handler(spec)
    cfg = parse_raw({"reward": {"delivery": "at_least_once"}})
    runtime = mod.service_settings(mod.settings_from(start(tmp_path, cfg)))
    assert loop_kind(service_class(spec), runtime) == "record" == spec.loops[1]
    strict = mod.service_settings(mod.settings_from(start(tmp_path)))
    assert strict.delivery.transactional_id == spec.transactional_id(RUN) == f"rs-reward-{RUN}"


@pytest.mark.parametrize(("label", "want"), [("judge1", "judge1"), ("", "judge")])
def test_a_judge_workers_transactional_id_is_its_group_and_label(tmp_path: Path, label: str, want: str) -> None:
    spec = SERVICES["judge"]
    mod = handler(spec)
    settings = mod.settings_from(start(tmp_path, label=label))
    assert settings.label == want
    assert mod.service_settings(settings).delivery.transactional_id == f"rs-judge-{RUN}-{want}"


def test_the_recorder_of_every_run_subscribes_by_pattern() -> None:
    spec = SERVICES["recorder"]
    sub = Subscription.of(spec, "")
    assert sub.group_id == "rs-recorder-all" and not sub.topics and sub.topic_pattern == r"^rs\..*"
    with pytest.raises(ValueError):  # a service of one run needs its run id
        Subscription.of(SERVICES["rollout"], "")
