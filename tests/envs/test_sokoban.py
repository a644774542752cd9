from __future__ import annotations

import json
import random

import pytest

from envs import Env, TaskSource, make_env, make_source
from envs.sokoban import (
    Room,
    Sokoban,
    SokobanConfig,
    SokobanSource,
    dead_squares,
    expert_actions,
    generate_room,
    make_sokoban_env,
    positions,
    render,
    solve,
)


def room_from(text: str) -> Room:
    """A Room from a board drawn with the env's symbols (square, ``size`` rows)."""
    rows = text.strip("\n").split("\n")
    size = len(rows)
    walls, targets, boxes, player = set(), set(), set(), -1
    for r, row in enumerate(rows):
        for c, ch in enumerate(row.ljust(size)):
            i = r * size + c
            if ch == "#":
                walls.add(i)
            if ch in ".*+":
                targets.add(i)
            if ch in "$*":
                boxes.add(i)
            if ch in "@+":
                player = i
    return Room(size, frozenset(walls), frozenset(targets), frozenset(boxes), player)


def env_with(room: Room, **kwargs: object) -> Sokoban:
    env = make_sokoban_env(size=room.size, **kwargs)
    env.reset(0)
    env.room, env.player, env.boxes = room, room.player, room.boxes
    return env


HAND = """
######
#    #
# $. #
#@   #
#    #
######
"""


def test_registered_and_built_like_make_env_does() -> None:
    env = make_env("sokoban", prompt="ignored", reference="ignored", boxes=2)
    assert isinstance(env, Env)
    obs, info = env.reset(0)
    assert "up, down, left or right" in obs
    board = obs.split("\n\n")[-1]
    assert board.count("$") == 2 and board.count(".") + board.count("+") == 2 and "*" not in board
    assert board.count("@") + board.count("+") == 1 and len(board.splitlines()) == 6
    assert set(info) >= {"state_hash", "success", "invalid_action", "turn", "seed"}
    assert isinstance(make_source("sokoban"), TaskSource)


def test_render_symbols_roundtrip() -> None:
    room = room_from("#####\n#*+ #\n#$ .#\n#   #\n#####")
    assert render(room, room.boxes, room.player) == "#####\n#*+ #\n#$ .#\n#   #\n#####"
    assert room_from(HAND).layout == "######/#    #/#  . #/#    #/#    #/######"


@pytest.mark.parametrize(("size", "boxes"), [(6, 1), (6, 2), (7, 2), (5, 1)])
def test_generated_rooms_are_solvable_and_unsolved(size: int, boxes: int) -> None:
    turns = SokobanConfig(size=size, boxes=boxes).turns
    for seed in range(60):
        room = generate_room(seed, size, boxes)
        assert len(room.boxes) == len(room.targets) == boxes
        assert not room.boxes & room.targets and room.player not in room.boxes | room.walls
        assert all(i in room.walls for i in range(size))  # closed by walls
        solution = solve(room)
        assert solution is not None and 1 <= len(solution) <= turns


def test_solver_is_optimal_on_a_known_room() -> None:
    assert solve(room_from(HAND)) == ["up", "right"]  # walk up beside the box, push it right
    stuck = room_from("#####\n#$ .#\n#  @#\n#   #\n#####")  # box in a corner
    assert solve(stuck) is None


def test_episode_is_determined_by_the_seed() -> None:
    actions = ["up", "left", "down", "right", "right", "up", "up", "left"] * 2
    a, b = make_sokoban_env(boxes=2), make_sokoban_env(boxes=2)
    for seed in range(20):
        oa, _ = a.reset(seed)
        ob, _ = b.reset(seed)
        assert oa == ob
        for act in actions:
            ra, rb = a.step(act), b.step(act)
            assert ra == rb
            if ra.terminated or ra.truncated:
                break
    assert len({generate_room(s, 6, 1) for s in range(50)}) > 40


