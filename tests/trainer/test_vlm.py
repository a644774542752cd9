"""A VLM's trainer logprobs (one teacher-forced pass with the pixels) agree with the engine's
behaviour logprobs (:class:`rollout.engine.VLMDecoder`: a batched prefill with the images, then
cached decode steps) within the text models' tolerance."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from PIL import Image

from blobs import pixel_inputs
from rollout.engine import VLMDecoder
from rollout.model_init import load_tokenizer
from rollout.sampling import sample_next
from rollout.vlm import ImageInputs, encode_vlm_prompt, load_image_processor, load_vlm
from tests.floats import assert_close
from trainer.vlm import vlm_token_logprobs

if TYPE_CHECKING:
    from blobs import BlobStore
    from trainer.batch import TrainSample
    from trainer.strategy import TorchStrategy


def _image(size: int, colour: tuple[int, int, int], corner: int) -> Image.Image:
    img = Image.new("RGB", (size, size), (255, 255, 255))
    x, y = (corner % 2) * size // 2, (corner // 2) * size // 2
    img.paste(colour, (x, y, x + size // 2, y + size // 2))
    return img


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl"])
@torch.no_grad()
def test_engine_and_trainer_logprobs_agree_on_image_prompts(arch: str, request: pytest.FixtureRequest) -> None:
    """Either architecture ``model.path`` takes (Qwen2.5-VL: windowed attention in the tower)."""
    vlm_dir = request.getfixturevalue("vlm_dir" if arch == "qwen2_vl" else "vlm25_dir")
    model, processor, tok = load_vlm(vlm_dir), load_image_processor(vlm_dir), load_tokenizer(vlm_dir)
    assert model.config.model_type == arch
    image_id = model.config.image_token_id
    # rows of different lengths (56 px -> 4 image tokens, 84 px -> 9, no image) so the prefill pads
    pics = [[_image(56, (255, 0, 0), 1)], [_image(84, (0, 0, 255), 2)], []]
    texts = ["where is the red square?", "which quadrant?", "2+2="]
    images = [ImageInputs(*pixel_inputs(processor, p)) if p else None for p in pics]
    prompts = [encode_vlm_prompt(tok, t, im.grid_thw if im else torch.zeros(0, 3, dtype=torch.long), image_id)
               for t, im in zip(texts, images, strict=True)]
    assert [p.count(image_id) for p in prompts] == [4, 9, 0]

    temperature, steps = 0.8, 12
    dec = VLMDecoder(model)
    logits = dec.prefill(prompts, images)  # (3, V)
    gen = torch.Generator().manual_seed(0)
    t = torch.full((3,), temperature)
    tokens, lps = [], []
    for _ in range(steps):
        tok_, lp = sample_next(logits, t, torch.ones(3), torch.zeros(3, dtype=torch.bool), gen)
        tokens.append(tok_)
        lps.append(lp)
        logits = dec.decode(tok_)
    responses, behaviour = torch.stack(tokens, 1), torch.stack(lps, 1)  # (3, steps) each

    # the trainer's batch: right-padded prompt + response, every row's images in row order
    rows = [p + r.tolist() for p, r in zip(prompts, responses, strict=True)]
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])  # (3, L)
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])  # (3, L)
    given = [im for im in images if im is not None]
    lp = vlm_token_logprobs(model, ids, mask, torch.cat([im.pixel_values for im in given]),
                            torch.cat([im.grid_thw for im in given]), temperature)  # (3, L - 1)
    trainer = torch.stack([lp[i, len(p) - 1 : len(p) - 1 + steps] for i, p in enumerate(prompts)])  # (3, steps)
    # the engine's cached decode steps and the trainer's one pass round differently (terms: the hidden size)
    assert_close(trainer, behaviour, model.config.text_config.hidden_size)

    # the pixels matter: the trainer's logprobs with another image for row 0 differ beyond that tolerance
    other = ImageInputs(*pixel_inputs(processor, [_image(56, (0, 255, 0), 3)]))
    swapped = vlm_token_logprobs(model, ids, mask, torch.cat([other.pixel_values, given[1].pixel_values]),
                                 torch.cat([other.grid_thw, given[1].grid_thw]), temperature)
    assert float((swapped[0] - lp[0]).abs().max()) > 1e-4


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl"])
async def test_the_strategy_trains_a_vlm_on_samples_whose_images_are_in_the_blob_store(
        arch: str, request: pytest.FixtureRequest, model_dir: Path, tmp_path: Path) -> None:
    """TorchStrategy on a Qwen2-VL and a Qwen2.5-VL: the samples' images come from the blob store by
    digest, its recomputed logprobs (rows reordered and split into micro-batches) are the engine's
    behaviour ones, a step and a warm-up step on image prompts run, and a sample with images for a
    text policy is refused."""
    vlm_dir = request.getfixturevalue("vlm_dir" if arch == "qwen2_vl" else "vlm25_dir")
    import envs
    from blobs import BlobStore
    from rollout.engine import GenerationRequest, TorchEngine, generate_all
    from rollout.sampling import SamplingParams
    from trainer.batch import TrainSample
    from trainer.sft import SFTExample
    from trainer.strategy import TorchStrategy

    store = BlobStore(tmp_path / "blobs")
    src = envs.make_source("shapes")
    problems = [src.problem(seed) for seed in (1, 2, 3)]
    hashes = [store.put(p.images[0]) for p in problems]
    eng = TorchEngine(vlm_dir, max_batch=4, seed=1)
    inputs = [eng.image_inputs([store.get(h)]) for h in hashes]
    params = SamplingParams(max_new_tokens=5, temperature=1.0)
    done = await generate_all(eng, [GenerationRequest(f"r{i}", eng.encode(p.prompt, images=im), params, images=im)
                                    for i, (p, im) in enumerate(zip(problems, inputs, strict=True))])
    samples = [TrainSample(c.prompt_ids, c.token_ids, c.logprobs, [1] * len(c.token_ids), reward=float(i == 0),
                           sample_id=f"g0/{i}", group_id="g0", image_hashes=(h,))
               for i, (c, h) in enumerate(zip(done, hashes, strict=True))]
    strat = TorchStrategy(vlm_dir, micro_batch_size=2, blob_dir=store.root, lr=1e-3)
    batch, _ = strat.prepare(samples)
    lp = strat.logprobs(batch.by_length())  # (B, L - 1), rows reordered
    order = torch.argsort(batch.attention_mask.sum(dim=1), stable=True)
    mask = batch.loss_mask[order] > 0
    assert_close(lp[mask], batch.old_logprobs[order][mask], strat.hf_model.config.text_config.hidden_size)
    before = strat.hf_model.model.visual.patch_embed.proj.weight.clone()
    metrics = strat.train_step(samples)
    assert metrics["train/samples"] == 3.0
    assert not torch.equal(before, strat.hf_model.model.visual.patch_embed.proj.weight)  # the vision tower learns
    target = strat.tokenizer(problems[0].reference, add_special_tokens=False)["input_ids"]
    losses = strat.warmup([[SFTExample(done[0].prompt_ids, target, images=problems[0].images)]], lr=1e-3,
                          grad_clip=1.0)
    assert len(losses) == 1 and losses[0] > 0
    with pytest.raises(ValueError, match="a sample has images but the policy is not a vision-language model"):
        TorchStrategy(model_dir).prepare(samples)


def _shapes_samples(strat: TorchStrategy, store: BlobStore, seeds: tuple[int, ...]) -> list[TrainSample]:
    """One GRPO group of ``shapes`` problems whose images are in ``store``: prompt (image tokens
    expanded), the reference answer + EOS as the response, reward 1 for even positions, and the
    behaviour logprobs the policy gives now (so the step's ratio starts at 1)."""
    import envs
    from blobs import decode_image
    from trainer.batch import TrainSample

    src = envs.make_source("shapes", colours=["red", "green", "blue"])
    tok, hf, processor = strat.tokenizer, strat.hf_model, strat.images.processor  # type: ignore[union-attr]
    samples = []
    for i, seed in enumerate(seeds):
        p = src.problem(seed)
        h = store.put(p.images[0])
        _, grid = pixel_inputs(processor, [decode_image(p.images[0])])
        prompt = encode_vlm_prompt(tok, p.prompt, grid, hf.config.image_token_id)
        response = [*tok(p.reference, add_special_tokens=False)["input_ids"], tok.eos_token_id]
        samples.append(TrainSample(prompt, response, [0.0] * len(response), [1] * len(response),
                                   reward=float(i % 2 == 0), sample_id=f"g0/{i}", group_id="g0", image_hashes=(h,)))
    batch, _ = strat.prepare(samples)
    lp = strat.logprobs(batch)  # (B, L - 1) in sample order
    return [dataclasses.replace(s, old_logprobs=lp[row, len(s.prompt_ids) - 1 : len(s.prompt_ids) - 1 + len(s.response_ids)]
                                .tolist()) for row, s in enumerate(samples)]


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl"])
def test_freeze_vision_leaves_the_tower_bit_identical_and_trains_the_rest(arch: str, request: pytest.FixtureRequest,
                                                                          model_dir: Path, tmp_path: Path) -> None:
    """``freeze_vision`` (either architecture): after a warm-up step and an RL step the tower's weights
    are bit-identical and it has no optimizer state; the merger and the language model changed. A
    text model refuses it."""
    vlm_dir = request.getfixturevalue("vlm_dir" if arch == "qwen2_vl" else "vlm25_dir")
    from blobs import BlobStore
    from trainer.sft import SFTExample
    from trainer.strategy import TorchStrategy
    from trainer.vlm import vision_parameters

    store = BlobStore(tmp_path / "blobs")
    strat = TorchStrategy(vlm_dir, micro_batch_size=4, blob_dir=store.root, lr=1e-2, freeze_vision=True)
    hf = strat.hf_model
    tower = vision_parameters(hf)
    merger = {n: p for n, p in vision_parameters(hf, with_merger=True).items() if n not in tower}
    assert tower and merger and all(".merger." in n for n in merger)
    before = {n: p.detach().clone() for n, p in hf.named_parameters()}
    samples = _shapes_samples(strat, store, (1, 2, 3, 4))
    strat.warmup([[SFTExample(s.prompt_ids, s.response_ids, images=(store.get(s.image_hashes[0]),))
                   for s in samples]], lr=1e-2, grad_clip=1.0)
    strat.train_step(samples)
    assert all(torch.equal(before[n], p) for n, p in tower.items())
    assert all(not p.requires_grad and p.grad is None for p in tower.values())
    frozen = {id(p) for p in tower.values()}
    assert strat.optimizer.state and not frozen & {id(p) for p in strat.optimizer.state}
    assert not frozen & {id(p) for g in strat.optimizer.param_groups for p in g["params"]}
    assert not torch.equal(before["model.visual.merger.mlp.0.weight"], merger["model.visual.merger.mlp.0.weight"])
    q = "model.language_model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(before[q], dict(hf.named_parameters())[q])
    with pytest.raises(ValueError, match=r"train\.freeze_vision: true needs a vision-language model"):
        TorchStrategy(model_dir, freeze_vision=True)


def test_lora_targets_only_the_language_model_of_a_vlm() -> None:
    """A module of the vision tower named like a target (Qwen2.5-VL's tower has ``gate_proj``) gets no
    adapter; targets naming no language module are refused."""
    from trainer.strategy import language_targets

    def mlp() -> torch.nn.Module:
        m = torch.nn.Module()
        m.gate_proj, m.fc1 = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
        return m

    toy = torch.nn.Module()
    toy.model = torch.nn.Module()
    toy.model.visual, toy.model.language_model = torch.nn.ModuleList([mlp()]), torch.nn.ModuleList([mlp()])
    assert language_targets(toy, ["gate_proj"]) == ["model.language_model.0.gate_proj"]
    assert language_targets(toy.model.language_model, ["gate_proj"]) == ["gate_proj"]  # no tower: as given
    with pytest.raises(ValueError, match=r"train.lora_target_modules \['qkv'\] name no module of the language"):
        language_targets(toy, ["qkv"])


def test_lora_on_a_vlm_trains_language_adapters_and_publishes_a_complete_vlm(vlm_dir: Path, tmp_path: Path) -> None:
    """LoRA on the tiny Qwen2-VL: adapters on the language model only; the warm-up folds them into the
    base; an RL step moves the adapters only; the merged export is a complete VLM directory with the
    plain model's names, and the engine's model loaded from it gives the strategy's logprobs."""
    from blobs import BlobStore
    from rollout.vlm import check_vlm_dir
    from trainer.sft import SFTExample
    from trainer.strategy import TorchStrategy, _lora_layers
    from trainer.vlm import vision_parameters

    store = BlobStore(tmp_path / "blobs")
    strat = TorchStrategy(vlm_dir, micro_batch_size=4, blob_dir=store.root, lr=1e-2, lora_rank=4, lora_alpha=8.0)
    hf = strat.hf_model
    layers = _lora_layers(hf)
    assert layers and all(n.startswith("model.language_model.") for n in layers)
    tower = {n: p.detach().clone() for n, p in vision_parameters(hf, with_merger=True).items()}
    samples = _shapes_samples(strat, store, (1, 2, 3, 4))
    q = "model.language_model.layers.0.self_attn.q_proj"
    base0 = layers[q].get_base_layer().weight.detach().clone()
    strat.warmup([[SFTExample(s.prompt_ids, s.response_ids, images=(store.get(s.image_hashes[0]),))
                   for s in samples]], lr=1e-2, grad_clip=1.0)
    base1 = layers[q].get_base_layer().weight.detach().clone()
    assert not torch.equal(base0, base1)  # folded into the base ...
    assert not bool(layers[q].lora_B["default"].weight.any())  # ... and fresh adapters (B = 0)
    samples = _shapes_samples(strat, store, (1, 2, 3, 4))
    strat.train_step(samples)
    assert torch.equal(base1, layers[q].get_base_layer().weight) and bool(layers[q].lora_B["default"].weight.any())
    assert all(torch.equal(tower[n], p) for n, p in vision_parameters(hf, with_merger=True).items())

    out, _ = strat.export_weights(tmp_path / "published")
    check_vlm_dir(out)
    engine_model = load_vlm(out)
    assert set(engine_model.state_dict()) == set(load_vlm(vlm_dir).state_dict())
    batch, _ = strat.prepare(samples)
    lp = strat.logprobs(batch)  # (B, L - 1) the merged policy, as the strategy computes it
    mask = batch.loss_mask > 0
    images = [strat.images.of_hashes(s.image_hashes) for s in samples]
    with torch.no_grad():
        want = vlm_token_logprobs(engine_model, batch.input_ids, batch.attention_mask, torch.cat([im[0] for im in images]),
                                  torch.cat([im[1] for im in images]), strat.temperature)
    assert_close(lp[mask], want[mask], hf.config.text_config.hidden_size)
