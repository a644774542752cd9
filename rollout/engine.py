"""Generation engines behind one :class:`Engine` protocol, and :class:`TorchEngine`.

``TorchEngine`` is a continuous-batching loop over a transformers causal LM on the CPU or one GPU.
At most ``max_batch`` sequences run together; one engine step admits waiting requests into free
slots (one batched prefill) and runs one decode step for every row, and a row that finished (EOS,
a stop string or ``max_new_tokens``) leaves right after it. Llama-family models
(:func:`rollout.slot_decoder.slot_support`) run through :class:`SlotDecoder`, any other causal LM
through :class:`HFDecoder` (transformers' forward over a ``DynamicCache`` whose rows we edit;
``decoder="hf"`` forces it). :class:`VLMDecoder` is the same for a Qwen2-VL-family model, its
prefill fed each row's images.

Each generated token reports its behaviour logprob ``log_softmax(logits / T)[token]`` at the
request's temperature, untruncated by ``top_p`` (:mod:`rollout.sampling`): the trainer's
teacher-forced logprob of the same weights up to float round-off. :meth:`TorchEngine.load_weights`
copies a published weight set into the live parameters between two steps
(:func:`weights.copy_weights_`); requests in flight continue with the new weights, and each
:class:`Completion` reports the version it started and ended with. All torch work runs on one
thread of the engine's own, so the event loop stays responsive. Sampling is seeded per engine.
:meth:`TorchEngine.release` gives back an idle engine's KV cache, and its weights to host memory,
which the next step takes back (``rollout.release_between_steps``: one device for rollout and trainer).

How admission, padding, prefix sharing and the swap work, and why not transformers' own
continuous batching: docs/architecture.md, "Engines and strategies".
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
import time
import typing
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from blobs import decode_image, pixel_inputs
from rollout.model_init import encode_prompt, eos_token_ids, load_model, load_tokenizer, use_chat_template
from rollout.sampling import SamplingParams, sample_next
from rollout.slot_decoder import SlotDecoder, forget_fusions, slot_support
from rollout.vlm import (
    ImageInputs,
    encode_vlm_prompt,
    is_vlm_dir,
    load_image_processor,
    load_vlm,
    suppress_vision_markers,
    vision_marker_ids,
)
from schemas.errors import surfaced, to_thread
from weights import copy_weights_, read_weights

FinishReason = Literal["stop", "length", "abort", "error"]
Released = Literal["", "kv", "kv_and_weights"]
"""What :meth:`TorchEngine.release` gave back: nothing (""), the KV cache, or it and the weights."""
_FEED_DONE = object()  # end-of-stream marker on a generate() call's queue
ENCODE_CACHE = 1024
"""How many recent prompts :meth:`TorchEngine.encode` keeps tokenized."""


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt to complete."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    images: ImageInputs | None = None
    """A vision-language engine's images of this prompt (:meth:`TorchEngine.image_inputs`), whose
    ``<|image_pad|>`` tokens ``prompt_ids`` hold (:meth:`TorchEngine.encode` with them); None: text."""


@dataclass(frozen=True)
class Completion:
    """A finished request. ``token_ids`` includes the EOS token when ``finish_reason == "stop"``."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    """Behaviour logprob of each generated token, ``len == len(token_ids)``."""
    text: str
    """Decoded ``token_ids`` without special tokens."""
    finish_reason: FinishReason
    policy_version: int
    """Weights version when the request got its slot."""
    policy_version_end: int
    """Weights version when it finished (differs if weights were swapped in between)."""
    queued_s: float = 0.0
    """Seconds from submission to getting a slot."""
    gen_s: float = 0.0
    """Seconds from getting a slot to finishing."""
    error: str = ""


@runtime_checkable
class Engine(Protocol):
    """What the services call on a generation engine (the rollout worker, and the trainer's
    greedy evaluation): exactly these members, nothing else."""

    policy_version: int
    """Version of the weights in use (the last :meth:`load_weights`)."""
    chat: bool
    """Whether :meth:`encode` renders prompts through the tokenizer's chat template."""
    tokenizer: Any
    """The model's Hugging Face tokenizer (multi-turn episodes render their turns with it)."""
    max_positions: int
    """Longest sequence the model takes (``max_position_embeddings``), tokens."""

    def encode(self, prompt: str, system_prompt: str | None = None) -> list[int]:
        """Prompt token ids as this engine renders them (chat template or bare text with BOS);
        ``system_prompt`` (None = the engine's default) is the chat template's system turn."""
        ...

    def generate(
        self, requests: Iterable[GenerationRequest] | AsyncIterable[GenerationRequest]
    ) -> AsyncIterator[Completion]:
        """Complete every request; yield completions in the order they finish."""
        ...

    async def load_weights(self, ref: str | Path, version: int | None = None) -> None:
        """Swap in the weights at ``ref`` (a directory of safetensors; the torch engine also takes a
        shared-memory segment, :func:`weights.read_weights`) and record ``version``."""
        ...


