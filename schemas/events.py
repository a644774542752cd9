"""Every event of a run, as msgspec Structs encoded as msgpack.

Rules (docs/architecture.md, "Events and topics"):

* Events are facts: frozen Structs, never mutated; a change is a new event.
* Every event carries ``run_id``, a unique ``event_id`` and ``ts`` (unix seconds, float);
  events produced under a policy carry ``policy_version``.
* Each topic's events form a tagged union (tag field ``kind``, tag = class name), so one
  decoder per topic turns bytes into the right type.
* Evolution: a new field gets a default and goes last; a field never changes type; a tag is
  never reused. Structs are encoded as maps (not arrays), so old payloads decode in newer
  versions and newer payloads decode in older ones (unknown fields are ignored on decode).
  ``tests/schemas/fixtures`` keeps encoded events of every released version.
"""

from __future__ import annotations

import os
import random
import time
from typing import Literal

import msgspec

_ids = random.Random()  # seeded from os.urandom
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_ids.seed)  # a forked child draws its own ids


def new_event_id() -> str:
    """A random 128-bit id as 32 hex characters, from a generator of this module's own: seeded from
    ``os.urandom`` at import and again in a forked child, and never the global ``random``, which a
    run seeds. A quarter of ``os.urandom``'s cost (a system call per id), which every event pays."""
    return _ids.randbytes(16).hex()


def group_id_of(k: int) -> str:
    """The id of the feeder's group number ``k`` (0, 1, ... in the order they are issued): ``g000042``."""
    return f"g{k:06d}"


def group_number(group_id: str) -> int | None:
    """``k`` of a group id made by :func:`group_id_of`; ``None`` for any other id."""
    digits = group_id[1:]
    return int(digits) if group_id[:1] == "g" and digits.isascii() and digits.isdigit() else None


def sample_id_of(group_id: str, index: int) -> str:
    """The id of sample ``index`` of group ``group_id``: ``<group_id>/<index>`` (the feeder names every
    sample of a group so, and the trainer recomputes the ids of a group's members from it)."""
    return f"{group_id}/{index}"


def now_s() -> float:
    """Wall-clock time in unix seconds."""
    return time.time()


class Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", tag=True):
    """Fields every event has."""

    run_id: str
    """The run this event belongs to."""
    event_id: str = msgspec.field(default_factory=new_event_id)
    """Unique id of this event; consumers dedupe on it."""
    ts: float = msgspec.field(default_factory=now_s)
    """When the event was created, unix seconds."""


# --------------------------------------------------------------------------- env spec


class EnvSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Which environment (or single-step verifier) judges a sample, and its arguments."""

    name: str
    """Registered environment / verifier name, e.g. ``arith`` or ``math``."""
    kwargs: dict[str, str | int | float | bool] = msgspec.field(default_factory=dict)
    """Environment arguments (JSON-like scalars only)."""


# --------------------------------------------------------------------------- tasks


class RolloutTask(Event, frozen=True, kw_only=True):
    """One sample to generate: a prompt replicated ``group_size`` times shares ``group_id``."""

    sample_id: str
    """Unique id of this sample (``<group_id>/<index>``)."""
    group_id: str
    """The prompt's group: all replicas of one prompt share it."""
    index: int
    """Replica index within the group, ``0 .. group_size - 1``."""
    group_size: int
    """How many replicas of this prompt the group needs (``n``)."""
    prompt_id: str
    """Stable id of the prompt in its task source (the same across groups and runs)."""
    domain: str
    """Domain tag used for routing to a verifier and for mixing ratios."""
    prompt: str
    """Prompt text, already formatted with the chat/template of the run."""
    reference: str = ""
    """Ground truth for the verifier (an answer, test cases as JSON, ...)."""
    env: EnvSpec | None = None
    """Environment or verifier spec; ``None`` means the domain's configured default."""
    policy_version: int = 0
    """Latest weights version the feeder had seen when it issued the task."""
    max_new_tokens: int | None = None
    """Per-task cap on generated tokens; ``None`` uses the rollout config."""
    redundancy: int = 0
    """``rollout.group_size_redundancy``: the group has ``group_size + redundancy`` tasks (indices
    ``0 .. group_size + redundancy - 1``) of which the first ``group_size`` to finish are kept.
    (Added after v4.)"""
    system_prompt: str = ""
    """The prompt's own system turn (a file source's ``system_key``); empty = the domain's
    ``system_prompt``, else ``model.system_prompt``. (Added after v8.)"""
    baseline_index: int = -1
    """ReMax (``algorithm.adv_estimator: remax``): the index of the group's greedy baseline task,
    ``group_size + redundancy`` (one task past the others); every task of the group carries it.
    The task whose ``index`` equals it is generated greedily, scored like any sample and never
    trained: its reward is the baseline of the group's samples and its outcome is ``filtered``
    (reason ``remax baseline: ...``). ``-1``: the group has none. (Added after v10.)"""
    image_hashes: list[str] = []
    """A visual task's images, in the order the prompt shows them: the sha256 hex digests of their
    bytes in the run's blob store (``<run dir>/blobs``, :mod:`blobs`); the bytes never travel on the
    topics. Empty = a text task. (Added after v11.)"""

    @property
    def is_baseline(self) -> bool:
        """This task is its group's greedy ReMax baseline (:attr:`baseline_index`)."""
        return self.baseline_index >= 0 and self.index == self.baseline_index


# --------------------------------------------------------------------------- environments


class EnvReset(Event, frozen=True, kw_only=True):
    """Start an episode of ``env`` for a sample."""

    episode_id: str
    sample_id: str
    env: EnvSpec
    seed: int = 0


class EnvStep(Event, frozen=True, kw_only=True):
    """The agent's action in an episode."""

    episode_id: str
    step: int
    action: str
    policy_version: int = 0
    history: list[str] = msgspec.field(default_factory=list)
    """The episode's earlier actions, steps ``1 .. step - 1`` in order (added after v3). With
    ``env`` and ``seed`` it makes the step self-contained: an environment worker that does not
    hold the episode (restart, rebalance, eviction) rebuilds it by replaying these from the seed.
    Empty: not given (then only the worker holding the episode can answer)."""
    env: EnvSpec | None = None
    """The episode's environment, as in its ``EnvReset`` (added after v3); ``None``: not given."""
    seed: int = 0
    """The episode's seed, as in its ``EnvReset`` (added after v3)."""


class EnvObservation(Event, frozen=True, kw_only=True):
    """The environment's answer to a reset or a step."""

    episode_id: str
    step: int
    observation: str
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    info: dict[str, str | int | float | bool] = msgspec.field(default_factory=dict)
    error: str = ""
    """Non-empty when the environment crashed or timed out on this step."""
    env_s: float = 0.0
    """Seconds the environment worker spent on this answer: building or rebuilding the episode,
    the environment call and any simulated latency (added after v3)."""
    failed: bool = False
    """The episode ended as failed on this step (the environment raised or timed out, or the
    episode could not be built or rebuilt); ``error`` says why and ``terminated`` is set
    (added after v3)."""
    image_hashes: list[str] = msgspec.field(default_factory=list)
    """The images this observation shows (a visual environment's, e.g. ``frozenlake_pixels``), in
    order: the sha256 hex digests of their bytes, which the environment worker wrote to the run's
    blob store (:mod:`blobs`). Empty = text only. (Added after v13.)"""


# --------------------------------------------------------------------------- generations

FinishReason = Literal["stop", "length", "abort", "error"]


