"""The stand-ins are laid out as hub snapshots are, and differ between families wherever checkpoints do."""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlpipe.training.standin import build_standin

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "小明有3个苹果, 12+34=?"},
            {"role": "assistant", "content": '<tool_call>{"name": "calc"}</tool_call>'},
            {"role": "tool", "content": "46"}]


@pytest.mark.parametrize("arch,eos_is_list,tied,dtype,vocab", [
    ("qwen2", False, True, torch.bfloat16, 716), ("llama", True, False, torch.float16, 1000)])
def test_layout_is_a_hub_snapshot(standins, arch, eos_is_list, tied, dtype, vocab):
    folder = standins[arch]
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= {p.name for p in folder.iterdir()}
    gen = json.loads((folder / "generation_config.json").read_text())
    assert isinstance(gen["eos_token_id"], list) == eos_is_list
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["vocab_size"] == vocab and vocab % 64 != 0 and cfg["tie_word_embeddings"] == tied
    with safe_open(folder / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16" if dtype == torch.bfloat16 else "F16"}
        assert ("lm_head.weight" in f.keys()) != tied
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.dtype == dtype
    assert 5e6 <= sum(p.numel() for p in model.parameters()) <= 50e6


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_tokenizer_is_a_trained_bpe_with_a_tool_role_template(standins, arch):
    tok = AutoTokenizer.from_pretrained(standins[arch])
    assert len(tok) == json.loads((standins[arch] / "config.json").read_text())["vocab_size"]
    merges = json.loads((standins[arch] / "tokenizer.json").read_text())["model"]["merges"]
    assert len(merges) > 100  # real merges, not one token per byte
    text = "小明有3个苹果 and 12+34=46\n\tdef f(x): return x  # 注释"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text and len(ids) < len(text.encode())
    rendered = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    for m in MESSAGES:
        assert m["content"] in rendered
    assert ("<|im_start|>tool" in rendered) == (arch == "qwen2") and ("ipython" in rendered) == (arch == "llama")


def test_families_differ_where_checkpoints_do(standins):
    qwen, llama = (AutoTokenizer.from_pretrained(standins[a]) for a in ("qwen2", "llama"))
    assert qwen.pad_token == "<|endoftext|>" and llama.pad_token is None
    # Llama's tokenizer starts plain text with its BOS; Qwen's adds nothing.
    assert llama("12")["input_ids"][0] == llama.bos_token_id and qwen("12")["input_ids"] == qwen("12", add_special_tokens=False)["input_ids"]


def test_same_seed_same_checkpoint_and_unknown_family_refused(tmp_path):
    a, b = build_standin(tmp_path / "a", "qwen3", hidden=64, layers=2, intermediate=128), build_standin(tmp_path / "b", "qwen3", hidden=64, layers=2, intermediate=128)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert json.loads((a / "config.json").read_text())["model_type"] == "qwen3"
    with pytest.raises(ValueError, match="valid: qwen2, qwen3, llama, mistral"):
        build_standin(tmp_path / "c", "gpt9")
