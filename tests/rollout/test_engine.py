from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch

from rollout import engine as engine_module
from rollout.engine import Completion, Engine, GenerationRequest, TorchEngine, generate_all
from rollout.sampling import SamplingParams
from rollout.slot_decoder import SlotDecoder
from tests.floats import assert_close

PROMPTS = ["12+34=", "7-3=", "99+1=", "5*6=", "123-45=", "8+8="]
GREEDY = SamplingParams(max_new_tokens=12, greedy=True)


@pytest.fixture(params=["slots", "hf"])
def decoder(request: pytest.FixtureRequest) -> str:
    """The engine's two forward paths (rollout.slot_decoder and transformers' own)."""
    return str(request.param)


def requests(
    engine: TorchEngine, params: SamplingParams, prompts: list[str] = PROMPTS
) -> list[GenerationRequest]:
    return [GenerationRequest(f"r{i}", engine.encode(p), params) for i, p in enumerate(prompts)]


def teacher_forced_logprobs(model: torch.nn.Module, c: Completion, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of the completion's tokens, one unpadded forward pass."""
    ids = torch.tensor([c.prompt_ids + c.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(c.prompt_ids) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]


async def test_is_an_engine(model_dir: Path) -> None:
    assert isinstance(TorchEngine(model_dir), Engine)


async def test_greedy_is_deterministic_and_batch_independent(model_dir: Path, decoder: str) -> None:
    engine = TorchEngine(model_dir, max_batch=8, decoder=decoder)
    first = await generate_all(engine, requests(engine, GREEDY))
    second = await generate_all(engine, requests(engine, GREEDY))
    assert [c.token_ids for c in first] == [c.token_ids for c in second]
    alone = [(await generate_all(engine, [r]))[0] for r in requests(engine, GREEDY)]
    assert [c.token_ids for c in alone] == [c.token_ids for c in first]
    assert all(len(c.token_ids) == len(c.logprobs) > 0 for c in first)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_logprobs_match_teacher_forced_forward(model_dir: Path, temperature: float, decoder: str) -> None:
    engine = TorchEngine(model_dir, max_batch=4, seed=3, decoder=decoder)  # 6 requests, 4 slots: rows join
    # the prefill computes the LM head at the last prompt position only; the first token's
    # logprob below checks that this is the right position
    assert engine._last_logits_only == {"logits_to_keep": 1}
    assert engine.decoder == decoder
    params = SamplingParams(max_new_tokens=16, temperature=temperature)
    done = await generate_all(engine, requests(engine, params))
    for c in done:
        expected = teacher_forced_logprobs(engine.model, c, temperature)
        # cached decode steps vs one unpadded pass: rounding only (terms: the hidden size)
        assert_close(torch.tensor(c.logprobs), expected, engine.model.config.hidden_size)


async def test_finished_slots_are_refilled_while_others_run(model_dir: Path, decoder: str) -> None:
    engine = TorchEngine(model_dir, max_batch=2, decoder=decoder)
    engine.eos_ids = set()  # never stop early: lengths are exactly max_new_tokens
    long = GenerationRequest("long", engine.encode("1+1="), SamplingParams(max_new_tokens=30, greedy=True))
    shorts = [
        GenerationRequest(f"s{i}", engine.encode(p), SamplingParams(max_new_tokens=3, greedy=True))
        for i, p in enumerate(["22+3=", "5-4=", "123*4="])
    ]
    order = [c.request_id async for c in engine.generate([long, *shorts])]
    # 2 slots: a static batch would finish "long" before starting s1; here s1 and s2 take
    # the slot s0 (then s1) freed while "long" is still decoding.
    assert order == ["s0", "s1", "s2", "long"]
    # rows that joined a running batch (different lengths, left-padded cache) decode exactly
    # as they do alone
    together = {c.request_id: c.token_ids for c in await generate_all(engine, [long, *shorts])}
    for r in shorts:
        assert (await generate_all(engine, [r]))[0].token_ids == together[r.request_id]


async def test_stop_at_eos_and_length(model_dir: Path, decoder: str) -> None:
    engine = TorchEngine(model_dir, max_batch=8, decoder=decoder)
    done = await generate_all(engine, requests(engine, SamplingParams(max_new_tokens=5)))
    for c in done:
        if c.finish_reason == "stop":
            assert c.token_ids[-1] in engine.eos_ids and len(c.token_ids) <= 5
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == 5
            assert not set(c.token_ids) & engine.eos_ids


async def test_hot_swap_changes_outputs_and_records_version(
    model_dir: Path, other_model_dir: Path, decoder: str
) -> None:
    engine = TorchEngine(model_dir, max_batch=8, decoder=decoder)
    before = await generate_all(engine, requests(engine, GREEDY))
    await engine.load_weights(other_model_dir, version=7)
    assert engine.policy_version == 7
    after = await generate_all(engine, requests(engine, GREEDY))
    assert [c.token_ids for c in after] != [c.token_ids for c in before]
    fresh = TorchEngine(other_model_dir, max_batch=8, decoder=decoder)  # the swapped-in weights, loaded
    assert [c.token_ids for c in after] == [c.token_ids for c in await generate_all(fresh, requests(fresh, GREEDY))]
    assert {(c.policy_version, c.policy_version_end) for c in after} == {(7, 7)}
    await engine.load_weights(model_dir)  # version defaults to +1
    assert engine.policy_version == 8
    again = await generate_all(engine, requests(engine, GREEDY))
    assert [c.token_ids for c in again] == [c.token_ids for c in before]


async def test_swap_mid_generation_records_both_versions(
    model_dir: Path, other_model_dir: Path, decoder: str
) -> None:
    engine = TorchEngine(model_dir, max_batch=2, decoder=decoder)
    engine.eos_ids = set()
    req = GenerationRequest("x", engine.encode("1+1="), SamplingParams(max_new_tokens=40, greedy=True))
    stream = engine.generate([req])
    task = asyncio.ensure_future(anext(stream))
    for _ in range(30_000):  # at least 30 s until the request holds a slot (a loaded machine admits late)
        if engine.running or task.done():
            break
        await asyncio.sleep(0.001)
    assert engine.running == 1
    await engine.load_weights(other_model_dir, version=1)
    c = await task
    assert (c.policy_version, c.policy_version_end) == (0, 1)
    assert len(c.token_ids) == 40


async def test_async_request_stream(model_dir: Path) -> None:
    engine = TorchEngine(model_dir, max_batch=2)
    reqs = requests(engine, GREEDY)

    async def feed() -> AsyncIterator[GenerationRequest]:
        for r in reqs:
            await asyncio.sleep(0.001)
            yield r

    got = {c.request_id async for c in engine.generate(feed())}
    assert got == {r.request_id for r in reqs}


async def test_bad_requests_are_rejected(model_dir: Path) -> None:
    engine = TorchEngine(model_dir)
    with pytest.raises(ValueError, match="empty prompt"):
        await generate_all(engine, [GenerationRequest("e", [])])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        await generate_all(engine, [GenerationRequest("l", [5] * 64)])


async def test_weights_that_do_not_fit_are_an_error(model_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"nonsense.weight": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    engine = TorchEngine(model_dir)
    with pytest.raises(KeyError, match="lacks"):
        await engine.load_weights(tmp_path)
    assert engine.policy_version == 0


async def test_model_failure_completes_requests_with_error(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, decoder: str
) -> None:
    engine = TorchEngine(model_dir, max_batch=4, decoder=decoder)

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.model.model.embed_tokens, "forward", broken)  # the first module both paths call
    done = await generate_all(engine, requests(engine, GREEDY))
    assert {(c.finish_reason, c.error) for c in done} == {("error", "RuntimeError: device lost")}
    monkeypatch.undo()
    ok = await generate_all(engine, requests(engine, GREEDY))  # still usable
    assert {c.finish_reason for c in ok} <= {"stop", "length"}


async def test_a_failure_while_joining_the_batch_completes_each_request_once(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, decoder: str
) -> None:
    # the batch bookkeeping fails half-way, after the rows joined: every request still gets exactly
    # one error completion (before, such rows were also still "admitting" and completed twice, and
    # generate() handed out one request's completion twice and another's never)
    engine = TorchEngine(model_dir, max_batch=2, decoder=decoder)  # fewer slots than requests: several admissions fail

    def half_add(self: object, rows: list[object], tokens: object, params: object) -> None:
        self.rows += rows  # type: ignore[attr-defined]
        raise RuntimeError("Expected all tensors to be on the same device")

    monkeypatch.setattr(engine_module._Slots, "add", half_add)
    reqs = requests(engine, GREEDY)
    assert len(reqs) > engine.max_batch
    done = [c async for c in engine.generate(reqs)]
    monkeypatch.undo()
    assert sorted(c.request_id for c in done) == sorted(r.request_id for r in reqs)
    assert {c.finish_reason for c in done} == {"error"}
    assert {c.finish_reason for c in await generate_all(engine, requests(engine, GREEDY))} <= {"stop", "length"}


async def test_generate_all_names_duplicate_ids_and_a_wrong_engine(model_dir: Path) -> None:
    engine = TorchEngine(model_dir, max_batch=2)
    reqs = requests(engine, GREEDY)
    with pytest.raises(ValueError, match="'r0' occurs more than once"):
        await generate_all(engine, [reqs[0], reqs[0]])

    class Twice:  # an engine that completes the first request twice and the second never
        async def generate(self, rs: list[GenerationRequest]) -> AsyncIterator[Completion]:
            done = await generate_all(engine, rs[:1])
            for c in (done[0], done[0]):
                yield c

    with pytest.raises(RuntimeError, match="two completions for request 'r0'"):
        await generate_all(Twice(), reqs[:2])  # type: ignore[arg-type]


def test_the_running_batch_lives_on_the_model_device(model_dir: Path) -> None:
    # a CUDA engine failed its first admission: the empty batch's tensors were on the CPU and
    # torch.cat refuses to mix devices. "meta" stands in for a second device on a CPU-only machine.
    from transformers import DynamicCache

    from rollout.model_init import load_model
    from rollout.slot_decoder import SlotDecoder

    hf = engine_module.HFDecoder(object(), "meta")
    slots = engine_module._Slots(hf)
    for rows, width in ((2, 5), (3, 7)):  # the first rows, then rows joining a running batch
        cache = DynamicCache()
        for layer in range(2):
            cache.update(torch.zeros(rows, 2, width, 4, device="meta"), torch.zeros(rows, 2, width, 4, device="meta"),
                         layer)
        hf.append(cache, torch.ones(rows, width, dtype=torch.long, device="meta"))
        params = engine_module._RowParams.of([SamplingParams()] * rows, torch.device("meta"))
        slots.add([object()] * rows, torch.zeros(rows, dtype=torch.long, device="meta"), params)  # type: ignore[list-item]
    assert len(slots.rows) == hf.rows == 5 and hf.mask.shape == (5, 7)
    assert {t.device.type for t in (hf.mask, slots.next_token, hf.next_pos, slots.params.temperature,
                                    slots.params.greedy)} == {"meta"}

    fast = SlotDecoder(load_model(model_dir, dtype="float32", device="cpu").to("meta"), slots=4)
    logits = fast.prefill([[1, 5, 6], [1, 7]])
    assert logits.device.type == fast.lens.device.type == "meta" and fast.rows == 2
    assert fast.keys is not None and fast.keys.device.type == "meta"


async def test_bad_request_in_a_stream_raises_after_earlier_ones(model_dir: Path) -> None:
    engine = TorchEngine(model_dir)

    async def feed() -> AsyncIterator[GenerationRequest]:
        yield GenerationRequest("ok", engine.encode("1+1="), GREEDY)
        yield GenerationRequest("bad", [])

    got = []
    with pytest.raises(ValueError, match="empty prompt"):
        async for c in engine.generate(feed()):
            got.append(c.request_id)
    assert got == ["ok"]


def test_encode_tokenizes_a_prompt_once_and_forgets_the_oldest(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import rollout.engine as eng

    engine = TorchEngine(model_dir)
    calls: list[str] = []
    real = eng.encode_prompt
    monkeypatch.setattr(eng, "encode_prompt", lambda tok, p, **kw: calls.append(p) or real(tok, p, **kw))
    monkeypatch.setattr(eng, "ENCODE_CACHE", 2)
    first = engine.encode("1+2=")
    first.append(-1)  # callers own the list they get
    assert engine.encode("1+2=") == real(engine.tokenizer, "1+2=", chat=engine.chat, system_prompt="")
    assert engine.encode("1+2=", system_prompt="be brief") is not None  # another system prompt: another entry
    assert calls == ["1+2=", "1+2="]
    engine.encode("3+4=")  # evicts the least recently used ("1+2=" with no system prompt)
    engine.encode("1+2=", system_prompt="be brief")
    engine.encode("1+2=")
    assert calls == ["1+2=", "1+2=", "3+4=", "1+2="]


async def test_a_groups_copies_are_prefilled_once_and_sampled_apart(model_dir: Path, decoder: str) -> None:
    engine = TorchEngine(model_dir, max_batch=8, seed=5, decoder=decoder)
    params = SamplingParams(max_new_tokens=16, temperature=1.0)
    group = ["12+34=", "7-3="] * 4  # two GRPO groups of four, admitted together
    done = await generate_all(engine, requests(engine, params, group))
    lens = [len(engine.encode(p)) for p in group]
    assert engine.prompt_tokens == sum(lens)
    # the slot decoder computes each distinct prompt once; transformers' path computes every row
    assert engine.prompt_tokens_reused == (3 * lens[0] + 3 * lens[1] if decoder == "slots" else 0)
    for c in done:  # each copy's logprobs are its own tokens' under the model
        # shared prompt work and cached steps vs one unpadded pass: rounding only (terms: the hidden size)
        assert_close(torch.tensor(c.logprobs), teacher_forced_logprobs(engine.model, c, 1.0),
                     engine.model.config.hidden_size)
    copies = [tuple(c.token_ids) for c in done[0::2]]
    assert len(set(copies)) > 1  # the copies sampled apart, not one sample copied four times


async def test_a_vlm_engine_generates_from_images_with_the_trainers_logprobs(vlm_dir: Path) -> None:
    """TorchEngine on a Qwen2-VL: requests carrying images (two sizes) and a text one share a batch;
    each completion's behaviour logprobs are the teacher-forced ones with the same pixels
    (trainer.vlm), and an image that does not decode is a BlobError naming it."""
    import io

    from PIL import Image

    from blobs import BlobError
    from rollout.engine import VLMDecoder
    from rollout.vlm import SUPPRESSED_LOGIT, vision_marker_ids
    from trainer.vlm import vlm_token_logprobs

    def png(size: int, colour: tuple[int, int, int]) -> bytes:
        buf = io.BytesIO()
        Image.new("RGB", (size, size), colour).save(buf, format="PNG")
        return buf.getvalue()

    eng = TorchEngine(vlm_dir, max_batch=4, seed=3)
    assert eng.vlm and eng.decoder == "hf"
    with pytest.raises(ValueError, match="vision-language model"):
        TorchEngine(vlm_dir, decoder="slots")
    images = [eng.image_inputs([png(56, (255, 0, 0))]), eng.image_inputs([png(84, (0, 0, 255))]), None]
    params = SamplingParams(max_new_tokens=6, temperature=0.9)
    reqs = [GenerationRequest(f"r{i}", eng.encode("what colour?", images=im), params, images=im)
            for i, im in enumerate(images)]
    assert [r.prompt_ids.count(eng.model.config.image_token_id) for r in reqs] == [4, 9, 0]
    done = await generate_all(eng, reqs)
    for c, im in zip(done, images, strict=True):
        ids = torch.tensor([c.prompt_ids + c.token_ids])  # (1, L)
        with torch.no_grad():
            lp = vlm_token_logprobs(eng.model, ids, torch.ones_like(ids), im.pixel_values if im else None,
                                    im.grid_thw if im else None, 0.9)[0, len(c.prompt_ids) - 1 :]  # (n,)
        assert_close(lp, torch.tensor(c.logprobs), eng.model.config.text_config.hidden_size)
    # the vision markers belong to prompts: the policy never samples one (the trainer suppresses them alike)
    markers = vision_marker_ids(eng.model.config)
    assert len(markers) == 4 and not any(set(c.token_ids) & set(markers) for c in done)
    with torch.no_grad():
        logits = VLMDecoder(eng.model).prefill([reqs[0].prompt_ids], [images[0]])  # (1, V)
    assert (logits[0, markers] == SUPPRESSED_LOGIT).all() and logits[0].max() > SUPPRESSED_LOGIT
    with pytest.raises(BlobError, match="blob cafe: not a decodable image"):
        eng.image_inputs([b"not a png"], ["cafe"])


def _refs(tensors: list[Any]) -> list[weakref.ref[Any]]:
    return [weakref.ref(t) for t in tensors if t is not None]


@pytest.mark.parametrize("weights", [False, True])
async def test_release_frees_memory_and_generation_is_unchanged(
        model_dir: Path, other_model_dir: Path, decoder: str, weights: bool) -> None:
    """``rollout.release_between_steps``: an idle engine drops its KV cache (and, with ``weights``,
    its device copy of the weights, fused projections included); a swap while released goes into
    the host copy; the next generation takes everything back and samples exactly what an engine
    that never released samples (same seed, same weights)."""
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    kept, freed = (TorchEngine(model_dir, max_batch=4, seed=11, decoder=decoder) for _ in range(2))
    for e in (kept, freed):
        await generate_all(e, requests(e, params))
    dec = freed._slots.decoder
    cache = _refs([dec, dec.keys, dec.values] if isinstance(dec, SlotDecoder) else [dec, dec.cache])
    assert len(cache) == 3 if isinstance(dec, SlotDecoder) else 2
    device_weights = _refs([p.untyped_storage() for p in freed.model.parameters()])  # fused ones included
    del dec
    assert await freed.release(weights=weights)
    gc.collect()
    assert all(r() is None for r in cache)  # the KV cache is gone
    assert all((r() is None) == weights for r in device_weights)  # the weights moved to new host tensors, or stayed
    assert freed.released == ("kv_and_weights" if weights else "kv") and freed.releases == 1
    assert all(p.device.type == "cpu" for p in freed.model.parameters())
    assert not await freed.release(weights=weights)  # released already: nothing more to give
    for e in (kept, freed):
        await e.load_weights(other_model_dir, version=1)
    assert freed.released  # the swap went into the released engine's copy without taking it back
    second = {e: await generate_all(e, requests(e, params)) for e in (kept, freed)}
    assert freed.released == ""
    for e in (kept, freed):  # a swap into the weights that came back, as into weights that stayed
        await e.load_weights(model_dir, version=2)
        second[e] += await generate_all(e, requests(e, params))
    assert [(c.token_ids, c.policy_version) for c in second[freed]] == [
        (c.token_ids, c.policy_version) for c in second[kept]]
    assert any(c.token_ids for c in second[freed])
    # bitwise equal with the weights that stayed; weights that came back sit at new addresses (the
    # loaded ones at odd offsets of the safetensors file), which changes the CPU GEMM's round-off
    # (terms: the hidden size)
    assert_close(torch.tensor([lp for c in second[freed] for lp in c.logprobs]),
                 torch.tensor([lp for c in second[kept] for lp in c.logprobs]), freed.model.config.hidden_size)
    if not weights:
        assert [c.logprobs for c in second[freed]] == [c.logprobs for c in second[kept]]


async def test_a_busy_engine_keeps_its_memory(model_dir: Path) -> None:
    engine = TorchEngine(model_dir, max_batch=2)
    engine.eos_ids = set()
    stream = engine.generate([GenerationRequest("x", engine.encode("1+1="), SamplingParams(max_new_tokens=40))])
    task = asyncio.ensure_future(anext(stream))
    for _ in range(30_000):
        if engine.running or task.done():
            break
        await asyncio.sleep(0.001)
    assert engine.running == 1
    assert not await engine.release(weights=True)
    assert engine.released == "" and len((await task).token_ids) == 40
