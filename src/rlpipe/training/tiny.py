"""rlpipe's own base model: a character-level tokenizer and a small Qwen2 causal LM.

No model hub is reachable where rlpipe is developed and tested, so it builds its own: the
tokenizer is a byte-level BPE with no merges over printable ASCII, tab and newline — one token per
character, so arithmetic is never split oddly — with a ChatML template; the model is
``Qwen2ForCausalLM`` from a config. Both save with ``save_pretrained`` and load with
``transformers`` and vLLM like any hub model.

Why byte-level BPE and not a simpler WordLevel model: transformers (5.x) loads any folder whose
config says ``qwen2`` with its own ``Qwen2Tokenizer`` pipeline (NFC, byte-level pre-tokenizer,
BPE over the saved vocab), whatever ``tokenizer_class`` says. A tokenizer that is not exactly that
pipeline would tokenize differently after a reload (a WordLevel one lost every space and
newline). This one is that pipeline, so it is the same object before and after saving, in
transformers and in vLLM.
"""

from __future__ import annotations

import string

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from rlpipe.config import ModelConfig

PAD, EOS, IM_START, IM_END, UNK = "<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|unk|>"
SPECIALS = [PAD, EOS, IM_START, IM_END, UNK]
CHARS = [c for c in string.printable if c not in "\r\x0b\x0c"]  # letters, digits, punctuation, ' ', \t, \n


def _byte_symbols() -> list[str]:
    """The byte-level symbols (GPT-2's bytes→unicode map) of CHARS, in CHARS order.

    Only printable ASCII, tab and newline are in the vocabulary: the tasks rlpipe's tiny model
    learns are ASCII, and a 128-row embedding keeps it small. Other bytes (non-ASCII text) have no
    token and are dropped — the same way before and after a reload."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[ord(c)] for c in CHARS]

CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

__all__ = ["build_char_tokenizer", "build_tiny_model", "count_parameters", "CHAT_TEMPLATE"]


def build_char_tokenizer(vocab_multiple: int = 64) -> PreTrainedTokenizerFast:
    """One token per byte (ASCII: per character), plus pad/eos/ChatML/unk specials."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + _byte_symbols())}
    # Round the vocabulary up (unused ids) so embedding rows align nicely for matmuls.
    for i in range(len(vocab), -(-len(vocab) // vocab_multiple) * vocab_multiple):
        vocab[f"<|unused{i}|>"] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, continuing_subword_prefix="",
                               end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        additional_special_tokens=[IM_START, IM_END],
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(
    cfg: ModelConfig, tokenizer: PreTrainedTokenizerFast, seed: int = 0, dtype: torch.dtype = torch.float32
) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END)],
        bos_token_id=None,
        torch_dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(dtype)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    return model


def count_parameters(model: torch.nn.Module) -> int:
    # Tied embeddings are one tensor: count unique storage once.
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel()
    return total
