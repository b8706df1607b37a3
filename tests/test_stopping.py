"""Stop conditions (EOS, stop sequences, max_new_tokens), the streaming form, the API and decode.py."""

import json
import subprocess
import sys

import pytest
import torch

import mtp
from mtp.decoding.decoder import Decoder, GenerationResult
from mtp.drafters.contract import Drafter, DrafterConfig, base_identity
from mtp.drafters.heads import MedusaHeads
from tests.conftest import PROMPT, ROOT, TINY_BASE, TREE, OracleHeads, reference, save_random_heads, tiny_model

pytestmark = pytest.mark.usefixtures("tokenizer")


@pytest.fixture(scope="module")
def tokenizer():
    return mtp.base.load_tokenizer(TINY_BASE)


@pytest.fixture(scope="module")
def setup(tokenizer):
    """A tiny model, its greedy continuation of PROMPT (48 tokens) and oracle heads for it."""
    model = tiny_model()
    input_ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    expected = reference(model, input_ids, 48)
    return model, expected, OracleHeads(model, torch.cat([input_ids[0], torch.tensor(expected)]), num_heads=4)


def test_eos_inside_an_accepted_block_ends_generation_there(setup, tokenizer):
    model, expected, oracle = setup
    first = next(i for i in range(8, 40) if expected.index(expected[i]) == i)  # a token not seen before
    eos = expected[first]
    model.generation_config.eos_token_id = eos
    try:
        result = Decoder(model, tokenizer, oracle, TREE).generate(PROMPT, max_new_tokens=40)
    finally:
        model.generation_config.eos_token_id = None
    assert result.token_ids == expected[:first] and result.finish_reason == "stop" and result.stop_sequence is None
    settled = 1 + sum(result.acceptance.lengths)  # the prefill's token, then every pass's
    assert settled > first + 1 and result.acceptance.lengths[-1] > 1  # the last block went on past EOS: cut there


def test_max_new_tokens_is_exact_in_the_middle_of_a_block(setup, tokenizer):
    model, expected, oracle = setup
    for limit in (1, 2, 7, 13):
        result = Decoder(model, tokenizer, oracle, TREE).generate(PROMPT, max_new_tokens=limit)
        assert result.token_ids == expected[:limit] and result.finish_reason == "length"
    # the last pass verified only the depths still wanted (1 + 5 + 5 + 2 tokens), not the whole tree
    lengths = result.acceptance.lengths
    assert 1 + sum(lengths) == 13 and lengths[-1] < lengths[0]


def test_max_new_tokens_zero_is_an_empty_result(setup, tokenizer):
    model, _, oracle = setup
    result = Decoder(model, tokenizer, oracle, TREE).generate(PROMPT, max_new_tokens=0)
    assert result.token_ids == [] and result.text == "" and result.finish_reason == "length"


def test_a_stop_sequence_spanning_two_steps_ends_the_text_before_it(setup, tokenizer):
    model, expected, _ = setup
    decoder = Decoder(model, tokenizer)  # plain decoding: one token per step, so two tokens span two steps
    text = tokenizer.decode(expected[:40])
    stop = tokenizer.decode(expected[6:8])
    assert len(stop) > 1
    cut = text.find(stop)
    result = decoder.generate(PROMPT, max_new_tokens=40, stop=["never appears", stop])
    assert result.text == text[:cut] and result.finish_reason == "stop" and result.stop_sequence == stop
    assert result.token_ids == expected[: len(result.token_ids)]
    assert tokenizer.decode(result.token_ids) == text[:cut]
    chunks = list(decoder.stream(PROMPT, max_new_tokens=40, stop=[stop]))
    assert "".join(chunks) == text[:cut] and len(chunks) > 1


def test_streaming_yields_the_whole_text_and_fills_the_result(setup, tokenizer):
    model, expected, oracle = setup
    result = GenerationResult()
    chunks = list(Decoder(model, tokenizer, oracle, TREE).stream(PROMPT, max_new_tokens=30, result=result))
    assert "".join(chunks) == result.text == tokenizer.decode(expected[:30])
    assert result.forward_passes < 30 and result.tokens_per_second > 0


def test_bad_prompts_are_clear_errors(setup, tokenizer):
    model, _, _ = setup
    decoder = Decoder(model, tokenizer)
    with pytest.raises(ValueError, match="The prompt is empty"):
        decoder.generate("", max_new_tokens=5)
    with pytest.raises(ValueError, match="context window is 512"):
        decoder.generate("word " * 600, max_new_tokens=5)


