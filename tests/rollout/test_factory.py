"""``check_engine`` / ``make_engine``: which engine ``rollout.engine`` gives, and the settings of the
server engines refused in one line before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout.engine import TorchEngine
from rollout.factory import check_engine, check_servers, make_engine, servers_down, worker_index
from rollout.server_engine import ServerEngine
from schemas.config import ConfigError, parse_config

URLS = "rollout.server_urls=['http://127.0.0.1:8001', 'http://127.0.0.1:8002/']"


@pytest.mark.parametrize(("overrides", "words"), [
    (["rollout.engine=server"], ["rollout.engine='server' needs rollout.server_urls", "rollstream serve MODEL_DIR"]),
    (["rollout.engine=vllm"], ["rollout.engine='vllm' needs rollout.server_urls", "vllm serve MODEL_DIR"]),
    (["rollout.server_urls=['http://h:1']"], ["used only by rollout.engine server or vllm"]),
    (["rollout.engine=server", "rollout.server_urls=['localhost:8000']"], ["'localhost:8000'", "http://host:port"]),
    (["rollout.engine=server", "rollout.server_urls=['http://h:8000/v1']"], ["without /v1"]),
    (["rollout.engine=server", "rollout.server_urls=['http://h:99999']"], ["not a URL"]),
    (["rollout.engine=server", URLS, "rollout.server_timeout_s=0"], ["rollout.server_timeout_s=0.0 must be > 0"]),
    (["rollout.engine=vllm", URLS, "rollout.server_down_s=-1"], ["rollout.server_down_s=-1.0 must be > 0"]),
    (["rollout.engine=server", URLS, "rollout.device=cpu"], ["rollout.device='cpu' applies to rollout.engine=torch",
                                                              "rollstream serve MODEL_DIR --device"]),
    (["rollout.engine=server", URLS, "rollout.cuda_graphs=false"], ["rollout.cuda_graphs=false applies to "
                                                                    "rollout.engine=torch", "--no-cuda-graphs"]),
    (["rollout.engine=vllm", URLS, "rollout.top_p=0.9"], ["rollout.top_p=0.9 with rollout.engine='vllm'",
                                                          "use rollout.top_p=1"]),
])
def test_bad_server_settings_are_refused_in_one_line(overrides: list[str], words: list[str]) -> None:
    cfg = parse_config("", overrides)
    with pytest.raises(ConfigError) as err:
        check_engine(cfg)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("config: ") and all(w in msg for w in words), msg


def test_good_server_settings_pass() -> None:
    for engine in ("server", "vllm"):
        check_engine(parse_config("", [f"rollout.engine={engine}", URLS]))
    check_engine(parse_config("", ["rollout.engine=server", URLS, "rollout.top_p=0.9"]))  # honoured by serve


def test_worker_index_from_the_service_label(monkeypatch: pytest.MonkeyPatch) -> None:
    assert worker_index("rollout") == 0 and worker_index("rollout3") == 3 and worker_index("") == 0
    monkeypatch.setenv("ROLLSTREAM_SERVICE_LABEL", "rollout5")
    assert worker_index() == 5


def test_make_engine_picks_the_url_by_worker_and_keeps_the_eval_engine_local(model_dir: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = parse_config("", ["rollout.engine=server", URLS, "rollout.server_timeout_s=7", "rollout.server_down_s=9"])
    engines = [make_engine(cfg, model_dir, worker=i) for i in range(3)]
    assert all(isinstance(e, ServerEngine) for e in engines)
    assert [e.url for e in engines if isinstance(e, ServerEngine)] == ["http://127.0.0.1:8001", "http://127.0.0.1:8002", "http://127.0.0.1:8001"]
    first = engines[0]
    assert isinstance(first, ServerEngine)
    assert (first.timeout_s, first.down_s, first.flavor, first.policy_version) == (7, 9, "server", -1)
    monkeypatch.setenv("ROLLSTREAM_SERVICE_LABEL", "rollout1")
    labelled = make_engine(cfg, model_dir)
    assert isinstance(labelled, ServerEngine) and labelled.url == "http://127.0.0.1:8002"
    vllm = make_engine(parse_config("", ["rollout.engine=vllm", URLS]), model_dir, worker=0)
    assert isinstance(vllm, ServerEngine) and vllm.flavor == "vllm"
    # the trainer's greedy evaluation stays a torch engine in its own process
    assert isinstance(make_engine(cfg, model_dir, local=True, policy_version=0), TorchEngine)
    with pytest.raises(ConfigError, match=r"needs rollout\.server_urls"):
        make_engine(parse_config("", ["rollout.engine=server"]), model_dir)


def test_make_engine_passes_rollout_cuda_graphs_to_the_torch_engine(model_dir: Path) -> None:
    on, off = (make_engine(parse_config("", [f"rollout.cuda_graphs={v}", "rollout.device=cpu"]), model_dir)
               for v in ("true", "off"))  # YAML: off = false
    assert isinstance(on, TorchEngine) and isinstance(off, TorchEngine)
    assert on.cuda_graphs and not off.cuda_graphs
    with pytest.raises(ConfigError, match="cuda_graphs"):
        parse_config("", ["rollout.cuda_graphs=sometimes"])


async def test_servers_down_names_the_urls_where_nothing_listens() -> None:
    import asyncio

    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        up = f"http://127.0.0.1:{port}"
        assert await servers_down([up, "http://127.0.0.1:1"]) == {"http://127.0.0.1:1": "connection refused"}
        assert await servers_down([up]) == {}


def test_a_server_url_where_nothing_answers_is_refused_in_one_line() -> None:
    cfg = parse_config("", ["rollout.engine=vllm", "rollout.server_urls=['http://127.0.0.1:1']"])
    with pytest.raises(ConfigError) as err:
        check_servers(cfg)
    msg = str(err.value)
    assert "\n" not in msg and "'http://127.0.0.1:1'" in msg and "connection refused" in msg, msg
    assert "vllm serve MODEL_DIR" in msg, msg
    check_servers(parse_config("", []))  # the torch engine has no server to ask
