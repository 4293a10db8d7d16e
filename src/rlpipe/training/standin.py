"""Stand-ins for hub checkpoints: small models laid out exactly as a hub snapshot is, built offline.

rlpipe's own tiny model has a character tokenizer and float32 weights; real checkpoints have a byte-level BPE
tokenizer with merges, a chat template with system/user/assistant/tool roles, 16-bit weights, an EOS that is an
int in one family and a list in another, tied embeddings in some, and a vocabulary the engine pads. Each of those
broke a path the tiny model never exercised (a vocabulary of 716 fails vLLM's read-back of the embedding; an int
EOS failed the HF engine). No hub is reachable where rlpipe is tested, so these are built here: the tokenizer is
trained with ``tokenizers`` on a small mixed corpus (ASCII, code, Chinese), the model is built from its
architecture's config with random weights and written by ``save_pretrained`` in 16 bits.

Two families, chosen to differ wherever a checkpoint can:

============  =========================  ==============================
              ``qwen2`` (also ``qwen3``)  ``llama`` (also ``mistral``)
============  =========================  ==============================
template      ChatML, ``tool`` role      Llama-3 headers, ``ipython``-style tool turns
EOS           ``<|im_end|>`` (an int)    ``[<|eot_id|>, <|end_of_text|>]`` (a list)
pad token     ``<|endoftext|>``          none (the documented fallback applies)
embeddings    tied                       untied
dtype         bfloat16                   float16
vocabulary    716                        1000 (neither a multiple of 64)
============  =========================  ==============================
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["ARCHITECTURES", "StandIn", "build_standin", "train_bpe_tokenizer"]

CHATML = (
    "{% for m in messages %}"
    "{% if loop.first and m['role'] != 'system' %}{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3 = (
    "{{ '<|begin_of_text|>' }}"
    "{% for m in messages %}"
    "{% set role = 'ipython' if m['role'] == 'tool' else m['role'] %}"
    "{{ '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' + m['content'] + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class StandIn:
    """How one family's stand-in is laid out (see the module table)."""

    model_type: str
    vocab_size: int
    specials: tuple[str, ...]
    eos: tuple[str, ...]  # one name: written as an int; several: as a list
    pad: str | None
    bos: str | None
    template: str
    tied: bool
    dtype: torch.dtype


ARCHITECTURES: dict[str, StandIn] = {
    "qwen2": StandIn("qwen2", 716, ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), ("<|im_end|>",),
                     "<|endoftext|>", None, CHATML, True, torch.bfloat16),
    "qwen3": StandIn("qwen3", 716, ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), ("<|im_end|>",),
                     "<|endoftext|>", None, CHATML, True, torch.bfloat16),
    "llama": StandIn("llama", 1000, ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                     "<|end_header_id|>", "<|eot_id|>"), ("<|eot_id|>", "<|end_of_text|>"),
                     None, "<|begin_of_text|>", LLAMA3, False, torch.float16),
    "mistral": StandIn("mistral", 1000, ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                         "<|end_header_id|>", "<|eot_id|>"), ("<|eot_id|>", "<|end_of_text|>"),
                       None, "<|begin_of_text|>", LLAMA3, False, torch.float16),
}


def _corpus(seed: int = 0) -> list[str]:
    """Text the BPE is trained on: arithmetic, word problems, code, tool calls and some Chinese, so merges form
    over digits, words and CJK bytes alike (a Chinese prompt then round-trips through real merges)."""
    rng = random.Random(seed)
    words = ("the apples cost each total how many does she have left after buying selling dollars "
             "number answer step first then so therefore because python function return value list "
             "calculator result tool call def print for in range if else while").split()
    syllables = "ka to ri ne sa mu lo pe di va shi chu ra mon tel gor bin".split()
    words += ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(400)]
    zh = ["小明有三个苹果，又买了五个。", "一共有多少个？答案是八。", "请计算下面的题目。", "你好，世界！我们来做数学题。"]
    lines = []
    for _ in range(3000):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        lines.append(f"{a}+{b}={a + b}")
        lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(4, 14))).capitalize() + ".")
        lines.append(f'def f{a}(x):\n    return x * {b}\n<tool_call>{{"name": "calc", "arguments": {{"expr": "{a}*{b}"}}}}</tool_call>')
        lines.append(rng.choice(zh))
    return lines


