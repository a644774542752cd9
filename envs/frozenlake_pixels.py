"""``frozenlake_pixels``: FrozenLake whose map the policy sees as an image (a visual multi-turn task).

The episode is ``frozenlake``'s (:mod:`envs.frozenlake`: the same map, slips, rewards and turn
limit for the same kwargs and seed), but the board is not written out: the observation's image is
the grid drawn with numpy, ``cell_px`` pixels a cell (start blue, ice white, hole black, goal green,
the player a red square inside its cell), and its text is the instructions (first observation,
unless ``instructions`` is false), the feedback of the step, and ``You are at row r, column c.``. ``frames: first`` shows the image with
the first observation only (the map; the player then moves by text), ``frames: every`` with every
observation. :meth:`PixelLake.observation_images` gives the latest observation's images (PNG
bytes); the environment worker writes them to the run's blob store and the observation event
carries their digests (``EnvObservation.image_hashes``).

Task source ``frozenlake_pixels``: :class:`envs.frozenlake.FrozenLakeSource`'s episodes (held out
by map, the same experts) with these env kwargs; :attr:`PixelLakeSource.image_px` is the image's
side, which must lie within the model's image processor bounds (``launch.prepare.check_vision``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from envs.base import StepResult
from envs.frozenlake import _TYPES, FrozenLake, FrozenLakeConfig, FrozenLakeSource
from envs.gym_text import check_kwargs
from envs.registry import VISUAL_SOURCES, register_env, register_source
from envs.vision import png_bytes

FRAMES = ("first", "every")
"""Which observations show the image (env kwarg ``frames``)."""
CELL_RGB: dict[str, tuple[int, int, int]] = {
    "S": (40, 90, 230), "F": (235, 235, 235), "H": (0, 0, 0), "G": (30, 170, 50),
}
"""A cell's colour by its map letter."""
PLAYER_RGB = (220, 30, 30)
_LAKE_KEYS = ("size", "p", "slippery", "success_rate", "max_turns", "invalid_penalty", "instructions")
_PIXEL_TYPES: dict[str, type | tuple[type, ...]] = {
    **{k: _TYPES[k] for k in _LAKE_KEYS}, "cell_px": int, "frames": str,
}


def draw_lake(desc: tuple[str, ...], pos: int, cell_px: int) -> np.ndarray:
    """The map ``desc`` with the player on cell ``pos`` (row-major) as an (H, W, 3) uint8 image."""
    rows, cols = len(desc), len(desc[0])
    img = np.zeros((rows * cell_px, cols * cell_px, 3), dtype=np.uint8)
    for r, row in enumerate(desc):
        for c, ch in enumerate(row):
            img[r * cell_px:(r + 1) * cell_px, c * cell_px:(c + 1) * cell_px] = CELL_RGB[ch]
    pr, pc = divmod(pos, cols)
    m = max(1, cell_px // 4)
    img[pr * cell_px + m:(pr + 1) * cell_px - m, pc * cell_px + m:(pc + 1) * cell_px - m] = PLAYER_RGB
    return img


class PixelLake(FrozenLake):
    """The ``frozenlake_pixels`` environment (see the module doc)."""

    def __init__(self, config: FrozenLakeConfig | None = None, cell_px: int = 28, frames: str = "first") -> None:
        if frames not in FRAMES:
            raise ValueError(f"frozenlake_pixels: frames={frames!r} must be one of {', '.join(FRAMES)}")
        if not 4 <= cell_px <= 64:
            raise ValueError(f"frozenlake_pixels: cell_px={cell_px} must be in [4, 64]")
        super().__init__(config)
        self.cell_px, self.frames = cell_px, frames
        cfg = self.config
        slip = " The ice is slippery: you may slide sideways instead of where you wanted." if cfg.slippery else ""
        self.instructions = "" if not cfg.instructions else (
            "FrozenLake: the image shows the lake: start blue, ice white, holes black, goal green; you are the red "
            f"square. Walk to the goal without stepping into a hole; up moves toward the top.{slip} You have "
            f"{cfg.turns} moves. Reply with one move: left, down, right or up.")
        self.render = self._where
        self._shown: tuple[bytes, ...] = ()

    def _where(self, obs: Any) -> str:
        r, c = divmod(int(obs), len(self.desc[0]))
        return f"You are at row {r + 1}, column {c + 1}."

    def _frame(self) -> tuple[bytes, ...]:
        return (png_bytes(draw_lake(self.desc, int(self.obs), self.cell_px)),)

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        out = super().reset(seed)
        self._shown = self._frame()
        return out

    def step(self, action: str) -> StepResult:
        out = super().step(action)
        self._shown = self._frame() if self.frames == "every" else ()
        return out

    def observation_images(self) -> tuple[bytes, ...]:
        """The PNG bytes the latest observation shows (``()`` after a step with ``frames: first``)."""
        return self._shown


def _split(kwargs: dict[str, Any]) -> tuple[FrozenLakeConfig, dict[str, Any]]:
    lake = {k: v for k, v in kwargs.items() if k in _LAKE_KEYS}
    return FrozenLakeConfig(**lake), {k: v for k, v in kwargs.items() if k not in _LAKE_KEYS}


@register_env("frozenlake_pixels")
def make_pixel_lake_env(prompt: str = "", reference: str = "", **kwargs: Any) -> PixelLake:
    """Build a :class:`PixelLake` from JSON-scalar kwargs (``prompt`` / ``reference`` ignored)."""
    check_kwargs("frozenlake_pixels", kwargs, _PIXEL_TYPES)
    config, rest = _split(kwargs)
    return PixelLake(config, **rest)


@dataclass(frozen=True)
class PixelLakeSource(FrozenLakeSource):
    """``frozenlake``'s episodes with the ``frozenlake_pixels`` environment; registered as ``frozenlake_pixels``."""

    cell_px: int = 28
    frames: str = "first"
    name: str = "frozenlake_pixels"

    def __post_init__(self) -> None:
        super().__post_init__()
        PixelLake(self.config, self.cell_px, self.frames)  # checks cell_px and frames

    @property
    def image_px(self) -> int:
        """The side of every image, pixels (``size * cell_px``)."""
        return self.config.size * self.cell_px

    def env_kwargs(self) -> dict[str, Any]:
        lake = {k: getattr(self.config, k) for k in _LAKE_KEYS}
        return {**lake, "cell_px": self.cell_px, "frames": self.frames}

    def env(self) -> PixelLake:
        return PixelLake(self.config, self.cell_px, self.frames)


VISUAL_SOURCES.add("frozenlake_pixels")


@register_source("frozenlake_pixels")
def make_pixel_lake_source(**kwargs: Any) -> PixelLakeSource:
    """Build a :class:`PixelLakeSource` from the env kwargs plus ``heldout_fraction``, ``salt`` and ``demo``."""
    check_kwargs("frozenlake_pixels", kwargs, {**_PIXEL_TYPES, "heldout_fraction": float, "salt": str, "demo": str})
    config, rest = _split(kwargs)
    return PixelLakeSource(config, **rest)
