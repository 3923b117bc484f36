"""ninfer-tiny tooling: tokenizer layout, chat template, data split, MTP alignment, a 3-step CPU train + export."""
import json
import sys
import unicodedata
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
import tiny_data  # noqa: E402
import tiny_tokenizer  # noqa: E402
import train_tiny  # noqa: E402

TINY = REPO / "ninfer_pack" / "tiny"
MOVED = 1e-4            # a logit change larger than this means the perturbed token was read
DOCUMENTED_IDS = {"<|endoftext|>": 4091, "<|im_start|>": 4092, "<|im_end|>": 4093, "<think>": 4094,
                  "</think>": 4095}
MTP_NAMES = ["fc.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight"] + [
    f"layers.0.{n}.weight" for n in ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj",
                                     "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                     "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj",
                                     "mlp.down_proj")]
CODE_SAMPLES = {
    "function": "def f(x, *args, **kw):\n    return x ** 2 + sum(args)  # square\n",
    "crlf_tabs": "class A:\r\n\tpass\r\n\r\n\r\n",
    "unicode": "s = 'caf\u00e9 \u2603 \U0001f600 \u6f22\u5b57'\nprint(s)\n",
    "combining_nfd": "name = 'cafe\u0301'\n",
    "whitespace_runs": "x = [\n" + " " * 37 + "1,\n\n\n        2]   \n",
    "special_lookalike": "tok = '<|im_end|' + '>'  # not a control token\n",
}


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer.load(TINY)


@pytest.mark.parametrize("name", sorted(CODE_SAMPLES))
def test_tokenizer_round_trips_code(tok, name):
    text = CODE_SAMPLES[name]
    ids = tok.encode(text).ids
    assert tok.decode(ids, skip_special_tokens=False) == unicodedata.normalize("NFC", text)
    assert max(ids) < DOCUMENTED_IDS["<|endoftext|>"]


def test_special_tokens_have_documented_ids(tok):
    assert tok.get_vocab_size() == 4096
    for s, i in DOCUMENTED_IDS.items():
        assert tok.token_to_id(s) == i
        assert tok.encode(f"a{s}b").ids[1] == i          # recognised in rendered prompts
    cfg = json.loads((TINY / "tokenizer_config.json").read_text())
    assert cfg["eos_token"] == "<|im_end|>" and cfg["pad_token"] == "<|endoftext|>"
    assert {v["content"]: int(k) for k, v in cfg["added_tokens_decoder"].items()} == DOCUMENTED_IDS


def test_file_text_never_produces_control_tokens(tok):
    ids = tiny_data.encode_documents(tok, ["x = '<|im_end|><think>'\n"], DOCUMENTED_IDS)[0]
    assert ids[-1] == DOCUMENTED_IDS["<|endoftext|>"]
    assert not set(ids[:-1].tolist()) & set(DOCUMENTED_IDS.values())


SMALL_CORPUS = [(REPO / "tools" / n).read_text() for n in ("tiny_data.py", "tiny_tokenizer.py", "train_tiny.py")]


def test_tokenizer_training_is_deterministic_with_specials_last():
    texts = SMALL_CORPUS
    a, b = tiny_tokenizer.train(texts, vocab_size=300), tiny_tokenizer.train(texts, vocab_size=300)
    assert a.to_str() == b.to_str()
    assert [a.token_to_id(s) for s in tiny_tokenizer.SPECIALS] == list(range(295, 300))
    with pytest.raises(tiny_tokenizer.TokenizerError, match="corpus too small"):
        tiny_tokenizer.train(texts[:2], vocab_size=4096)


def test_load_rejects_wrong_special_ids(tmp_path):
    t = tiny_tokenizer.train(SMALL_CORPUS, vocab_size=280)
    t.add_special_tokens(["<extra>"])                    # shifts nothing but breaks "specials are last"
    tiny_tokenizer.write_files(t, tmp_path)
    with pytest.raises(tiny_tokenizer.TokenizerError, match="tokenizer.json: special token"):
        tiny_tokenizer.load(tmp_path)


MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Write "}, {"type": "text", "text": "f."}]},
            {"role": "assistant", "content": "def f():\n    pass"}]