def train_bpe_tokenizer(spec: StandIn, seed: int = 0):
    """A byte-level BPE (every byte has a token, so any text encodes) of exactly ``spec.vocab_size`` ids, with
    the family's special tokens and chat template, as a transformers fast tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    # The pre-tokenizer Qwen2's and Llama-3's tokenizers use (the GPT-4-style split, then byte-level):
    # transformers rebuilds a qwen2 folder's tokenizer with this pipeline whatever tokenizer.json says.
    split = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
             r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(pattern=Regex(split), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=spec.vocab_size, special_tokens=list(spec.specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    if spec.bos:  # as Llama-3's tokenizer.json: plain text starts with the BOS (a chat template writes its own)
        bos = (spec.bos, tok.token_to_id(spec.bos))
        tok.post_processor = processors.TemplateProcessing(single=f"{bos[0]} $A", pair=f"{bos[0]} $A {bos[0]} $B",
                                                           special_tokens=[bos])
    if tok.get_vocab_size() != spec.vocab_size:
        raise RuntimeError(f"the BPE trainer gave {tok.get_vocab_size()} tokens, not {spec.vocab_size}: "
                           "the corpus is too small for that many merges")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=spec.eos[0], pad_token=spec.pad,
                                   bos_token=spec.bos, clean_up_tokenization_spaces=False, model_max_length=32768)
    fast.chat_template = spec.template
    return fast


def _config(spec: StandIn, tok, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int,
            max_positions: int):
    from transformers import AutoConfig

    eos_ids = [tok.convert_tokens_to_ids(t) for t in spec.eos]
    kw = dict(vocab_size=spec.vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
              num_key_value_heads=kv_heads, intermediate_size=intermediate, max_position_embeddings=max_positions,
              tie_word_embeddings=spec.tied, rope_theta=10000.0, rms_norm_eps=1e-6,
              bos_token_id=tok.convert_tokens_to_ids(spec.bos) if spec.bos else None,
              eos_token_id=eos_ids[0] if len(eos_ids) == 1 else eos_ids,
              pad_token_id=tok.pad_token_id)
    if spec.model_type == "qwen3":
        kw["head_dim"] = hidden // heads
    return AutoConfig.for_model(spec.model_type, **kw)


def build_standin(folder: str | Path, arch: str = "qwen2", hidden: int = 256, layers: int = 6, heads: int = 4,
                  kv_heads: int = 2, intermediate: int = 1024, max_positions: int = 8192, seed: int = 0) -> Path:
    """Write a hub-style checkpoint of family ``arch`` to ``folder``: ``config.json``,
    ``generation_config.json``, ``model.safetensors`` in 16 bits, the tokenizer files with the chat template.
    The defaults give ~6.5M parameters (5–50M by ``hidden``/``layers``)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown stand-in architecture {arch!r}; valid: {', '.join(ARCHITECTURES)}")
    spec, folder = ARCHITECTURES[arch], Path(folder)
    tok = train_bpe_tokenizer(spec, seed)
    config = _config(spec, tok, hidden, layers, heads, kv_heads, intermediate, max_positions)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).to(spec.dtype)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
        do_sample=True, temperature=0.7, top_p=0.8)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    _check_layout(folder, spec)
    return folder


def _check_layout(folder: Path, spec: StandIn) -> None:
    """The written folder is what a hub snapshot holds: 16-bit safetensors, an EOS of the family's form."""
    cfg = json.loads((folder / "config.json").read_text())
    gen = json.loads((folder / "generation_config.json").read_text())
    want_list = len(spec.eos) > 1
    if isinstance(gen["eos_token_id"], list) != want_list:
        raise RuntimeError(f"{folder}/generation_config.json: eos_token_id {gen['eos_token_id']!r} is not a "
                           f"{'list' if want_list else 'single int'}")
    if cfg.get("dtype", cfg.get("torch_dtype")) != str(spec.dtype).removeprefix("torch."):
        raise RuntimeError(f"{folder}/config.json: dtype {cfg.get('dtype')!r}, expected {spec.dtype}")
