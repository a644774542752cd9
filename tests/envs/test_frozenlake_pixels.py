"""``frozenlake_pixels``: FrozenLake's episodes with the map as an image (a visual multi-turn task)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

import envs
from envs.base import observation_images
from envs.frozenlake import expert_actions, generate_map
from envs.frozenlake_pixels import CELL_RGB, PLAYER_RGB, make_pixel_lake_env, make_pixel_lake_source


def pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


def test_the_image_is_the_map_with_the_player_and_the_episode_is_frozenlakes() -> None:
    seed, cell = 11, 14
    env = make_pixel_lake_env(size=4, cell_px=cell, frames="every")
    lake = envs.make_env("frozenlake", prompt="", reference="", size=4)
    text, info = env.reset(seed)
    assert lake.reset(seed)[1]["state_hash"] == info["state_hash"]
    assert "the image shows the lake" in text and text.endswith("You are at row 1, column 1.")
    desc = generate_map(4, 0.8, seed)
    img = pixels(observation_images(env)[0])
    assert img.shape == (4 * cell, 4 * cell, 3)
    for r, row in enumerate(desc):  # a cell's corner has its colour; the player's centre is red
        for c, ch in enumerate(row):
            assert tuple(img[r * cell, c * cell]) == CELL_RGB[ch]
    assert tuple(img[cell // 2, cell // 2]) == PLAYER_RGB
    actions = expert_actions(seed, size=4)
    for a in actions:
        got, want = env.step(a), lake.step(a)
        assert (got.reward, got.terminated, got.info["state_hash"]) == (want.reward, want.terminated,
                                                                        want.info["state_hash"])
    assert got.reward == 1.0 and got.terminated and "reached the goal" in got.observation
    r, c = next((r, c) for r, row in enumerate(desc) for c, ch in enumerate(row) if ch == "G")
    assert tuple(pixels(observation_images(env)[0])[r * cell + cell // 2, c * cell + cell // 2]) == PLAYER_RGB


def test_frames_first_shows_the_image_with_the_first_observation_only() -> None:
    env = make_pixel_lake_env(size=3, cell_px=20, frames="first", instructions=False)
    text, _ = env.reset(0)
    assert text == "You are at row 1, column 1." and len(observation_images(env)) == 1
    assert observation_images(env)[0] == env.observation_images()[0]
    env.step("up")
    assert observation_images(env) == ()
    assert observation_images(envs.make_env("frozenlake", prompt="", reference="")) == ()  # a text env shows none


def test_source_is_visual_and_episodic_and_checks_its_kwargs() -> None:
    assert envs.is_visual("frozenlake_pixels") and envs.is_episodic("frozenlake_pixels")
    src = make_pixel_lake_source(size=4, cell_px=28, frames="every")
    assert src.image_px == 112 and envs.make_source("frozenlake_pixels").image_px == 112
    p = src.problem(5)
    assert p.prompt_id == "frozenlake_pixels:5" and '"cell_px": 28' in p.reference and '"frames": "every"' in p.reference
    assert src.expert_actions(5) == expert_actions(5, size=4)
    for kwargs, match in (({"frames": "all"}, "frames='all'"), ({"cell_px": 2}, "cell_px=2"),
                          ({"board": True}, "unknown kwarg 'board'"), ({"cell_px": 2.5}, "cell_px=2.5")):
        with pytest.raises(ValueError, match=match):
            make_pixel_lake_source(**kwargs)
