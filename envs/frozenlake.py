"""``frozenlake``: Gymnasium's FrozenLake as a multi-turn text environment, and its task source.

Each episode is determined by its seed: the map is ``generate_random_map(size, p, seed)`` and the
Gymnasium ``FrozenLakeEnv`` is reset with the same seed, which fixes the slips too. Observations:
instructions (unless ``instructions`` is false) and the board (``S F H G``, ``P`` the player; unless
``board`` is false), an ``Around you: ...`` line with ``neighbors`` (:func:`neighbor_line`; in
letters with ``letters``), and a feedback line after each step. Actions: ``left``, ``down``,
``right``, ``up`` (the last such word counts; a reply of only ``L``/``D``/``R``/``U`` too). Reward
1.0 on the step that reaches G, else 0; the episode truncates after ``max_turns`` steps (0 =
``5 * size``). ``info``: ``turn``, ``state_hash`` (map and player's cell), ``success``,
``invalid_action``; ``seed`` after reset. Env kwargs: :class:`FrozenLakeConfig`.

Task source ``frozenlake`` (:class:`FrozenLakeSource`, an :class:`envs.gym_text.EpisodeSource`):
held out by map; the expert (source kwarg ``demo``) is ``expert`` (:func:`shortest_path`, ties
broken at random by the seed) or ``safe_random`` (:func:`safe_random_walk`: keeps to the ice but
does not seek the goal). What each kwarg is for: docs/agentic.md, "The environments".
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Any

from envs.base import check_heldout_fraction
from envs.gym_text import EpisodeSource, GymTextEnv, check_kwargs, word_action_parser
from envs.registry import register_env, register_source

ACTIONS = ("left", "down", "right", "up")
"""Gymnasium's action order: 0 left, 1 down, 2 right, 3 up."""
_DELTA = {0: (0, -1), 1: (1, 0), 2: (0, 1), 3: (-1, 0)}
_DIR_BY_DELTA = {d: ACTIONS[a] for a, d in _DELTA.items()}
parse_action = word_action_parser(
    {w: i for i, w in enumerate(ACTIONS)}, {w[0]: i for i, w in enumerate(ACTIONS)}
)


@dataclass(frozen=True)
class FrozenLakeConfig:
    """The environment kwargs (see the module doc)."""

    size: int = 4
    p: float = 0.8
    slippery: bool = False
    success_rate: float = 1.0 / 3.0
    max_turns: int = 0
    invalid_penalty: float = 0.0
    neighbors: bool = False
    board: bool = True
    letters: bool = False
    instructions: bool = True

    def __post_init__(self) -> None:
        check_kwargs("frozenlake", asdict(self), _TYPES)
        if not self.board and not self.neighbors:
            raise ValueError("frozenlake: board=false needs neighbors=true (else observations show nothing)")
        if not 2 <= self.size <= 16:
            raise ValueError(f"frozenlake: size={self.size} must be in [2, 16]")
        if not 0.6 <= self.p <= 1.0:
            raise ValueError(f"frozenlake: p={self.p} must be in [0.6, 1]")
        if not 0.0 < self.success_rate <= 1.0:
            raise ValueError(f"frozenlake: success_rate={self.success_rate} must be in (0, 1]")
        if not 0 <= self.max_turns <= 10_000:
            raise ValueError(f"frozenlake: max_turns={self.max_turns} must be in [0, 10000] (0 = 5*size)")
        if not -1.0 <= self.invalid_penalty <= 0.0:
            raise ValueError(f"frozenlake: invalid_penalty={self.invalid_penalty} must be in [-1, 0]")

    @property
    def turns(self) -> int:
        """The turn limit (``max_turns``, or ``5 * size`` when 0)."""
        return self.max_turns or 5 * self.size


_TYPES: dict[str, type | tuple[type, ...]] = {
    "size": int,
    "p": float,
    "slippery": bool,
    "success_rate": float,
    "max_turns": int,
    "invalid_penalty": float,
    "neighbors": bool,
    "board": bool,
    "letters": bool,
    "instructions": bool,
}


