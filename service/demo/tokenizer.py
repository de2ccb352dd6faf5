"""The demo checkpoints' tokenizer: byte-level BPE trained on a synthetic corpus, special tokens and a
ChatML-like chat template, sized to the model's vocabulary exactly."""
from __future__ import annotations

import functools
import json
import random



BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|pad|>"
# Ids 0..4, in this order (the BPE trainer puts special tokens first).
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN, PAD_TOKEN)
BOS_ID, EOS_ID, IM_START_ID, IM_END_ID, PAD_ID = range(len(SPECIAL_TOKENS))
_N_BYTES = 256
MIN_VOCAB_SIZE = _N_BYTES + len(SPECIAL_TOKENS)

# ChatML-like, rendered by transformers' apply_chat_template and by plain jinja2 alike.
# `content` may be a string or an OpenAI-style list of parts (text parts are concatenated).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_COMMON_WORDS = (
    "the of and to a in is it you that he was for on are with as I his they be at one have "
    "this from or had by hot word but what some we can out other were all there when up use "
    "your how said an each she which do their time if will way about many then them write "
    "would like so these her long make thing see him two has look more day could go come did "
    "number sound no most people my over know water than call first who may down side been "
    "now find any new work part take get place made live where after back little only round "
    "man year came show every good me give our under name very through just form sentence "
    "great think say help low line differ turn cause much mean before move right boy old too "
    "same tell does set three want air well also play small end put home read hand port large "
    "spell add even land here must big high such follow act why ask men change went light kind "
    "off need house picture try us again animal point mother world near build self earth father "
    "model token request server cache block batch layer attention expert router value key query "
    "hello question answer please thank explain write code function return import class def "
    "data list string number print error file test true false null none let var const python"
).split()
_ONSETS = ("", "", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t",
           "v", "w", "y", "z", "ch", "sh", "th", "st", "tr", "pl", "gr", "br", "cr", "str",
           "qu", "sp", "fl", "bl", "cl", "wh", "pr", "dr")
_VOWELS = ("a", "e", "i", "o", "u", "a", "e", "i", "o", "ai", "ea", "ee", "oo", "ou", "io",
           "y", "ie", "au")
_CODAS = ("", "", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck", "rt", "nt", "ll",
          "ss", "x", "th", "sh", "ed", "er", "ly", "ing", "tion", "ment", "ness")
_PUNCT = (".", ",", ".", ",", "?", "!", ":", ";", " -", "'s", ")", "\n")


def _synthetic_corpus(vocab_size: int) -> list[str]:
    """Deterministic English-like text, sized so BPE training reaches `vocab_size` quickly."""
    rng = random.Random(0x6B7673)  # fixed: the tokenizer depends on vocab_size only
    merges_wanted = max(0, vocab_size - MIN_VOCAB_SIZE)
    n_words = min(60_000, 200 + 2 * merges_wanted)
    seen = set(_COMMON_WORDS)
    lexicon = list(_COMMON_WORDS)
    while len(lexicon) < n_words:
        word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                       for _ in range(rng.choice((1, 1, 2, 2, 2, 3, 3, 4))))
        if word and word not in seen:
            seen.add(word)
            lexicon.append(word)
    n_lines = min(2_500, 20 + merges_wanted // 12)
    lines = []
    for _ in range(n_lines):
        out = []
        for _ in range(48):
            # Zipf-ish: low indexes (common words first) are drawn far more often.
            word = lexicon[int(len(lexicon) * rng.random() ** 2.5)]
            r = rng.random()
            if r < 0.08:
                word = word.capitalize()
            elif r < 0.10:
                word = str(rng.randrange(0, 10_000))
            out.append(word)
            if rng.random() < 0.12:
                out[-1] += rng.choice(_PUNCT)
        lines.append(" ".join(out))
    return lines


def _pad_merges(tok_json: dict, vocab_size: int) -> None:
    """Append merges of existing tokens until the vocabulary has exactly `vocab_size` entries."""
    vocab: dict[str, int] = tok_json["model"]["vocab"]
    merges: list = tok_json["model"]["merges"]
    base = sorted((tid, tok) for tok, tid in vocab.items()
                  if tok not in SPECIAL_TOKENS and tid < len(SPECIAL_TOKENS) + _N_BYTES)
    base_tokens = [tok for _, tok in base]
    next_id = len(vocab)
    for a in base_tokens:
        for b in base_tokens:
            if next_id >= vocab_size:
                return
            merged = a + b
            if merged in vocab:
                continue
            vocab[merged] = next_id
            merges.append([a, b])
            next_id += 1
    if next_id < vocab_size:  # pragma: no cover - 65k byte pairs always suffice for our sizes
        raise ValueError(f"vocab_size {vocab_size} too large for the demo tokenizer")


@functools.lru_cache(maxsize=16)
def build_tokenizer_json(vocab_size: int, *, train: bool = True) -> str:
    """Serialized `tokenizer.json` for a byte-level BPE with exactly `vocab_size` tokens.

    Ids 0..4 are `SPECIAL_TOKENS`, then the 256 byte symbols, then merges learnt from a
    deterministic synthetic corpus (`train=False` skips training and only pads, for tests).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB_SIZE} (256 bytes + "
                         f"{len(SPECIAL_TOKENS)} special tokens), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_synthetic_corpus(vocab_size) if train else [], trainer)
    tok_json = json.loads(tok.to_str())
    _pad_merges(tok_json, vocab_size)
    tok = Tokenizer.from_str(json.dumps(tok_json))
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
            single=f"{BOS_TOKEN}:0 $A:0",
            pair=f"{BOS_TOKEN}:0 $A:0 {BOS_TOKEN}:1 $B:1",
            special_tokens=[(BOS_TOKEN, BOS_ID)]),
    ])
    # Make the specials "added tokens" so text containing them is not split by BPE.
    from tokenizers import AddedToken
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise AssertionError(f"built {tok.get_vocab_size(with_added_tokens=True)} tokens, "
                             f"wanted {vocab_size}")
    return tok.to_str(pretty=True)


def tokenizer_config(max_length: int) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(max_length),
        "padding_side": "left",
        "added_tokens_decoder": {
            str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": True}
            for i, t in enumerate(SPECIAL_TOKENS)
        },
        "chat_template": CHAT_TEMPLATE,
    }
