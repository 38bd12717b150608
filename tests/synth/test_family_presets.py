"""``--like`` presets of Kimi-K2, Mixtral-8x7B and DeepSeek-V2-Lite: their geometry, their real
tokenizers' shape (model, pre-tokenizer, special tokens) as the runtime's ``GGUFTokenizer``
builds it, and the quick start (synth -> repack -> run) on a cut of each."""

from __future__ import annotations

import json

import pytest

from expertfs.cli import main
from expertfs.errors import UsageError
from expertfs.formats.gguf_split import read_model
from expertfs.runtime.tokenizer.gguf import GGUFTokenizer
from expertfs.synth import SynthConfig, build_vocab
from expertfs.synth.presets import preset_names

# preset -> (tokenizer.ggml.model, tokenizer.ggml.pre, eos, bos, tokens the chat template uses)
_FAMILY = {
    "Kimi-K2": ("gpt2", "kimi-k2", "<|im_end|>", "[BOS]",
                ("<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>")),
    "Mixtral-8x7B": ("llama", "llama", "</s>", "<s>", ("<s>", "</s>")),
    "DeepSeek-V2-Lite": ("gpt2", "deepseek-llm", "<｜end▁of▁sentence｜>",
                         "<｜begin▁of▁sentence｜>", ("<｜begin▁of▁sentence｜>",)),
}
_TEXT = "Beautiful is better than ugly.\nNamespaces: one honking great idea! 日本 \t x"


def test_presets_listed():
    assert set(_FAMILY) <= set(preset_names())


def test_geometry():
    k = SynthConfig.like("Kimi-K2")
    assert (k.arch, k.n_layers, k.n_dense_lead, k.n_experts, k.n_expert_shared,
            k.n_expert_used, k.n_embd, k.n_ff_exp, k.n_vocab) == (
        "deepseek2", 61, 1, 384, 1, 8, 7168, 2048, 163840)
    assert (k.q_lora_rank, k.kv_lora_rank, k.qk_nope_dim, k.qk_rope_dim, k.v_head_dim) == (
        1536, 512, 128, 64, 128)
    m = SynthConfig.like("Mixtral-8x7B")
    assert (m.arch, m.n_layers, m.n_experts, m.n_expert_used, m.n_embd, m.n_ff, m.n_head,
            m.n_head_kv, m.n_vocab) == ("llama", 32, 8, 2, 4096, 14336, 32, 8, 32000)
    d = SynthConfig.like("DeepSeek-V2-Lite")
    assert (d.arch, d.n_layers, d.n_dense_lead, d.n_experts, d.n_expert_shared, d.n_expert_used,
            d.n_embd, d.n_ff_exp, d.kv_lora_rank, d.q_lora_rank, d.n_vocab) == (
        "deepseek2", 27, 1, 64, 2, 6, 2048, 1408, 512, 0, 102400)


@pytest.mark.parametrize("preset", list(_FAMILY))
def test_full_vocab_has_real_size_and_specials(preset):
    cfg = SynthConfig.like(preset)
    v = build_vocab(cfg.tokenizer_family, cfg.n_vocab)
    assert len(v.tokens) == cfg.n_vocab and len(set(v.tokens)) == cfg.n_vocab
    for t, kind in v.family.specials:
        assert v.token_types[v.tokens.index(t)] == kind


def test_spm_vocab_layout():
    v = build_vocab("mixtral", 1024)
    assert v.tokens[:3] == ("<unk>", "<s>", "</s>") and v.token_types[:3] == (2, 3, 3)
    assert v.tokens[3] == "<0x00>" and v.tokens[258] == "<0xFF>" and set(v.token_types[3:259]) == {6}
    assert v.merges == () and len(v.scores) == 1024
    normal = [s for s, ty in zip(v.scores, v.token_types) if ty == 1]
    assert normal == sorted(normal, reverse=True) and "\u2581" in v.tokens
    with pytest.raises(UsageError, match="vocabulary"):
        build_vocab("mixtral", 300)


@pytest.fixture(scope="module")
def cuts(tmp_path_factory):
    d = tmp_path_factory.mktemp("family")
    out = {}
    for p in _FAMILY:
        out[p] = d / f"{p}.gguf"
        assert main(["synth", "-o", str(out[p]), "--like", p, "--layers", "2", "--vocab", "1024",
                     "--experts", "8", "--top-k", "2", "--json"]) == 0
    return out


@pytest.mark.parametrize("preset", list(_FAMILY))
def test_tokenizer_shape_builds_in_runtime(cuts, preset):
    model, pre, eos, bos, chat_tokens = _FAMILY[preset]
    m = read_model(str(cuts[preset]))
    kv = {k: m.value(k) for k in m.kv}
    assert kv["tokenizer.ggml.model"] == model and kv["tokenizer.ggml.pre"] == pre
    tokens = kv["tokenizer.ggml.tokens"]
    assert tokens[kv["tokenizer.ggml.eos_token_id"]] == eos
    assert tokens[kv["tokenizer.ggml.bos_token_id"]] == bos
    if model == "llama":
        assert len(kv["tokenizer.ggml.scores"]) == len(tokens)
        assert tokens[kv["tokenizer.ggml.unknown_token_id"]] == "<unk>"
    tok = GGUFTokenizer(kv)
    ids = tok.encode(_TEXT, add_bos=False)
    assert tok.decode(ids) == _TEXT and len(ids) < len(_TEXT.encode())
    assert tok.eos_id in tok.stop_ids
    chat = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "Zen?"}])
    cids = tok.encode(chat)
    for t in chat_tokens:
        assert t in chat and tokens.index(t) in cids, t


@pytest.mark.parametrize("preset", list(_FAMILY))
def test_quick_start(cuts, preset, tmp_path, capsys):
    store = tmp_path / "store"
    assert main(["repack", str(cuts[preset]), "-o", str(store), "--json"]) == 0
    capsys.readouterr()
    assert main(["run", str(store), "-p", "Beautiful is better", "-n", "3", "--ignore-eos",
                 "-t", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert isinstance(out, dict)


def test_a_cut_of_a_model_without_q_lora_states_it_for_llama_cpp():
    """llama.cpp reads a deepseek2 without q_lora as 'lite' only at 26 or 27 layers and
    otherwise requires attention.q_lora_rank: a cut states its 0 (the full model writes none,
    as the converter does)."""
    from expertfs.synth import SynthConfig
    from expertfs.synth.metadata import metadata_items
    from expertfs.synth.presets import like_fields
    full = SynthConfig(**like_fields("DeepSeek-V2-Lite"))
    cut = full.replace(n_layers=2, n_experts=16, n_vocab=2048)
    keys = {k: v for k, v, *_ in metadata_items(cut)}
    assert keys["deepseek2.attention.q_lora_rank"] == 0
    assert "deepseek2.attention.q_lora_rank" not in {k for k, *_ in metadata_items(full)}
