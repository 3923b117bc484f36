"""The tiny checkpoints' tokenizer: byte-level BPE without merges (token id = byte value below 246), the
specials on the ids of bytes 0xF6..0xFF, which never occur in UTF-8, so a 256-entry vocab suffices; plus a
minimal ChatML chat template with `<think>` and image placeholders. Re-exported by hf_tiny."""
from __future__ import annotations

import json
from pathlib import Path

# the tiny tokenizer's specials take the ids of bytes 0xF6..0xFF, which never occur in valid UTF-8
SPECIALS = {"<|endoftext|>": 246, "<|im_start|>": 247, "<|im_end|>": 248, "<think>": 249, "</think>": 250,
            "<|vision_start|>": 251, "<|vision_end|>": 252, "<|vision_pad|>": 253, "<|image_pad|>": 254,
            "<|video_pad|>": 255}
EOS_ID, IM_END_ID = SPECIALS["<|endoftext|>"], SPECIALS["<|im_end|>"]


# ---- tokenizer -------------------------------------------------------------------------------------------

def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 byte-level alphabet: printable bytes map to themselves, the rest to 256+n."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- elif part['type'] in ('image', 'image_url') -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- else -%}{{- '<think>\\n' -}}{%- endif -%}{%- endif -%}"
)


def tokenizer_json() -> str:
    """Byte-level BPE without merges: token id = byte value below 246; specials at 246..255."""
    b2u = _bytes_to_unicode()
    # tokenizers numbers added tokens after the model vocab, so the byte vocab must be exactly 0..245
    vocab = {b2u[b]: b for b in range(min(SPECIALS.values()))}
    added = [dict(id=i, content=s, single_word=False, lstrip=False, rstrip=False, normalized=False, special=True)
             for s, i in sorted(SPECIALS.items(), key=lambda kv: kv[1])]
    bl = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": True}
    tok = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
           "normalizer": {"type": "NFC"}, "pre_tokenizer": bl, "post_processor": bl, "decoder": bl,
           "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                     "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                     "ignore_merges": False, "vocab": vocab, "merges": []}}
    return json.dumps(tok, ensure_ascii=False)


def write_tiny_tokenizer(d) -> None:
    d = Path(d)
    (d / "tokenizer.json").write_text(tokenizer_json(), encoding="utf-8")
    tcfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>", "bos_token": None, "model_max_length": 512,
            "add_bos_token": False, "clean_up_tokenization_spaces": False}
    (d / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2))
    (d / "chat_template.jinja").write_text(CHAT_TEMPLATE)