class Generation(Event, frozen=True, kw_only=True):
    """A finished rollout of one sample: everything the reward router and trainer need."""

    task: RolloutTask
    """The task this generation answers (carried whole, so downstream needs nothing else)."""
    prompt_ids: list[int]
    """Prompt token ids as the engine saw them."""
    response_ids: list[int]
    """Generated token ids (for multi-turn: agent and environment tokens interleaved)."""
    response_text: str
    """Decoded response."""
    logprobs: list[float]
    """Behaviour-policy log-probability of each response token, ``len == len(response_ids)``."""
    loss_mask: list[int]
    """1 for tokens the policy generated (trained on), 0 for environment tokens."""
    finish_reason: FinishReason
    """Why generation stopped: eos/stop string, token limit, aborted, engine error."""
    policy_version: int
    """Weights version the generation started with (at dispatch)."""
    policy_version_end: int
    """Weights version at completion (differs when weights were swapped mid-generation)."""
    worker_id: str = ""
    """Which rollout worker produced it."""
    queued_s: float = 0.0
    """Seconds between the task event and the start of generation."""
    gen_s: float = 0.0
    """Seconds spent generating."""
    env_s: float = 0.0
    """Seconds spent waiting on environments (multi-turn)."""
    num_turns: int = 1
    """Agent turns in the episode (1 for single-turn tasks)."""
    episode_id: str = ""
    """Multi-turn: the episode's id on ``env.requests`` / ``env.responses`` (unique per attempt:
    ``<sample_id>@<8 hex>``); empty for single-turn tasks. (Added after v4.)"""
    step_rewards: list[float] = msgspec.field(default_factory=list)
    """Multi-turn: the environment's reward for each agent turn, in order (``len == num_turns``).
    (Added after v4.)"""
    turn_versions: list[int] = msgspec.field(default_factory=list)
    """Multi-turn: the weights version each agent turn was generated with (weights are swapped
    between turns, never inside one). (Added after v4.)"""
    state_hashes: list[str] = msgspec.field(default_factory=list)
    """Multi-turn: the environment state each agent turn acted from (``info["state_hash"]`` of the
    observation before the turn; empty string where the environment reports none), GiGPO's step
    anchors. (Added after v4.)"""
    env_finish: str = ""
    """Multi-turn: how the episode ended: ``terminated``, ``truncated`` (by the environment),
    ``max_turns``, ``context`` (a rollout limit), ``env_error`` (the environment failed: see
    ``env_error``). Empty for single-turn tasks. (Added after v4.)"""
    env_error: str = ""
    """Multi-turn: why the environment failed (crash, timeout, unreachable), one line. (Added after v4.)"""
    success: bool = False
    """Multi-turn: the environment reported success (``info["success"]``) when the episode ended.
    (Added after v4.)"""
    segment_starts: list[int] = msgspec.field(default_factory=list)
    """Multi-turn with ``rollout.history_turns``: where each agent turn's own prompt (its window of
    the conversation, ``loss_mask`` 0) starts in ``response_ids``, for every turn after the first.
    The sequence ``prompt_ids + response_ids`` is then independent segments, each scored on its own
    (a segment's tokens never attend to an earlier segment's); empty = one sequence. (Added after v6.)"""
    peak_memory_gib: float = 0.0
    """The rollout worker's peak memory so far, GiB (``runtime.memory``: CUDA's peak allocation on a
    CUDA engine, else the process's peak resident set); 0 = not reported. (Added after v11.)"""
    image_hashes: list[str] = msgspec.field(default_factory=list)
    """Multi-turn: the images the environment's observations showed, in the order the sequence
    shows them (sha256 digests in the run's blob store; after the task's own ``image_hashes``, which
    come first). The trainer feeds ``task.image_hashes + image_hashes`` with the sequence. Empty =
    none. With ``segment_image_hashes``: every segment's images, one segment after the other. (Added after v13.)"""
    segment_image_hashes: list[list[str]] = msgspec.field(default_factory=list)
    """Multi-turn with ``rollout.history_turns`` and images: the images each segment shows, in its
    order (one list per segment: the first turn's, then one per ``segment_starts``; an image shows
    again in every window that holds its observation). The trainer feeds segment ``k``'s row
    ``segment_image_hashes[k]``; ``image_hashes`` is their concatenation. Empty = none (a text
    episode, or one sequence). (Added after v14.)"""


