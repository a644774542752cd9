"""Hugging Face models as they are, on a tiny BPE model with a ChatML template: prompts through the
chat template, several EOS tokens, stop strings, and the engine/trainer logprob contract on
chat-rendered prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rollout.engine import GenerationRequest, TorchEngine, generate_all
from rollout.model_init import (
    CHATML_TEMPLATE,
    encode_prompt,
    eos_token_ids,
    init_tiny_model,
    load_model,
    load_tokenizer,
    use_chat_template,
)
from rollout.sampling import SamplingParams
from schemas.config import TinyModelSpec
from tests.floats import assert_close
from trainer.batch import TrainSample, collate
from trainer.strategy import TorchStrategy

SPEC = TinyModelSpec(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position_embeddings=128,
                     tokenizer="bpe", chat_template=True)


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("chat") / "bpe", SPEC, seed=3)


def test_chat_template_renders_system_and_user_turns(chat_dir: Path) -> None:
    tok = load_tokenizer(chat_dir)
    assert tok.chat_template == CHATML_TEMPLATE
    ids = encode_prompt(tok, "12+7=", chat=True, system_prompt="Be brief.")
    assert tok.decode(ids) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n12+7=<|im_end|>\n"
                               "<|im_start|>assistant\n")
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")  # no second BOS in front of the template's
    no_system = tok.decode(encode_prompt(tok, "hi", chat=True))
    assert "system" not in no_system and no_system.endswith("<|im_start|>assistant\n")
    bare = encode_prompt(tok, "12+7=")
    assert bare[0] == tok.bos_token_id and tok.decode(bare, skip_special_tokens=True) == "12+7="
    assert len(set(tok("12+7= the answer is 19")["input_ids"])) < len("12+7= the answer is 19")  # BPE merges


def test_chat_template_setting(chat_dir: Path, model_dir: Path) -> None:
    chat, plain = load_tokenizer(chat_dir), load_tokenizer(model_dir)
    assert use_chat_template(chat, "auto") and use_chat_template(chat, True) and not use_chat_template(chat, False)
    assert not use_chat_template(plain, "auto") and not use_chat_template(plain, False)
    with pytest.raises(ValueError, match=r"model.chat_template=true.*no chat template"):
        use_chat_template(plain, True)


def test_every_eos_token_ends_generation(chat_dir: Path, tmp_path: Path) -> None:
    tok = load_tokenizer(chat_dir)
    assert eos_token_ids(load_model(chat_dir), tok) == {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")}
    engine = TorchEngine(chat_dir, max_batch=2)
    prompt = engine.encode("5+5=")
    first = engine.model(torch.tensor([prompt])).logits[0, -1].argmax().item()  # greedy's first token
    # a copy whose generation_config names that token as a second EOS: greedy stops right there
    copy = tmp_path / "eos"
    load_model(chat_dir).save_pretrained(copy)
    tok.save_pretrained(copy)
    gen_cfg = json.loads((copy / "generation_config.json").read_text())
    gen_cfg["eos_token_id"] = [tok.eos_token_id, first]
    (copy / "generation_config.json").write_text(json.dumps(gen_cfg))
    params = SamplingParams(max_new_tokens=20, greedy=True)
    (free,) = engine_run(engine, prompt, params)
    (stopped,) = engine_run(TorchEngine(copy, max_batch=2), prompt, params)
    assert free.token_ids[0] == first and free.finish_reason == "length"
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"


def engine_run(engine: TorchEngine, prompt: list[int], params: SamplingParams) -> list:
    import asyncio

    return asyncio.run(generate_all(engine, [GenerationRequest("r", prompt, params)]))


def test_stop_string_ends_at_the_token_that_completes_it(chat_dir: Path) -> None:
    engine = TorchEngine(chat_dir, max_batch=2)
    prompt = engine.encode("what is 3+4?", "Answer briefly.")
    (free,) = engine_run(engine, prompt, SamplingParams(max_new_tokens=24, greedy=True))
    assert len(free.token_ids) == 24 and len(free.text) >= 6
    stop = free.text[3:6]  # a string that appears after a few tokens of the greedy answer
    (cut,) = engine_run(engine, prompt, SamplingParams(max_new_tokens=24, greedy=True, stop=(stop,)))
    assert cut.finish_reason == "stop"
    assert cut.token_ids == free.token_ids[: len(cut.token_ids)] and len(cut.token_ids) < 24
    assert stop in cut.text and stop not in engine.tokenizer.decode(cut.token_ids[:-1], skip_special_tokens=True)
    assert cut.logprobs == free.logprobs[: len(cut.token_ids)]
    (never,) = engine_run(engine, prompt, SamplingParams(max_new_tokens=24, greedy=True, stop=("\u2603never",)))
    assert never.token_ids == free.token_ids


async def test_engine_and_trainer_logprobs_agree_on_chat_prompts(chat_dir: Path) -> None:
    engine = TorchEngine(chat_dir, max_batch=4, chat_template=True, system_prompt="Think, then answer.")
    strategy = TorchStrategy(chat_dir, temperature=0.8, micro_batch_size=4)
    prompts = ["12+34=", "what is 7 minus 3?", "add 99 and 1", "8+8="]
    params = SamplingParams(max_new_tokens=16, temperature=0.8)
    done = await generate_all(engine, [GenerationRequest(str(i), engine.encode(p), params) for i, p in enumerate(prompts)])
    assert all(c.prompt_ids[0] == engine.tokenizer.convert_tokens_to_ids("<|im_start|>") for c in done)
    batch = collate([TrainSample(c.prompt_ids, c.token_ids, c.logprobs, [1] * len(c.token_ids), 0.0, group_id="g")
                     for c in done], strategy.pad_id)
    mask = batch.loss_mask.bool()
    # the engine's cached decode steps and the trainer's one pass round differently (terms: the hidden size)
    assert_close(strategy.logprobs(batch)[mask], batch.old_logprobs[mask], strategy.model.config.hidden_size)
