"""The tiny checkpoints' word-level tokenizer, read by its consumers: transformers and ``tokenizers``."""

from __future__ import annotations

import json
import os

import pytest

from kimi_core.checkpoint.tokenizer import FIRST_WORD_ID, TOKENIZER_FILES, write_tokenizer

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

SPECIAL = {0: "<pad>", 1: "<s>", 2: "</s>", 3: "<|media_pad|>", 4: "<unk>", 5: "<|user|>", 6: "<|assistant|>"}


@pytest.fixture(scope="module", params=[1024, 4096], ids=lambda v: f"V{v}")
def folder(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"tok{request.param}")
    write_tokenizer(d, request.param, model_max_length=8192)
    return str(d), request.param


def test_files_are_written_without_temporaries(folder):
    """Every tokenizer file is in place and no temporary name is left beside them."""
    d, _ = folder
    assert sorted(os.listdir(d)) == sorted(TOKENIZER_FILES)


def test_autotokenizer_encodes_and_decodes_words(folder):
    """AutoTokenizer maps the word ``w<i>`` to id ``i`` and decodes the ids back to the same text."""
    d, vocab = folder
    tok = transformers.AutoTokenizer.from_pretrained(d)
    text = f"w{FIRST_WORD_ID} w17 w{vocab - 1}"
    ids = tok.encode(text)
    assert ids == [FIRST_WORD_ID, 17, vocab - 1]
    assert tok.decode(ids) == text
    assert len(tok) == vocab
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 4)
    assert tok.encode("w17  foo\tw18") == [17, 4, 18]  # any whitespace splits, an unknown word is <unk>


def test_every_id_decodes(folder):
    """Each id below vocab_size decodes to one token: the special token or ``w<i>``; none is out of range."""
    d, vocab = folder
    tok = transformers.AutoTokenizer.from_pretrained(d)
    got = [tok.decode([i]) for i in range(vocab)]
    assert got == [SPECIAL.get(i, f"w{i}") for i in range(vocab)]
    assert tok.convert_tokens_to_ids([f"w{i}" for i in range(FIRST_WORD_ID, vocab)]) == list(
        range(FIRST_WORD_ID, vocab)
    )


def test_skip_special_tokens_drops_every_special_id(folder):
    """skip_special_tokens removes pad/bos/eos/media/unk and both role tokens, as a host's detokenizer does."""
    d, _ = folder
    tok = transformers.AutoTokenizer.from_pretrained(d)
    assert sorted(tok.all_special_ids) == sorted(SPECIAL)
    assert tok.decode([5, 12, 6, 13, 2, 0], skip_special_tokens=True) == "w12 w13"


def test_chat_template_renders_roles_and_generation_prompt(folder):
    """The chat template gives ``<|user|> <content> ... <|assistant|>``; system renders as user; turns end in eos."""
    d, _ = folder
    tok = transformers.AutoTokenizer.from_pretrained(d)
    msgs = [{"role": "system", "content": "w9"}, {"role": "user", "content": "w12 w99"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == "<|user|> w9 <|user|> w12 w99 <|assistant|>"
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids == [5, 9, 5, 12, 99, 6]
    # a batch of conversations, as SkyRL's batched generator passes them
    batch = tok.apply_chat_template([msgs, msgs[1:]], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert batch == [[5, 9, 5, 12, 99, 6], [5, 12, 99, 6]]
    turn = msgs[1:] + [{"role": "assistant", "content": "w7 w8"}]
    assert tok.apply_chat_template(turn, tokenize=True, return_dict=False) == [5, 12, 99, 6, 7, 8, 2]


@pytest.mark.parametrize("skip", [False, True], ids=["keep-special", "skip-special"])
def test_incremental_decode_equals_full_decode(folder, skip):
    """tokenizers' DecodeStream (what vLLM's detokenizer uses) concatenates to the full decode of the same ids."""
    decoders = tokenizers.decoders
    if not hasattr(decoders, "DecodeStream"):
        pytest.skip(f"tokenizers {tokenizers.__version__} has no DecodeStream")
    d, vocab = folder
    tok = tokenizers.Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
    ids = [5, 12, 99, 6, 7, vocab - 1, 2, 0, 8, 4]
    stream = decoders.DecodeStream(skip_special_tokens=skip)
    pieces = [stream.step(tok, i) for i in ids]
    assert "".join(p for p in pieces if p) == tok.decode(ids, skip_special_tokens=skip)


def _auto_tokenizer(folder: str, cfg: dict):
    """AutoTokenizer on a checkpoint folder, as vLLM and our Megatron bridge load it.

    transformers has no ``kimi_k2`` config class, and its fallback config rejects the YaRN ``rope_scaling``;
    vLLM and ``kimi_megatron_plugin`` register ``kimi_k2`` as a DeepSeek-V3 config. Passing that config here
    does the same without changing transformers' registry for the rest of the session.
    """
    if cfg["model_type"] == "kimi_k2":
        hf = transformers.DeepseekV3Config(**{k: v for k, v in cfg.items() if k != "model_type"})
        return transformers.AutoTokenizer.from_pretrained(folder, config=hf)
    return transformers.AutoTokenizer.from_pretrained(folder)


def test_make_tiny_writes_a_tokenizer_consistent_with_config(tiny_ckpt):
    """make-tiny's folder loads in AutoTokenizer; config.json and generation_config.json name its special ids."""
    for model in ("k2", "k25"):
        d = tiny_ckpt(model)
        with open(os.path.join(d, "config.json")) as f:
            cfg = json.load(f)
        tok = _auto_tokenizer(d, cfg)
        text_cfg = cfg.get("text_config", cfg)
        assert len(tok) == text_cfg["vocab_size"]
        for c in (cfg, text_cfg):
            assert (c["bos_token_id"], c["eos_token_id"], c["pad_token_id"]) == (
                tok.bos_token_id,
                tok.eos_token_id,
                tok.pad_token_id,
            )
        gen = transformers.GenerationConfig.from_pretrained(d)
        assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == (
            tok.bos_token_id,
            tok.eos_token_id,
            tok.pad_token_id,
        )
        if "media_placeholder_token_id" in cfg:
            assert tok.convert_ids_to_tokens(cfg["media_placeholder_token_id"]) in tok.all_special_tokens