# --------------------------------------------------------------------------- KV batch


def left_padded(prompts: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``prompts`` as one left-padded batch: token ids (pad 0), attention mask and position ids
    (each row counts from 0 at its first real token), each ``(b, P)``."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts], device=device)  # (b, P)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)  # (b, P)
    pos = (mask.cumsum(dim=1) - 1).clamp(min=0)  # (b, P)
    return ids, mask, pos


def _pad_left(x: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """Zero-pad ``x`` on the left along ``dim`` to ``length``."""
    extra = length - x.shape[dim]
    if extra <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x.new_zeros(shape), x], dim=dim)


def kv_layers(cache: DynamicCache) -> list[DynamicLayer]:
    """The cache's layers, checked to be plain full-attention ``DynamicLayer``s.

    Row editing (left padding, eviction, trimming) is only exact for full attention; models
    with sliding-window or linear-attention layers are rejected with a clear error.
    """
    layers = list(cache.layers)
    for layer in layers:
        if type(layer) is not DynamicLayer:
            raise TypeError(f"TorchEngine supports full-attention caches only, got {type(layer).__name__}")
    return typing.cast(list[DynamicLayer], layers)


def _kv(layer: DynamicLayer) -> tuple[torch.Tensor, torch.Tensor]:
    if layer.keys is None or layer.values is None:
        raise RuntimeError("KV cache layer is empty (no prefill ran)")
    return layer.keys, layer.values


def merge_caches(a: DynamicCache, b: DynamicCache, length: int) -> None:
    """Append ``b``'s rows to ``a`` in place, both left-padded to ``length`` columns."""
    for la, lb in zip(kv_layers(a), kv_layers(b), strict=True):
        (ka, va), (kb, vb) = _kv(la), _kv(lb)
        la.keys = torch.cat([_pad_left(ka, length, 2), _pad_left(kb, length, 2)], dim=0)
        la.values = torch.cat([_pad_left(va, length, 2), _pad_left(vb, length, 2)], dim=0)


def select_cache(cache: DynamicCache, rows: torch.Tensor, first_col: int) -> None:
    """Keep ``rows`` and the columns from ``first_col`` on, in place."""
    for layer in kv_layers(cache):
        keys, values = _kv(layer)
        layer.keys, layer.values = keys[rows, :, first_col:], values[rows, :, first_col:]


