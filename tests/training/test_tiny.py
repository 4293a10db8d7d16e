import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlpipe.config import ModelConfig
from rlpipe.storage.weights import file_weights_digest, weights_digest
from rlpipe.training.checkpoint import load_checkpoint, save_checkpoint
from rlpipe.training.tiny import EOS, IM_END, build_char_tokenizer, build_tiny_model, count_parameters


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


TRICKY = ["12+34=46", "  spaces  and\ttabs\nnewlines", "What is 7*8? \\boxed{56}", "~!@#$%^&*()_", "expr 1234:"]


@pytest.mark.parametrize("text", TRICKY)
def test_tokenizer_round_trip_one_token_per_char(tok, text):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)
    assert tok.decode(ids) == text


def test_reloaded_tokenizer_is_the_same_tokenizer(tok, tmp_path):
    """transformers reloads a qwen2 folder with its own Qwen2Tokenizer pipeline: ids must not change
    (a WordLevel tokenizer silently lost every space and newline here)."""
    model = build_tiny_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), tok)
    save_checkpoint(tmp_path, model, tok)
    again = AutoTokenizer.from_pretrained(tmp_path)
    for text in TRICKY + ["naïve café ✓", f"a{EOS}b", "<|im_start|>user\nhi<|im_end|>\n"]:
        assert again(text, add_special_tokens=False)["input_ids"] == tok(text, add_special_tokens=False)["input_ids"], text
    msgs = [{"role": "user", "content": "What is 2 + 2?\nAnswer briefly."}]
    assert again.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def test_special_tokens_and_unknowns(tok):
    ids = tok(f"1{EOS}2", add_special_tokens=False)["input_ids"]
    assert ids[1] == tok.eos_token_id and len(ids) == 3
    assert tok.decode(ids, skip_special_tokens=True) == "12"
    # Non-ASCII has no token: dropped (the same way after a reload, see below).
    assert tok.decode(tok("naïve ✓", add_special_tokens=False)["input_ids"]) == "nave "
    assert len(tok) % 64 == 0


def test_chat_template(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "2+2="}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\n2+2=<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template([{"role": "user", "content": "2+2="}], tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")


def test_default_model_size_is_in_range(tok):
    n = count_parameters(build_tiny_model(ModelConfig(), tok))
    assert 1_000_000 <= n <= 10_000_000


def test_save_load_round_trip_with_transformers(tok, tmp_path):
    cfg = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    model = build_tiny_model(cfg, tok, seed=1)
    digest = save_checkpoint(tmp_path, model, tok, trainer_state={"iteration": 3})
    assert digest == file_weights_digest(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    tok2 = AutoTokenizer.from_pretrained(tmp_path)
    assert tok2.decode(tok2("9-3=6")["input_ids"]) == "9-3=6"
    assert tok2.chat_template == tok.chat_template
    x = torch.tensor([tok("12+3=", add_special_tokens=False)["input_ids"]])
    assert torch.allclose(model(x).logits, again(x).logits, atol=1e-6)
    _, _, state = load_checkpoint(tmp_path)
    assert state["iteration"] == 3 and state["weights_sha256"] == digest
    assert IM_END in tok2.get_vocab()


def test_weight_hash_sees_every_change(tok):
    model = build_tiny_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), tok)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    h = weights_digest(state)
    assert h == weights_digest(dict(reversed(list(state.items()))))  # order-free
    key = next(iter(state))
    state[key].view(-1)[0] += 1e-6
    assert weights_digest(state) != h
    assert weights_digest({key: state[key].to(torch.bfloat16)}) != weights_digest({key: state[key]})


def test_vllm_loads_the_saved_model(tiny_checkpoint, tmp_path):
    """The saved folder is a real HF model: vLLM (CPU build here) serves it and agrees with HF greedy decoding."""
    import subprocess
    import sys

    from rlpipe.training.sft import greedy_answers

    model, tok, _ = load_checkpoint(tiny_checkpoint)
    prompts = ["12+34=", "55+11=", "90+90="]
    expected = greedy_answers(model, tok, prompts, max_new_tokens=6)
    script = f"""
import json, os
os.environ.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0-1", VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                  VLLM_ENABLE_V1_MULTIPROCESSING="0")
from vllm import LLM, SamplingParams
llm = LLM(model={str(tiny_checkpoint)!r}, enforce_eager=True, dtype="float32", seed=0, max_model_len=64)
outs = llm.generate({prompts!r}, SamplingParams(temperature=0, max_tokens=6))
print("RESULT" + json.dumps([o.outputs[0].text for o in outs]))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    assert json.loads(lines[-1][len("RESULT"):]) == expected
