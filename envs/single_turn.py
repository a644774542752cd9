"""A single-turn environment: one prompt, one response, one verifier call."""

from __future__ import annotations

from typing import Any

from envs.base import StepResult
from envs.registry import ENVS, SOURCES, VERIFIERS, get_env_factory, make_source
from envs.verifiers import Isolation, run_verifier


class SingleTurnEnv:
    """``reset()`` returns the prompt; ``step(response)`` scores it with the verifier and terminates.

    ``info`` of the step holds ``correct``, ``details``, ``error`` (empty unless the verifier
    crashed or timed out) and the reward components. Stepping a finished episode is an error.
    """

    def __init__(
        self,
        prompt: str,
        reference: str,
        verifier: str,
        verifier_kwargs: dict[str, Any] | None = None,
        timeout_s: float = 5.0,
        isolation: Isolation = "thread",
    ) -> None:
        self.prompt, self.reference, self.verifier = prompt, reference, verifier
        self.verifier_kwargs = dict(verifier_kwargs or {})
        self.timeout_s, self.isolation = timeout_s, isolation
        self.done = False

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.done = False
        return self.prompt, {}

    def step(self, action: str) -> StepResult:
        if self.done:
            raise RuntimeError("step() on a finished single-turn episode; call reset() first")
        self.done = True
        res = run_verifier(
            self.verifier,
            action,
            self.reference,
            self.verifier_kwargs,
            timeout_s=self.timeout_s,
            isolation=self.isolation,
        )
        info: dict[str, Any] = {"correct": res.correct, "details": res.details, "error": res.error}
        info.update({f"reward/{k}": v for k, v in res.components.items()})
        return StepResult("", res.reward, True, False, info)


def make_env(name: str, *, prompt: str, reference: str = "", **kwargs: Any) -> Any:
    """An environment for ``EnvSpec(name, kwargs)``.

    ``name`` may be a registered environment (its factory gets ``prompt``, ``reference`` and
    ``kwargs``), a registered verifier (a :class:`SingleTurnEnv` with that verifier and
    ``kwargs`` as verifier kwargs), or a registered task source (a :class:`SingleTurnEnv` with
    the source's default verifier).
    """
    if name in ENVS:
        return get_env_factory(name)(prompt=prompt, reference=reference, **kwargs)
    if name in VERIFIERS:
        return SingleTurnEnv(prompt, reference, name, kwargs)
    if name in SOURCES:
        return SingleTurnEnv(prompt, reference, make_source(name).default_verifier)
    known = sorted({*ENVS, *VERIFIERS, *SOURCES})
    raise KeyError(f"unknown environment {name!r}; known: {', '.join(known)}")