@lru_cache(maxsize=8192)
def generate_map(size: int, p: float, seed: int) -> tuple[str, ...]:
    """The map of episode ``seed``: rows of ``S F H G`` (Gymnasium's ``generate_random_map``)."""
    from gymnasium.envs.toy_text.frozen_lake import generate_random_map

    return tuple(generate_random_map(size=size, p=p, seed=seed))


def _safe_moves(desc: tuple[str, ...] | list[str], cell: tuple[int, int]) -> list[tuple[int, tuple[int, int]]]:
    """(action, next cell) for each move from ``cell`` that stays on the lake and out of holes,
    in Gymnasium's action order (not slippery: the next cell is where the move leads)."""
    rows, cols = len(desc), len(desc[0])
    out = []
    for a, (dr, dc) in _DELTA.items():
        nxt = (cell[0] + dr, cell[1] + dc)
        if 0 <= nxt[0] < rows and 0 <= nxt[1] < cols and desc[nxt[0]][nxt[1]] != "H":
            out.append((a, nxt))
    return out


def shortest_path(desc: tuple[str, ...] | list[str], rng: random.Random | None = None) -> list[str]:
    """A shortest list of action words from S to G avoiding holes (``[]`` if none).

    Each step takes a move that stays on a shortest path (distances to G by a backward BFS):
    without ``rng`` the first such move in Gymnasium's action order, with ``rng`` one drawn
    uniformly — so demonstrations show every optimal move where there are several,
    and a policy imitating them keeps its options open (the BFS order alone prefers ``down``)."""
    rows, cols = len(desc), len(desc[0])
    cells = [(r, c) for r in range(rows) for c in range(cols)]
    start = next(rc for rc in cells if desc[rc[0]][rc[1]] == "S")
    goal = next((rc for rc in cells if desc[rc[0]][rc[1]] == "G"), None)
    if goal is None:
        return []

    to_goal = {goal: 0}  # moves left to G, by backward BFS (moves are symmetric)
    queue = deque([goal])
    while queue:
        cell = queue.popleft()
        for _, nxt in _safe_moves(desc, cell):
            if nxt not in to_goal:
                to_goal[nxt] = to_goal[cell] + 1
                queue.append(nxt)
    if start not in to_goal:
        return []
    path, cell = [], start
    while cell != goal:
        options = [(a, nxt) for a, nxt in _safe_moves(desc, cell) if to_goal.get(nxt) == to_goal[cell] - 1]
        a, cell = rng.choice(options) if rng is not None else options[0]
        path.append(ACTIONS[a])
    return path


DEMOS = ("expert", "safe_random")
"""Who demonstrates for the warm-up (source kwarg ``demo``)."""


def safe_random_walk(desc: tuple[str, ...] | list[str], max_moves: int, rng: random.Random) -> list[str]:
    """Moves drawn uniformly among those that stay on the lake and out of holes, from S until G
    or ``max_moves`` (not slippery: where the walker ends up is where it meant to go)."""
    rows, cols = len(desc), len(desc[0])
    cell = next((r, c) for r in range(rows) for c in range(cols) if desc[r][c] == "S")
    path: list[str] = []
    while len(path) < max_moves and desc[cell[0]][cell[1]] != "G":
        options = _safe_moves(desc, cell)
        if not options:
            break
        a, cell = rng.choice(options)
        path.append(ACTIONS[a])
    return path


def render_board(desc: tuple[str, ...], pos: int) -> str:
    """The board with the player ``P`` on cell index ``pos`` (row-major)."""
    cols = len(desc[0])
    pr, pc = divmod(pos, cols)
    return "\n".join(
        " ".join("P" if (r, c) == (pr, pc) else ch for c, ch in enumerate(row)) for r, row in enumerate(desc)
    )


