"""rollstream: envs — the environment interface, task sources and verifiers (registered by name)."""

from envs import arith, verifiers
from envs.base import Env, Problem, StepResult, TaskSource, Verifier, VerifyResult
from envs.registry import (
    get_verifier,
    make_source,
    register_env,
    register_source,
    register_verifier,
)
from envs.single_turn import SingleTurnEnv, make_env
from envs.verifiers import run_verifier

__all__ = [
    "Env",
    "Problem",
    "SingleTurnEnv",
    "StepResult",
    "TaskSource",
    "Verifier",
    "VerifyResult",
    "arith",
    "get_verifier",
    "make_env",
    "make_source",
    "register_env",
    "register_source",
    "register_verifier",
    "run_verifier",
    "verifiers",
]