# --------------------------------------------------------------------------- scored


class ScoredSample(Event, frozen=True, kw_only=True):
    """A generation with its reward(s): self-contained input of the trainer."""

    generation: Generation
    reward: float
    """The scalar reward the trainer uses."""
    rewards: dict[str, float] = msgspec.field(default_factory=dict)
    """Named reward components (e.g. ``correct``, ``format``)."""
    verifier: str = ""
    """Which verifier scored it."""
    details: str = ""
    """Verifier's explanation (extracted answer, failing test...), free text."""
    reward_s: float = 0.0
    """Seconds spent verifying."""
    policy_version: int = 0
    """Copied from the generation (dispatch version), for filtering without decoding deeper."""
    step_rewards: list[float] = msgspec.field(default_factory=list)
    """Multi-turn episodes: one reward per agent turn (a contiguous run of ``loss_mask == 1``), for
    the step-level estimators; empty = ``reward`` is the outcome of the last turn. (Added after v1.)"""
    judge: str = ""
    """The judge of ``judge.models`` that scored it (empty = no judge). (Added after v5.)"""
    judge_s: float = 0.0
    """Seconds the judge call that scored it took (its batch's forward pass or its generated
    answer). (Added after v5.)"""
    judge_error: str = ""
    """Why the judge's answer gave no score (unparseable answer, judge failure); the ``judge``
    component is then 0. Empty = scored. (Added after v5.)"""


class JudgeRequest(Event, frozen=True, kw_only=True):
    """A generation the reward router scored with its verifier, waiting for its domain's judge
    (``judge.requests`` -> judge service -> ``scored``). (Added after v5.)"""

    scored: ScoredSample
    """The sample as the router scored it: verifier components in ``rewards``; the judge service
    adds ``judge``, computes ``reward`` from the domain's weights and emits it to ``scored``."""
    judge: str
    """Which judge of ``judge.models``."""


# --------------------------------------------------------------------------- weights


class WeightsPublished(Event, frozen=True, kw_only=True):
    """A new policy version exists; the event points at the weights, it never carries them."""

    policy_version: int
    """The new version; increases by one per optimizer step (0 = initial model)."""
    step: int
    """Trainer step that produced it."""
    uri: str
    """Where the weights are: a directory path, or a ``ray://`` / ``nccl://`` reference. With a
    ``memory`` copy the directory is written after the event (off the critical path): a reader
    waits for it to appear (it is renamed into place whole)."""
    format: Literal["safetensors-dir", "hf-dir", "ray", "nccl"] = "safetensors-dir"
    checksum: str = ""
    """sha256 over the weight files, hex; empty when the event went out before the directory was
    written (with a ``memory`` copy)."""
    num_bytes: int = 0
    """Bytes of the weights (of the directory's safetensors files, or of the ``memory`` segment)."""
    memory: str = ""
    """Where the same-node copy is: the path of a sealed shared-memory segment (``weights.shm``)
    on ``memory_host``; empty = none (``train.weights_handoff``). Engines on that node copy it
    straight into their model; the others, or when it is gone, read ``uri``. (Added after v9.)"""
    memory_host: str = ""
    """The node (host name) holding ``memory``. (Added after v9.)"""
    memory_checksum: str = ""
    """sha256 of the segment's manifest (names, dtypes, shapes, offsets and a nonce), hex: an
    engine applies the segment only when it is sealed and has this checksum. (Added after v9.)"""
    broadcast: str = ""
    """Where engines on other nodes receive ``memory`` from: the trainer's ``gloo://host:port``
    (``train.weights_broadcast``, ``weights.broadcast``); empty = they read ``uri``. (Added after
    v15.)"""


# --------------------------------------------------------------------------- metrics


