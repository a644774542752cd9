"""How a run generates and learns: generation (:class:`RolloutConfig`), the trainer
(:class:`TrainConfig`) and the RL algorithm (:class:`AlgorithmConfig`; formulas in
``docs/algorithms.md``)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from schemas.config.base import (
    AboveOne,
    Device,
    FractionBelowOne,
    NonEmptyStr,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveFraction,
    PositiveInt,
    Section,
    UnitInterval,
)


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
    workers: PositiveInt = 1
    """Rollout worker processes (one consumer group on ``tasks``)."""
    group_size: PositiveInt = 8
    """``n``: independent samples per prompt (a group)."""
    async_ratio: NonNegativeFloat = 1.0
    """Feeder keeps at most ``train.batch_size × (1 + async_ratio)`` samples outstanding (times
    ``1 + algorithm.oversample_ratio``); 0 = synchronous on-policy."""
    max_new_tokens: PositiveInt = 32
    """Cap on generated tokens per sample."""
    temperature: PositiveFloat = 1.0
    """Sampling temperature."""
    top_p: PositiveFraction = 1.0
    """Nucleus sampling mass."""
    max_batch: PositiveInt = 64
    """Concurrent sequences per worker (continuous batching slots)."""
    stop: list[Annotated[str, Meta(min_length=1, description="a non-empty string")]] = msgspec.field(
        default_factory=list)
    """Stop strings: a sample ends (``finish_reason: stop``) at the token that completes one of them
    in its decoded response; the tokens up to and including that one are kept. Generation also
    stops at the model's EOS tokens (tokenizer and ``generation_config.json``)."""
    device: Device = "auto"
    """Torch device of the rollout engine: ``auto`` (CUDA when present, else CPU), ``cpu``, ``cuda``
    or ``cuda:N``. A CUDA device that is not there is refused before anything starts. ``engine: torch``
    only (a generation server picks its own device; another value is refused with it)."""
    group_size_redundancy: NonNegativeInt = 0
    """``r``: extra samples per group. ``group_size + r`` are started and the first ``group_size`` to
    finish (to be scored) are kept; the others are cancelled — a multi-turn episode stops before its
    next turn, a sample that finishes anyway is not trained — and recorded as ``filtered`` with a
    reason starting ``cancelled:``. Against stragglers (slow or hanging environments); the feeder's
    in-flight bound grows by ``(group_size + r) / group_size``."""
    max_turns: PositiveInt = 8
    """Multi-turn domains: agent turns per episode at most (each turn generates at most
    ``max_new_tokens``); an episode still running after them ends with ``env_finish: max_turns``."""
    max_context_tokens: PositiveInt = 1024
    """Multi-turn domains: prompt plus every agent and environment turn, tokens at most (also capped
    by the model's ``max_position_embeddings``); an episode whose next observation would not fit ends
    with ``env_finish: context``. With ``history_turns`` it bounds each turn's window and reply."""
    history_turns: NonNegativeInt | None = None
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
    release_between_steps: Literal["off", "kv", "kv_and_weights"] = "off"
    """One device shared by rollout and trainer (``docs/models.md``, "One GPU for both"): what the
    engine gives back while it has nothing to generate, waiting for the next weights version, so the
    trainer's step has that memory. ``kv``: its KV cache (and CUDA graphs), reallocated at the next
    generation; ``kv_and_weights``: also its weights, moved to host memory and back (the new version
    is copied into the host copy). Needs ``rollout.async_ratio: 0`` (otherwise the engine generates
    while the trainer steps), ``engine: torch``, and ``rollout.device`` and ``train.device`` resolving
    to the same device; refused otherwise. ``off``: keep everything resident."""


DEFAULT_MICRO_BATCH_SIZE = 16
"""``train.micro_batch_size`` when neither it nor ``train.micro_batch_tokens`` is set."""


