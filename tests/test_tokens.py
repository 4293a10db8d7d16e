"""A checkpoint's end tokens, pad token and chat template, whatever form it gives them in."""

import json
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from rlpipe.tokens import encode_prompt, eos_ids, ensure_pad_token, folder_eos_ids, load_tokenizer, render_prompt


class _Tok(SimpleNamespace):
    def convert_tokens_to_ids(self, t):
        return {"<|im_end|>": 7, "<|eot_id|>": 9}.get(t, self.unk_token_id)


@pytest.mark.parametrize("eos,expected", [(7, {7, 2}), ([7, 9], {7, 9, 2}), (None, {2})])
def test_eos_an_int_a_list_or_only_the_tokenizers(eos, expected):
    assert eos_ids(eos, _Tok(eos_token_id=2, unk_token_id=0)) == expected


def test_stop_tokens_override_by_id_or_name_and_unknown_names_refused():
    tok = _Tok(eos_token_id=2, unk_token_id=0)
    assert eos_ids([5], tok, ["<|im_end|>", 11]) == {7, 11}
    with pytest.raises(ValueError, match="'<nope>' is not in the model's vocabulary"):
        eos_ids(5, tok, ["<nope>"])
    with pytest.raises(ValueError, match="rollout.stop_tokens"):
        eos_ids(None, _Tok(eos_token_id=None, unk_token_id=0))


def test_folder_eos_reads_generation_config_int_and_list(standins):
    for arch, want in (("qwen2", 1), ("llama", 2)):
        tok = load_tokenizer(standins[arch])
        ids = folder_eos_ids(standins[arch], tok)
        gen = json.loads((standins[arch] / "generation_config.json").read_text())["eos_token_id"]
        assert ids == set(gen if isinstance(gen, list) else [gen]) | {tok.eos_token_id} and len(ids) == want


def test_pad_fallback_is_the_eos(standins):
    tok = AutoTokenizer.from_pretrained(standins["llama"])
    assert tok.pad_token_id is None
    assert ensure_pad_token(tok).pad_token_id == tok.eos_token_id
    assert load_tokenizer(standins["llama"]).pad_token == "<|eot_id|>"
    assert load_tokenizer(standins["qwen2"]).pad_token == "<|endoftext|>"  # its own is kept


def test_chat_prompt_without_a_template_is_refused(standins):
    tok = load_tokenizer(standins["qwen2"])
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        render_prompt(tok, json.dumps([{"role": "user", "content": "hi"}]), chat=True)


def test_encode_prompt_chat_has_one_bos_and_plain_text_the_tokenizers_own(standins):
    tok = load_tokenizer(standins["llama"])
    chat = encode_prompt(tok, json.dumps([{"role": "user", "content": "你好"}]), chat=True)
    assert chat.count(tok.bos_token_id) == 1 and chat[0] == tok.bos_token_id
    assert encode_prompt(tok, "12+3=", chat=False)[0] == tok.bos_token_id
    assert tok.decode(chat).count("你好") == 1
