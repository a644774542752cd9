"""A VLM's trainer logprobs (one teacher-forced pass with the pixels) agree with the engine's
behaviour logprobs (:class:`rollout.engine.VLMDecoder`: a batched prefill with the images, then
cached decode steps) within the text models' tolerance."""

from __future__ import annotations

from pathlib import Path

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


def _image(size: int, colour: tuple[int, int, int], corner: int) -> Image.Image:
    img = Image.new("RGB", (size, size), (255, 255, 255))
    x, y = (corner % 2) * size // 2, (corner // 2) * size // 2
    img.paste(colour, (x, y, x + size // 2, y + size // 2))
    return img


@torch.no_grad()
def test_engine_and_trainer_logprobs_agree_on_image_prompts(vlm_dir: Path) -> None:
    model, processor, tok = load_vlm(vlm_dir), load_image_processor(vlm_dir), load_tokenizer(vlm_dir)
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


async def test_the_strategy_trains_a_vlm_on_samples_whose_images_are_in_the_blob_store(
        vlm_dir: Path, model_dir: Path, tmp_path: Path) -> None:
    """TorchStrategy on a Qwen2-VL: the samples' images come from the blob store by digest, its
    recomputed logprobs (rows reordered and split into micro-batches) are the engine's behaviour ones,
    a step and a warm-up step on image prompts run, and a sample with images for a text policy is refused."""
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
