"""``sokoban``: small generated Sokoban rooms as a multi-turn text environment, and its task source.

Rooms (:func:`generate_room`, no dependency) are ``size`` x ``size`` including the outer walls with
``boxes`` boxes, generated from the episode seed alone by playing a random walk backwards from the
solved state (so every room is solvable); :func:`solve` (BFS over player and boxes, dead squares
pruned) gives a shortest solution and is the expert. Board: ``#`` wall, ``.`` target, ``$`` box,
``*`` box on target, ``@`` player, ``+`` player on a target; ``positions`` adds a line with each
box and free target relative to the player (:func:`positions`).

Actions: ``up``, ``down``, ``left``, ``right`` (the last such word counts; a reply of only
``U``/``D``/``L``/``R`` too); walking into a box pushes it when the cell behind is free. Reward of
a step: ``step_penalty`` + ``box_reward`` times the change in boxes on targets + ``solve_reward``
on the step that solves the room (which ends it, ``success``). It truncates after ``max_turns``
steps (0 = ``10 * boxes + 2 * size``); a box pushed onto a dead square sets ``info["deadlock"]``
and, with ``end_on_deadlock``, ends the episode. ``info``: ``turn``, ``state_hash``, ``success``,
``invalid_action``, ``deadlock``; ``seed`` after reset. Env kwargs: :class:`SokobanConfig`.

Task source ``sokoban`` (:class:`SokobanSource`, an :class:`envs.gym_text.EpisodeSource`): held
out by room. Details and what each kwarg is for: docs/agentic.md, "The environments".
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Any

from envs.base import StepResult, check_heldout_fraction
from envs.gym_text import EpisodeSource, check_kwargs, check_seed, state_hash, word_action_parser
from envs.registry import register_env, register_source

ACTIONS = ("up", "down", "left", "right")
parse_action = word_action_parser(
    {w: i for i, w in enumerate(ACTIONS)}, {w[0]: i for i, w in enumerate(ACTIONS)}
)


@dataclass(frozen=True)
class Room:
    """A generated room: ``size`` x ``size`` cells indexed row-major (``r * size + c``)."""

    size: int
    walls: frozenset[int]
    targets: frozenset[int]
    boxes: frozenset[int]
    player: int

    @property
    def deltas(self) -> tuple[int, int, int, int]:
        """Cell-index offsets of up, down, left, right."""
        return (-self.size, self.size, -1, 1)

    @property
    def layout(self) -> str:
        """The static room (walls and targets) as rows joined by ``/``."""
        return render(self, frozenset(), -1).replace("\n", "/")


def render(room: Room, boxes: frozenset[int] | set[int], player: int) -> str:
    """The board text of ``room`` with these boxes and player (``player=-1``: none)."""
    rows = []
    for r in range(room.size):
        row = []
        for i in range(r * room.size, (r + 1) * room.size):
            if i in room.walls:
                row.append("#")
            elif i == player:
                row.append("+" if i in room.targets else "@")
            elif i in boxes:
                row.append("*" if i in room.targets else "$")
            else:
                row.append("." if i in room.targets else " ")
        rows.append("".join(row))
    return "\n".join(rows)


def positions(room: Room, boxes: frozenset[int] | set[int], player: int) -> str:
    """Where the boxes not on a target and the free targets are, relative to the player, in rows and
    columns: ``box U1 L2, target D1 R3`` (``U``/``D`` rows up/down, ``L``/``R`` columns left/right; a
    zero offset is left out, ``here`` when both are). Boxes first, then targets, each in cell order."""
    pr, pc = divmod(player, room.size)

    def offset(cell: int) -> str:
        r, c = divmod(cell, room.size)
        parts = [f"{'U' if r < pr else 'D'}{abs(r - pr)}"] if r != pr else []
        parts += [f"{'L' if c < pc else 'R'}{abs(c - pc)}"] if c != pc else []
        return " ".join(parts) or "here"

    items = [f"box {offset(b)}" for b in sorted(set(boxes) - room.targets)]
    items += [f"target {offset(t)}" for t in sorted(room.targets - set(boxes))]
    return ", ".join(items)


def _connected(floor: set[int], size: int) -> bool:
    start = next(iter(floor))
    seen, stack = {start}, [start]
    while stack:
        i = stack.pop()
        for d in (-size, size, -1, 1):
            if i + d in floor and i + d not in seen:
                seen.add(i + d)
                stack.append(i + d)
    return len(seen) == len(floor)


def _manhattan(a: int, b: int, size: int) -> int:
    return abs(a // size - b // size) + abs(a % size - b % size)


@lru_cache(maxsize=4096)
def generate_room(seed: int, size: int = 6, boxes: int = 1) -> Room:
    """The room of episode ``seed`` (solvable by construction; see the module doc)."""
    rng = random.Random(seed)
    interior = [r * size + c for r in range(1, size - 1) for c in range(1, size - 1)]
    border = frozenset(range(size * size)) - frozenset(interior)
    for _ in range(1000):
        floor = set(interior)
        for _ in range(rng.randint(0, len(interior) // 5)):
            cell = rng.choice(interior)
            if cell in floor and len(floor) > 2 * boxes + 3 and _connected(floor - {cell}, size):
                floor.discard(cell)
        cells = sorted(floor)
        targets = rng.sample(cells, boxes)
        player = rng.choice([c for c in cells if c not in targets])
        box_list = list(targets)  # box k starts on target k
        last_pull: list[int | None] = [None] * boxes
        turns = 0  # pulls of a box in a new direction (the player must walk around it)
        best: tuple[float, int, tuple[int, ...]] | None = None
        for _ in range(8 * len(cells) * boxes):
            d = rng.choice((-size, size, -1, 1))
            nxt = player + d
            if nxt not in floor or nxt in box_list:
                continue
            behind = player - d
            if behind in box_list and rng.random() < 0.8:
                k = box_list.index(behind)
                box_list[k] = player
                turns += last_pull[k] is not None and last_pull[k] != d
                last_pull[k] = d
            player = nxt
            if not any(b in targets for b in box_list):
                score = (
                    sum(_manhattan(b, t, size) for b, t in zip(box_list, targets, strict=True))
                    + 2 * turns
                    + 0.5 * min(_manhattan(player, b, size) for b in box_list)
                )
                if best is None or score > best[0]:
                    best = (score, player, tuple(box_list))
        if best is not None:
            walls = frozenset(border | (set(interior) - floor))
            return Room(size, walls, frozenset(targets), frozenset(best[2]), best[1])
    raise RuntimeError(f"sokoban: no room generated for seed={seed}, size={size}, boxes={boxes}")


@lru_cache(maxsize=4096)
def dead_squares(room: Room) -> frozenset[int]:
    """Floor cells (not targets) from which a lone box can never be pushed onto any target."""
    floor = {i for i in range(room.size * room.size) if i not in room.walls}
    live = set(room.targets)
    queue = deque(room.targets)
    while queue:
        y = queue.popleft()
        for d in room.deltas:
            x = y - d  # a box at x pushed by d (player at x - d) lands on y
            if x in floor and x - d in floor and x not in live:
                live.add(x)
                queue.append(x)
    return frozenset(floor - live)


def solve(room: Room, max_states: int = 2_000_000) -> list[str] | None:
    """A shortest solution in moves (BFS), as action words; ``None`` if unsolvable (or over
    ``max_states`` states)."""
    dead, deltas = dead_squares(room), room.deltas
    start = (room.player, room.boxes)
    prev: dict[tuple[int, frozenset[int]], tuple[tuple[int, frozenset[int]], int] | None] = {start: None}
    queue = deque([start])
    while queue:
        state = queue.popleft()
        player, boxes = state
        if boxes <= room.targets:
            path: list[str] = []
            while (step := prev[state]) is not None:
                state, a = step
                path.append(ACTIONS[a])
            return path[::-1]
        for a, d in enumerate(deltas):
            nxt = player + d
            if nxt in room.walls:
                continue
            new_boxes = boxes
            if nxt in boxes:
                dest = nxt + d
                if dest in room.walls or dest in boxes or dest in dead:
                    continue
                new_boxes = (boxes - {nxt}) | {dest}
            key = (nxt, new_boxes)
            if key not in prev:
                prev[key] = (state, a)
                if len(prev) > max_states:
                    return None
                queue.append(key)
    return None


# --------------------------------------------------------------------------- environment

_TYPES: dict[str, type | tuple[type, ...]] = {
    "size": int,
    "boxes": int,
    "max_turns": int,
    "solve_reward": float,
    "box_reward": float,
    "step_penalty": float,
    "invalid_penalty": float,
    "end_on_deadlock": bool,
    "instructions": bool,
    "letters": bool,
    "positions": bool,
}


@dataclass(frozen=True)
class SokobanConfig:
    """The environment kwargs (see the module doc)."""

    size: int = 6
    boxes: int = 1
    max_turns: int = 0
    solve_reward: float = 1.0
    box_reward: float = 0.1
    step_penalty: float = 0.0
    invalid_penalty: float = 0.0
    end_on_deadlock: bool = False
    instructions: bool = True
    letters: bool = False
    positions: bool = False

    def __post_init__(self) -> None:
        check_kwargs("sokoban", asdict(self), _TYPES)
        if not 5 <= self.size <= 10:
            raise ValueError(f"sokoban: size={self.size} must be in [5, 10]")
        if not 1 <= self.boxes <= 3:
            raise ValueError(f"sokoban: boxes={self.boxes} must be in [1, 3]")
        if not 0 <= self.max_turns <= 10_000:
            raise ValueError(f"sokoban: max_turns={self.max_turns} must be in [0, 10000] (0 = auto)")
        if not 0 <= self.solve_reward <= 100:
            raise ValueError(f"sokoban: solve_reward={self.solve_reward} must be in [0, 100]")
        if not 0 <= self.box_reward <= 10:
            raise ValueError(f"sokoban: box_reward={self.box_reward} must be in [0, 10]")
        if not -1 <= self.step_penalty <= 0:
            raise ValueError(f"sokoban: step_penalty={self.step_penalty} must be in [-1, 0]")
        if not -1 <= self.invalid_penalty <= 0:
            raise ValueError(f"sokoban: invalid_penalty={self.invalid_penalty} must be in [-1, 0]")

    @property
    def turns(self) -> int:
        """The turn limit (``max_turns``, or ``10 * boxes + 2 * size`` when 0)."""
        return self.max_turns or 10 * self.boxes + 2 * self.size


class Sokoban:
    """The ``sokoban`` text environment (see the module doc)."""

    def __init__(self, config: SokobanConfig | None = None) -> None:
        self.config = cfg = config or SokobanConfig()
        reply = ("Reply with one letter: U (up), D (down), L (left) or R (right)." if cfg.letters else
                 "Reply with one move: up, down, left or right (the last one in your reply counts).")
        self.instructions = (
            "Sokoban: push every box $ onto a target . (# wall, * box on a target, @ you, + you on "
            "a target). You push a box by walking into it; you cannot pull boxes or push two at "
            f"once. You have {cfg.turns} moves. {reply}"
        ) if cfg.instructions else ""
        self.room: Room | None = None
        self.player, self.boxes = -1, frozenset[int]()
        self.seed, self.turn, self.done, self.succeeded, self.deadlock = 0, 0, True, False, False

    def board(self) -> str:
        """The board, and with ``positions`` a line saying where boxes and targets are."""
        assert self.room is not None
        text = render(self.room, self.boxes, self.player)
        if self.config.positions:
            text += "\n" + positions(self.room, self.boxes, self.player)
        return text

    def _info(self, invalid: bool) -> dict[str, Any]:
        assert self.room is not None
        key = f"sokoban|{self.room.layout}|{self.player}|{sorted(self.boxes)}"
        return {
            "turn": self.turn,
            "state_hash": state_hash(key),
            "success": self.succeeded,
            "invalid_action": invalid,
            "deadlock": self.deadlock,
        }

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.seed = check_seed(seed)
        self.room = generate_room(self.seed, self.config.size, self.config.boxes)
        self.player, self.boxes = self.room.player, self.room.boxes
        self.turn, self.done, self.succeeded, self.deadlock = 0, False, False, False
        text = f"{self.instructions}\n\n{self.board()}" if self.instructions else self.board()
        return text, {**self._info(False), "seed": self.seed}

    def step(self, action: str) -> StepResult:
        if self.done or self.room is None:
            raise RuntimeError("step() on a finished episode; call reset() first")
        cfg, room = self.config, self.room
        self.turn += 1
        a = parse_action(action)
        terminated = False
        if a is None:
            reward, feedback = (
                cfg.invalid_penalty,
                ("Invalid action: reply with U, D, L or R. Nothing moved." if cfg.letters
                 else "Invalid action: reply with up, down, left or right. Nothing moved."),
            )
        else:
            reward, word, d = cfg.step_penalty, ACTIONS[a], room.deltas[a]
            nxt = self.player + d
            if nxt in room.walls:
                feedback = f"You cannot move {word}: a wall is in the way."
            elif nxt in self.boxes:
                dest = nxt + d
                if dest in room.walls or dest in self.boxes:
                    feedback = f"You cannot push the box {word}: it is blocked."
                else:
                    before = len(self.boxes & room.targets)
                    self.boxes = (self.boxes - {nxt}) | {dest}
                    self.player = nxt
                    after = len(self.boxes & room.targets)
                    reward += cfg.box_reward * (after - before)
                    where = (
                        " onto a target"
                        if dest in room.targets
                        else (" off a target" if after < before else "")
                    )
                    feedback = f"You pushed a box {word}{where}."
                    self.deadlock = bool((self.boxes - room.targets) & dead_squares(room))
                    if self.boxes <= room.targets:
                        reward += cfg.solve_reward
                        terminated = self.succeeded = True
                        feedback += " All boxes are on targets: solved!"
                    elif self.deadlock:
                        feedback += " A box is stuck where it can never reach a target."
                        if cfg.end_on_deadlock:
                            terminated = True
                            feedback += " Game over."
            else:
                self.player = nxt
                feedback = f"You moved {word}."
        truncated = not terminated and self.turn >= cfg.turns
        if truncated:
            feedback += " Turn limit reached."
        self.done = terminated or truncated
        return StepResult(
            f"{feedback}\n\n{self.board()}", float(reward), terminated, truncated, self._info(a is None)
        )


@register_env("sokoban")
def make_sokoban_env(prompt: str = "", reference: str = "", **kwargs: Any) -> Sokoban:
    """Build a :class:`Sokoban` from JSON-scalar kwargs (``prompt`` / ``reference`` ignored)."""
    check_kwargs("sokoban", kwargs, _TYPES)
    return Sokoban(SokobanConfig(**kwargs))


# --------------------------------------------------------------------------- task source


@dataclass(frozen=True)
class SokobanSource(EpisodeSource):
    """Sokoban episodes as problems (see :class:`envs.gym_text.EpisodeSource`: held out by room);
    registered as ``sokoban``."""

    config: SokobanConfig = SokobanConfig()
    heldout_fraction: float = 0.05
    salt: str = "sokoban"
    name: str = "sokoban"
    default_verifier: str = ""

    def __post_init__(self) -> None:
        check_heldout_fraction("sokoban", self.heldout_fraction)

    def env_kwargs(self) -> dict[str, Any]:
        return asdict(self.config)

    def env(self) -> Sokoban:
        return Sokoban(self.config)

    def room(self, seed: int) -> Room:
        return generate_room(seed, self.config.size, self.config.boxes)

    def layout(self, seed: int) -> str:
        room = self.room(seed)
        return render(room, room.boxes, room.player)

    def expert_actions(self, seed: int) -> list[str]:
        """The expert's moves for episode ``seed``: a BFS shortest solution (one letter each with
        ``letters``)."""
        moves = expert_actions(seed, size=self.config.size, boxes=self.config.boxes)
        return [m[0].upper() for m in moves] if self.config.letters else moves


@register_source("sokoban")
def make_sokoban_source(**kwargs: Any) -> SokobanSource:
    """Build a :class:`SokobanSource` from the env kwargs plus ``heldout_fraction`` and ``salt``."""
    check_kwargs("sokoban", kwargs, {**_TYPES, "heldout_fraction": float, "salt": str})
    env = {k: v for k, v in kwargs.items() if k in _TYPES}
    return SokobanSource(SokobanConfig(**env), **{k: v for k, v in kwargs.items() if k not in env})


def expert_actions(seed: int, **kwargs: Any) -> list[str]:
    """A shortest solution (action words) of episode ``seed`` of ``sokoban`` with env ``kwargs``."""
    cfg = SokobanConfig(**kwargs)
    solution = solve(generate_room(seed, cfg.size, cfg.boxes))
    if solution is None:  # cannot happen for generated rooms (solvable by construction)
        raise RuntimeError(f"sokoban: no solution found for seed={seed}")
    return solution