@dataclass
class _Row:
    """Book-keeping of one running request."""

    request: GenerationRequest
    out: asyncio.Queue[Completion | object]
    submitted: float
    started: float
    version: int
    cap: int
    """Most tokens this row may generate: its ``max_new_tokens``, within the model's positions."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class _RowParams:
    """The sampling parameters of a batch's rows as tensors, one entry per row in row order, kept
    beside the rows (built once per row at admission, not per decode step)."""

    temperature: torch.Tensor  # (B,) float
    top_p: torch.Tensor  # (B,) float
    greedy: torch.Tensor  # (B,) bool

    @classmethod
    def of(cls, params: list[SamplingParams], device: torch.device) -> _RowParams:
        return cls(torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
                   torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
                   torch.tensor([p.greedy for p in params], dtype=torch.bool, device=device))

    def cat(self, other: _RowParams) -> _RowParams:
        return _RowParams(torch.cat([self.temperature, other.temperature]), torch.cat([self.top_p, other.top_p]),
                          torch.cat([self.greedy, other.greedy]))

    def select(self, idx: torch.Tensor) -> _RowParams:
        return _RowParams(self.temperature[idx], self.top_p[idx], self.greedy[idx])


@dataclass
class _Pending:
    request: GenerationRequest
    out: asyncio.Queue[Completion | object]
    submitted: float


class HFDecoder:
    """The running batch through transformers' own forward (any causal LM): one ``DynamicCache``
    with rows right-aligned (left padding masked by the 2-D attention mask, explicit position ids),
    all on ``device`` (the model's: a CPU tensor among CUDA ones fails the first ``torch.cat``).
    :class:`rollout.slot_decoder.SlotDecoder` has the same members."""

    def __init__(self, model: Any, device: torch.device | str = "cpu", prefill_kwargs: dict[str, Any] | None = None
                 ) -> None:
        self.model = model
        self.device = torch.device(device)
        self.prefill_kwargs = prefill_kwargs or {}
        self.cache: DynamicCache | None = None
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)  # (B, L)
        self.next_pos = torch.zeros(0, dtype=torch.long, device=self.device)  # (B,) position id of the next token
        self.reused_tokens = 0
        """Always 0: this path prefills every prompt token of every row (no shared-prompt reuse)."""

    @property
    def rows(self) -> int:
        return int(self.mask.shape[0])

    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        """Append rows for ``prompts`` (one left-padded forward); the logits (b, V) after each prompt."""
        ids, mask, pos = left_padded(prompts, self.device)  # (b, P) each
        cache = DynamicCache(config=self.model.config)
        # only the last position's logits (prefill_kwargs): the LM head over every prompt position is
        # (b, P, V) of work for nothing (about a third of a SmolLM2 prefill's time, its 49k vocabulary)
        logits = self.model(
            input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True,
            **self.prefill_kwargs,
        ).logits[:, -1]  # (b, V)
        self.append(cache, mask)
        return logits

    def append(self, cache: DynamicCache, mask: torch.Tensor) -> None:
        """Append prefilled rows (``cache``/``mask`` left-padded). The rows join only once every
        tensor is built: a failure leaves the batch as it was (except a half-merged cache, which the
        engine's error path drops with the batch)."""
        next_pos = torch.cat([self.next_pos, mask.sum(dim=1)])
        if self.cache is None or not self.rows:
            self.cache, self.mask = cache, mask
        else:
            length = max(self.mask.shape[1], mask.shape[1])
            new_mask = torch.cat([_pad_left(self.mask, length, 1), _pad_left(mask, length, 1)], dim=0)
            merge_caches(self.cache, cache, length)
            self.mask = new_mask
        self.next_pos = next_pos

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row (B,); the next logits (B, V)."""
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.rows, 1)], dim=1)  # (B, L + 1)
        logits = self.model(
            input_ids=tokens.unsqueeze(1),
            attention_mask=self.mask,
            position_ids=self.next_pos.unsqueeze(1),
            past_key_values=self.cache,
            use_cache=True,
        ).logits[:, -1]  # (B, V)
        self.next_pos = self.next_pos + 1
        return logits

    def keep(self, keep: list[int]) -> list[int]:
        """Evict every row not in ``keep`` and trim columns that are padding for all kept rows;
        the kept rows stay in their order (returned, as :class:`SlotDecoder` does)."""
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        mask = self.mask[idx]
        first_col = int(mask.shape[1] - mask.sum(dim=1).max()) if keep else mask.shape[1]
        self.mask = mask[:, first_col:]
        if self.cache is not None:
            select_cache(self.cache, idx, first_col)
        self.next_pos = self.next_pos[idx]
        return keep


class VLMDecoder(HFDecoder):
    """:class:`HFDecoder` for a vision-language model (Qwen2-VL / Qwen2.5-VL): the prefill feeds each
    row's images (their features replace the row's ``<|image_pad|>`` tokens) at the model's
    multimodal RoPE positions (``get_rope_index``); each row then decodes text from one past its
    largest position (all three RoPE axes alike), so the KV-cache rows edit as for text. The vision
    markers are never sampled (:func:`rollout.vlm.suppress_vision_markers`): they belong to prompts."""

    def __init__(self, model: Any, device: torch.device | str = "cpu", prefill_kwargs: dict[str, Any] | None = None
                 ) -> None:
        super().__init__(model, device, prefill_kwargs)
        self.markers = vision_marker_ids(model.config)

    def prefill(self, prompts: list[list[int]], images: list[ImageInputs | None] | None = None) -> torch.Tensor:
        """Append rows for ``prompts`` with ``images[i]`` for row i (None: text only); logits (b, V)."""
        ids, mask, _ = left_padded(prompts, self.device)  # (b, P) each
        given = [im for im in (images or []) if im is not None]
        pixels = torch.cat([im.pixel_values for im in given]).to(self.device) if given else None  # (patches, F)
        grid = torch.cat([im.grid_thw for im in given]).to(self.device) if given else None  # (images, 3)
        mm = (ids == self.model.config.image_token_id).int()  # (b, P)
        pos, _ = self.model.model.get_rope_index(ids, mm_token_type_ids=mm, image_grid_thw=grid,
                                                 attention_mask=mask)  # (3, b, P)
        cache = DynamicCache(config=self.model.config)
        logits = self.model(
            input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True,
            pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=mm, **self.prefill_kwargs,
        ).logits[:, -1]  # (b, V)
        start = len(self.next_pos)
        self.append(cache, mask)
        self.next_pos[start:] = pos.amax(dim=(0, 2)) + 1  # (b,) one past each row's largest position
        return suppress_vision_markers(logits, self.markers)

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row (B,); the next logits (B, V)."""
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.rows, 1)], dim=1)  # (B, L + 1)
        pos = self.next_pos.view(1, -1, 1).expand(3, -1, 1)  # (3, B, 1)
        logits = self.model(input_ids=tokens.unsqueeze(1), attention_mask=self.mask, position_ids=pos,
                            past_key_values=self.cache, use_cache=True).logits[:, -1]  # (B, V)
        self.next_pos = self.next_pos + 1
        return suppress_vision_markers(logits, self.markers)