def test_generation_fills_the_context_window_exactly_and_no_further(tokenizer):
    """prompt + max_new_tokens may reach the context window, not pass it; near the end, the tree loses the nodes
    that would sit past the window (a model with learned positions would fail on them)."""
    model = tiny_model(max_position_embeddings=41)  # 14 prompt tokens, 27 new: 1 + 5 x 5 from full trees, then 1
    input_ids = tokenizer(PROMPT, return_tensors="pt").input_ids  # (1, P)
    room = 41 - input_ids.shape[1]
    expected = reference(model, input_ids, room)
    oracle = OracleHeads(model, torch.cat([input_ids[0], torch.tensor(expected)]), num_heads=4)
    decoder = Decoder(model, tokenizer, oracle, TREE)
    positions = []
    hook = model.get_decoder().register_forward_pre_hook(
        lambda module, args, kwargs: (
            positions.append(int(kwargs["position_ids"].max()))
            if "position_ids" in kwargs and kwargs["position_ids"] is not None
            else None
        ),
        with_kwargs=True,
    )
    try:
        result = decoder.generate(PROMPT, max_new_tokens=room)
    finally:
        hook.remove()
    assert result.token_ids == expected and result.finish_reason == "length"
    assert max(positions) == 39 and result.acceptance.lengths[-1] == 1  # the last pass: the root alone, at 39
    with pytest.raises(
        ValueError,
        match=f"{41 + 1} in all, past the model's context window of 41 tokens: lower max_new_tokens to at most {room}",
    ):
        decoder.generate(PROMPT, max_new_tokens=room + 1)


@pytest.mark.parametrize("head_type", Drafter.kinds)
def test_load_gives_a_lossless_decoder_for_saved_heads(tmp_path, head_type):
    path, model, tokenizer = save_random_heads(tmp_path, "own", head_type)
    decoder = mtp.load(path, tree="medium")
    messages = [{"role": "user", "content": "Count from 1 to 9."}]
    result = decoder.generate(messages, max_new_tokens=24)
    input_ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    expected = model.generate(**input_ids, max_new_tokens=24, do_sample=False)[0, input_ids["input_ids"].shape[1] :]
    expected = expected.tolist()
    if 2 in expected:  # EOS (<|im_end|>, id 2) ends both
        expected = expected[: expected.index(2)]
    assert result.token_ids == expected


def test_heads_for_another_base_are_refused_at_load(tmp_path):
    model, tokenizer = mtp.base.load_base(TINY_BASE)
    identity = {**base_identity("a narrower model", model, tokenizer), "hidden_size": 32}
    MedusaHeads(DrafterConfig(num_heads=2, **identity)).save_pretrained(tmp_path / "heads")
    path = str(tmp_path / "heads")
    with pytest.raises(ValueError, match=r"trained for base model 'a narrower model'.*hidden 32.*not for .*hidden 64"):
        mtp.load(path, base_model=TINY_BASE)