_CELL_NAMES = {"S": "start", "F": "ice", "H": "hole", "G": "goal"}


def neighbor_line(desc: tuple[str, ...], pos: int, letters: bool = False) -> str:
    """What lies one move away in each direction, e.g. ``Around you: left edge, down hole, right ice, up edge.``
    (``Around you: L=# D=H R=F U=#`` with ``letters``: moves named by their letters, cells by the
    board's letters, ``#`` the edge — a fixed-width line, so each move's cell sits at a fixed
    distance from the end of the observation)."""
    cols = len(desc[0])
    r, c = divmod(pos, cols)
    parts = []
    for a, (dr, dc) in _DELTA.items():
        rr, cc = r + dr, c + dc
        inside = 0 <= rr < len(desc) and 0 <= cc < cols
        if letters:
            parts.append(f"{ACTIONS[a][0].upper()}={desc[rr][cc] if inside else '#'}")
        else:
            parts.append(f"{ACTIONS[a]} {_CELL_NAMES[desc[rr][cc]] if inside else 'edge'}")
    return f"Around you: {' '.join(parts)}" if letters else f"Around you: {', '.join(parts)}."


class FrozenLake(GymTextEnv):
    """The ``frozenlake`` text environment (see the module doc)."""

    def __init__(self, config: FrozenLakeConfig | None = None) -> None:
        self.config = cfg = config or FrozenLakeConfig()
        self.desc: tuple[str, ...] = ()
        slip = (
            " The ice is slippery: you may slide sideways instead of where you wanted."
            if cfg.slippery
            else ""
        )
        reply = (
            "Around you shows the cell each move leads to (F ice, H hole, G goal, S start, # edge). "
            "Reply with one letter: L (left), D (down), R (right) or U (up)."
            if cfg.letters
            else "Reply with one move: left, down, right or up"
            + (" (the last one in your reply counts)." if cfg.board else ".")
        )
        if cfg.board:
            instructions = (
                "FrozenLake: walk from the start S to the goal G over frozen cells F without stepping "
                f"into a hole H. P marks you; up moves toward the top line.{slip} You have {cfg.turns} "
                f"moves. {reply}"
            )
        else:
            instructions = (
                "FrozenLake: walk to the goal in the bottom right corner without stepping into a hole."
                f"{slip} You have {cfg.turns} moves. {reply}"
            )
        super().__init__(
            self._make,
            self._render,
            parse_action,
            instructions=instructions if cfg.instructions else "",
            max_turns=cfg.turns,
            invalid_penalty=cfg.invalid_penalty,
            invalid_message=(
                "Invalid action: reply with L, D, R or U. You did not move."
                if cfg.letters
                else "Invalid action: reply with left, down, right or up. You did not move."
            ),
            state_key=self._state_key,
            describe=self._describe,
        )

    def _make(self, seed: int) -> Any:
        from gymnasium.envs.toy_text.frozen_lake import FrozenLakeEnv

        cfg = self.config
        desc = generate_map(cfg.size, cfg.p, seed)
        if desc == self.desc and self.gym_env is not None:
            return self.gym_env  # same map: reuse (reset(seed=...) reseeds its randomness)
        self.desc = desc
        return FrozenLakeEnv(desc=list(self.desc), is_slippery=cfg.slippery, success_rate=cfg.success_rate)

    def _render(self, obs: Any) -> str:
        parts = [render_board(self.desc, int(obs))] if self.config.board else []
        if self.config.neighbors:
            parts.append(neighbor_line(self.desc, int(obs), self.config.letters))
        return "\n".join(parts)

    def _state_key(self, obs: Any) -> str:
        return f"frozenlake|{'/'.join(self.desc)}|{int(obs)}"

    def _describe(self, prev: Any, action: int, obs: Any, reward: float, terminated: bool) -> str:
        cols = len(self.desc[0])
        (r0, c0), (r1, c1) = divmod(int(prev), cols), divmod(int(obs), cols)
        want = ACTIONS[action]
        moved = _DIR_BY_DELTA.get((r1 - r0, c1 - c0))
        if moved == want:
            text = f"You moved {want}."
        elif moved is not None:
            text = f"You tried to move {want} but slipped {moved}."
        else:
            dr, dc = _DELTA[action]
            if 0 <= r0 + dr < len(self.desc) and 0 <= c0 + dc < cols:
                text = f"You tried to move {want} but slipped against the edge and stayed in place."
            else:
                text = f"You cannot move {want}: that is the edge of the lake. You stayed in place."
        cell = self.desc[r1][c1]
        if terminated and cell == "H":
            text += " You fell into a hole. Game over."
        elif terminated and cell == "G":
            text += " You reached the goal!"
        return text