class TrainConfig(Section):
    """The trainer."""

    strategy: Literal["torch", "fsdp2", "megatron"] = "torch"
    """Training strategy behind ``trainer.Strategy``: ``torch`` (single process, CPU or one GPU),
    ``fsdp2`` (PyTorch FSDP2 over ``ranks`` processes: data parallel, parameters sharded) or
    ``megatron`` (megatron-core ``GPTModel``: tensor parallel ``tensor_parallel``, data parallel
    ``ranks / tensor_parallel``; needs the ``megatron`` extra). ``docs/scaling.md``."""
    ranks: PositiveInt = 1
    """Trainer processes (``fsdp2``, ``megatron``): rank 0 is the trainer service, which consumes
    ``scored``, commits and publishes; it starts ranks 1..N-1 itself and broadcasts every batch to
    them. On CUDA rank r uses ``cuda:r``; on CPU they share the CPU (gloo). ``torch``: 1."""
    tensor_parallel: PositiveInt = 1
    """``megatron``: tensor-parallel size (divides ``ranks``; the rest of ``ranks`` is data parallel)."""
    dist_timeout_s: PositiveFloat = 600.0
    """Collective timeout of the trainer's process group: a rank that hangs or dies fails the step
    (and the trainer, which the supervisor restarts from its checkpoint) after this many seconds."""
    steps: PositiveInt = 40
    """Optimizer steps of the run."""
    batch_size: PositiveInt = 64
    """Samples per optimizer step (a multiple of ``rollout.group_size``: whole groups)."""
    lr: PositiveFloat = 1e-5
    """AdamW learning rate (peak; see ``min_lr_ratio``)."""
    min_lr_ratio: PositiveFraction = 1.0
    """Cosine decay of the learning rate over ``steps`` down to ``lr × min_lr_ratio`` (1 = constant)."""
    lr_warmup_steps: NonNegativeInt = 0
    """Linear learning-rate warm-up over the first K RL steps: step k (0-based) trains at
    ``(k + 1) / K`` of the scheduled rate (0 = none). RL starts a fresh AdamW, whose first steps
    move every weight by about ``lr`` whatever its gradient; a warm-up keeps them from knocking a
    freshly warmed-up policy off its format."""
    weight_decay: NonNegativeFloat = 0.0
    """AdamW weight decay."""
    grad_clip: NonNegativeFloat = 1.0
    """Max global gradient norm (0 = off)."""
    micro_batch_size: PositiveInt | None = None
    """Samples per forward/backward pass (gradient accumulation over the batch); unset: 16, unless
    ``micro_batch_tokens`` sizes the micro-batches (set one of the two, not both). Each micro-batch
    is right-padded to its longest sample (samples are sorted by length first)."""
    micro_batch_tokens: NonNegativeInt = 0
    """Size the micro-batches by tokens instead: each holds consecutive samples (shortest first) whose
    ``prompt + response`` tokens add up to at most this many (a longer sample runs alone), and
    they are packed into one sequence without padding (position ids restart at every sample, so
    attention stays within each sample). 0 = off (``micro_batch_size``). ``strategy: torch`` and
    ``fsdp2`` (refused with ``megatron``)."""
    shared_prefix: bool = True
    """The samples of one group share their prompt: the trainer forwards it once per micro-batch and
    every response of the group attends to it (one packed sequence with an explicit attention
    mask, no padding), instead of once per sample. Exact: the logprobs and gradients equal the
    padded forward's up to float round-off. With a group of 8 and short answers, several times
    fewer tokens go through the model (docs/architecture.md, "Shared prompts"). Micro-batches then
    keep each group's samples together. ``strategy: torch`` and ``fsdp2`` with a text model; a
    vision-language model and ``megatron`` forward every sample on its own (false: always so)."""
    logprob_chunk_tokens: Annotated[int, Meta(ge=1, le=1 << 20)] = 1024
    """The token logprobs and entropies of the loss are computed from the last hidden states this
    many positions at a time (forward, and recomputed in backward): the whole-vocabulary logits of
    a micro-batch are never held at once, only ``logprob_chunk_tokens × vocabulary`` floats (fp32:
    200 MB for 1024 positions of a 49,152-token vocabulary). Larger: fewer, bigger matmuls.
    Every strategy (``megatron``: per tensor-parallel rank over its vocabulary slice) and the
    supervised warm-up, with a Hugging Face causal LM whose logits are ``head(last hidden
    state)``; the exact KL loss (``algorithm.kl_loss_type: full``) still computes whole logits."""
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
    max_staleness: NonNegativeInt = 1
    """Accept a sample only if ``trainer_version − policy_version ≤ max_staleness``."""
    checkpoint_every: NonNegativeInt = 10
    """Save a resumable checkpoint every K steps (0 = only at the start and the end). ``rollstream
    replay step RUN N`` starts from the latest checkpoint at or before N."""
    keep_checkpoints: NonNegativeInt = 0
    """Keep the newest K checkpoints (0 = all; the one of step 0, the RL start, is always kept).
    Besides them the run keeps the last 3 published weight versions (``runs/<id>/weights``) and its
    final model (``runs/<id>/final``); ``rollstream export RUN --step N DIR`` copies any of those
    (docs/runs.md)."""
    weights_handoff: Literal["auto", "memory", "disk"] = "auto"
    """How each new weight version reaches the rollout engines. ``disk``: the trainer writes the
    version's directory (``runs/<id>/weights``), then announces it; every engine reads it back.
    ``memory``: the trainer copies the version into a sealed shared-memory segment (``/dev/shm``;
    the newest 2 versions are kept), announces it, and writes the directory afterwards, off the
    critical path; engines on the trainer's node copy straight from the segment into their model,
    the others (or when the segment is gone) read the directory. Needs ``strategy: torch`` and
    ``rollout.engine: torch``. ``auto``: ``memory`` where it can be (those two and a ``/dev/shm``
    on the trainer's node), else ``disk``. A full ``/dev/shm`` sends that version by disk (a warning)."""
    weights_broadcast: Literal["off", "gloo"] = "off"
    """How engines on other nodes get each version of the ``memory`` handoff. ``off``: they read
    its directory (a filesystem the nodes share). ``gloo``: the trainer serves each version's
    segment over ``torch.distributed`` (gloo, TCP) at ``weights_broadcast_host``:
    ``weights_broadcast_port``. One engine per node receives it into that node's ``/dev/shm``; the
    node's other engines copy it from there. The directory is still written, and it is what an
    engine reads when the transfer fails. Needs ``weights_handoff`` ``memory`` or ``auto`` (with a
    ``/dev/shm`` on the trainer's node). The port serves the weights to whoever connects, with no
    authentication: a trusted network only (docs/security.md). NCCL (GPU to GPU) is not built."""
    weights_broadcast_host: str = ""
    """The address that engines on other nodes reach the trainer at (``weights_broadcast``); empty
    = the trainer node's address on its route to the Kafka broker."""
    weights_broadcast_port: Annotated[int, Meta(ge=0, le=65535)] = 0
    """The trainer's port for ``weights_broadcast`` (0 = any free one; the ``WeightsPublished``
    event carries the one taken)."""
    eval_every: NonNegativeInt = 5
    """Greedy evaluation on the held-out set every K steps (0 = only start and end)."""
    eval_samples: NonNegativeInt = 0
    """Besides the greedy answer, sample every held-out problem (or play every held-out episode)
    this many times at ``rollout.temperature`` / ``rollout.top_p`` in each evaluation:
    ``eval/accuracy_sampled`` (and ``eval/<domain>/accuracy_sampled``) is the mean correctness of
    those samples (mean@k), the policy as rollout runs it. 0 = greedy only. Costs k greedy
    evaluations' worth of generation per evaluation."""
    warmup_sft_steps: NonNegativeInt = 0
    """Supervised warm-up steps on generated solutions before RL (0 = none)."""
    warmup_lr: PositiveFloat = 1e-3
    """Learning rate of the supervised warm-up."""
    warmup_batch_size: PositiveInt = 32
    """Examples per supervised warm-up step (a multi-turn demonstration is one example, or with
    ``rollout.history_turns`` one per turn: its turns count as one)."""
    device: Device = "auto"
    """Torch device of the trainer (and its greedy evaluation): ``auto`` (CUDA when present, else
    CPU), ``cpu``, ``cuda`` or ``cuda:N``. It may be the rollout's device (one shared GPU) or
    another one."""
    lora_rank: NonNegativeInt = 0
    """LoRA rank (``peft``); 0 = train all parameters. With LoRA only the adapters train; the
    published weights are merged, so rollout needs no ``peft``."""
    lora_alpha: PositiveFloat = 32.0
    """LoRA scaling numerator (the update is scaled by ``lora_alpha / lora_rank``)."""
    lora_dropout: FractionBelowOne = 0.0
    """Dropout on the LoRA input."""
    lora_target_modules: Annotated[list[NonEmptyStr], Meta(min_length=1)] = msgspec.field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    """Module names (suffixes) that get LoRA adapters. A vision-language policy gets them on its
    language model's modules only: the vision tower's modules of the same names (Qwen2.5-VL's
    ``gate_proj`` / ``up_proj`` / ``down_proj``) get none, so with LoRA the tower, merger included,
    stays as it is."""
    freeze_vision: bool = False
    """Vision-language policy: the vision tower (Qwen2-VL's ``visual``: patch embedding and blocks)
    gets no gradient and no optimizer state, in the supervised warm-up and in RL; its merger (the
    projection of the tower's features into the language model) stays trainable, as does the
    language model. Refused with a text model. With LoRA the tower is frozen anyway."""

    @property
    def micro_rows(self) -> int:
        """Samples per micro-batch when sized by samples (``micro_batch_size``, default 16)."""
        return self.micro_batch_size or DEFAULT_MICRO_BATCH_SIZE


