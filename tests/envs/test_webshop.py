"""The ``webshop`` environment: catalogue and goal generation, navigation, WebShop's reward,
invalid actions, truncation, the task source's split, the expert against simple baselines."""

from __future__ import annotations

import json
import random
import re
import time

import pytest

from envs import Env, TaskSource, make_env, make_source
from envs.webshop import (
    COLORS,
    DEMO_SEP,
    DEPARTMENTS,
    WebShopEnv,
    WebShopSource,
    build_world,
    parse_action,
    search,
)

INFO_KEYS = {"state_hash", "success", "invalid_action", "turn"}


def new_env(**kwargs: object) -> WebShopEnv:
    env = make_env("webshop", prompt="ignored", reference="ignored", **kwargs)
    assert isinstance(env, WebShopEnv)
    return env


def source(**kwargs: object) -> WebShopSource:
    src = make_source("webshop", **kwargs)
    assert isinstance(src, WebShopSource)
    return src


def check_info(info: dict[str, object]) -> None:
    assert INFO_KEYS <= set(info)
    assert all(isinstance(v, str | int | float | bool) for v in info.values())  # EnvObservation.info


def play(env: WebShopEnv, seed: int, actions: list[str]) -> list[tuple[str, float, bool, bool, dict]]:
    env.reset(seed=seed)
    return [tuple(env.step(a)) for a in actions]  # type: ignore[misc]


# --------------------------------------------------------------------------- registry and kwargs


def test_registered_env_and_source() -> None:
    assert isinstance(new_env(), Env) and isinstance(make_source("webshop"), TaskSource)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"bogus": 1}, "bogus"),
        ({"n_products": 5}, "n_products"),
        ({"n_products": "100"}, "n_products"),
        ({"max_turns": 0}, "max_turns"),
        ({"max_turns": 2.5}, "max_turns"),
        ({"results_per_page": False}, "results_per_page"),
    ],
)
def test_bad_kwargs_are_one_line_errors_naming_them(kwargs: dict[str, object], name: str) -> None:
    with pytest.raises(ValueError, match=name) as e:
        new_env(**kwargs)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=name):
        make_source("webshop", **kwargs)
    with pytest.raises(ValueError, match="heldout_fraction"):
        make_source("webshop", heldout_fraction=0)


# --------------------------------------------------------------------------- generation


def test_world_is_determined_by_seed_and_has_the_goal_and_near_misses() -> None:
    assert build_world(3, 100) == build_world(3, 100)
    assert build_world(3, 100).goal != build_world(4, 100).goal
    for seed in range(50):
        w = build_world(seed, 60)
        assert len(w.products) == 60 and len({p.pid for p in w.products}) == 60
        g = w.goal
        assert any(g.satisfied_by(p) for p in w.products)
        same_type_misses = [p for p in w.products if p.type == g.type and not g.satisfied_by(p)]
        assert len(same_type_misses) >= 3  # lacking an attribute, the colour, the size, or over budget
        assert g.color in COLORS and g.type in DEPARTMENTS[g.dept]["types"]
        assert f"price lower than {g.budget:.2f} dollars" in g.text and g.type in g.text
        assert all(a in g.text for a in g.attrs) and (not g.size or f"size {g.size.lower()}" in g.text)


def test_search_ranks_by_keyword_score() -> None:
    w = build_world(8, 100)
    res = search(w, w.goal.query)
    q = set(w.goal.query.split())
    scores = [len(q & p.words) for p in res]
    assert scores == sorted(scores, reverse=True) and scores[0] == len(q) and min(scores) > 0
    assert search(w, "zzzz qqqq") == []


def test_reset_is_determined_by_the_seed_and_replay_reproduces_the_episode() -> None:
    a, b = new_env(), new_env()
    obs, info = a.reset(seed=12)
    assert b.reset(seed=12)[0] == obs
    assert "Instruction:" in obs and "search[" in obs and "buy" in obs and "[search page]" in obs
    check_info(info)
    assert info["turn"] == 0 and info["seed"] == 12 and info["page"] == "search"
    actions = [*source().expert_actions(12)[:-1], "click[back]", "click[next page]", "nonsense"]
    assert play(a, 12, actions) == play(b, 12, actions)
    assert len({new_env().reset(seed=s)[0] for s in range(30)}) == 30


# --------------------------------------------------------------------------- an episode


def test_expert_episode_pages_and_reward() -> None:
    seed = 12
    env = new_env()
    env.reset(seed=seed)
    goal = env.world.goal  # type: ignore[union-attr]
    actions = source().expert_actions(seed)
    assert actions[0] == f"search[{goal.query}]" and actions[-1] == "buy"
    hashes = []
    for a in actions[:-1]:
        r = env.step(a)
        assert not r.info["invalid_action"] and r.reward == 0.0 and not (r.terminated or r.truncated), r
        check_info(r.info)
        hashes.append(r.info["state_hash"])
    assert len(set(hashes)) == len(hashes)  # every action changed the state
    assert r.observation.startswith("[product P") and f"color={goal.color}" in r.observation
    r = env.step("buy")
    assert (r.reward, r.terminated, r.truncated) == (1.0, True, False)
    assert r.info["success"] and r.info["matched"] == r.info["total"] and r.info["page"] == "done"
    check_info(r.info)
    with pytest.raises(RuntimeError):
        env.step("buy")