def test_expert_solves_heldout_episodes() -> None:
    for boxes in (1, 2):
        src = make_source("sokoban", boxes=boxes)
        assert isinstance(src, SokobanSource)
        for p in src.heldout(20):
            seed = src.seed_of(p)
            env = make_sokoban_env(boxes=boxes)
            assert env.reset(seed)[0] == p.prompt
            demo = src.demonstration(p, random.Random(0)).split("\n")
            assert demo == src.expert_actions(seed) == expert_actions(seed, boxes=boxes)
            total = 0.0
            for a in demo:
                res = env.step(a)
                total += res.reward
            assert res.terminated and not res.truncated and res.info["success"] is True
            assert all(type(v) in (str, int, float, bool) for v in res.info.values())  # JSON scalars
            assert res.reward >= 1.0 and total == pytest.approx(1.0 + 0.1 * boxes)
            assert "solved" in res.observation


def test_pushes_blocks_and_shaped_rewards() -> None:
    room = room_from("""
#######
#     #
# @$. #
#  $  #
#  .  #
#     #
#######
""")
    env = env_with(room)
    res = env.step("right")  # push the first box onto its target
    assert res.reward == pytest.approx(0.1) and "onto a target" in res.observation and not res.terminated
    assert "*" in res.observation
    res = env.step("right")  # and off it again
    assert res.reward == pytest.approx(-0.1) and "off a target" in res.observation
    res = env.step("right")  # box now against the east wall: blocked
    assert res.reward == 0.0 and "blocked" in res.observation
    env = env_with(room, box_reward=0.0, solve_reward=2.0, step_penalty=-0.01)
    rewards = [env.step(a).reward for a in ("right", "down")]  # box 1 on, then box 2 (below) on
    assert rewards[-1] == pytest.approx(2.0 - 0.01) and env.done and env.succeeded
    assert all(r == pytest.approx(-0.01) for r in rewards[:-1])


def test_walls_block() -> None:
    env = env_with(room_from(HAND))
    res = env.step("left")
    assert "wall" in res.observation and res.info["invalid_action"] is False and res.info["turn"] == 1


def test_deadlock_detection() -> None:
    room = room_from("""
######
#    #
# $. #
#  @ #
#    #
######
""")
    assert 7 in dead_squares(room) and room.targets.isdisjoint(dead_squares(room))
    env = env_with(room)
    res = env.step("left")
    res = env.step("up")  # pushes the box to the top wall, away from the target row: dead
    assert res.info["deadlock"] is True and not res.terminated and "stuck" in res.observation
    env = env_with(room, end_on_deadlock=True)
    env.step("left")
    res = env.step("up")
    assert res.terminated and res.info["success"] is False and "Game over" in res.observation


def test_invalid_action_and_truncation() -> None:
    env = make_sokoban_env(max_turns=3, invalid_penalty=-0.1)
    _, info = env.reset(5)
    res = env.step("push the box somewhere")
    assert res.reward == -0.1 and res.info["invalid_action"] is True and res.info["turn"] == 1
    assert res.info["state_hash"] == info["state_hash"] and res.observation.startswith("Invalid action")
    assert not env.step("hmm").truncated
    res = env.step("nope")
    assert res.truncated and not res.terminated and "Turn limit" in res.observation
    with pytest.raises(RuntimeError):
        env.step("up")
    assert "You have 22 moves" in make_sokoban_env().reset(0)[0]  # default 10 * boxes + 2 * size


def test_state_hash() -> None:
    room = room_from(HAND)
    a, b = env_with(room), env_with(room)
    ha = a.step("up").info["state_hash"]  # up, then right pushes
    a.step("down")
    hb = [b.step(x).info["state_hash"] for x in ("right", "left", "up")][-1]  # walk elsewhere and back
    assert ha == hb
    assert a.step("up").info["state_hash"] == ha and a.step("right").info["state_hash"] != ha
    other = room_from(HAND.replace("# $. #", "#.$  #"))  # same player and box, other target
    assert env_with(other).step("up").info["state_hash"] != ha
    env = make_sokoban_env()
    assert len({env.reset(s)[1]["state_hash"] for s in range(30)}) > 25