Decoder = HFDecoder | SlotDecoder


class _Slots:
    """The running batch: its rows, each row's sampled next token (not yet in the cache), and the
    decoder that holds their KV cache, in the same row order."""

    def __init__(self, decoder: Decoder) -> None:
        self.decoder = decoder
        self.device = decoder.device
        self.rows: list[_Row] = []
        self.next_token = torch.zeros(0, dtype=torch.long, device=self.device)  # (B,)
        self.params = _RowParams.of([], self.device)

    def add(self, rows: list[_Row], tokens: torch.Tensor, params: _RowParams) -> None:
        """Rows the decoder just prefilled, with their first sampled tokens and their parameters."""
        next_token, params = torch.cat([self.next_token, tokens]), self.params.cat(params)
        self.next_token, self.params = next_token, params  # both built before either changes
        self.rows += rows

    def keep(self, keep: list[int]) -> None:
        """Evict every row not in ``keep``."""
        order = self.decoder.keep(keep)
        idx = torch.tensor(order, dtype=torch.long, device=self.device)
        self.rows = [self.rows[i] for i in order]
        self.next_token = self.next_token[idx]
        self.params = self.params.select(idx)


# --------------------------------------------------------------------------- engine


class TorchEngine:
    """Continuous-batching generation with a transformers causal LM on CPU or one GPU."""

    ADMIT_WAIT_STEPS = 4
    """Decode steps a waiting request may wait for more requests to share its prefill."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        max_batch: int = 64,
        device: str = "cpu",
        dtype: str = "float32",
        seed: int = 0,
        policy_version: int = 0,
        chat_template: bool | str = "auto",
        system_prompt: str = "",
        decoder: Literal["auto", "slots", "hf"] = "auto",
        cuda_graphs: bool = True,
    ) -> None:
        if decoder not in ("auto", "slots", "hf"):
            raise ValueError(f"decoder must be 'auto', 'slots' or 'hf', got {decoder!r}")
        self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        """The one thread that runs all of this engine's torch work (load, steps, weight swaps)."""
        self.vlm = is_vlm_dir(model_dir)
        """A vision-language model (Qwen2-VL family): prompts may carry images, :class:`VLMDecoder` runs it."""
        load = load_vlm if self.vlm else load_model
        self.model = self._thread.submit(load, model_dir, dtype=dtype, device=device).result()
        self.tokenizer = load_tokenizer(model_dir)
        self.image_processor = load_image_processor(model_dir) if self.vlm else None
        self._last_logits_only = (
            {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(self.model.forward).parameters else {}
        )
        """Forward kwargs for a prefill that needs only the last position's logits (where the model
        takes ``logits_to_keep``, as transformers' causal LMs do)."""
        self.chat = use_chat_template(self.tokenizer, chat_template)
        """Whether prompts go through the tokenizer's chat template (``model.chat_template``)."""
        self.system_prompt = system_prompt
        self._encoded: dict[tuple[str, str], tuple[int, ...]] = {}
        """The last :data:`ENCODE_CACHE` prompts :meth:`encode` tokenized (a group's samples share
        one prompt: it is tokenized once, not ``group_size`` times, on the caller's event loop)."""
        self.device = torch.device(device)
        self.max_batch = max_batch
        self.policy_version = policy_version
        self.eos_ids = self._eos_ids()
        self.max_positions = int(getattr(self.model.config, "max_position_embeddings", 1 << 30))
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.tokens_generated = 0
        self.prompt_tokens = 0
        """Prompt tokens of the requests admitted so far."""
        self.prompt_tokens_reused = 0
        """Of those, the ones the slot decoder did not compute because another prompt of the same
        admission had them too (an identical prompt, or the prefix common to the admission's prompts)."""
        self._pending: deque[_Pending] = deque()
        why_not = "a vision-language model (its prefill takes images)" if self.vlm else slot_support(self.model)
        if decoder == "slots" and why_not:
            raise ValueError(f"decoder='slots' cannot run this model: {why_not}")
        self.decoder: Literal["slots", "hf"] = "hf" if decoder == "hf" or why_not else "slots"
        """Which forward runs the batch: ``slots`` (:class:`rollout.slot_decoder.SlotDecoder`, the
        Llama-family fast path) or ``hf`` (transformers' forward, any causal LM)."""
        self.cuda_graphs = cuda_graphs
        """Whether the slot decoder replays its decode steps as CUDA graphs on a CUDA device
        (:mod:`rollout.slot_decoder`); no effect on the CPU or with the ``hf`` decoder."""
        self._slots = _Slots(self._new_decoder())
        self._admitting: list[_Row] = []  # popped from _pending, not yet in _slots
        self._waited_steps = 0  # decode steps since waiting requests were last admitted
        self._step_lock = threading.Lock()
        self._driver: asyncio.Task[None] | None = None
        self.released: Released = ""
        """What :meth:`release` gave back; the next step (or :meth:`next_token_logprobs`) takes it again."""
        self.releases = 0
        """How many times :meth:`release` freed memory."""

    def _new_decoder(self) -> Decoder:
        if self.decoder == "slots":
            return SlotDecoder(self.model, self.max_batch, cuda_graphs=self.cuda_graphs)
        if self.vlm:
            return VLMDecoder(self.model, self.device, self._last_logits_only)
        return HFDecoder(self.model, self.device, self._last_logits_only)

    def _eos_ids(self) -> set[int]:
        ids = eos_token_ids(self.model, self.tokenizer)
        if not ids:
            raise ValueError("the model has no EOS token (generation_config.json and the tokenizer name none)")
        return ids

    # ----------------------------------------------------------------- public API

    @property
    def running(self) -> int:
        """Requests holding a slot right now."""
        return len(self._slots.rows)

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot."""
        return len(self._pending)

    def image_inputs(self, images: list[bytes], names: list[str] | None = None) -> ImageInputs:
        """Encoded images (PNG, JPEG...) as this vision-language model's processor gives them;
        ``blobs.BlobError`` naming the image (``names[i]``, e.g. its digest) when one does not decode."""
        if self.image_processor is None:
            raise ValueError("this engine's model is not a vision-language model: a prompt with images needs one")
        names = names or [""] * len(images)
        pics = [decode_image(data, name) for data, name in zip(images, names, strict=True)]
        return ImageInputs(*pixel_inputs(self.image_processor, pics))

    def encode(self, prompt: str, system_prompt: str | None = None, images: ImageInputs | None = None) -> list[int]:
        """Prompt token ids (:func:`rollout.model_init.encode_prompt`): through the chat template
        when :attr:`chat` (system turn ``system_prompt``, None = the engine's default), else the
        bare text with the tokenizer's BOS. With ``images`` (a VLM): a user turn showing them, then
        the text, each image's placeholder expanded (:func:`rollout.vlm.encode_vlm_prompt`)."""
        system = self.system_prompt if system_prompt is None else system_prompt
        if images is not None:
            return encode_vlm_prompt(self.tokenizer, prompt, images.grid_thw, self.model.config.image_token_id,
                                     system_prompt=system)
        key = (prompt, system)
        ids = self._encoded.pop(key, None)  # re-inserted last: the dict's order is recency
        if ids is None:
            ids = tuple(encode_prompt(self.tokenizer, prompt, chat=self.chat, system_prompt=system))
        self._encoded[key] = ids
        if len(self._encoded) > ENCODE_CACHE:
            del self._encoded[next(iter(self._encoded))]  # the least recently used
        return list(ids)

    async def generate(
        self, requests: Iterable[GenerationRequest] | AsyncIterable[GenerationRequest]
    ) -> AsyncIterator[Completion]:
        """Submit ``requests`` (a list, or an async stream whose requests join while others run)
        and yield their completions in the order they finish.

        Invalid requests (empty, or too long for the model) raise ``ValueError``: for a list,
        before anything is submitted; for a stream, after the completions of the requests
        submitted before it. If the model itself fails during a step, the requests in that step
        complete with ``finish_reason="error"`` and the error text; the engine stays usable.
        """
        out: asyncio.Queue[Completion | object] = asyncio.Queue()
        if isinstance(requests, AsyncIterable):
            async for c in self._generate_stream(requests, out):
                yield c
            return
        batch = list(requests)
        for req in batch:
            self._validate(req)
        for req in batch:
            self._submit(req, out)
        for _ in batch:
            yield typing.cast(Completion, await out.get())

    async def _generate_stream(
        self, requests: AsyncIterable[GenerationRequest], out: asyncio.Queue[Completion | object]
    ) -> AsyncIterator[Completion]:
        submitted = 0

        async def feed() -> None:
            nonlocal submitted
            try:
                async for req in requests:
                    self._validate(req)
                    self._submit(req, out)
                    submitted += 1
            finally:
                out.put_nowait(_FEED_DONE)

        feeder = asyncio.ensure_future(feed())
        delivered, feeding = 0, True
        try:
            while feeding or delivered < submitted:
                item = await out.get()
                if item is _FEED_DONE:
                    feeding = False
                else:
                    delivered += 1
                    yield typing.cast(Completion, item)
            await feeder  # re-raises a bad request or a failing stream
        finally:
            feeder.cancel()

    async def load_weights(self, ref: str | Path, version: int | None = None) -> None:
        """Copy the safetensors weights in ``ref`` into the live model between two engine
        steps; ``version`` defaults to the current version + 1."""
        state = await to_thread(read_weights, ref)
        await asyncio.get_running_loop().run_in_executor(self._thread, surfaced(self._swap), state, version, str(ref))

    def load_weights_sync(self, ref: str | Path, version: int | None = None) -> None:
        """Blocking variant of :meth:`load_weights` (for synchronous callers)."""
        self._swap(read_weights(ref), version, str(ref))

    def _swap(self, state: dict[str, torch.Tensor], version: int | None, ref: str) -> None:
        with self._step_lock:
            copy_weights_(self.model, state, f"weights at {ref}")
            self.policy_version = self.policy_version + 1 if version is None else version

    async def release(self, weights: bool = False) -> bool:
        """Give back device memory while idle (``rollout.release_between_steps``): see :meth:`release_sync`."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, surfaced(self.release_sync), weights)

    def release_sync(self, weights: bool = False) -> bool:
        """Between two steps, with no request running or waiting: drop the KV cache (the decoder,
        with its CUDA graphs) and, with ``weights``, copy the parameters to host memory (pinned,
        from CUDA) and drop the fused projections that still point at the device copies. The next
        step takes them back before it admits (:meth:`_restore`); a weight swap meanwhile writes
        into the host copy. False (nothing done) when a request is there or it is released already."""
        with self._step_lock:
            if self._slots.rows or self._pending or self._admitting or self.released == "kv_and_weights" or (
                    self.released == "kv" and not weights):
                return False
            self.released = "kv_and_weights" if weights else "kv"  # first: a failure below is restored too
            if weights:
                self._slots = _Slots(HFDecoder(self.model, self.device))  # a placeholder: holds no tensor
                forget_fusions(self.model)
                with torch.no_grad():
                    for p in self.model.parameters():
                        host = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=p.is_cuda)
                        host.copy_(p.data)
                        p.data = host
            else:
                self._slots = _Slots(self._new_decoder())  # the old one's cache goes with it
            self.releases += 1
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # back to the driver: the trainer process can use it
        return True

    def _restore(self) -> None:
        """Take back what :meth:`release_sync` gave (the caller holds the step lock): the weights
        onto the device, a new decoder (its KV cache is allocated by its first prefill)."""
        if self.released == "kv_and_weights":
            with torch.no_grad():
                for p in self.model.parameters():
                    p.data = p.data.to(self.device, non_blocking=True)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._slots = _Slots(self._new_decoder())
        self.released = ""

    @torch.inference_mode()
    def next_token_logprobs(self, prompts: list[list[int]]) -> torch.Tensor:
        """``log_softmax`` of the next-token logits after each prompt, in one batched, left-padded
        forward pass (no sampling, no slot taken; between two engine steps). Returns ``(b, V)``
        float32 on the CPU. A judge reads its score labels' probabilities from it."""
        for i, p in enumerate(prompts):
            self._validate(GenerationRequest(f"logprobs-{i}", p))
        ids, mask, pos = left_padded(prompts, self.device)  # (b, P) each
        with self._step_lock, torch.inference_mode():
            if self.released:
                self._restore()
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos,
                                **self._last_logits_only).logits[:, -1]  # (b, V)
        return torch.log_softmax(logits.float(), dim=-1).cpu()  # (b, V)

    # ----------------------------------------------------------------- scheduling

    def _validate(self, req: GenerationRequest) -> None:
        if not req.prompt_ids:
            raise ValueError(f"request {req.request_id}: empty prompt")
        if req.images is not None and not self.vlm:
            raise ValueError(f"request {req.request_id}: has images but the model is not a vision-language model")
        if len(req.prompt_ids) >= self.max_positions:
            raise ValueError(
                f"request {req.request_id}: prompt of {len(req.prompt_ids)} tokens leaves no room "
                f"(model max_position_embeddings={self.max_positions})"
            )

    def _submit(self, req: GenerationRequest, out: asyncio.Queue[Completion | object]) -> None:
        self._pending.append(_Pending(req, out, time.perf_counter()))
        if self._driver is None or self._driver.done():
            self._driver = asyncio.get_running_loop().create_task(self._drive())

    async def _drive(self) -> None:
        """Run engine steps while there is work; deliver finished completions."""
        loop = asyncio.get_running_loop()
        while self._pending or self._slots.rows:
            finished = await loop.run_in_executor(self._thread, surfaced(self._step))
            for row, completion in finished:
                row.out.put_nowait(completion)

    def _step(self) -> list[tuple[_Row, Completion]]:
        """Admit into free slots, run one decode step, evict finished rows."""
        with self._step_lock:
            try:
                return self._step_locked()
            except Exception as e:  # fail the rows of this step, keep the engine usable
                admitting = [r for r in self._admitting if all(r is not x for x in self._slots.rows)]
                rows, self._admitting = self._slots.rows + admitting, []
                self._slots = _Slots(self._new_decoder())
                return [(r, self._complete(r, "error", f"{type(e).__name__}: {e}")) for r in rows]

    @torch.inference_mode()
    def _step_locked(self) -> list[tuple[_Row, Completion]]:
        if self.released:
            self._restore()
        finished = self._admit()
        if self._slots.rows:
            finished += self._decode()
        return finished

    def _admit(self) -> list[tuple[_Row, Completion]]:
        """Prefill waiting requests into free slots (when :meth:`_admit_now` says so); the
        completions of the new rows that finished at their first token."""
        free = self.max_batch - len(self._slots.rows)
        if not self._admit_now(free):
            self._waited_steps += 1
            return []
        self._waited_steps = 0
        batch = [self._pending.popleft() for _ in range(min(free, len(self._pending)))]
        if not batch:
            return []
        now = time.perf_counter()
        rows = [_Row(p.request, p.out, p.submitted, now, self.policy_version,
                     min(p.request.params.max_new_tokens, self.max_positions - len(p.request.prompt_ids)))
                for p in batch]
        self._admitting = rows
        decoder = self._slots.decoder
        reused = decoder.reused_tokens
        prompts = [r.request.prompt_ids for r in rows]
        if isinstance(decoder, VLMDecoder):
            logits = decoder.prefill(prompts, [r.request.images for r in rows])  # (b, V)
        else:
            logits = decoder.prefill(prompts)  # (b, V)
        self.prompt_tokens += sum(len(r.request.prompt_ids) for r in rows)
        self.prompt_tokens_reused += decoder.reused_tokens - reused
        params = _RowParams.of([r.request.params for r in rows], self.device)
        tokens, done = self._sample(logits, rows, params)
        first = len(self._slots.rows)
        self._slots.add(rows, tokens, params)
        self._admitting = []
        return self._evict([(first + i, why) for i, why in done])

    def _admit_now(self, free: int) -> bool:
        """Whether this step prefills the waiting requests. Prefill is batched: with rows running,
        waiting requests join only once they fill ``max_batch // 4`` free slots (or every free slot),
        or once they waited :attr:`ADMIT_WAIT_STEPS` decode steps — many one-row prefills cost far more
        than one prefill of many rows."""
        if not self._pending or free <= 0:
            return False
        if not self._slots.rows:
            return True
        return (min(len(self._pending), free) >= max(1, min(free, self.max_batch // 4))
                or self._waited_steps >= self.ADMIT_WAIT_STEPS)

    def _decode(self) -> list[tuple[_Row, Completion]]:
        """One decode step of every row; the completions of the rows it finished."""
        s = self._slots
        logits = s.decoder.decode(s.next_token)  # (B, V)
        s.next_token, done = self._sample(logits, s.rows, s.params)
        return self._evict(done)

    def _sample(self, logits: torch.Tensor, rows: list[_Row], params: _RowParams
                ) -> tuple[torch.Tensor, list[tuple[int, FinishReason]]]:
        """Sample one token for each of ``rows`` (``logits`` and ``params`` in row order) and record
        it; the tokens (B,) and, for each row that this token finished, (its index, why)."""
        tokens, logprobs = sample_next(logits, params.temperature, params.top_p, params.greedy, self.generator)
        eos = self.eos_ids
        done: list[tuple[int, FinishReason]] = []
        for i, (row, tok, lp) in enumerate(zip(rows, tokens.tolist(), logprobs.tolist(), strict=True)):
            row.tokens.append(tok)
            row.logprobs.append(lp)
            stop = row.request.params.stop
            if tok in eos or (stop and self._hit_stop(row.tokens, stop)):
                done.append((i, "stop"))
            elif len(row.tokens) >= row.cap:
                done.append((i, "length"))
        self.tokens_generated += len(rows)
        return tokens, done

    def _hit_stop(self, tokens: list[int], stop: tuple[str, ...]) -> bool:
        """Whether the newest token completes a stop string: one occurs in the decoded tail that
        ends with it but not in the tail without it (every token decodes to at least one
        character or none, so the last ``len(longest stop)`` tokens cover any new occurrence)."""
        n = max(len(s) for s in stop)
        tail = self.tokenizer.decode(tokens[-n:], skip_special_tokens=True)
        if not any(s in tail for s in stop):
            return False
        before = self.tokenizer.decode(tokens[-n:-1], skip_special_tokens=True) if len(tokens) > 1 else ""
        return not any(s in before for s in stop)

    def _evict(self, done: list[tuple[int, FinishReason]]) -> list[tuple[_Row, Completion]]:
        """Complete and evict the running rows at the given indices."""
        if not done:
            return []
        rows = self._slots.rows
        finished = [(rows[i], self._complete(rows[i], why)) for i, why in done]
        gone = {i for i, _ in done}
        self._slots.keep([i for i in range(len(rows)) if i not in gone])
        return finished

    def _complete(self, row: _Row, reason: FinishReason, error: str = "") -> Completion:
        now = time.perf_counter()
        return Completion(
            request_id=row.request.request_id,
            prompt_ids=list(row.request.prompt_ids),
            token_ids=row.tokens,
            logprobs=row.logprobs,
            text=str(self.tokenizer.decode(row.tokens, skip_special_tokens=True)),
            finish_reason=reason,
            policy_version=row.version,
            policy_version_end=self.policy_version,
            queued_s=row.started - row.submitted,
            gen_s=now - row.started,
            error=error,
        )


async def generate_all(engine: Engine, requests: list[GenerationRequest]) -> list[Completion]:
    """Run ``requests`` through ``engine``; return completions in request order. Request ids must be
    unique (``ValueError``); an engine that does not return exactly one completion per request is a
    ``RuntimeError`` naming the first request it got wrong."""
    ids = [r.request_id for r in requests]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"generate_all: request id {dup!r} occurs more than once")
    by_id: dict[str, Completion] = {}
    async for c in engine.generate(requests):
        if c.request_id in by_id:
            raise RuntimeError(f"engine returned two completions for request {c.request_id!r}")
        by_id[c.request_id] = c
    missing = [i for i in ids if i not in by_id]
    if missing:
        raise RuntimeError(f"engine returned no completion for {len(missing)} request(s), e.g. {missing[0]!r}")
    return [by_id[i] for i in ids]