class TrainStep(Event, frozen=True, kw_only=True):
    """One optimizer step of the trainer. ``metrics`` keys are stable column names."""

    step: int
    policy_version: int
    """Version the step trained (weights before the update)."""
    metrics: dict[str, float]
    """E.g. ``loss/policy``, ``loss/clipfrac``, ``rollout/reward_mean``, ``perf/step_s``."""
    sample_ids: list[str] = msgspec.field(default_factory=list)
    """The samples of this step's batch, in batch order."""
    staleness_hist: dict[int, int] = msgspec.field(default_factory=dict)
    """version gap -> number of samples in this batch."""


SampleStatus = Literal["trained", "dropped_stale", "filtered", "dead_letter"]


class SampleOutcome(Event, frozen=True, kw_only=True):
    """What became of a sample at the trainer (every issued sample ends in exactly one)."""

    sample_id: str
    group_id: str
    status: SampleStatus
    reason: str = ""
    """Why it was dropped or filtered (``stale: gap 3 > 2``, ``all-equal rewards``...)."""
    policy_version: int = 0
    """Version the sample was generated with."""
    trained_version: int = -1
    """Trainer version when it decided (the step's version if trained)."""
    step: int = -1
    """Trainer step that consumed it, ``-1`` if none."""


class EvalAnswer(msgspec.Struct, frozen=True, kw_only=True):
    """The greedy answer to one held-out problem, as an evaluation recorded it."""

    domain: str
    prompt_id: str
    prompt: str
    """The problem's text (cut to :data:`EVAL_TEXT_MAX_CHARS`)."""
    reference: str
    response: str
    """The model's greedy answer (cut to :data:`EVAL_TEXT_MAX_CHARS`)."""
    correct: bool
    """As the domain's verifier judged it."""
    image_hashes: list[str] = msgspec.field(default_factory=list)
    """A visual problem's images in the run's blob store (sha256 digests); empty = text only."""


EVAL_TEXT_MAX_CHARS = 2000
"""An :class:`EvalAnswer`'s prompt and response are cut to this many characters."""


class EvalResult(Event, frozen=True, kw_only=True):
    """Greedy evaluation on the fixed held-out set."""

    step: int
    policy_version: int
    split: str
    metrics: dict[str, float]
    """E.g. ``eval/accuracy``, ``eval/response_len``."""
    answers: list[EvalAnswer] = msgspec.field(default_factory=list)
    """The greedy answers to the first few held-out problems of each single-turn domain (the trainer
    records 8 a domain; ``rollstream report`` shows a visual run's with their images). Empty in
    events recorded before it existed. (Added after v12.)"""


# --------------------------------------------------------------------------- control


class RunStarted(Event, frozen=True, kw_only=True):
    config_json: str
    """The full resolved run config, JSON."""
    host: str = ""


class RunFinished(Event, frozen=True, kw_only=True):
    status: Literal["completed", "stopped", "failed"]
    summary_json: str = "{}"
    error: str = ""


class Pause(Event, frozen=True, kw_only=True):
    reason: str = ""


class Resume(Event, frozen=True, kw_only=True):
    pass


DrainOrigin = Literal["trainer", "user", "supervisor"]
"""Who publishes a ``Drain``: the trainer (its last step is done, or it stopped after another
``Drain``), a user (``rollstream stop``), the supervisor (``run.max_wall_s`` reached)."""


class Drain(Event, frozen=True, kw_only=True):
    """Finish in-flight work, take no new tasks, then stop."""

    reason: str = ""
    origin: DrainOrigin = "trainer"
    """Who published it (:data:`DrainOrigin`); every publisher sets it. (Added after v7.) The default
    is how a ``Drain`` recorded before the field reads: as the trainer's. That keeps old runs
    right: most of their drains are the trainer's, and for the others (``rollstream stop``, the
    wall limit) the feeder of that run already wrote ``RunFinished(status="stopped")``, which
    ``status`` reads first; a trainer resuming such a run still stops (a trainer ``Drain`` before
    the last step means "drained before the restart")."""