def test_results_page_listing_and_navigation() -> None:
    env = new_env(results_per_page=3)
    env.reset(seed=5)
    r = env.step("search[black]")
    lines = r.observation.splitlines()
    assert lines[0].startswith('[results for "black", page 1/') and len(lines) == 5  # head, 3 items, turns left
    ids = re.findall(r"^\[(P\d+)\] .+ \| \$\d+\.\d\d$", r.observation, re.MULTILINE)
    assert len(ids) == 3
    page1 = r.info["state_hash"]
    r = env.step("click[next page]")
    assert "page 2/" in r.observation and not set(ids) & set(re.findall(r"\[(P\d+)\]", r.observation))
    r = env.step("click[prev page]")
    assert r.info["state_hash"] == page1
    r = env.step(f"click[{ids[1].lower()}]")  # ids are case-insensitive
    assert r.observation.startswith(f"[product {ids[1]}]") and r.info["page"] == "item"
    item = env.item
    assert item is not None
    r = env.step(f"select[color: {item.colors[0].upper()}]")
    assert f"selected: color={item.colors[0]}" in r.observation
    r = env.step(f"click[{item.colors[-1]}]")  # clicking an option selects it, replacing the colour
    assert f"selected: color={item.colors[-1]}" in r.observation
    r = env.step("click[back]")
    assert r.info["state_hash"] == page1 and r.info["page"] == "results"
    r = env.step("click[back]")
    assert r.info["page"] == "search" and r.observation.startswith("[search page]")


def test_partial_rewards_follow_webshops_formula() -> None:
    src = source()
    wrong_colour_checked = 0
    for seed in range(40):
        env = new_env()
        env.reset(seed=seed)
        w = env.world
        assert w is not None
        g = w.goal
        n_opts = 2 if g.size else 1
        total = len(g.attrs) + n_opts + 1
        expert = src.expert_actions(seed)
        # no options selected: the options are missed
        r = play(new_env(), seed, [a for a in expert if not a.startswith("select")])[-1]
        assert r[1] == pytest.approx((total - n_opts) / total) and not r[4]["success"]
        # a wrong colour
        wrong = next(c for c in COLORS if c != g.color)
        p = w.by_id[next(a for a in expert if a.startswith("click[P"))[len("click["):-1].lower()]
        if wrong in p.colors:
            r = play(new_env(), seed, [*expert[:-1], f"select[{wrong}]", "buy"])[-1]
            assert r[1] == pytest.approx((total - 1) / total)
            wrong_colour_checked += 1
    assert wrong_colour_checked >= 5
    # an over-budget product of the goal's type, and a product of another type
    env = new_env()
    env.reset(seed=3)
    w = env.world
    assert w is not None
    from envs.webshop import score

    g = w.goal
    over = [p for p in w.products if p.type == g.type and p.price > g.budget]
    if over:
        assert score(g, over[0], {})[0] < 1.0
    other_dept = next(p for p in w.products if p.dept != g.dept)
    other_type = [p for p in w.products if p.dept == g.dept and p.type != g.type]
    assert score(g, other_dept, {})[0] <= 0.1
    if other_type:
        assert score(g, other_type[0], {"color": g.color, "size": g.size})[0] <= 0.5


@pytest.mark.parametrize(
    ("actions", "why"),
    [
        (["I would like to buy a nice shirt."], "no action found"),
        (["buy"], "buy works on a product page"),
        (["click[P0000]"], "search first"),
        (["select[red]"], "select[...] works on a product page"),
        (["click[back]"], "already on the search page"),
        (["search[  ]"], "empty search"),
        (["search[black]", "click[P0000]"], "'P0000' is not listed on this page"),
        (["search[black]", "select[red]"], "select[...] works on a product page"),
        (["search[black]", "click[prev page]"], "there is no previous page"),
        (["search[zzzz]", "click[next page]"], "there is no next page"),
    ],
)
def test_invalid_actions_consume_a_turn(actions: list[str], why: str) -> None:
    env = new_env()
    env.reset(seed=1)
    for a in actions[:-1]:
        assert not env.step(a).info["invalid_action"]
    before = env.state_hash()
    r = env.step(actions[-1])
    assert r.observation.startswith("Invalid action: ") and why in r.observation, r.observation
    assert (r.reward, r.terminated, r.truncated) == (0.0, False, False)
    assert r.info["invalid_action"] and r.info["turn"] == len(actions) and r.info["state_hash"] == before
    check_info(r.info)


def test_invalid_option_on_a_product_page() -> None:
    env = new_env()
    env.reset(seed=2)
    ex = source().expert_actions(2)
    i = next(i for i, a in enumerate(ex) if a.startswith("click[P"))
    for a in ex[: i + 1]:
        env.step(a)
    r = env.step("select[plaid]")
    assert r.info["invalid_action"] and "'plaid' is not an option" in r.observation
    r = env.step("click[next page]")
    assert r.info["invalid_action"] and "use click[back]" in r.observation