def test_chat_template_renders_chatml():
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(str(TINY))
    text = hf.apply_chat_template(MESSAGES[:2], tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWrite f.<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert (TINY / "chat_template.jinja").read_text() == tiny_tokenizer.CHAT_TEMPLATE
    assert hf.eos_token_id == DOCUMENTED_IDS["<|im_end|>"]


def test_training_chats_match_the_template(tok):
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(str(TINY))
    conv = [MESSAGES[0], {"role": "user", "content": "Write f."}, MESSAGES[2]]
    rendered = hf.apply_chat_template(conv, tokenize=False)
    ids = tiny_data.encode_chats(tok, [conv], DOCUMENTED_IDS)[0]
    assert ids.tolist() == hf(rendered, add_special_tokens=False)["input_ids"] + [DOCUMENTED_IDS["<|endoftext|>"]]


def test_split_is_path_hash_and_about_two_percent():
    rels = [f"pkg{i % 37}/mod_{i}.py" for i in range(20000)]
    held = [r for r in rels if tiny_data.split_of(r) == "heldout"]
    assert 0.015 < len(held) / len(rels) < 0.025
    assert held == [r for r in rels if tiny_data.split_of(r) == "heldout"]
    examples = tiny_data.chat_examples("a/b.py", "import os\n\ndef g(x):\n    y = x\n    return y\n")
    assert examples and examples[-1][-1] == {"role": "assistant", "content": "def g(x):\n    y = x\n    return y"}
    assert "`a.b`" in examples[0][-2]["content"]


@pytest.fixture(scope="module")
def small_model():
    opts = train_tiny.Options(out="unused", device="cpu", preset="test", batch=2, seq=24)
    _, model, mtp = train_tiny.build(opts, 4096)
    with torch.no_grad():   # non-trivial (1+w) norms, as in the reference's tiny random model
        for name, p in list(model.named_parameters()) + list(mtp.named_parameters()):
            if "norm" in name:
                p.normal_(1.0 if "linear_attn.norm" in name else 0.0, 0.1)
    return model.eval(), mtp.eval()


def _mtp_logits(model, mtp, ids):
    with torch.no_grad():
        return train_tiny.forward_losses(model, mtp, ids)[3]


@pytest.mark.parametrize("k", [3, 11, 20])
def test_mtp_reads_hidden_t_and_token_t_plus_1(small_model, k):
    """Changing token k may only move MTP outputs at positions >= k-1 (it is x_{t+1} for t = k-1)."""
    model, mtp = small_model
    ids = torch.randint(0, 4000, (2, 26), generator=torch.Generator().manual_seed(k))
    alt = ids.clone()
    alt[:, k] = (alt[:, k] + 1234) % 4000
    a, b = _mtp_logits(model, mtp, ids), _mtp_logits(model, mtp, alt)
    assert torch.equal(a[:, : k - 1], b[:, : k - 1])
    assert (a[:, k - 1] - b[:, k - 1]).abs().max() > MOVED


def test_mtp_fc_takes_embedding_first(small_model):
    """With fc's first H columns zeroed, position k-1 no longer sees token k (it only reached it via e)."""
    model, mtp = small_model
    h = model.config.hidden_size
    saved = mtp.fc.weight.detach().clone()
    ids = torch.randint(0, 4000, (1, 26), generator=torch.Generator().manual_seed(7))
    alt = ids.clone()
    alt[:, 9] = (alt[:, 9] + 99) % 4000
    try:
        with torch.no_grad():
            mtp.fc.weight[:, :h] = 0
        a, b = _mtp_logits(model, mtp, ids), _mtp_logits(model, mtp, alt)
    finally:
        with torch.no_grad():
            mtp.fc.weight.copy_(saved)
    torch.testing.assert_close(a[:, 8], b[:, 8], rtol=0, atol=0)
    assert (a[:, 9] - b[:, 9]).abs().max() > MOVED          # later positions still see token 9


def test_three_step_cpu_training_exports_a_loadable_checkpoint(tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM
    out = tmp_path / "tiny"
    opts = train_tiny.Options(out=str(out), device="cpu", preset="test", steps=3, batch=2, seq=64,
                              max_files=12, eval_windows=2, eval_every_s=1e9, warmup=2, with_tokenizer=True)
    report = train_tiny.run(opts)
    assert report["steps"] == 3 and np.isfinite(report["heldout_loss"]) and np.isfinite(report["mtp_heldout_loss"])
    assert sorted(p.name for p in out.iterdir()) == report["files"]
    assert len(set(report["files"]) - set(tiny_tokenizer.FILES)) <= 8     # device transport: 8 files
    assert not (tmp_path / "tiny.partial").exists() and report["reload"]["class"] == "Qwen3_5ForCausalLM"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5_text" and cfg["mtp_num_hidden_layers"] == 1
    assert cfg["tie_word_embeddings"] is False and cfg["layer_types"][3] == "full_attention"
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        shapes = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
    h, i, a, kv, d = (cfg[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                        "num_key_value_heads", "head_dim"))
    want = {"fc.weight": (h, 2 * h), "layers.0.self_attn.q_proj.weight": (2 * a * d, h),
            "layers.0.self_attn.k_proj.weight": (kv * d, h), "layers.0.self_attn.o_proj.weight": (h, a * d),
            "layers.0.self_attn.q_norm.weight": (d,), "layers.0.mlp.down_proj.weight": (h, i),
            "layers.0.mlp.gate_proj.weight": (i, h), "norm.weight": (h,)}
    mtp = {k[4:]: v for k, v in shapes.items() if k.startswith("mtp.")}
    assert sorted(mtp) == sorted(MTP_NAMES)
    for name, shape in want.items():
        assert mtp[name][0] == shape, name
    assert shapes["model.layers.0.linear_attn.A_log"][1] == "F32" and shapes["lm_head.weight"][1] == "BF16"
    assert not any("rotary" in k for k in shapes)


def test_cli_errors_are_one_line(tmp_path, capsys):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    assert train_tiny.main(["--out", str(tmp_path / "busy"), "--device", "cpu"]) == 2
    assert train_tiny.main(["--out", str(tmp_path / "o"), "--device", "cpu", "--batch", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {tmp_path / 'busy'}: output folder exists and is not empty (use --force to replace it)",
                   "error: --batch: must be >= 1"]