# --------------------------------------------------------------------------- dead letters


class DeadLetter(Event, frozen=True, kw_only=True):
    """A message a consumer could not decode or handle; raw bytes are kept for replay.

    One naming a ``sample_id`` ends that sample (``dead_letter`` in the record) unless it already
    had an outcome: the feeder frees its slot and the trainer completes its group without it."""

    source_topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    error: str
    """One line: what was wrong."""
    service: str = ""
    """Which service (consumer group) gave up on it."""
    stage: Literal["decode", "handle"] = "handle"
    sample_id: str = ""
    """The sample the message was about, when it could be decoded far enough to tell (from the
    decoded event, else from a schemaless decode of the bytes, else from a ``sample_id`` key)."""
    group_id: str = ""
    """The group of that sample, when the message names it (a ``scored`` key is a group id; a
    ``<group_id>/<index>`` sample id names its group). (Added after v1.)"""
    index: int = 0
    """Which event of its Kafka record it was (a batched record carries several; ``value`` is that
    event's own bytes). (Added after v9.)"""


# --------------------------------------------------------------------------- service lifecycle


class ServiceStarted(Event, frozen=True, kw_only=True):
    """The supervisor started a service process (the first start; a restart is
    :class:`ServiceRestarted`). (Added after v2.)"""

    service: str
    """Service label: ``recorder``, ``feeder``, ``reward``, ``rollout`` (``rollout0``... with
    several workers), ``trainer``."""
    pid: int
    """OS process id of the started process."""
    host: str = ""
    """Host the process runs on."""


class ServiceRestarted(Event, frozen=True, kw_only=True):
    """The supervisor restarted a service whose process exited unexpectedly. (Added after v2.)"""

    service: str
    """Service label (see :class:`ServiceStarted`)."""
    pid: int
    """OS process id of the new process."""
    exit_code: int
    """Exit status of the process that ended (negative: killed by that signal, e.g. -9)."""
    restarts: int
    """Restarts of this service so far, this one included."""
    reason: str = ""
    """One line: how the process ended and the last error line of its log."""
    backoff_s: float = 0.0
    """How long the supervisor waited before restarting it, seconds."""
    previous_pid: int = 0
    """OS process id of the process that ended."""


class ServiceFailed(Event, frozen=True, kw_only=True):
    """A service exited unexpectedly once more than ``run.max_restarts`` allows: the supervisor
    gives up and stops the run. (Added after v2.)"""

    service: str
    """Service label (see :class:`ServiceStarted`)."""
    pid: int
    """OS process id of the process that ended."""
    exit_code: int
    """Its exit status (negative: killed by that signal)."""
    restarts: int
    """Restarts of this service before it failed for good."""
    reason: str = ""
    """One line: how the process ended and the last error line of its log."""


# Per-topic unions (one decoder each). A topic's union only grows.
TaskEvent = RolloutTask
EnvRequestEvent = EnvReset | EnvStep
EnvResponseEvent = EnvObservation
GenerationEvent = Generation
ScoredEvent = ScoredSample
JudgeEvent = JudgeRequest
WeightsEvent = WeightsPublished
MetricsEvent = TrainStep | SampleOutcome | EvalResult
ControlEvent = RunStarted | RunFinished | Pause | Resume | Drain | ServiceStarted | ServiceRestarted | ServiceFailed
DlqEvent = DeadLetter

ALL_EVENT_TYPES: tuple[type[Event], ...] = (
    RolloutTask,
    EnvReset,
    EnvStep,
    EnvObservation,
    Generation,
    ScoredSample,
    JudgeRequest,
    WeightsPublished,
    TrainStep,
    SampleOutcome,
    EvalResult,
    RunStarted,
    RunFinished,
    Pause,
    Resume,
    Drain,
    DeadLetter,
    ServiceStarted,
    ServiceRestarted,
    ServiceFailed,
)