def test_truncation_at_max_turns() -> None:
    env = new_env(max_turns=3)
    obs, _ = env.reset(seed=4)
    assert "You have 3 turns" in obs
    assert not env.step("search[red]").truncated
    assert "1 turn left" in env.step("gibberish").observation
    r = env.step("search[blue]")
    assert (r.reward, r.terminated, r.truncated) == (0.0, False, True) and "Out of turns" in r.observation
    with pytest.raises(RuntimeError):
        env.step("buy")


def test_parse_action() -> None:
    assert parse_action("Thought: red shirt.\nAction: search[red  cotton t-shirt]") == ("search", "red cotton t-shirt")
    assert parse_action("click[Next Page]") == ("click", "Next Page")
    assert parse_action("click[buy now]") == ("buy", "")
    assert parse_action("I have selected everything.\nbuy") == ("buy", "")
    assert parse_action("Buy now.") == ("buy", "")
    assert parse_action("I want to buy a red shirt") == ("", "")
    assert parse_action("select[M]\nbuy") == ("select", "M")


# --------------------------------------------------------------------------- the task source and the expert


def test_source_problems_and_heldout_split() -> None:
    src = source(n_products=50)
    held = src.heldout(40)
    assert held == source(n_products=50).heldout(40) and src.heldout(5) == held[:5]
    assert all(src.is_heldout(p) for p in held) and len({p.prompt_id for p in held}) == 40
    rng = random.Random(0)
    train = [src.sample(rng) for _ in range(500)]
    assert not any(src.is_heldout(p) for p in train)
    assert not {p.prompt_id for p in held} & {p.prompt_id for p in train}
    p = held[0]
    ref = json.loads(p.reference)
    assert ref == {"env": "webshop", "seed": int(p.prompt_id.split(":")[1]), "kwargs": ref["kwargs"]}
    assert ref["kwargs"]["n_products"] == 50 and p.verifier == ""
    env = make_env("webshop", prompt=p.prompt, reference=p.reference, **ref["kwargs"])
    assert env.reset(seed=ref["seed"])[0] == p.prompt


def run_policy(policy: object, seeds: list[int], **kwargs: object) -> tuple[float, float]:
    succ, total = 0, 0.0
    for s in seeds:
        env = new_env(**kwargs)
        obs, _ = env.reset(seed=s)
        rng = random.Random(s)
        while True:
            r = env.step(policy(env, obs, rng))  # type: ignore[operator]
            obs = r.observation
            if r.terminated or r.truncated:
                break
        succ += r.info["success"]
        total += r.reward
    return succ / len(seeds), total / len(seeds)


def test_expert_solves_heldout_episodes_and_baselines_do_not() -> None:
    src = source()
    problems = src.heldout(200)
    solved = 0
    for p in problems:
        seed = json.loads(p.reference)["seed"]
        actions = src.demonstration(p, random.Random(0)).split(DEMO_SEP)
        assert actions == src.expert_actions(seed) and len(actions) <= 10
        env = new_env()
        env.reset(seed=seed)
        for a in actions:
            r = env.step(a)
            assert not r.info["invalid_action"]
        solved += r.info["success"]
    assert solved / len(problems) >= 0.95, solved  # 200/200 when written
    seeds = src.heldout_seeds(200)

    def first_result(env: WebShopEnv, obs: str, rng: random.Random) -> str:
        g = env.world.goal  # type: ignore[union-attr]
        if env.page == "search":
            return f"search[{g.query}]"
        if env.page == "results":
            return f"click[{env._visible()[0].pid}]"
        assert env.item is not None
        if "color" not in env.selected and g.color in env.item.colors:
            return f"select[{g.color}]"
        if g.size and "size" not in env.selected and g.size in env.item.sizes:
            return f"select[{g.size}]"
        return "buy"

    vocab = sorted({w for d in DEPARTMENTS.values() for w in d["types"] + d["attrs"]} | set(COLORS))

    def uniform(env: WebShopEnv, obs: str, rng: random.Random) -> str:
        opts = [*env.item.colors, *env.item.sizes] if env.item else []
        return rng.choice([f"search[{' '.join(rng.sample(vocab, 2))}]", "click[next page]", "click[back]", "buy",
                           *(f"click[{i}]" for i in re.findall(r"\[(P\d+)\]", obs)), *(f"select[{o}]" for o in opts)])

    naive_success, naive_reward = run_policy(first_result, seeds)
    random_success, _ = run_policy(uniform, seeds)
    assert naive_success < 0.7 and naive_reward > 0.6  # ~37% success, mean reward ~0.84 when written
    assert random_success < 0.05  # 0% when written


def test_reset_and_steps_are_cheap() -> None:
    env = new_env()
    src = source()
    t = time.perf_counter()
    steps = 0
    for s in range(100):
        env.reset(seed=s)
        for a in src.expert_actions(s):
            env.step(a)
            steps += 1
    assert (time.perf_counter() - t) / 100 < 0.05
