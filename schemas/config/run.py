"""The whole run config (:class:`RunConfig`), its ``run`` section, and the rules a run config must
satisfy beyond its fields' declared bounds: the rules that relate two or more values (or need a
value to be finite, which a bound cannot say: ``inf > 0``).

Each rule is a function of the whole config that returns the one line naming what is wrong, or
``None``; :func:`check_rules` runs them in order (:data:`RULES`) and raises :class:`ConfigError`
with the first line. :func:`check_bounds` checks the declared bounds (msgspec ``Meta``) of a config
built in code; decoding checks them already. ``RunConfig.__post_init__`` calls both, so every way
of building a run config (parsing, ``RunConfig(...)``, ``msgspec.structs.replace``) is checked.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from schemas.config.base import (
    ConfigError,
    NonEmptyStr,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    Section,
)
from schemas.config.explain import explain_error
from schemas.config.infra import (
    KafkaSettings,
    PlacementConfig,
    ServicePlacement,
    StoreSettings,
    TrackingConfig,
)
from schemas.config.tasks import (
    REWARD_COMPONENTS,
    DataConfig,
    EnvWorkersConfig,
    JudgeConfig,
    ModelConfig,
    RewardConfig,
    TinyModelSpec,
)
from schemas.config.training import AlgorithmConfig, RolloutConfig, TrainConfig
from schemas.services import in_start_order, value_at


class RunSection(Section):
    """Identity and bookkeeping of the run."""

    name: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,100}$", description="1-100 characters of A-Z a-z 0-9 _ -")] = "run"
    """Prefix of generated run ids (``<name>-<timestamp>``)."""
    runs_dir: NonEmptyStr = "runs"
    """Directory holding one folder per run (weights, checkpoints, logs, store, summary)."""
    seed: int = 0
    """Seed of every random generator of the run."""
    max_wall_s: PositiveFloat = 3600.0
    """Wall-time budget of ``rollstream run``, seconds (warm-up and evaluations included): once it
    is spent the run is drained as by ``rollstream stop`` (no step starts after it; the trainer ends
    with its final evaluation; ``summary.json`` says ``stopped``); a run still not finished 600 s
    later is stopped as failed."""
    max_restarts: NonNegativeInt = 3
    """How often ``rollstream run`` restarts one service whose process exited unexpectedly (a
    crash, a signal, or exit 0 of a service that should still be running) before the run fails;
    0 = the first unexpected exit fails the run. A restarted service resumes from its committed
    offsets (the trainer from its latest checkpoint)."""
    restart_backoff_s: NonNegativeFloat = 1.0
    """Wait before the first restart of a service, seconds; doubles with each further restart of
    that service (1, 2, 4 ...) up to ``restart_backoff_max_s``."""
    restart_backoff_max_s: NonNegativeFloat = 30.0
    """Longest wait before a restart, seconds (at least ``restart_backoff_s``)."""
    torch_threads: NonNegativeInt = 0
    """Torch threads (``OMP_NUM_THREADS``) of each process that runs a model: the rollout workers, the
    trainer (shared out among its ``train.ranks``), the judge workers. 0 = auto: with the local
    launcher this machine's cores divided among those processes (at least 1 each), except with
    ``rollout.async_ratio`` 0, where the trainer computes only while the others wait for its weights:
    then the trainer gets every core and the others divide them; with ``--launcher ray`` each
    process's ``placement.<service>.cpus`` (at least 1). The other services get 1. Processes
    that each start a thread per core on a shared machine slow each other down badly (on 2 cores the
    main example ran 1.4x faster with 1 thread each). An ``OMP_NUM_THREADS`` in ``rollstream run``'s
    environment wins over this key."""
    stall_after_s: PositiveFloat = 120.0
    """``rollstream run`` and ``rollstream status`` call a run stalled when no training step
    (new weights version) happened for this long, seconds (before the first weights version,
    during the trainer's warm-up, five times as long), and say what they see."""


class RunConfig(Section):
    """A whole run."""

    run: RunSection = msgspec.field(default_factory=RunSection)
    kafka: KafkaSettings = msgspec.field(default_factory=KafkaSettings)
    store: StoreSettings = msgspec.field(default_factory=StoreSettings)
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    data: DataConfig = msgspec.field(default_factory=DataConfig)
    rollout: RolloutConfig = msgspec.field(default_factory=RolloutConfig)
    train: TrainConfig = msgspec.field(default_factory=TrainConfig)
    algorithm: AlgorithmConfig = msgspec.field(default_factory=AlgorithmConfig)
    reward: RewardConfig = msgspec.field(default_factory=RewardConfig)
    tracking: TrackingConfig = msgspec.field(default_factory=TrackingConfig)
    env: EnvWorkersConfig = msgspec.field(default_factory=EnvWorkersConfig)
    judge: JudgeConfig = msgspec.field(default_factory=JudgeConfig)
    placement: PlacementConfig = msgspec.field(default_factory=PlacementConfig)

    def __post_init__(self) -> None:
        check_bounds(self)  # decoding checked them already; a constructor does not
        check_rules(self)

    @property
    def max_inflight(self) -> int:
        """Samples the feeder keeps outstanding: ``batch_size × (1 + async_ratio) × (1 +
        oversample_ratio)``, times ``(group_size + group_size_redundancy + b) / group_size`` (``b = 1``
        with ``remax``: its greedy baseline task)."""
        n, r = self.rollout.group_size, self.rollout.group_size_redundancy
        b = int(self.algorithm.adv_estimator == "remax")
        return int(self.train.batch_size * (1 + self.rollout.async_ratio) * (1 + self.algorithm.oversample_ratio)
                   * (n + r + b) / n)


def resolve_dtype(dtype: str, device: str) -> str:
    """``model.dtype`` for a service on ``device``: ``auto`` = ``bfloat16`` on CUDA, ``float32`` elsewhere."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device.startswith("cuda") else "float32"


# --------------------------------------------------------------------------- the checks

Rule = Callable[[RunConfig], str | None]
RULES: list[Rule] = []
"""Every rule, in the order :func:`check_rules` runs them."""


def rule(fn: Rule) -> Rule:
    """Declare ``fn`` a rule of every run config."""
    RULES.append(fn)
    return fn


def check_rules(cfg: RunConfig) -> None:
    """:class:`ConfigError` with the line of the first rule ``cfg`` breaks."""
    for check in RULES:
        problem = check(cfg)
        if problem:
            raise ConfigError(problem)


@functools.cache
def _unchecked(cls: type[msgspec.Struct]) -> type[msgspec.Struct]:
    """A Struct with the fields and declared types of ``cls`` but not its ``__post_init__``."""
    return msgspec.defstruct(cls.__name__, [(f.name, f.type) for f in msgspec.structs.fields(cls)],
                             kw_only=True, forbid_unknown_fields=True)


def check_bounds(cfg: msgspec.Struct) -> None:
    """:class:`ConfigError` naming the key unless every value of ``cfg`` (a config Struct built in
    code) has its declared type and bounds: ``cfg`` is converted once more, as a parsed one was."""
    raw = msgspec.to_builtins(cfg)
    try:
        msgspec.convert(raw, _unchecked(type(cfg)))
    except msgspec.ValidationError as e:
        raise ConfigError(explain_error(e, raw, type(cfg))) from None


def _non_finite(obj: Any, prefix: str) -> str | None:
    """The first ``key=value`` below ``obj`` (a Struct, list or dict) holding NaN or ±inf, else None."""
    if isinstance(obj, msgspec.Struct):
        items: Any = ((f, getattr(obj, f)) for f in obj.__struct_fields__)
    elif isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, list):
        items = enumerate(obj)
    else:
        return None
    for name, value in items:
        key = f"{prefix}.{name}" if prefix else str(name)
        if isinstance(value, float) and not math.isfinite(value):
            return f"{key}={value}"
        found = _non_finite(value, key)
        if found:
            return found
    return None


def _tiny_shape(spec: TinyModelSpec, prefix: str) -> str | None:
    if spec.hidden_size % spec.num_heads:
        return f"{prefix}hidden_size={spec.hidden_size} must be a multiple of {prefix}num_heads={spec.num_heads}"
    return None


def check_tiny_spec(spec: TinyModelSpec, prefix: str = "") -> None:
    """:class:`ConfigError` naming the key unless ``spec`` describes a model that can be built."""
    check_bounds(spec)
    problem = _tiny_shape(spec, prefix)
    if problem:
        raise ConfigError(problem)


# --------------------------------------------------------------------------- the rules, in order


@rule
def finite_numbers(cfg: RunConfig) -> str | None:
    bad = _non_finite(cfg, "")
    return f"{bad} must be a finite number" if bad else None


@rule
def whole_groups(cfg: RunConfig) -> str | None:
    if cfg.train.batch_size % cfg.rollout.group_size:
        return (f"train.batch_size={cfg.train.batch_size} must be a multiple of "
                f"rollout.group_size={cfg.rollout.group_size} (batches hold whole groups)")
    return None


@rule
def weights_handoff(cfg: RunConfig) -> str | None:
    """``train.weights_handoff: memory`` needs the single-process torch strategy and the torch engine."""
    if cfg.train.weights_handoff != "memory":
        return None
    if cfg.train.strategy != "torch":
        return (f"train.weights_handoff=memory needs train.strategy=torch (got {cfg.train.strategy}); "
                "use auto or disk")
    if cfg.rollout.engine != "torch":
        return (f"train.weights_handoff=memory needs rollout.engine=torch (got {cfg.rollout.engine}: the server "
                "reads the directory); use auto or disk")
    return None


@rule
def weights_broadcast(cfg: RunConfig) -> str | None:
    """``train.weights_broadcast`` sends the ``memory`` handoff's segments: it needs that handoff."""
    t = cfg.train
    if t.weights_broadcast == "off":
        return None
    if t.weights_handoff == "disk":
        return (f"train.weights_broadcast={t.weights_broadcast} sends the memory handoff's copies, and "
                "train.weights_handoff=disk makes none; use train.weights_handoff=auto or memory")
    if t.strategy != "torch" or cfg.rollout.engine != "torch":
        return (f"train.weights_broadcast={t.weights_broadcast} needs train.strategy=torch and rollout.engine=torch "
                f"(got {t.strategy} and {cfg.rollout.engine}); use train.weights_broadcast=off")
    return None


@rule
def release_between_steps(cfg: RunConfig) -> str | None:
    """``rollout.release_between_steps`` frees the engine's memory only where it waits for the trainer
    (the devices are compared once resolved: :func:`schemas.devices.placement`)."""
    r, key = cfg.rollout, "rollout.release_between_steps"
    if r.release_between_steps == "off":
        return None
    if r.async_ratio > 0:
        return (f"{key}={r.release_between_steps} needs rollout.async_ratio=0 (got {r.async_ratio:g}: the engine "
                "generates while the trainer steps); set one of them")
    if r.engine != "torch":
        return (f"{key}={r.release_between_steps} needs rollout.engine=torch (got {r.engine}: a generation server "
                "manages its own memory); set it to off")
    return None


@rule
def restart_backoff(cfg: RunConfig) -> str | None:
    r = cfg.run
    if r.restart_backoff_max_s < r.restart_backoff_s:
        return (f"run.restart_backoff_s={r.restart_backoff_s:g} must be <= "
                f"run.restart_backoff_max_s={r.restart_backoff_max_s:g}")
    return None


@rule
def algorithm_combinations(cfg: RunConfig) -> str | None:
    """Impossible or meaningless combinations of ``algorithm`` keys."""
    s, a = cfg.algorithm, "algorithm."
    if s.adv_estimator == "gae" and s.critic == "none":
        return f"{a}adv_estimator=gae needs a critic: set {a}critic to value_head or separate"
    if s.adv_estimator != "gae" and s.critic != "none":
        return f"{a}critic={s.critic} is only used by {a}adv_estimator=gae (got {s.adv_estimator}); set {a}critic=none"
    if s.off_policy_correction != "none" and s.old_logprobs != "recompute":
        return (f"{a}off_policy_correction={s.off_policy_correction} needs {a}old_logprobs=recompute "
                "(the ratio π_old/μ needs recomputed logprobs)")
    if s.off_policy_correction == "decoupled" and s.pg_variant != "ppo":
        return f"{a}off_policy_correction=decoupled is decoupled PPO: needs {a}pg_variant=ppo"
    if s.dual_clip_loss and s.pg_variant != "ppo":
        return f"{a}dual_clip_loss needs {a}pg_variant=ppo (got {s.pg_variant})"
    if s.norm_std is not None and s.norm_std_type is not None:
        return f"{a}norm_std is the deprecated form of {a}norm_std_type: set only norm_std_type"
    if s.adv_estimator == "dr_grpo" and s.norm_std_type not in (None, "none"):
        return f"{a}adv_estimator=dr_grpo divides by no std: {a}norm_std_type must be none"
    if s.difficulty_low_threshold >= s.difficulty_high_threshold:
        return (f"{a}difficulty_low_threshold={s.difficulty_low_threshold:g} must be < "
                f"{a}difficulty_high_threshold={s.difficulty_high_threshold:g}")
    if s.dynamic_filter == "mean" and s.dynamic_filter_low > s.dynamic_filter_high:
        return (f"{a}dynamic_filter_low={s.dynamic_filter_low:g} must be <= "
                f"{a}dynamic_filter_high={s.dynamic_filter_high:g} (dynamic_filter: mean)")
    if s.target_kl_per_token is not None and not s.add_token_level_kl:
        return f"{a}target_kl_per_token adapts the coefficient of {a}add_token_level_kl, which is off"
    if s.pg_variant == "gspo" and s.loss_agg_mode != "seq-mean-token-mean":
        return (f"{a}pg_variant=gspo is a sequence-level objective: set {a}loss_agg_mode=seq-mean-token-mean "
                f"(got {s.loss_agg_mode})")
    if s.kl_penalty in ("k1+", "k3+"):
        return (f"{a}kl_penalty={s.kl_penalty} differs from {s.kl_penalty[:-1]} only in its gradient, and the KL "
                f"in the reward has none: use {s.kl_penalty[:-1]} (the + kinds are for {a}kl_loss_type)")
    return None


@rule
def domains(cfg: RunConfig) -> str | None:
    """Unique domain names, a share for some domain, and what each domain's answer format and
    system prompt need."""
    ds = cfg.data.domains
    names = [d.name for d in ds]
    for i, d in enumerate(ds):
        if d.name in names[:i]:
            return f"data.domains[{i}].name={d.name!r} must be unique"
    if not sum(d.ratio for d in ds) > 0:
        return "data.domains: the ratios must not all be 0"
    for i, d in enumerate(ds):
        if d.format_reward and d.answer == "raw":
            return (f"data.domains[{i}].format_reward={d.format_reward:g} needs data.domains[{i}].answer "
                    "'tag', 'boxed' or 'auto' (a raw answer has no format to reward)")
        if d.system_prompt and cfg.model.chat_template is False:
            return (f"data.domains[{i}].system_prompt is set but model.chat_template=false "
                    "(a system prompt needs the chat template; prepend it to the prompts instead)")
        if d.kwargs.get("system_key") and not _may_chat(cfg.model):
            return (f"data.domains[{i}].kwargs.system_key is set but the model has no chat template "
                    "(model.chat_template=false, or a tiny model without model.init.chat_template); "
                    "a system prompt needs one")
    return None


def _may_chat(m: ModelConfig) -> bool:
    """Whether prompts may go through a chat template: not ``chat_template: false``, and a tiny
    model only with ``init.chat_template`` (a model directory may have one: checked on disk)."""
    if m.chat_template is False:
        return False
    return bool(m.path or m.source or m.init.chat_template)


@rule
def chat_template(cfg: RunConfig) -> str | None:
    m = cfg.model
    if m.chat_template is True and not m.path and not m.source and not m.init.chat_template:
        return ("model.chat_template=true but the tiny model gets no chat template "
                "(set model.init.chat_template: true, or model.chat_template: auto)")
    if m.system_prompt and m.chat_template is False:
        return "model.system_prompt is set but model.chat_template=false (a system prompt needs the chat template)"
    return None


@rule
def trainer_layout(cfg: RunConfig) -> str | None:
    """LoRA, ranks and tensor parallelism against the training strategy."""
    t = cfg.train
    if t.lora_rank and t.strategy != "torch":
        return f"train.lora_rank={t.lora_rank} works with train.strategy='torch' only"
    if t.ranks > 1 and t.strategy == "torch":
        return f"train.ranks={t.ranks} needs train.strategy=fsdp2 or megatron (torch is one process)"
    if t.ranks % t.tensor_parallel:
        return f"train.tensor_parallel={t.tensor_parallel} must divide train.ranks={t.ranks}"
    if t.tensor_parallel > 1 and t.strategy != "megatron":
        return f"train.tensor_parallel={t.tensor_parallel} needs train.strategy=megatron"
    if t.micro_batch_tokens and t.micro_batch_size is not None:
        return (f"train.micro_batch_size={t.micro_batch_size} and train.micro_batch_tokens={t.micro_batch_tokens} "
                "are both set: micro-batches are sized by one of them, remove the other")
    if t.micro_batch_tokens and t.strategy == "megatron":
        return (f"train.micro_batch_tokens={t.micro_batch_tokens} does not work with train.strategy='megatron' "
                "(its GPTModel takes padded rows): use train.micro_batch_size")
    return None


@rule
def wandb_project(cfg: RunConfig) -> str | None:
    if cfg.tracking.wandb and not cfg.tracking.wandb_project:
        return "tracking.wandb_project must not be empty (tracking.wandb is on)"
    return None


@rule
def trackers_need_the_recorder(cfg: RunConfig) -> str | None:
    """Experiment trackers are fed by the live recorder."""
    if not cfg.store.record_live and (cfg.tracking.tensorboard or cfg.tracking.wandb):
        return ("tracking.tensorboard/tracking.wandb need the live recorder, but store.record_live=false "
                "(turn the trackers off, or record live)")
    return None


@rule
def simulated_latency(cfg: RunConfig) -> str | None:
    """A simulated latency (``reward``, ``env``) needs a mean, and a finite one for ``pareto``."""
    for key, s in (("reward", cfg.reward), ("env", cfg.env)):
        if s.latency != "none" and not s.latency_mean_s > 0:
            return f"{key}.latency={s.latency!r} needs {key}.latency_mean_s > 0, got {s.latency_mean_s:g}"
        if s.latency == "pareto" and s.latency_sigma <= 1:
            return f"{key}.latency_sigma={s.latency_sigma:g} must be > 0 (> 1 for pareto: a finite mean)"
    return None


@rule
def judges(cfg: RunConfig) -> str | None:
    """Each judge of ``judge.models`` has a model and only the keys its kind and score use (the
    models themselves are checked on disk by the CLI)."""
    for name, m in cfg.judge.models.items():
        key = f"judge.models.{name}"
        if not name:
            return "judge.models: a judge needs a non-empty name"
        if not m.path:
            return f"{key}.path is empty: a judge needs a local Hugging Face model directory"
        if m.kind == "reward_model":
            for field, bad in (("rubric", m.rubric), ("score", m.score), ("choices", m.choices), ("source", m.source)):
                if bad:
                    return (f"{key}.{field} is set but {key}.kind='reward_model' does not use it "
                            "(a reward model reads prompt + response and has its own head); remove it")
            continue
        if m.min_score >= m.max_score:
            return f"{key}: min_score={m.min_score} must be < max_score={m.max_score}"
        if m.score == "choice" and not m.choices:
            return f"{key}.score='choice' needs {key}.choices, e.g. {{yes: 1.0, no: 0.0}}"
        if m.score != "choice" and m.choices:
            return (f"{key}.choices is set but {key}.score={m.score or 'number'!r} does not use it; "
                    "set score: choice or remove choices")
        for label, value in m.choices.items():
            if not label.strip():
                return f"{key}.choices: {label!r}: {value:g} needs a non-empty label and a score in [0, 1]"
    return None


@rule
def domain_rewards(cfg: RunConfig) -> str | None:
    """A domain's ``judge`` is one of ``judge.models``; its ``rewards`` weigh components it has."""
    for i, d in enumerate(cfg.data.domains):
        key = f"data.domains[{i}]"
        if d.judge and d.judge not in cfg.judge.models:
            known = ", ".join(sorted(cfg.judge.models)) or "none defined"
            return f"{key}.judge={d.judge!r} is not in judge.models ({known})"
        for comp in d.rewards:
            if comp not in REWARD_COMPONENTS:
                return f"{key}.rewards: unknown component {comp!r}; one of {', '.join(REWARD_COMPONENTS)}"
            if comp == "judge" and not d.judge:
                return f"{key}.rewards weights 'judge' but the domain has no judge (set {key}.judge)"
            if comp == "format" and d.answer == "raw":
                return f"{key}.rewards weights 'format' but {key}.answer='raw' has no format"
    return None


@rule
def placement(cfg: RunConfig) -> str | None:
    """What Ray can reserve for a service (whether the cluster holds it is checked at the start)."""
    for spec in in_start_order():
        key = spec.placement_key
        s: ServicePlacement = value_at(cfg, key)
        if s.gpus > 1 and s.gpus != int(s.gpus):
            return (f"{key}.gpus={s.gpus:g} must be >= 0 and, above 1, a whole number (Ray shares a GPU "
                    "only as a fraction below 1)")
        for res in s.resources:
            if not res.strip() or res in ("CPU", "GPU", "memory", "object_store_memory"):
                return (f"{key}.resources: {res!r} is not a custom resource name (use {key}.cpus / "
                        f"{key}.gpus for CPU and GPU)")
    return None


@rule
def tiny_model(cfg: RunConfig) -> str | None:
    """The tiny model made when no ``model.path`` or ``model.source`` is given can be built and
    has room for a prompt and ``rollout.max_new_tokens``."""
    if cfg.model.path or cfg.model.source:
        return None
    spec, tokens = cfg.model.init, cfg.rollout.max_new_tokens
    shape = _tiny_shape(spec, "model.init.")
    if shape or tokens < spec.max_position_embeddings:
        return shape
    return (f"rollout.max_new_tokens={tokens} must be < model.init.max_position_embeddings="
            f"{spec.max_position_embeddings} (the prompt needs room too)")


_READ_BY: dict[str, tuple[str, str]] = {
    "sapo_tau_pos": ("pg_variant", "sapo"),
    "sapo_tau_neg": ("pg_variant", "sapo"),
    "clip_cov_ratio": ("pg_variant", "clip_cov"),
    "clip_cov_lb": ("pg_variant", "clip_cov"),
    "clip_cov_ub": ("pg_variant", "clip_cov"),
    "kl_cov_ratio": ("pg_variant", "kl_cov"),
    "kl_cov_coef": ("pg_variant", "kl_cov"),
    "pass_k": ("adv_estimator", "pass_at_k"),
    "pass_k_threshold": ("adv_estimator", "pass_at_k"),
}
"""The ``algorithm`` keys of the newer objectives and the one choice that reads each."""


@rule
def newer_objectives(cfg: RunConfig) -> str | None:
    """The keys of ``sapo``, ``gmpo``, ``clip_cov``, ``kl_cov`` and ``pass_at_k`` are set only for
    the choice that reads them, and each of the newer objectives gets what it needs (``remax``: no
    reward normalisation, its baseline is a raw reward)."""
    s, a = cfg.algorithm, "algorithm."
    if s.adv_estimator == "remax":  # A = r − r_greedy: the baseline must be on the reward's scale
        for key in ("norm_mean_type", "norm_std_type"):
            if getattr(s, key) not in (None, "none"):
                return (f"{a}{key}={getattr(s, key)} does not apply to adv_estimator=remax (its baseline is the "
                        "greedy response's reward, on the reward's own scale); remove it")
        if s.whiten_rewards:
            return (f"{a}whiten_rewards does not apply to adv_estimator=remax (its baseline is the greedy "
                    f"response's reward, on the reward's own scale); use {a}whiten_advantages")
    defaults = AlgorithmConfig()
    for key, (selector, reader) in _READ_BY.items():
        if getattr(s, key) != getattr(defaults, key) and getattr(s, selector) != reader:
            return (f"{a}{key} is set but only {a}{selector}={reader} reads it "
                    f"(got {selector}={getattr(s, selector)}); remove it")
    if s.pg_variant in ("sapo", "kl_cov") and (s.pg_clip_low is not None or s.pg_clip_high is not None):
        return f"{a}pg_variant={s.pg_variant} has no ratio clip: remove {a}pg_clip_low / {a}pg_clip_high"
    if s.pg_variant == "gmpo" and s.loss_agg_mode != "seq-mean-token-mean":
        return (f"{a}pg_variant=gmpo is a per-sequence objective: set {a}loss_agg_mode=seq-mean-token-mean "
                f"(got {s.loss_agg_mode})")
    if s.clip_cov_lb >= s.clip_cov_ub:
        return f"{a}clip_cov_lb={s.clip_cov_lb:g} must be < {a}clip_cov_ub={s.clip_cov_ub:g}"
    if s.pg_variant == "kl_cov" and s.old_logprobs == "recompute":
        return (f"{a}pg_variant=kl_cov penalises |log π − log π_old|, which is 0 throughout a step with "
                f"{a}old_logprobs=recompute (one update per batch): use old_logprobs=behaviour")
    if s.adv_estimator == "pass_at_k":
        if s.pass_k >= cfg.rollout.group_size:
            return (f"{a}pass_k={s.pass_k} must be < rollout.group_size={cfg.rollout.group_size} "
                    "(pass@k over all of a group's samples has one subset: no signal)")
        if s.norm_mean_type not in (None, "none") or s.norm_std_type not in (None, "none") or s.whiten_rewards \
                or s.add_token_level_kl:
            return (f"{a}adv_estimator=pass_at_k reads correctness from the shaped rewards and normalises "
                    f"itself: leave {a}norm_mean_type, norm_std_type, whiten_rewards and add_token_level_kl unset")
    if s.adv_estimator in ("gpg", "opo") and s.norm_mean_type not in (None, "none"):
        return (f"{a}adv_estimator={s.adv_estimator} subtracts its own baseline: leave {a}norm_mean_type "
                "unset (or none)")
    return None