@register_env("frozenlake")
def make_frozenlake_env(prompt: str = "", reference: str = "", **kwargs: Any) -> FrozenLake:
    """Build a :class:`FrozenLake` from JSON-scalar kwargs (``prompt`` / ``reference`` ignored)."""
    check_kwargs("frozenlake", kwargs, _TYPES)
    return FrozenLake(FrozenLakeConfig(**kwargs))


# --------------------------------------------------------------------------- task source


@dataclass(frozen=True)
class FrozenLakeSource(EpisodeSource):
    """FrozenLake episodes as problems (see :class:`envs.gym_text.EpisodeSource`: held out by map);
    registered as ``frozenlake``."""

    config: FrozenLakeConfig = FrozenLakeConfig()
    heldout_fraction: float = 0.05
    salt: str = "frozenlake"
    demo: str = "expert"
    name: str = "frozenlake"
    default_verifier: str = ""

    def __post_init__(self) -> None:
        check_heldout_fraction("frozenlake", self.heldout_fraction)
        if self.demo not in DEMOS:
            raise ValueError(f"frozenlake: demo={self.demo!r} must be one of {', '.join(DEMOS)}")

    def env_kwargs(self) -> dict[str, Any]:
        return asdict(self.config)

    def env(self) -> FrozenLake:
        return FrozenLake(self.config)

    def layout(self, seed: int) -> str:
        return "/".join(generate_map(self.config.size, self.config.p, seed))

    def expert_actions(self, seed: int) -> list[str]:
        """The demonstrator's moves for episode ``seed`` (one letter each with ``letters``): with
        ``demo: expert`` a shortest path on its map, ties broken at random by the seed
        (:func:`shortest_path`); with ``demo: safe_random`` :func:`safe_random_walk`."""
        cfg = self.config
        desc = generate_map(cfg.size, cfg.p, seed)
        if self.demo == "safe_random":
            moves = safe_random_walk(desc, cfg.turns, _expert_rng(seed))
        else:
            moves = shortest_path(desc, _expert_rng(seed))
        return [m[0].upper() for m in moves] if cfg.letters else moves


@register_source("frozenlake")
def make_frozenlake_source(**kwargs: Any) -> FrozenLakeSource:
    """Build a :class:`FrozenLakeSource` from the env kwargs plus ``heldout_fraction``, ``salt`` and
    ``demo``."""
    check_kwargs("frozenlake", kwargs, {**_TYPES, "heldout_fraction": float, "salt": str, "demo": str})
    env = {k: v for k, v in kwargs.items() if k in _TYPES}
    return FrozenLakeSource(FrozenLakeConfig(**env), **{k: v for k, v in kwargs.items() if k not in env})


def expert_actions(seed: int, **kwargs: Any) -> list[str]:
    """The expert's moves for episode ``seed`` of ``frozenlake`` with env ``kwargs``."""
    return make_frozenlake_source(**kwargs).expert_actions(seed)


def _expert_rng(seed: int) -> random.Random:
    """The expert's tie-breaking randomness for episode ``seed`` (the same moves every time)."""
    return random.Random(f"frozenlake-expert/{seed}")