NormType = Literal["batch", "group", "running", "none"]
AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
KLKind = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "k1+", "k3+", "full"]


class AlgorithmConfig(Section):
    """RL algorithm knobs (names follow ROLL / verl). Formulas and papers: ``docs/algorithms.md``."""

    # --- advantage estimator
    adv_estimator: Literal["grpo", "dr_grpo", "rloo", "reinforce", "gae", "raft", "step_reinforce", "gigpo",
                           "gpg", "opo", "pass_at_k", "remax"] = "grpo"
    """Advantage estimator: ``grpo`` (group mean/std), ``dr_grpo`` (group mean, no std), ``rloo``
    (leave-one-out mean), ``reinforce`` (REINFORCE++: token returns whitened over the batch), ``gae``
    (PPO with a critic), ``raft`` (RAFT++: best of each group, advantage 1), ``step_reinforce`` and
    ``gigpo`` (step-level, for multi-turn episodes), ``gpg`` (group mean, rescaled by the share of
    groups with a signal), ``opo`` (length-weighted group mean), ``pass_at_k`` (analytic pass@k
    advantages); ``remax`` (one more response per prompt, greedy and never trained: its reward is the baseline)."""
    reinforce_baseline: bool = True
    """``reinforce``: subtract the group mean reward first (REINFORCE++-baseline); False = plain REINFORCE++."""
    gamma: UnitInterval = 1.0
    """Discount over response tokens (``reinforce``, ``gae``)."""
    lam: UnitInterval = 0.95
    """GAE λ (``gae``)."""
    raft_top_k: NonNegativeInt = 0
    """``raft``: keep the best ``top_k`` samples of each group (0 = every sample tied for the group's best)."""
    raft_min_reward: float | None = 0.0
    """``raft``: keep only samples with reward above this (``None`` = no threshold)."""
    episode_reward_weight: float = 1.0
    """``step_reinforce`` / ``gigpo``: weight of the episode-level term."""
    step_reward_weight: float = 1.0
    """``step_reinforce`` / ``gigpo``: weight of the step-level term."""
    step_reward_gamma: UnitInterval = 0.95
    """``step_reinforce`` / ``gigpo``: discount over the steps (turns) of an episode."""
    pass_k: PositiveInt = 4
    """``pass_at_k``: the k of pass@k (below ``rollout.group_size``)."""
    pass_k_threshold: float = 0.5
    """``pass_at_k``: a sample counts as correct when its reward (after shaping) is above this."""

    # --- policy loss
    pg_variant: Literal["ppo", "gspo", "topr", "cispo", "pg", "sapo", "gmpo", "clip_cov", "kl_cov"] = "ppo"
    """Policy loss: PPO clip, GSPO (sequence-level ratio), TOPR, CISPO, plain policy gradient, SAPO
    (soft gate), GMPO (geometric mean of clipped token ratios), Clip-Cov and KL-Cov (PPO / the plain
    surrogate, holding back the tokens of largest covariance between log-prob and advantage).
    ``gmpo`` reads ``pg_clip_low`` / ``pg_clip_high`` as bounds of the log ratio (unset: 0.4 each).
    ``gspo`` is a per-sequence objective: it needs ``loss_agg_mode: seq-mean-token-mean`` (any
    other aggregation is refused, not silently changed)."""
    pg_clip: NonNegativeFloat = 0.2
    """Ratio clip ε (both sides unless ``pg_clip_low`` / ``pg_clip_high`` are set)."""
    pg_clip_low: NonNegativeFloat | None = None
    """Lower clip ε_low; ``None`` = ``pg_clip``."""
    pg_clip_high: NonNegativeFloat | None = None
    """Upper clip ε_high (DAPO's clip-higher); ``None`` = ``pg_clip``."""
    dual_clip_loss: bool = False
    """``ppo``: dual-clip (the loss of a negative-advantage token is capped at ``−c·A``)."""
    dual_clip_c: AboveOne = 3.0
    """Dual-clip constant ``c``."""
    sapo_tau_pos: PositiveFloat = 1.0
    """``sapo``: gate temperature τ of positive-advantage tokens (larger = the gate closes sooner as ρ leaves 1)."""
    sapo_tau_neg: PositiveFloat = 1.05
    """``sapo``: gate temperature τ of negative-advantage tokens."""
    clip_cov_ratio: PositiveFraction = 2e-4
    """``clip_cov``: share of the batch's trained tokens whose gradient is detached (at least one)."""
    clip_cov_lb: float = 1.0
    """``clip_cov``: a token is a candidate when its covariance term is above this ..."""
    clip_cov_ub: float = 5.0
    """``clip_cov``: ... and below this."""
    kl_cov_ratio: PositiveFraction = 2e-4
    """``kl_cov``: share of the batch's trained tokens (largest covariance first, at least one) that get the KL penalty."""
    kl_cov_coef: NonNegativeFloat = 1.0
    """``kl_cov``: coefficient of the penalty ``|log π − log π_old|`` on those tokens."""
    loss_agg_mode: AggMode = "token-mean"
    """How per-token losses become one number: ``token-mean``, ``seq-mean-token-mean``,
    ``seq-mean-token-sum``, ``seq-mean-token-sum-norm`` (token sum / ``rollout.max_new_tokens``).
    ``pg_variant: gspo`` takes ``seq-mean-token-mean`` only."""

    # --- reward shaping
    reward_clip: PositiveFloat | None = None
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
    advantage_clip: PositiveFloat | None = None
    """Clip advantages to ``[−advantage_clip, advantage_clip]`` (``None`` = off)."""

    # --- data shaping
    max_len_mask: bool = False
    """Do not train on truncated responses (``finish_reason == "length"``; DAPO's overlong filtering)."""
    difficulty_mask: bool = False
    """Do not train on groups whose mean reward is ``<= difficulty_low_threshold`` or
    ``>= difficulty_high_threshold`` (too hard or too easy)."""
    difficulty_low_threshold: UnitInterval = 0.1
    """See ``difficulty_mask`` (below ``difficulty_high_threshold``)."""
    difficulty_high_threshold: UnitInterval = 0.95
    """See ``difficulty_mask``."""
    dynamic_filter: Literal["none", "all_equal", "mean", "std"] = "none"
    """Drop whole groups before they enter a batch (recorded as ``filtered``; the batch waits for more
    groups, so it still fills): ``all_equal`` (every reward equal: no signal), ``mean`` (group mean
    reward outside ``[dynamic_filter_low, dynamic_filter_high]``), ``std`` (group std below ``dynamic_filter_low``)."""
    dynamic_filter_low: float = 0.0
    """Lower bound of ``dynamic_filter`` (``mean``: minimum group mean; ``std``: minimum group std)."""
    dynamic_filter_high: float = 1.0
    """Upper bound of ``dynamic_filter: mean``."""
    oversample_ratio: NonNegativeFloat = 0.0
    """Issue up to ``(1 + oversample_ratio)×`` more samples in flight, so filtered groups are replaced sooner."""
    error_max_len_clip: bool = False
    """Train on at most ``error_max_len_threshold`` tokens of a response whose reward is ``<= 0``."""
    error_max_len_threshold: PositiveInt = 16
    """See ``error_max_len_clip``, tokens."""
    difficulty_loss_weight: bool = False
    """Weigh each sample's loss by its group's difficulty ``1 − mean reward`` (renormalised to batch mean 1)."""
    length_loss_weight: bool = False
    """Weigh each sample's loss by ``mean length / its response length`` (renormalised to batch mean 1):
    long responses do not dominate a ``token-mean`` loss."""

    # --- regularisation and the reference model
    add_token_level_kl: bool = False
    """Subtract ``kl_coef · KL(π ‖ π_ref)`` per token from the rewards (loads the reference model)."""
    init_kl_coef: NonNegativeFloat = 0.05
    """Initial (or fixed) coefficient of ``add_token_level_kl``."""
    target_kl_per_token: PositiveFloat | None = None
    """Adaptive KL controller target (Ziegler et al. 2019), nats per trained token: the batch's mean
    per-token KL of ``add_token_level_kl`` is steered towards it; ``None`` = fixed coefficient.
    (Replaces ``target_kl``, which was compared with the KL summed over each sequence.)"""
    kl_horizon: PositiveInt = 10000
    """Adaptive KL controller horizon, samples."""
    kl_penalty: KLKind = "kl"
    """KL estimator of ``add_token_level_kl``: ``kl`` (k1), ``abs``, ``mse`` (k2), ``low_var_kl`` (k3), or
    ``full`` (exact, over the vocabulary: one more forward pass of policy and reference per step).
    ``k1+``/``k3+`` are refused here: they differ from k1/k3 in their gradient only, and the KL in
    the reward has none."""
    use_kl_loss: bool = False
    """Add ``kl_loss_coef · KL(π ‖ π_ref)`` to the loss (GRPO's β·KL; loads the reference model)."""
    kl_loss_coef: NonNegativeFloat = 0.001
    """Coefficient of ``use_kl_loss``."""
    kl_loss_type: KLKind = "low_var_kl"
    """KL estimator of ``use_kl_loss`` (``full``: exact over the vocabulary; the reference model runs
    once more per micro-batch). ``k1+``/``k3+``: the value of k1/k3 with the gradient of k2
    (straight-through; the k2 gradient's expectation is the KL's gradient, k1's and k3's are not)."""
    entropy_loss_coef: float = 0.0
    """Entropy bonus coefficient (the loss gets ``− coef · entropy``)."""

    # --- critic
    critic: Literal["none", "value_head", "separate"] = "none"
    """Critic for ``gae``: a ``value_head`` on the policy's last hidden state (shared trunk) or a
    ``separate`` value model initialised from the policy."""
    value_clip: float | None = 0.2
    """PPO value clip (``None`` = off)."""
    vf_coef: NonNegativeFloat = 0.5
    """Weight of the value loss (``value_head``: added to the policy loss)."""
    critic_lr: PositiveFloat | None = None
    """Learning rate of a ``separate`` critic and of the value head; ``None`` = ``train.lr × 10``."""

    # --- off-policy correction
    old_logprobs: Literal["behaviour", "recompute"] = "behaviour"
    """The ratio's denominator: the rollout engine's ``behaviour`` logprobs (the ratio corrects for
    staleness directly) or logprobs ``recompute``d by the trainer at the start of the step (PPO's
    proximal policy; needed by the corrections below)."""
    off_policy_correction: Literal["none", "tis", "masked_is", "decoupled", "rejection", "icepop"] = "none"
    """With ``old_logprobs: recompute``: ``tis`` (truncated importance weight ``min(π_old/μ, is_cap)``),
    ``masked_is`` (tokens with ``π_old/μ`` outside ``[is_low, is_high]`` are not trained),
    ``decoupled`` (AReaL's decoupled PPO: ``min(π_prox/μ, is_cap) ×`` PPO-clip of ``π/π_prox``; token level),
    ``rejection`` (tokens or sequences whose k1/k3 divergence between π_old and μ exceeds
    ``rejection_threshold`` are not trained; ``rejection_*`` keys) or ``icepop`` (IcePop: weight
    ``π_old/μ`` inside ``[icepop_low, icepop_high]``, 0 outside). ``rejection`` and ``icepop`` record
    ``offpolicy/rejected_tokens`` and ``offpolicy/rejected_seqs`` per step."""
    is_level: Literal["token", "sequence", "geometric"] = "token"
    """Level of the ``tis`` / ``masked_is`` ratio."""
    is_cap: PositiveFloat = 2.0
    """Truncation of ``tis`` / ``decoupled`` weights."""
    is_low: FractionBelowOne = 0.5
    """Lower bound of ``masked_is``."""
    is_high: AboveOne = 2.0
    """Upper bound of ``masked_is``."""
    rejection_level: Literal["token", "sequence"] = "sequence"
    """``rejection``: reject single ``token``s, or whole ``sequence``s by the mean divergence over
    their trained tokens."""
    rejection_divergence: Literal["k1", "k3"] = "k3"
    """``rejection``: the per-token divergence of μ from π_old (``log ρ = log π_old − log μ``):
    ``k1 = −log ρ``, compared by its magnitude (a band ``ρ ∈ [e^{−τ}, e^{τ}]``; per sequence, on
    the geometric-mean ratio), or ``k3 = ρ − 1 − log ρ`` (≥ 0, lower variance)."""
    rejection_threshold: PositiveFloat = 0.05
    """``rejection``: the threshold ``τ``, nats (per token, or the sequence's mean per token)."""
    icepop_low: FractionBelowOne = 0.5
    """``icepop``: lower end ``α`` of the band of ``π_old/μ`` that keeps its weight (0 = none)."""
    icepop_high: AboveOne = 5.0
    """``icepop``: upper end ``β`` of that band."""
    norm_std: bool | None = None
    """Deprecated (configs before the algorithm suite): ``false`` = ``norm_std_type: none``,
    ``true`` = the estimator's default. Kept so recorded runs still load."""

    @property
    def clip_low(self) -> float:
        """ε_low in effect."""
        if self.pg_clip_low is not None:
            return self.pg_clip_low
        return 1.0 if self.pg_variant == "cispo" else 0.4 if self.pg_variant == "gmpo" else self.pg_clip

    @property
    def clip_high(self) -> float:
        """ε_high in effect."""
        if self.pg_clip_high is not None:
            return self.pg_clip_high
        return 0.28 if self.pg_variant == "cispo" else 0.4 if self.pg_variant == "gmpo" else self.pg_clip

    @property
    def uses_reference(self) -> bool:
        """Whether a reference model is needed (only when a KL term is on)."""
        return self.add_token_level_kl or self.use_kl_loss