def test_heldout_is_deterministic_and_disjoint_from_training() -> None:
    src = make_source("sokoban")
    held = src.heldout(30)
    assert held == make_source("sokoban").heldout(30) and held[:5] == src.heldout(5)
    assert all(src.is_heldout(p) for p in held)
    rng = random.Random(1)
    train = [src.sample(rng) for _ in range(500)]
    assert not any(src.is_heldout(p) for p in train)
    assert not {p.prompt for p in held} & {p.prompt for p in train}


def test_reference_rebuilds_the_episode() -> None:
    src = make_source("sokoban", boxes=2, max_turns=40)
    p = src.sample(random.Random(3))
    ref = json.loads(p.reference)
    assert ref["env"] == "sokoban" and p.prompt_id == f"sokoban:{ref['seed']}" and p.verifier == ""
    assert ref["kwargs"]["boxes"] == 2 and ref["kwargs"]["max_turns"] == 40
    env = make_env(ref["env"], prompt=p.prompt, reference=p.reference, **ref["kwargs"])
    assert env.reset(ref["seed"])[0] == p.prompt


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"size": 4}, "size"),
        ({"size": "6"}, "size"),
        ({"boxes": 0}, "boxes"),
        ({"boxes": 9}, "boxes"),
        ({"max_turns": -2}, "max_turns"),
        ({"solve_reward": -1.0}, "solve_reward"),
        ({"box_reward": "0.1"}, "box_reward"),
        ({"step_penalty": 0.5}, "step_penalty"),
        ({"invalid_penalty": 1}, "invalid_penalty"),
        ({"end_on_deadlock": 1}, "end_on_deadlock"),
        ({"instructions": "no"}, "instructions"),
        ({"letters": 1}, "letters"),
        ({"positions": "yes"}, "positions"),
        ({"walls": 3}, "walls"),
    ],
)
def test_kwargs_are_validated(kwargs: dict[str, object], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        make_sokoban_env(**kwargs)
    with pytest.raises(ValueError, match=name):
        make_source("sokoban", **kwargs)


def test_instructions_false_shows_the_board_alone_and_letters_are_one_letter_moves() -> None:
    plain, terse = make_sokoban_env(), make_sokoban_env(instructions=False, letters=True)
    full, _ = plain.reset(seed=4)
    board, _ = terse.reset(seed=4)
    assert full.startswith("Sokoban:") and full.endswith(board) and not board.startswith("Sokoban")
    assert board == plain.board()
    src = make_source("sokoban", letters=True)
    words = make_source("sokoban").expert_actions(4)  # type: ignore[attr-defined]
    assert src.expert_actions(4) == [w[0].upper() for w in words]  # type: ignore[attr-defined]
    for move in src.expert_actions(4):  # type: ignore[attr-defined]
        res = terse.step(move)
    assert res.info["success"] and res.terminated
    terse.reset(seed=4)
    assert "reply with U, D, L or R" in terse.step("jump").observation


def test_positions_names_boxes_and_targets_relative_to_the_player() -> None:
    room = Room(size=6, walls=frozenset(), targets=frozenset({8, 33}), boxes=frozenset({15, 33}), player=21)
    # player at (3, 3); box 15 = (2, 3) one row up; box 33 = (5, 3) sits on its target; target 8 = (1, 2)
    assert positions(room, room.boxes, room.player) == "box U1, target U2 L1"
    assert positions(room, {15}, 8) == "box D1 R1, target here, target D4 R1"
    env = make_sokoban_env(instructions=False, letters=True, positions=True)
    first, _ = env.reset(seed=4)
    board, hint = first.rsplit("\n", 1)
    assert board == render(env.room, env.boxes, env.player) and hint.startswith("box ")  # type: ignore[arg-type]
    moved = env.step("U").observation
    assert moved.endswith(positions(env.room, env.boxes, env.player))  # type: ignore[arg-type]
    plain = make_sokoban_env(instructions=False)
    assert plain.reset(seed=4)[0] == render(plain.room, plain.boxes, plain.player)  # type: ignore[arg-type]
    assert make_source("sokoban", positions=True).env_kwargs()["positions"] is True  # type: ignore[attr-defined]