@pytest.mark.slow
def test_decode_py_answers_prompts_as_json_lines(tmp_path):
    path, _, _ = save_random_heads(tmp_path)
    prompts = tmp_path / "questions.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "x", "turns": ["Count to 5.", "And to 6?"]}) + "\n")
    command = [
        sys.executable,
        str(ROOT / "decode.py"),
        "--drafter",
        path,
        "--prompts-file",
        str(prompts),
        "--json",
        "--max-new-tokens",
        "12",
        "--tree",
        "chain",
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    answers = [json.loads(line) for line in done.stdout.splitlines()]
    assert [a["prompt"] for a in answers] == ["Count to 5.", "And to 6?"]
    for answer in answers:
        assert answer["tokens"] <= 12 and (answer["finish_reason"] == "stop") == (answer["tokens"] < 12)
        assert answer["forward_passes"] == 0 if answer["tokens"] <= 1 else answer["forward_passes"] >= 1
        assert answer["tau"] == round(answer["tokens"] / max(answer["forward_passes"], 1), 3)
        assert answer["acceptance"]["passes"] == answer["forward_passes"]  # the decoder's acceptance record
        assert set(answer["acceptance"]) >= {"at_depth", "rate_at_depth", "by_source"}
    assert "tau" in done.stderr and "tokens/s" in done.stderr


@pytest.mark.slow
def test_decode_py_answers_a_file_in_batches_as_one_by_one(tmp_path):
    path, _, _ = save_random_heads(tmp_path)
    prompts = tmp_path / "questions.jsonl"
    rows = [{"turns": ["Count to 5.", "And to 6?"]}, {"prompt": "Hi"}, {"turns": ["Name three colours, then stop."]}]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    command = [
        sys.executable,
        str(ROOT / "decode.py"),
        "--drafter",
        path,
        "--prompts-file",
        str(prompts),
        "--json",
        "--max-new-tokens",
        "12",
    ]
    runs = [
        subprocess.run(command + ["--batch-size", size], cwd=ROOT, capture_output=True, text=True, timeout=300)
        for size in ("1", "2")
    ]
    assert all(done.returncode == 0 for done in runs), runs[1].stderr[-2000:]
    one_by_one, batched = ([json.loads(line) for line in done.stdout.splitlines()] for done in runs)
    assert [a["prompt"] for a in batched] == ["Count to 5.", "Hi", "Name three colours, then stop.", "And to 6?"]
    assert [(a["conversation"], a["turn"]) for a in batched] == [(0, 0), (1, 0), (2, 0), (0, 1)]  # file rows, turns
    by_prompt = {a["prompt"]: (a["text"], a["tokens"], a["finish_reason"]) for a in one_by_one}
    assert {a["prompt"]: (a["text"], a["tokens"], a["finish_reason"]) for a in batched} == by_prompt
    streamed = subprocess.run(
        command + ["--batch-size", "2", "--stream"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert streamed.returncode != 0 and "--batch-size 2: give B >= 1; B > 1 answers" in streamed.stderr


def test_an_attention_that_takes_no_4d_mask_is_refused_at_load(setup, tokenizer):
    model, _, _ = setup
    implementation = model.config._attn_implementation
    model.config._attn_implementation = "flash_attention_2"  # as if loaded so: it ignores custom 4D masks
    try:
        with pytest.raises(ValueError, match="'flash_attention_2' of llama takes no custom 4D tree mask"):
            Decoder(model, tokenizer)
    finally:
        model.config._attn_implementation = implementation


@pytest.mark.slow
def test_decode_py_chats_interactively_without_heads_until_input_ends():
    command = [sys.executable, str(ROOT / "decode.py"), "--base-model", TINY_BASE, "--max-new-tokens", "6"]
    done = subprocess.run(command, cwd=ROOT, input="Hello\nAnd again\n", capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("> ") == 3  # two turns answered, then the end of input
    assert "(12 tokens, 10 verification passes)" in done.stderr  # plain decoding: one token per pass


@pytest.mark.slow
def test_decode_py_samples_reproducibly_with_a_seed_and_refuses_bad_settings(tmp_path):
    path, _, _ = save_random_heads(tmp_path)
    command = [
        sys.executable,
        str(ROOT / "decode.py"),
        "--drafter",
        path,
        "--prompt",
        "Count to 5.",
        "--json",
        "--max-new-tokens",
        "16",
        "--temperature",
        "1.0",
        "--top-k",
        "50",
    ]
    runs = [
        subprocess.run(command + ["--seed", seed], cwd=ROOT, capture_output=True, text=True, timeout=300)
        for seed in ("1", "1", "2")
    ]
    assert all(done.returncode == 0 for done in runs), runs[0].stderr[-2000:]
    texts = [json.loads(done.stdout)["text"] for done in runs]
    assert texts[0] == texts[1] and texts[0] != texts[2]
    done = subprocess.run(command + ["--top-p", "0"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "top_p=0.0: use a probability in (0, 1]" in done.stderr
    help_text = subprocess.run([sys.executable, str(ROOT / "decode.py"), "--help"], capture_output=True, text=True)
    assert "NOT the base model's distribution" in " ".join(help_text.stdout.split())


def test_a_stop_sequence_that_begins_inside_a_token_keeps_the_text_before_it_and_that_token(setup, tokenizer):
    """As `Hello.` from the one token `.\\n\\n` with the stop `\\n\\n`: the text ends before the stop sequence, the
    token it begins in is kept, and the tokens decode to the text and that token's rest."""
    model, expected, _ = setup
    i = next(i for i in range(4, 40) if len(tokenizer.decode(expected[i])) > 1)  # a token of 2 or more characters
    inside = tokenizer.decode(expected[i])
    text, stop = tokenizer.decode(expected[:i]) + inside[:1], inside[1:] + tokenizer.decode(expected[i + 1])
    result = Decoder(model, tokenizer).generate(PROMPT, max_new_tokens=40, stop=[stop])
    assert result.text == text and result.token_ids == expected[: i + 1] and result.finish_reason == "stop"
    assert tokenizer.decode(result.token_ids) == text + inside[1:]
