"""rollstream: envs — the environment interface, task sources and verifiers (registered by name)."""

from envs import (
    arith,
    code,
    files,
    frozenlake,
    frozenlake_pixels,
    gym_text,
    instruct,
    reasoning_gym,
    sandbox,
    sokoban,
    tool_use,
    verifiers,
    vision,
    webshop,
)
from envs.base import Env, Problem, StepResult, TaskSource, Verifier, VerifyResult
from envs.extract import extract_answer
from envs.registry import (
    episodic_domains,
    get_verifier,
    is_episodic,
    is_visual,
    make_source,
    register_env,
    register_source,
    register_verifier,
)
from envs.scoring import score_response, score_response_async
from envs.single_turn import SingleTurnEnv, make_env
from envs.verifiers import run_verifier, run_verifier_async

__all__ = [
    "Env",
    "Problem",
    "SingleTurnEnv",
    "StepResult",
    "TaskSource",
    "Verifier",
    "VerifyResult",
    "arith",
    "code",
    "episodic_domains",
    "extract_answer",
    "files",
    "frozenlake",
    "frozenlake_pixels",
    "get_verifier",
    "gym_text",
    "instruct",
    "is_episodic",
    "is_visual",
    "make_env",
    "make_source",
    "reasoning_gym",
    "register_env",
    "register_source",
    "register_verifier",
    "run_verifier",
    "run_verifier_async",
    "sandbox",
    "score_response",
    "score_response_async",
    "sokoban",
    "tool_use",
    "verifiers",
    "vision",
    "webshop",
]
