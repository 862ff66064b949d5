"""A word-level tokenizer for tiny checkpoints, so hosts that load one from the model folder can run them.

SkyRL, vLLM and SGLang load a tokenizer from the checkpoint folder (transformers ``AutoTokenizer``) and
apply its chat template to chat-message prompts. A tiny random checkpoint has no real vocabulary, so
this writes a bijective word-level one: id ``i`` is the word ``w<i>``, except the first
:data:`FIRST_WORD_ID` ids, which are the special tokens of :data:`SPECIAL_TOKENS` (pad, bos, eos, the
K2.5/K3 media placeholder, unk, and the two chat roles). Every id ``0 .. vocab_size - 1`` decodes to
one token, whatever a random model samples.

Files, all in formats transformers and ``tokenizers`` read without extra dependencies (written with
``json``, atomically):

- ``tokenizer.json``: a ``WordLevel`` model, a ``WhitespaceSplit`` pre-tokenizer (text is
  whitespace-separated words) and a ``WordPiece`` decoder with no word ever carrying its ``##``
  continuation prefix, so decoding joins tokens with single spaces. That decoder puts the space
  *before* every token but the first, so a prefix-diffing incremental decoder (``tokenizers``'
  ``DecodeStream``, vLLM's detokenizer) yields ``" w12"`` per step and its pieces concatenate to the
  full decode. ``cleanup`` is off: no English-punctuation fix-ups of the text.
- ``tokenizer_config.json``: ``PreTrainedTokenizerFast`` with the special token strings and a Jinja
  chat template (:data:`CHAT_TEMPLATE`).
- ``special_tokens_map.json`` and ``generation_config.json`` (bos / eos / pad ids).

The ids of pad / bos / eos / media are the ones :mod:`kimi_core.checkpoint.tiny` writes in
``config.json`` (it imports them from here). eos is one id of ``vocab_size`` (1024 or 4096), so a
random model rarely stops early.
"""

from __future__ import annotations

import json
import os

from kimi_core.checkpoint.writer import atomic_write_text

PAD_ID, BOS_ID, EOS_ID, MEDIA_ID, UNK_ID, USER_ID, ASSISTANT_ID = range(7)

#: ``(id, text)`` of every special token; ids are contiguous from 0.
SPECIAL_TOKENS: tuple[tuple[int, str], ...] = (
    (PAD_ID, "<pad>"),
    (BOS_ID, "<s>"),
    (EOS_ID, "</s>"),
    (MEDIA_ID, "<|media_pad|>"),  # K2.5 / K3 configs' media_placeholder_token_id
    (UNK_ID, "<unk>"),
    (USER_ID, "<|user|>"),
    (ASSISTANT_ID, "<|assistant|>"),
)
FIRST_WORD_ID = len(SPECIAL_TOKENS)
_TEXT = dict(SPECIAL_TOKENS)

#: ``<|user|> w12 w99 <|assistant|> w7 w8</s> ... <|assistant|>``. The tiny vocabulary has two roles: every
#: role other than ``assistant`` (``system``, ``user``, ``tool``) renders as the user token. An assistant turn
#: ends with eos, as a generated one does; the generation prompt is the assistant token.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    f"{{{{- '{_TEXT[ASSISTANT_ID]} ' + message['content'] + eos_token + ' ' -}}}}"
    "{%- else -%}"
    f"{{{{- '{_TEXT[USER_ID]} ' + message['content'] + ' ' -}}}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    f"{{%- if add_generation_prompt -%}}{{{{- '{_TEXT[ASSISTANT_ID]}' -}}}}{{%- endif -%}}"
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def word(token_id: int) -> str:
    """The text of ``token_id``: its special token, or the word ``w<id>``."""
    return _TEXT.get(token_id, f"w{token_id}")


def word_id(text: str) -> int | None:
    """The id of a word ``w<i>`` (``i >= FIRST_WORD_ID``), or ``None`` for any other text."""
    if len(text) > 1 and text[0] == "w" and text[1:].isdigit() and (text[1] != "0" or len(text) == 2):
        i = int(text[1:])
        return i if i >= FIRST_WORD_ID else None
    return None


def tokenizer_json(vocab_size: int) -> dict:
    """The ``tokenizers`` JSON of the word-level tokenizer over ids ``0 .. vocab_size - 1``."""
    if vocab_size <= FIRST_WORD_ID:
        raise ValueError(f"vocab_size {vocab_size}: the tokenizer needs more than {FIRST_WORD_ID} ids")
    added = [
        {
            "id": i,
            "content": text,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, text in SPECIAL_TOKENS
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        # no token starts with "##", so the decoder only joins with single spaces
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": False},
        "model": {"type": "WordLevel", "vocab": {word(i): i for i in range(vocab_size)}, "unk_token": _TEXT[UNK_ID]},
    }


def special_tokens_map() -> dict:
    """transformers' ``special_tokens_map.json`` of the tokenizer."""
    return {
        "bos_token": _TEXT[BOS_ID],
        "eos_token": _TEXT[EOS_ID],
        "pad_token": _TEXT[PAD_ID],
        "unk_token": _TEXT[UNK_ID],
        # the other special tokens, so transformers' all_special_ids (skip_special_tokens) holds every one
        "additional_special_tokens": [_TEXT[i] for i in (MEDIA_ID, USER_ID, ASSISTANT_ID)],
    }


def tokenizer_config(model_max_length: int) -> dict:
    """transformers' ``tokenizer_config.json`` of the tokenizer (the class, special tokens, chat template)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_tokens_map(),
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def generation_config() -> dict:
    """``generation_config.json``: the special ids, nothing else (hosts keep their own sampling defaults)."""
    return {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}


def write_tokenizer(folder: str | os.PathLike, vocab_size: int, model_max_length: int) -> list[str]:
    """Write the tokenizer files of :data:`TOKENIZER_FILES` into ``folder`` (each atomically).

    :param vocab_size: the checkpoint's ``vocab_size`` (embedding rows); every id below it gets a token.
    :param model_max_length: the longest sequence, usually ``config.json``'s ``max_position_embeddings``.
    :returns: the paths written.
    """
    folder = os.fspath(folder)
    contents = {
        "tokenizer.json": tokenizer_json(vocab_size),
        "tokenizer_config.json": tokenizer_config(model_max_length),
        "special_tokens_map.json": special_tokens_map(),
        "generation_config.json": generation_config(),
    }
    paths = []
    for name, obj in contents.items():
        path = os.path.join(folder, name)
        atomic_write_text(path, json.dumps(obj, indent=2 if name != "tokenizer.json" else None))
        paths.append(path)
    return paths
